"""``python -m fastdit.train``: the LoRA recipe on a pipeline (fastdit's tiny ones built in), with
an optional before / after measurement (``--eval``) and a dense-training timing (``--time-dense``).

    python -m fastdit.train --tiny wan --method sta --options '{"tile": [2, 4, 4], "window": [1, 1, 1]}' \\
        --steps 40 --out runs/lora-sta --eval --json runs/lora-sta/result.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

TINY_CALL = {"num_frames": 13, "height": 128, "width": 128, "num_inference_steps": 4, "guidance_scale": 5.0,
             "max_sequence_length": 16}  # latent grid 4 x 8 x 8 = 256 tokens
HELD_OUT = ("a city street at night in the rain", "a bird on a branch")
#: ``--tiny`` without ``--options``: the sliding-window methods' defaults (window 3 x 3 x 3 of the
#: model's tiles) cover the whole 4 x 8 x 8 latent grid (density 1: nothing to learn), so the tiny
#: run uses 2 x 4 x 4 tiles and a one-tile window (density about 0.4).
TINY_OPTIONS = {"sta": {"tile": (2, 4, 4), "window": (1, 1, 1)}, "window": {"tile": (2, 4, 4), "window": (1, 1, 1)}}


def _pipeline(args):
    """``(pipe, call)``: a tiny random-weight pipeline (``--tiny``) with 256-token videos, or
    ``--model`` through ``fastdit.pipelines.loading.load_pipeline`` (the trained ``tiny-shapes``
    with its native call, a folder or a hub id with the pipeline's defaults)."""
    if args.tiny:
        from fastdit.pipelines.tiny import tiny

        return tiny(args.tiny, seed=args.model_seed), dict(TINY_CALL)
    from fastdit.pipelines.loading import TRAINED_DEFAULTS, load_pipeline

    return load_pipeline(args.model), dict(TRAINED_DEFAULTS.get(args.model, {}))


def _shapes_captions(count, seed):
    """``count`` distinct captions of the tiny-shapes grammar (1-2 objects), drawn with ``seed``."""
    from fastdit.pipelines.shapes_data import distinct_captions

    return distinct_captions(count, seed, max_shapes=2)


def _json_arg(parser, flag, text, kind):
    """``text`` parsed as JSON of ``kind`` (``"object"``, ``"strings"``: a non-empty list of
    strings, ``"pairs"``: a list of ``[caption, video file]``), or a one-line error naming ``flag``."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        parser.error(f"{flag}: not valid JSON ({error}): {text!r}")
    if kind == "object" and not isinstance(value, dict):
        parser.error(f"{flag} must be a JSON object ({{\"name\": value, ...}}), got {type(value).__name__}: {text!r}")
    if kind == "strings" and not (isinstance(value, list) and value and all(isinstance(v, str) and v for v in value)):
        parser.error(f"{flag} must be a JSON list of non-empty strings (e.g. '[\"a red fox\", \"waves\"]'), "
                     f"got {text!r}")
    if kind == "pairs" and not (isinstance(value, list) and all(
            isinstance(v, list) and len(v) == 2 and all(isinstance(x, str) for x in v) for v in value)):
        parser.error(f"{flag} must be a JSON list of [caption, video file] pairs, got {text!r}")
    return value


def _check_args(parser, args):
    """Every input checked before any model loads: ``(options, notes, eval_seeds, json values)``."""
    from fastdit.methods.base import get_method

    from .recipe import LoraTrainConfig

    notes = []
    if args.options is None and args.tiny and args.method in TINY_OPTIONS:
        options = dict(TINY_OPTIONS[args.method])
        notes.append(f"--tiny: {args.method}'s default window covers the whole tiny latent grid; using {options} "
                     "(pass --options to choose)")
    else:
        options = {key: tuple(v) if isinstance(v, list) else v
                   for key, v in _json_arg(parser, "--options", args.options or "{}", "object").items()}
    try:
        get_method(args.method).make_config(None, **options)
    except (ValueError, TypeError) as error:
        flag = "--method" if "unknown method" in str(error) else "--options"
        parser.error(f"{flag}: {error}")
    call = _json_arg(parser, "--call", args.call, "object") if args.call else {}
    prompts = tuple(_json_arg(parser, "--prompts", args.prompts, "strings")) if args.prompts else None
    held_out = tuple(_json_arg(parser, "--held-out", args.held_out, "strings")) if args.held_out else None
    videos = tuple(tuple(v) for v in _json_arg(parser, "--videos", args.videos, "pairs")) if args.videos else ()
    for _, video in videos:
        if not Path(video).is_file():
            parser.error(f"--videos: {video!r} is not a file")
    try:
        eval_seeds = tuple(int(s) for s in args.eval_seeds.split(","))
    except ValueError:
        parser.error(f"--eval-seeds must be comma-separated integers (e.g. 100,101), got {args.eval_seeds!r}")
    for flag, value in (("--out", args.out), ("--json", args.json)):
        if value is None:
            continue
        path = Path(value)
        if (flag == "--out" and path.exists() and not path.is_dir()) or (flag == "--json" and path.is_dir()):
            parser.error(f"{flag} {value!r} is an existing {'file' if flag == '--out' else 'folder'}; "
                         f"--out takes a folder, --json a file")
    if args.time_dense < 0:
        parser.error(f"--time-dense must be >= 0 (0: off), got {args.time_dense}")
    try:
        LoraTrainConfig(method=args.method, options=options, steps=args.steps, samples=args.samples, lr=args.lr,
                        rank=args.rank, checkpoint_every=args.checkpoint_every, videos=videos,
                        flow_weight=args.flow_weight, **({"prompts": prompts} if prompts else {}))
    except ValueError as error:
        field = str(error).split()[0]  # the config's messages start with the field: the flag of the same name
        parser.error(f"--{field.replace('_', '-')}: {error}")
    return options, notes, eval_seeds, call, prompts, held_out, videos


def main(argv=None):
    from .evaluate import dense_videos, layer_errors, output_error, video_fidelity
    from .recipe import LoraTrainConfig, add_lora, make_samples, train_lora, train_steps

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--tiny", help="one of fastdit's tiny pipelines (e.g. wan)")
    source.add_argument("--model", help="a diffusers pipeline folder or hub id")
    parser.add_argument("--model-seed", type=int, default=0)
    parser.add_argument("--method", default="sta")
    parser.add_argument("--options", default=None, help="the method's options as JSON (default: the method's own; "
                        "--tiny with sta / window: tile [2, 4, 4], window [1, 1, 1], which fit its grid)")
    parser.add_argument("--call", default=None, help="pipeline call arguments as JSON (tiny: 256-token videos)")
    parser.add_argument("--prompts", default=None, help="JSON list of distillation prompts (tiny-shapes: 8 captions "
                        "of its grammar)")
    parser.add_argument("--held-out", default=None, help="JSON list of held-out prompts for --eval (default: two "
                        "fixed prompts; tiny-shapes: 4 captions drawn apart from the training ones)")
    parser.add_argument("--eval-seeds", default="100", help="comma-separated seeds of the held-out videos")
    parser.add_argument("--videos", default=None, help="JSON list of [caption, video file] pairs: adds the "
                        "flow-matching loss on them (Wan family)")
    parser.add_argument("--flow-weight", type=float, default=1.0, help="weight of the flow-matching loss")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--checkpoint-every", type=int, default=0)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--out", required=True)
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    parser.add_argument("--eval", action="store_true", help="PSNR / SSIM and per-layer errors before and after")
    parser.add_argument("--time-dense", type=int, default=0, help="also time N dense LoRA training steps")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    options, notes, eval_seeds, call_override, prompts_given, held_given, videos = _check_args(parser, args)
    pipe, call = _pipeline(args)
    pipe.set_progress_bar_config(disable=True)
    call.update(call_override)
    prompts, held_out = None, HELD_OUT
    if args.model == "tiny-shapes":  # its own grammar: the tiny text encoder knows nothing else
        prompts, held_out = _shapes_captions(8, seed=7), _shapes_captions(4, seed=8)
    prompts = prompts_given or prompts
    held_out = held_given or held_out
    config = LoraTrainConfig(method=args.method, options=options, steps=args.steps, samples=args.samples, lr=args.lr,
                             rank=args.rank, checkpoint_every=args.checkpoint_every, call_kwargs=call,
                             backend=args.backend, videos=videos,
                             flow_weight=args.flow_weight, **({"prompts": prompts} if prompts else {}))
    result = {"method": args.method, "options": options, "call": call, "prompts": config.prompts,
              "held_out": held_out, "eval_seeds": eval_seeds}
    eval_call = dict(call)
    held = None
    if args.eval:
        dense = dense_videos(pipe, held_out, eval_seeds, eval_call)
        held_all = make_samples(pipe, LoraTrainConfig(prompts=held_out, seeds=(100, 101), samples=8, seed=100,
                                                      call_kwargs=call))
        held = held_all[0]
        result["before"] = video_fidelity(pipe, dense, held_out, eval_seeds, eval_call, args.method, options,
                                          args.backend)
        result["before"]["layer_errors"] = layer_errors(pipe.transformer, held, args.method, options, args.backend)
        result["before"]["output_error"] = output_error(pipe.transformer, held_all, args.method, options, args.backend)
    from .recipe import TrainingDiverged

    try:
        trained = train_lora(pipe, config, args.out, resume=args.resume, progress=not args.no_progress)
    except (ValueError, TrainingDiverged) as error:  # resume mismatch, unreadable checkpoints, divergence
        parser.exit(1, f"{parser.prog}: error: {error}\n")
    times = trained["seconds_per_step"][1:] or trained["seconds_per_step"]
    result.update(loss_first=trained["losses"][0], loss_last=trained["losses"][-1], steps=len(trained["losses"]),
                  sparse_step_s=statistics.median(times) if times else None, stats=trained["stats"],
                  options_trained=trained["options_trained"], notes=notes + trained["notes"])
    for note in result["notes"]:
        print(f"note: {note}", file=sys.stderr)
    own = trained.get("method_params")  # the method's trained gates / projections, if it has any
    result["method_params"] = own
    if args.eval:
        result["after"] = video_fidelity(pipe, dense, held_out, eval_seeds, eval_call, args.method, options,
                                         args.backend, method_params=own)
        result["after"]["layer_errors"] = layer_errors(pipe.transformer, held, args.method, options, args.backend,
                                                       method_params=own)
        result["after"]["output_error"] = output_error(pipe.transformer, held_all, args.method, options, args.backend,
                                                       method_params=own)
    if args.time_dense:  # the same LoRA steps without the patch (a fresh adapter on a fresh model)
        dense_pipe, _ = _pipeline(args)
        dense_pipe.set_progress_bar_config(disable=True)
        samples = make_samples(dense_pipe, config)
        params = add_lora(dense_pipe.transformer, config)
        _, dense_times, _ = train_steps(dense_pipe.transformer, params, samples,
                                        LoraTrainConfig(**{**config.__dict__, "steps": args.time_dense}),
                                        progress=not args.no_progress)
        result["dense_step_s"] = statistics.median(dense_times[1:] or dense_times)
    print(json.dumps({k: v for k, v in result.items() if k != "stats"}, indent=1, default=str))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
