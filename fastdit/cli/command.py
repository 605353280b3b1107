"""The ``fastdit`` command: its parser (every subcommand registers itself: ``compare``, ``eval``,
``app``, ``calibrate``, ``profile``) and ``main``; the two listings ``fastdit methods`` and
``fastdit support`` live here.
"""
from __future__ import annotations

from fastdit.cli.common import ArgumentParser, run_command
from fastdit.cli.compare import add_compare_parser


def cmd_methods(args):
    import fastdit

    print("\n".join(fastdit.method_names()))
    return 0


def cmd_support(args):
    from fastdit.support import support_table_markdown

    print(support_table_markdown())
    return 0


def build_parser():
    parser = ArgumentParser(prog="fastdit", description="Sparse attention for diffusers DiT pipelines.")
    sub = parser.add_subparsers(dest="command", required=True)

    add_compare_parser(sub)

    methods = sub.add_parser("methods", help="list the available attention methods")
    methods.set_defaults(func=cmd_methods)

    support = sub.add_parser("support", help="print the model family x method support table (Markdown)")
    support.set_defaults(func=cmd_support)

    from fastdit.app import add_app_parser
    from fastdit.cli.eval import add_eval_parser

    add_eval_parser(sub)
    add_app_parser(sub)
    from fastdit.cli.calibrate import add_calibrate_parser
    from fastdit.cli.profile import add_profile_parser

    add_calibrate_parser(sub)
    add_profile_parser(sub)
    return parser


def main(argv=None):
    """``fastdit``: every error is one line on stderr (exit 2 for bad arguments, 1 otherwise, 130 on
    Ctrl-C); ``FASTDIT_DEBUG=1`` shows tracebacks of unexpected ones."""
    def parse_and_run(argv):
        args = build_parser().parse_args(argv)
        return run_command(args.func, args, f"fastdit {args.command}")

    return run_command(parse_and_run, argv, "fastdit")
