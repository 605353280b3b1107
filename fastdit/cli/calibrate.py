"""``fastdit calibrate``: search a method's settings per (step bucket, layer[, head]) against an error budget.

    fastdit calibrate --model tiny-wan --method sta --prompts coco --max-prompts 4 --budget 0.05 --out sta.json
    fastdit compare ... (then apply with fastdit.patch(pipe, "sta", calibration="sta.json"))
    fastdit calibrate --model tiny-shapes --method auto --budget 0.2 --gpu H100 --out auto.json

``--method auto`` scores the candidates of every method per (step bucket, layer, head) and chooses
the one of least predicted time on ``--gpu`` within the budget (``fastdit/methods/auto.py``); it
prints the chosen method per (layer, head), the predicted speedup and the measured error, and
draws them (``OUT`` with ``.png``). ``--set METHOD.OPTION=VALUE`` sets a method's base option there.

Runs the pipeline densely on the prompts, measures every candidate setting on sampled query rows
of every attention call, and writes the calibration file (JSON). Re-running the same command after an
interruption resumes: prompts already finished (kept in ``OUT.partial.json``) are not redone.
"""
from __future__ import annotations

import argparse
import math
import os

__all__ = ["add_calibrate_arguments", "add_calibrate_parser", "cmd_calibrate"]


