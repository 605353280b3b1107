"""``fastdit app`` and ``python app.py``: command-line arguments and launching the page."""
from __future__ import annotations

import argparse
import logging

from fastdit.options import port_int, positive_int

from .models import MAX_TOKENS

__all__ = ["add_app_parser", "cmd_app", "main"]

DESCRIPTION = "The fastdit Gradio app: dense and accelerated generation side by side."


def _add_arguments(parser):
    parser.add_argument("--host", default=None, help="server address (default 127.0.0.1; 0.0.0.0 to serve the network)")
    parser.add_argument("--port", type=port_int, default=None, help="server port (default 7860, or the next free one)")
    parser.add_argument("--share", action="store_true", help="create a public gradio.live link (off by default)")
    parser.add_argument("--model", default="tiny-shapes",
                        help="the model selected when the page opens (default tiny-shapes, trained here)")
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    parser.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--max-tokens", type=positive_int, default=None,
                        help=f"largest latent token count a run may take (default CPU {MAX_TOKENS['cpu']}, "
                             f"GPU {MAX_TOKENS['cuda']})")
    parser.add_argument("--calibration", "--plan", dest="calibration", default=None, metavar="PATH",
                        help="a calibration file (fastdit calibrate) preset in the page's calibration input, for its "
                             "method (--plan: the same, its earlier name)")
    parser.add_argument("--concurrency", type=positive_int, default=1,
                        help="comparisons that may run at once (runs on one model always take turns; default 1)")


def check_calibration_argument(path):
    """``--calibration PATH`` read and checked before the page starts; SystemExit with the reason otherwise."""
    if path is None:
        return None
    from fastdit.calibration.calibration_file import CalibrationError, load_calibration

    try:
        load_calibration(path)
    except CalibrationError as error:
        raise SystemExit(f"fastdit app: argument --calibration: {error}") from None
    return path


def cmd_app(args):
    from .ui import build_app

    calibration = check_calibration_argument(getattr(args, "calibration", None))
    demo = build_app(args.model, device=args.device, dtype=args.dtype, max_tokens=args.max_tokens,
                     concurrency=getattr(args, "concurrency", 1), calibration=calibration)
    demo.queue(default_concurrency_limit=1)
    demo.launch(server_name=args.host, server_port=args.port, share=args.share)
    return 0


def add_app_parser(subparsers):
    """Add ``fastdit app`` to the CLI's subparsers."""
    parser = subparsers.add_parser("app", help="the Gradio app: dense and accelerated side by side",
                                   description=DESCRIPTION)
    _add_arguments(parser)
    parser.set_defaults(func=cmd_app)
    return parser


def main(argv=None):
    """``python app.py [--host ...] [--port ...]``."""
    parser = argparse.ArgumentParser(prog="fastdit app", description=DESCRIPTION)
    _add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    return cmd_app(args)
