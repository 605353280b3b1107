"""``fastdit eval`` (and ``python -m fastdit.eval``): dense and methods over prompts x seeds, scored.

    fastdit eval --methods dense,sta,radial --prompts vbench --seeds 0,1 --metrics psnr,ssim,vbench --out runs/eval
    accelerate launch --multi_gpu --num_processes 2 -m fastdit.eval ...   # shards samples over processes

Writes ``OUT/results.json``, ``OUT/results.md`` and ``OUT/plots/*.png``; re-running the same
command resumes (finished samples are kept). See ``fastdit.eval.runner.run`` for what is measured.

This module only reads and checks the arguments; the run itself is ``fastdit.eval`` (the library,
which never imports the command line).
"""
from __future__ import annotations

import sys

__all__ = ["DEFAULT_METRICS", "add_eval_arguments", "add_eval_parser", "build_parser", "cmd_eval", "config_from_args",
           "main", "parse_grid", "parse_seeds", "size_check"]

DEFAULT_METRICS = "psnr,ssim,vbench"


def add_eval_arguments(parser):
    from fastdit.cli.common import add_calibration_argument, add_generation_arguments, positive_int

    add_generation_arguments(parser)
    parser.add_argument("--methods", default="dense,sta", help="comma-separated methods; dense always runs, first")
    parser.add_argument("--set", action="append", metavar="METHOD.OPTION=VALUE",
                        help="method option for every setting of METHOD, e.g. --set sta.window=3,3,3 (repeatable)")
    parser.add_argument("--grid", action="append", metavar="METHOD.OPTION=V1,V2",
                        help="one setting per value, e.g. --grid sta.dense_steps=0,0.25; separate values with ';' when "
                             "they contain commas: --grid 'sta.window=3,3,3;5,5,5' (repeatable: the product is run)")
    parser.add_argument("--prompts", default=None,
                        help="prompt file (.txt one per line, or .json list of strings / {prompt_en, dimension}); "
                             "'coco', 'vbench' or 'shapes' for the shipped sets (default coco; shapes, its 32 "
                             "held-out captions, for tiny-shapes)")
    parser.add_argument("--seeds", default="0", help="comma-separated seeds or ranges, e.g. 0,1 or 0-4")
    parser.add_argument("--metrics", default=DEFAULT_METRICS,
                        help="comma-separated, from psnr, ssim, lpips, fid, clip, vbench (default %(default)s)")
    parser.add_argument("--negative-prompt", default=None)
    parser.add_argument("--out", default="fastdit_eval",
                        help="output folder (samples/, results.json, results.md, plots/)")
    parser.add_argument("--fps", type=positive_int, default=16)
    parser.add_argument("--no-warmup", action="store_true", help="skip the untimed 1-step warm-up run")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    add_calibration_argument(parser, "a calibration file (fastdit calibrate, or sta.load_strategy) for its "
                             "method, which must be in --methods (--plan: the same, its earlier name)")
    parser.add_argument("--cp", type=positive_int, default=None, metavar="N",
                        help="split each sample over N processes (Ulysses context parallelism); the launcher's "
                             "processes form groups of N that share the samples")
    from fastdit.methods.parallel.ring import ring_methods  # asked of the registry: svg2 was missing here

    parser.add_argument("--cp-ring", type=positive_int, default=None, metavar="M",
                        help="ring attention over M processes per sample, alone or with --cp N (groups of N * M); "
                             f"block-sparse methods {', '.join(ring_methods())}")
    from fastdit.cli.common import add_cache_arguments

    add_cache_arguments(parser)
    parser.add_argument("--lpips-net", default="alex", choices=["alex", "vgg"])
    parser.add_argument("--lpips-weights", default=None,
                        help="folder with the LPIPS files (default $FASTDIT_LPIPS_WEIGHTS or ~/.cache/fastdit/lpips)")
    parser.add_argument("--fid-weights", default=None,
                        help="pt_inception-2015-12-05-6726825d.pth or its folder (default $FASTDIT_FID_WEIGHTS or "
                             "~/.cache/fastdit/fid)")
    parser.add_argument("--fid-frames", type=positive_int, default=16,
                        help="evenly spaced frames per video that enter FID")
    parser.add_argument("--clip-model", default=None,
                        help="local HF-format CLIP folder or a cached hub id (default $FASTDIT_CLIP_MODEL or "
                             "openai/clip-vit-large-patch14 from the HF cache)")
    parser.add_argument("--vbench-python", default=None,
                        help="python of VBench's own environment (default $FASTDIT_VBENCH_PYTHON); without it the "
                             "vbench metric gives the native temporal flickering only")
    parser.add_argument("--vbench-dimensions", default=None,
                        help="comma-separated VBench dimensions (default: the prompt file's dimension tags, else the "
                             "dimensions that work on custom prompts)")
    return parser