def _budget(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expects a number > 0 (relative L2 error), got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expects a number > 0 (relative L2 error), got {text!r}")
    return value


def add_calibrate_arguments(parser):
    from fastdit.cli.common import add_generation_arguments, positive_int, seed_int

    add_generation_arguments(parser)
    parser.add_argument("--method", default="sta",
                        help="the method to calibrate (sta: per layer and head; the others per layer; auto: per "
                             "layer and head, across methods)")
    parser.add_argument("--gpu", default=None, help="--method auto: the GPU of the cost model whose predicted time is "
                        "minimised (A100, H100, H200, RTX 4090; default H100)")
    parser.add_argument("--prompts", default=None,
                        help="prompt file (.txt one per line, or .json), or 'coco' / 'vbench' / 'shapes' (the shipped "
                             "sets); default coco, and for tiny-shapes the training captions shipped beside its "
                             "weights")
    parser.add_argument("--max-prompts", type=positive_int, default=4, help="use the first N prompts (default 4)")
    parser.add_argument("--budget", type=_budget, required=True,
                        help="largest relative L2 error against dense attention per head, e.g. 0.05")
    parser.add_argument("--buckets", type=positive_int, default=1, help="step buckets with their own settings")
    parser.add_argument("--candidates", default=None,
                        help="sta: windows 'wt,wh,ww;...' (0 = whole axis); other methods: 'option=v1,v2'; "
                             "default: the method's candidate set")
    parser.add_argument("--set", action="append", metavar="OPTION=VALUE",
                        help="a base option of the method, e.g. --set tile=4,4,8 (repeatable)")
    parser.add_argument("--rows", type=positive_int, default=256, help="query rows sampled per attention call")
    parser.add_argument("--seed", type=seed_int, default=0)
    parser.add_argument("--out", default="calibration.json", help="the calibration file to write (JSON)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    return parser


def parse_candidates(text, method):
    """``"1,3,3;3,3,3"`` (sta windows) or ``"ratio=0.25,0.5"`` -> a list of candidate option dicts."""
    from fastdit.cli.common import CLIError
    from fastdit.options import parse_value

    if text is None:
        return None
    if "=" in text:
        name, _, values = text.partition("=")
        parsed = [parse_value(v) for v in values.split(",") if v.strip()]
        candidates = [{name.strip(): v} for v in parsed]
    else:
        try:
            candidates = [tuple(int(x) for x in part.split(",")) for part in text.split(";") if part.strip()]
        except ValueError:
            raise CLIError("argument --candidates: expects windows like '1,3,3;3,3,3' or OPTION=V1,V2, "
                           f"got {text!r}") from None
        if method != "sta":
            raise CLIError(f"argument --candidates: window triples apply to sta; for {method} give OPTION=V1,V2")
    if not candidates:
        raise CLIError(f"argument --candidates: no candidates in {text!r}")
    return candidates


def cmd_calibrate(args):
    import torch

    import fastdit
    from fastdit.calibration.calibration_file import split_calibration
    from fastdit.calibration.search import calibrate
    from fastdit.cli.common import (CLIError, call_arguments, check_device, check_requested_size,
                                    check_shapes_prompts, default_prompts)
    from fastdit.eval.runner.config import EvalError
    from fastdit.eval.runner.prompts import load_prompts
    from fastdit.eval.runner.settings import tiny_method_presets
    from fastdit.options import parse_value
    from fastdit.pipelines.loading import ModelNotFoundError, load_pipeline

    auto = args.method == "auto"
    if args.method not in fastdit.method_names() and not auto:
        raise CLIError(f"argument --method: unknown method {args.method!r}; available: "
                       f"{', '.join(fastdit.method_names() + ['auto'])}")
    if args.gpu is not None and not auto:
        raise CLIError("argument --gpu: only --method auto chooses by predicted time")
    if auto:
        from fastdit.costmodel import gpu_named

        try:
            gpu_named(args.gpu or "H100")
        except ValueError as error:
            raise CLIError(f"argument --gpu: {error}") from None
        if args.candidates is not None:
            raise CLIError("argument --candidates: --method auto scores every method's default candidates")
    options = {}
    for setting in args.set or []:
        key, sep, value = setting.partition("=")
        if not sep or not key.strip():
            raise CLIError(f"argument --set: expects OPTION=VALUE, got {setting!r}")
        if auto:  # METHOD.OPTION=VALUE: a base option of one of the methods auto chooses from
            method, dot, name = key.strip().partition(".")
            if not dot or not name:
                raise CLIError(f"argument --set: with --method auto give METHOD.OPTION=VALUE, got {setting!r}")
            options.setdefault(method, {})[name] = parse_value(value)
        else:
            options[key.strip()] = parse_value(value)
    candidates = parse_candidates(args.candidates, args.method)
    from fastdit.calibration.candidates import SCHEDULE_OPTIONS, auto_candidates, auto_methods, has_candidates

    if auto:
        try:
            auto_candidates(None, options)
        except ValueError as error:
            raise CLIError(f"argument --set: {error}") from None
    elif candidates is None and not has_candidates(args.method):
        raise CLIError(f"argument --candidates: method {args.method!r} has no default candidate set; give its "
                       f"candidates, e.g. --candidates OPTION=V1,V2")
    if args.prompts is None:
        args.prompts = default_prompts(args.model, "calibrate")
    try:
        prompts = [p.text for p in load_prompts(args.prompts)][: args.max_prompts]
    except EvalError as error:
        raise CLIError(f"argument --prompts: {error}") from None
    check_shapes_prompts(args.model, prompts)
    out_dir = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(out_dir) or os.path.isdir(args.out):
        raise CLIError(f"argument --out: {args.out} must be a file in an existing folder")
    # the files written beside it: the resume record, and auto's picture
    beside = [f"{args.out}.partial.json"] + ([os.path.splitext(args.out)[0] + ".png"] if auto else [])
    for path in beside:
        if os.path.isdir(path):
            raise CLIError(f"argument --out: calibrate also writes {path}, which is a folder; move it or choose "
                           "another --out")
    check_device(args.device)
    try:
        check_requested_size(args.model, args.frames, args.height, args.width)
        pipe = load_pipeline(args.model, args.device, getattr(torch, args.dtype) if args.dtype else None)
    except ModelNotFoundError as error:
        raise CLIError(f"argument --model: {error}") from None
    if args.no_progress:  # also the pipeline's own per-step bars
        pipe.set_progress_bar_config(disable=True)
    call_kwargs = call_arguments(pipe, args.model, args.height, args.width, args.frames, args.steps, args.guidance)
    # The built-in models' presets (block sizes, tiles) under each method's options; a preset that is
    # a calibration (a trained model's) is what this command re-makes, so it is left out.
    if auto:  # a preset's schedule (tiny-shapes' sta: first 6 steps dense) is the method's alone, not a candidate's
        options = {method: {k: v for k, v in split_calibration(values)[1].items() if k not in SCHEDULE_OPTIONS}
                   for method, values in tiny_method_presets(args.model, auto_methods(), options).items()}
    else:
        options = split_calibration(
            tiny_method_presets(args.model, [args.method], {args.method: options})[args.method])[1]
    shown = {k: v for k, v in call_kwargs.items() if isinstance(v, (int, float, str))}
    print(f"calibrating {args.method} on {args.model} ({pipe.device}): {len(prompts)} prompt(s), budget {args.budget}, "
          f"{shown}")
    try:
        calibration = calibrate(pipe, args.method, prompts, budget=args.budget, steps=args.buckets,
                                candidates=candidates, out=args.out, call_kwargs=call_kwargs, options=options,
                                rows=args.rows, seed=args.seed, progress=not args.no_progress,
                                **({"gpu": args.gpu or "H100"} if auto else {}))
    except ValueError as error:
        raise CLIError(str(error), exit_code=1) from None
    if auto:
        from fastdit.calibration.auto_report import heatmap, summary

        print(f"calibration written to {args.out}")
        print("\n".join(summary(calibration)))
        picture = heatmap(calibration, os.path.splitext(args.out)[0] + ".png")
        print(f"chosen methods drawn in {picture}")
        return 0
    measured = calibration["measured"]
    print(f"calibration written to {args.out}: worst relative error {measured['error']:.4f} (budget {args.budget}), "
          f"mean density {measured['density']:.3f}")
    settings = calibration.get("settings", {})
    for row in measured["layers"]:
        key = f"{row['bucket']}_{row['layer']}"
        chosen = f", {'dense' if settings[key] is None else settings[key]}" if key in settings else ""
        print(f"  bucket {row['bucket']} layer {row['layer']}: error {row['error']:.4f}, density {row['density']:.3f}"
              f"{chosen}")
    return 0


def add_calibrate_parser(subparsers):
    """Add the ``calibrate`` subcommand to ``fastdit``'s subparsers."""
    parser = subparsers.add_parser("calibrate",
                                   help="search per-layer (sta: per-head) settings of a method against an error "
                                        "budget; writes a calibration file (resumable)")
    add_calibrate_arguments(parser)
    parser.set_defaults(func=cmd_calibrate)
    return parser
