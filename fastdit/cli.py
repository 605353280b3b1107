"""The ``fastdit`` command line: ``fastdit compare`` (and ``eval``, ``app``, ``methods``, ``support``).

    fastdit compare                                  # tiny Wan model, dense vs sta
    fastdit compare --model Wan-AI/Wan2.1-T2V-1.3B-Diffusers --frames 81 --height 480 --width 832 \
        --methods dense,sta --set sta.dense_steps=0.25 --out runs/wan
"""
from __future__ import annotations

import argparse
import ast
import sys


def parse_value(text):
    """``6,8,8`` -> (6, 8, 8); ``0.25`` -> 0.25; ``true`` -> True; lists of triples as ``[(1,3,3),(3,3,3)]``."""
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text
    return tuple(value) if isinstance(value, list) and all(isinstance(v, (int, float)) for v in value) else value


def parse_options(settings, methods):
    """``["sta.tile=6,8,8", ...]`` -> ``{"sta": {"tile": (6, 8, 8)}}``."""
    options = {}
    for setting in settings or []:
        key, sep, value = setting.partition("=")
        method, dot, option = key.partition(".")
        if not sep or not dot or not option:
            raise SystemExit(f"fastdit: --set expects METHOD.OPTION=VALUE, got {setting!r}")
        if method not in methods:
            raise SystemExit(f"fastdit: --set {setting!r} names method {method!r}, which is not in --methods {','.join(methods)}")
        options.setdefault(method, {})[option] = parse_value(value)
    return options


def add_generation_arguments(parser, steps_default=None):
    parser.add_argument("--model", default="tiny-wan", help="tiny-wan, tiny-wan-i2v, tiny-hunyuan-video, a hub id or a local folder")
    parser.add_argument("--steps", type=int, default=steps_default, help="denoising steps")
    parser.add_argument("--frames", type=int, default=None, help="video frames (rounded to what the model takes)")
    parser.add_argument("--height", type=int, default=None)
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--guidance", type=float, default=None, help="guidance scale")
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    parser.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--backend", default="auto", choices=["auto", "triton", "torch"], help="kernel backend")


def call_arguments(pipe, model, height=None, width=None, frames=None, steps=None, guidance=None):
    """Pipeline call kwargs: the tiny model's defaults, then the user's sizes (fitted to the model)."""
    from fastdit.pipelines.loading import fitted_call, tiny_name

    base = {}
    name = tiny_name(model)
    if name is not None:
        from fastdit.pipelines.tiny import TINY_DEFAULTS

        base = {**TINY_DEFAULTS[name], **COMPARE_TINY_SIZE}
    kwargs, notes = fitted_call(pipe, base, height, width, frames, steps, guidance)
    for note in notes:
        print(f"note: {note}")
    return kwargs


#: `fastdit compare` on a tiny model: 29 frames at 512x768 -> an 8 x 32 x 48 latent token grid
#: (12288 tokens), 8 steps (the first 2 dense by sliding-tile's default). Attention dominates the
#: transformer there, and 8 steps keep the VAE decode (about a quarter of a dense run) from
#: hiding the speedup on a 2-core CPU.
COMPARE_TINY_SIZE = {"num_frames": 29, "height": 512, "width": 768, "num_inference_steps": 8}


def cmd_compare(args):
    import torch

    from fastdit.compare import compare, format_table, tiny_method_options
    from fastdit.pipelines.loading import ModelNotFoundError, load_pipeline, tiny_name

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    import fastdit

    unknown = [m for m in methods if m not in fastdit.methods()]
    if unknown:
        raise SystemExit(f"fastdit: unknown method(s) {unknown}; available: {', '.join(fastdit.methods())}")
    options = parse_options(args.set, methods)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    try:
        pipe = load_pipeline(args.model, args.device, dtype)
    except ModelNotFoundError as error:
        raise SystemExit(f"fastdit: {error}") from None
    call_kwargs = call_arguments(pipe, args.model, args.height, args.width, args.frames, args.steps, args.guidance)
    if tiny_name(args.model) is not None:
        for method, preset in tiny_method_options(pipe, call_kwargs).items():
            if method in methods:
                options[method] = {**preset, **options.get(method, {})}
    if args.negative_prompt is not None:
        call_kwargs["negative_prompt"] = args.negative_prompt
    shown = {k: v for k, v in call_kwargs.items() if isinstance(v, (int, float, str))}
    print(f"model {args.model} on {pipe.device}: {shown}")
    report = compare(pipe, methods, args.prompt, args.seed, call_kwargs, args.out, model_name=args.model,
                     method_options=options, backend=args.backend, fps=args.fps, warmup=not args.no_warmup)
    print()
    print(format_table(report["runs"]))
    for row in report["runs"]:
        if row.get("padding_fraction") is not None:
            print(f"{row['method']}: plans {', '.join(row.get('plans', []))}; padding {100 * row['padding_fraction']:.1f}% of tokens")
    print(f"\nvideos and report.json in {args.out}")
    return 0


def cmd_methods(args):
    import fastdit

    print("\n".join(fastdit.methods()))
    return 0


def build_parser():
    parser = argparse.ArgumentParser(prog="fastdit", description="Sparse attention for diffusers DiT pipelines.")
    sub = parser.add_subparsers(dest="command", required=True)

    compare = sub.add_parser("compare", help="run dense and each method with the same seed; latency, speedup, PSNR, SSIM")
    add_generation_arguments(compare)
    compare.add_argument("--methods", default="dense,sta", help="comma-separated methods (dense always runs first)")
    compare.add_argument("--set", action="append", metavar="METHOD.OPTION=VALUE",
                         help="method option, e.g. --set sta.tile=6,8,8 --set sta.dense_steps=0.25 (repeatable)")
    compare.add_argument("--seed", type=int, default=0)
    compare.add_argument("--prompt", default="A red fox runs through fresh snow in a pine forest at sunrise")
    compare.add_argument("--negative-prompt", default=None)
    compare.add_argument("--out", default="fastdit_compare", help="output folder (mp4 per run, report.json)")
    compare.add_argument("--fps", type=int, default=16)
    compare.add_argument("--no-warmup", action="store_true", help="skip the untimed 1-step warm-up run")
    compare.set_defaults(func=cmd_compare)

    methods = sub.add_parser("methods", help="list the available attention methods")
    methods.set_defaults(func=cmd_methods)

    from fastdit.app import add_app_parser
    from fastdit.cli_eval import add_eval_parser

    add_eval_parser(sub)
    add_app_parser(sub)
    return parser


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