def _trained_call_grid(args):
    """The latent grid of the sizes asked of a trained built-in model (its presets' calibrations are for its
    native grid), else None."""
    from fastdit.pipelines.loading import trained_grid, trained_name

    if trained_name(args.model) is None:
        return None
    return trained_grid(args.model, {"num_frames": args.frames, "height": args.height, "width": args.width})


def parse_seeds(text):
    """``"0,1"`` / ``"0-4"`` -> a list of seeds."""
    from fastdit.cli.common import CLIError

    seeds = []
    for part in (p.strip() for p in str(text).split(",")):
        if not part:
            continue
        try:
            lo, dash, hi = part.partition("-")
            lo, hi = (int(lo), int(hi)) if dash else (int(part), int(part))
        except ValueError:
            raise CLIError(f"argument --seeds: expects integers >= 0 or ranges like 0,1 or 0-4, got {text!r}") from None
        if hi < lo or hi >= 1 << 64:
            raise CLIError(f"argument --seeds: {part!r} is an empty range or a seed over 2**64 - 1; e.g. 0,1 or 0-4")
        if hi - lo >= 100_000:
            raise CLIError(f"argument --seeds: {part!r} is {hi - lo + 1} seeds; at most 100000 per range")
        seeds.extend(range(lo, hi + 1))
    return seeds


def parse_grid(entries, methods):
    """``["sta.dense_steps=0,0.25", ...]`` -> ``{"sta": {"dense_steps": [0, 0.25]}}`` (values checked)."""
    from fastdit.cli.common import CLIError, check_method_options
    from fastdit.options import parse_value

    grid = {}
    for entry in entries or []:
        key, sep, values = entry.partition("=")
        method, dot, option = key.partition(".")
        if not sep or not dot or not option or not values.strip():
            raise CLIError(f"argument --grid: expects METHOD.OPTION=V1,V2,..., got {entry!r}")
        if method not in methods:
            raise CLIError(f"argument --grid: {entry!r} names method {method!r}, which is not in --methods "
                           f"{','.join(methods)}")
        parts = values.split(";") if ";" in values else values.split(",")
        grid.setdefault(method, {})[option] = [parse_value(v) for v in parts if v.strip()]
        for part, value in zip([v for v in parts if v.strip()], grid[method][option]):
            check_method_options(method, {option: value}, f"--grid {method}.{option}={part.strip()}")
    return grid


def config_from_args(args):
    """An ``EvalConfig`` from parsed arguments (SystemExit with a clear message on bad input)."""
    import os

    import fastdit
    from fastdit.cli.common import (CLIError, apply_calibration_argument, auto_calibration_missing, cache_arguments,
                                    check_generation_arguments, check_method_options, check_shapes_prompts,
                                    default_prompts, parse_options)
    from fastdit.calibration.calibration_file import split_calibration
    from fastdit.eval.runner.config import EvalConfig, EvalError
    from fastdit.eval.runner.prompts import load_prompts
    from fastdit.eval.runner.settings import tiny_method_presets
    from fastdit.pipelines.loading import ModelNotFoundError, tiny_name

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    methods = ["dense"] + [m for m in methods if m != "dense"]
    runnable = fastdit.methods.runnable_method_names()
    unknown = [m for m in methods if m not in runnable]
    if unknown:
        raise CLIError(f"argument --methods: unknown method(s) {', '.join(unknown)}; available: {', '.join(runnable)}")
    options = parse_options(args.set, methods, args.calibration)
    grid = parse_grid(args.grid, methods)
    for method, values in grid.items():
        for option, choices in values.items():
            for value in choices:
                check_method_options(method, {**options.get(method, {}), option: value},
                                     f"--grid {method}.{option}={value!r} with --set {method}.*")
    try:
        tiny_name(args.model)
    except ModelNotFoundError as error:
        raise CLIError(f"argument --model: {error}") from None
    check_generation_arguments(args)
    if args.prompts is None:
        args.prompts = default_prompts(args.model, "eval")
    try:
        prompts = load_prompts(args.prompts)
    except EvalError as error:
        raise CLIError(f"argument --prompts: {error}") from None
    check_shapes_prompts(args.model, [p.text for p in prompts])
    metric_names = [m.strip() for m in args.metrics.split(",") if m.strip()]
    if "adherence" in metric_names:  # scored only on captions of the tiny-shapes grammar
        from fastdit.pipelines.shapes_data import parse_caption

        unscored = 0
        for prompt in prompts:
            try:
                parse_caption(prompt.text)
            except ValueError:
                unscored += 1
        if unscored:
            print(f"note: adherence is scored only on captions of the tiny-shapes grammar ('a <colour> <shape> "
                  f"moving <direction>', e.g. --prompts shapes); {unscored} of the {len(prompts)} prompts are not, "
                  f"and their adherence is None")
    cache, cache_options = cache_arguments(args, args.cp is not None or args.cp_ring is not None)
    vbench_dimensions = None
    if args.vbench_dimensions:
        vbench_dimensions = [d.strip() for d in args.vbench_dimensions.split(",") if d.strip()]
    call = {"steps": args.steps, "frames": args.frames, "height": args.height, "width": args.width,
            "guidance": args.guidance, "negative_prompt": args.negative_prompt}
    run_grid = _trained_call_grid(args)
    options = apply_calibration_argument(args.calibration, methods,
                                         tiny_method_presets(args.model, methods, options, run_grid), options)
    # auto runs a calibration's choices only: --calibration, or the one shipped with a trained model at its grid
    if "auto" in methods and split_calibration(options.get("auto", {}))[0] is None:
        raise CLIError(auto_calibration_missing(args.model, run_grid))
    return EvalConfig(
        out=args.out, model=args.model, methods=methods, options=options,
        grid=grid, prompts=prompts, prompts_file=args.prompts, seeds=parse_seeds(args.seeds),
        metrics=metric_names,
        call={k: v for k, v in call.items() if v is not None}, device=args.device, dtype=args.dtype,
        backend=args.backend, fps=args.fps, warmup=not args.no_warmup, progress=not args.no_progress,
        lpips_net=args.lpips_net, lpips_weights=args.lpips_weights, fid_weights=args.fid_weights,
        fid_frames=args.fid_frames, clip_model=args.clip_model,
        vbench_python=args.vbench_python or os.environ.get("FASTDIT_VBENCH_PYTHON") or None,
        vbench_dimensions=vbench_dimensions,
        plots=not args.no_plots, cp=args.cp, cp_ring=args.cp_ring, cache=cache, cache_options=cache_options,
    )


def size_check(cfg):
    """``check_call`` for ``run_eval``: the command line's size limits on the loaded pipeline's call."""
    from fastdit.cli.common import check_loaded_size

    requested = {"frames": cfg.call.get("frames"), "height": cfg.call.get("height"), "width": cfg.call.get("width")}
    return lambda pipe, call_kwargs: check_loaded_size(pipe, call_kwargs, requested)


def cmd_eval(args):
    from fastdit.cli.common import CLIError
    from fastdit.eval.runner.config import EvalError
    from fastdit.eval.runner.processes import make_state
    from fastdit.eval.runner.run import run_eval

    cfg = config_from_args(args)
    if cfg.cp is not None or cfg.cp_ring is not None:
        from fastdit.parallel import check_degree

        try:
            check_degree(cfg.cp or 1, "eval", ring=cfg.cp_ring or 1)
        except ValueError as error:
            raise CLIError(f"argument --cp/--cp-ring: {error}") from None
    try:
        run_eval(cfg, make_state(args.device), check_call=size_check(cfg))
    except EvalError as error:
        raise CLIError(str(error), exit_code=1) from None
    return 0


def add_eval_parser(subparsers):
    """Add the ``eval`` subcommand to ``fastdit``'s subparsers."""
    parser = subparsers.add_parser("eval",
                                   help="dense and methods over prompts x seeds: latency, speedup, quality metrics; "
                                        "results.json, results.md, plots (resumable, accelerate-shardable)")
    add_eval_arguments(parser)
    parser.set_defaults(func=cmd_eval)
    return parser


def build_parser():
    from fastdit.cli.common import ArgumentParser

    parser = ArgumentParser(prog="python -m fastdit.eval", description=__doc__.splitlines()[0])
    add_eval_arguments(parser)
    return parser


def main(argv=None):
    from fastdit.cli.common import run_command

    return run_command(lambda argv: run_command(cmd_eval, build_parser().parse_args(argv), "fastdit eval"), argv,
                       "fastdit eval")


if __name__ == "__main__":
    sys.exit(main())
