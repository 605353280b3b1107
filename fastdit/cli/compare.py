"""``fastdit compare``: dense and each method with the same seed; latency, speedup, PSNR, SSIM.

    fastdit compare                                  # tiny-shapes (trained here): dense and its demo methods
    fastdit compare --model tiny-wan --methods dense,sta   # the random-weight tiny Wan
    fastdit compare --model Wan-AI/Wan2.1-T2V-1.3B-Diffusers --frames 81 --height 480 --width 832 \
        --methods dense,sta --set sta.dense_steps=0.25 --out runs/wan
"""
from __future__ import annotations

from fastdit.cli.common import (
    CLIError,
    add_cache_arguments,
    add_calibration_argument,
    apply_calibration_argument,
    add_generation_arguments,
    auto_calibration_missing,
    cache_arguments,
    call_arguments,
    check_generation_arguments,
    parse_options,
    positive_int,
    seed_int,
    shipped_auto_elsewhere,
)
from fastdit.cpu_load import load_warning
from fastdit.pipelines.shapes_data import DEMO_CAPTION


DEFAULT_PROMPT = "A red fox runs through fresh snow in a pine forest at sunrise"
SHAPES_PROMPT = DEMO_CAPTION
#: The model ``fastdit compare`` runs without ``--model``: trained here, so its videos can be judged by eye.
DEFAULT_MODEL = "tiny-shapes"
#: ``--methods`` when it is not given: on tiny-shapes sta (the static default), window (sta's tiles
#: with a cached residual), prune (query blocks reused across steps), sparge (dynamic, under its quality
#: guard) and auto, each at the presets and calibrations shipped with the model (BENCHMARKS.md,
#: "Trained tiny model"); elsewhere dense and sta.
#: ``auto`` in a default list runs the calibration shipped with the model's weights; at a size whose
#: latent grid it was not made for it is left out of the default run (with a note), not an error.
DEFAULT_METHODS = {"tiny-shapes": "dense,sta,window,prune,sparge,auto"}
FALLBACK_METHODS = "dense,sta"


def cmd_compare(args):
    import torch

    from fastdit.calibration.calibration_file import split_calibration
    from fastdit.compare import compare, format_table
    from fastdit.eval.runner.settings import tiny_method_presets
    from fastdit.pipelines.loading import ModelNotFoundError, load_pipeline, trained_name

    defaulted = args.methods is None
    if defaulted:
        args.methods = DEFAULT_METHODS.get(args.model, FALLBACK_METHODS)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if not methods:
        raise CLIError(f"argument --methods: no method given in {args.methods!r}; e.g. --methods dense,sta")
    import fastdit

    runnable = fastdit.methods.runnable_method_names()
    unknown = [m for m in methods if m not in runnable]
    if unknown:
        raise CLIError(f"argument --methods: unknown method(s) {', '.join(unknown)}; available: {', '.join(runnable)}")
    shapes = trained_name(args.model) == "tiny-shapes"
    # auto runs only a calibration's choices: given, or (tiny-shapes) shipped with the weights, checked
    # below once the call's grid is known; any other model fails here, before it is loaded
    if "auto" in methods and args.calibration is None and not defaulted:
        from fastdit.pipelines.loading import trained_grid

        if not shapes:
            raise CLIError(auto_calibration_missing(args.model))
        asked = trained_grid("tiny-shapes", {"num_frames": args.frames, "height": args.height, "width": args.width})
        if asked != trained_grid("tiny-shapes"):  # the shipped calibration cannot serve this call: say so now
            raise CLIError(auto_calibration_missing(args.model, asked))
    options = parse_options(args.set, methods, args.calibration)
    check_generation_arguments(args)
    if args.prompt is None:
        args.prompt = SHAPES_PROMPT if shapes else DEFAULT_PROMPT
    if shapes:  # adherence needs a caption of the shapes grammar
        from fastdit.pipelines.shapes_data import parse_caption

        try:
            parse_caption(args.prompt)
        except ValueError as error:
            raise CLIError(f"argument --prompt: tiny-shapes takes captions like {SHAPES_PROMPT!r}: {error}") from None
    split = args.cp is not None or args.cp_ring is not None
    cache, cache_options = cache_arguments(args, split)
    parallel = None
    if split:
        from fastdit import parallel as cp

        ulysses, ring = args.cp or 1, args.cp_ring or 1
        if cp.launched_world() is not None and cp.launched_world()[1] != ulysses * ring:
            raise CLIError(f"argument --cp/--cp-ring: compare splits one sample over all {cp.launched_world()[1]} "
                           f"processes; launch ulysses x ring = {ulysses * ring} (torchrun --nproc_per_node "
                           f"{ulysses * ring})")
        try:
            parallel = cp.setup(ulysses, ring)
        except ValueError as error:
            raise CLIError(f"argument --cp/--cp-ring: {error}") from None
    dtype = getattr(torch, args.dtype) if args.dtype else None
    try:
        pipe = load_pipeline(args.model, args.device or (parallel and str(parallel.device)), dtype)
    except ModelNotFoundError as error:
        raise CLIError(f"argument --model: {error}") from None
    if parallel is not None:
        try:  # Ulysses' heads checked here, before the dense run (diffusers fails inside it)
            cp.enable(pipe, parallel)
        except ValueError as error:
            raise CLIError(f"argument {error}") from None
        if not parallel.is_main and hasattr(pipe, "set_progress_bar_config"):
            pipe.set_progress_bar_config(disable=True)  # one progress bar, rank 0's
    check_quant_options(options, pipe)
    call_kwargs = call_arguments(pipe, args.model, args.height, args.width, args.frames, args.steps, args.guidance)
    from fastdit.pipelines.loading import latent_grid

    grid = latent_grid(pipe, call_kwargs) if shapes else None  # a trained model's calibrations fit its native grid
    options = apply_calibration_argument(args.calibration, methods,
                                         tiny_method_presets(args.model, methods, options, grid), options)
    if "auto" in methods and split_calibration(options.get("auto") or {})[0] is None:  # the shipped one does not fit
        if not defaulted:
            raise CLIError(auto_calibration_missing(args.model, grid))
        methods = [m for m in methods if m != "auto"]
        print(f"note: auto left out of the default methods: {shipped_auto_elsewhere(args.model, grid)}")
    if args.negative_prompt is not None:
        call_kwargs["negative_prompt"] = args.negative_prompt
    if cache is not None:  # the fitted settings, checked before any run
        from fastdit.integrations.caches import cache_settings

        try:
            cache_settings(cache, pipe, call_kwargs.get("num_inference_steps", 50), cache_options)
        except (ValueError, TypeError) as error:
            raise CLIError(f"argument --cache: {error}") from None
    shown = {k: v for k, v in call_kwargs.items() if isinstance(v, (int, float, str))}
    print(f"model {args.model} on {pipe.device}: {shown}")
    from fastdit.eval.runner.settings import method_presets

    presets, label = method_presets(args.model, grid)
    if presets and any(m in presets for m in methods):
        print(f"method presets: {label}")
    report = compare(pipe, methods, args.prompt, args.seed, call_kwargs, args.out, model_name=args.model,
                     method_options=options, backend=args.backend, fps=args.fps, warmup=not args.no_warmup,
                     parallel=parallel, adherence=shapes, cache=cache,
                     cache_options=cache_options)
    if parallel is not None and not parallel.is_main:
        return 0
    print()
    print(format_table(report["runs"]))
    for row in report["runs"]:
        if row.get("plans"):
            plans = ", ".join(row.get("plans", []))
            print(f"{row['method']}: plans {plans}; padding {100 * row['padding_fraction']:.1f}% of tokens")
        for reason, count in (row.get("fallbacks") or {}).items():
            print(f"{row['method']}: {count} fallback call(s) ran the model's own attention: {reason}")
    print("density: computed / total attention blocks over all calls of the patched layers (dense steps, dense "
          "layers and fallbacks count as 1); sparse-only: the same over the sparse calls alone")
    if shapes:
        from fastdit.eval.metrics.adherence import CHANCE_LEVEL

        print(f"adherence: colour, shape and motion of each captioned object found with OpenCV "
              f"(fastdit.eval.metrics.adherence); 1 = all as captioned, chance (a valid video of another caption) "
              f"about {CHANCE_LEVEL:.2f}, noise about 0")
    for row in report["runs"]:
        warning = load_warning(row.get("load"), f"{row['method']}'s timed run")
        if warning:
            print(warning)
    print(f"\nvideos and report.json in {args.out}")
    return 0


def check_quant_options(options, pipe):
    """``--set METHOD.quant=...`` checked against the model's dtype and device before any run (the
    methods check it at their first call, which comes after the dense run)."""
    import torch

    from fastdit.kernels.quant import check_quant

    model = getattr(pipe, "transformer", None) or getattr(pipe, "unet", None)
    for method, values in (options or {}).items():
        quant = (values or {}).get("quant")
        if quant is not None and model is not None:
            try:
                check_quant(quant, model.dtype, model.device)
            except ValueError as error:
                hint = "" if model.dtype in (torch.float16, torch.bfloat16) else " (pass --dtype bfloat16 or float16)"
                raise CLIError(f"argument --set {method}.quant: {error}{hint}") from None


def add_compare_parser(sub):
    compare = sub.add_parser("compare",
                             help="run dense and each method with the same seed; latency, speedup, PSNR, SSIM")
    add_generation_arguments(compare, model_default=DEFAULT_MODEL)
    compare.add_argument("--methods", default=None,
                         help=f"comma-separated methods (dense always runs first; default "
                              f"{DEFAULT_METHODS[DEFAULT_MODEL]} on {DEFAULT_MODEL}, else {FALLBACK_METHODS})")
    compare.add_argument("--set", action="append", metavar="METHOD.OPTION=VALUE",
                         help="method option, e.g. --set sta.tile=6,8,8 --set sta.dense_steps=0.25 (repeatable)")
    compare.add_argument("--seed", type=seed_int, default=0)
    compare.add_argument("--prompt", default=None,
                         help=f"default: {DEFAULT_PROMPT!r} ({SHAPES_PROMPT!r} for --model tiny-shapes)")
    compare.add_argument("--negative-prompt", default=None)
    compare.add_argument("--out", default="fastdit_compare", help="output folder (mp4 per run, report.json)")
    compare.add_argument("--fps", type=positive_int, default=16)
    compare.add_argument("--no-warmup", action="store_true", help="skip the untimed 1-step warm-up run")
    add_calibration_argument(compare, "a calibration file (fastdit calibrate, or sta.load_strategy) for its "
                             "method, which must be in --methods (--plan: the same, its earlier name)")
    compare.add_argument("--cp", type=positive_int, default=None, metavar="N",
                         help="Ulysses context parallelism over N processes of a launcher "
                              "(torchrun --nproc_per_node N -m fastdit.cli compare ... --cp N)")
    from fastdit.methods.parallel.ring import ring_methods  # asked of the registry: svg2 was missing here

    compare.add_argument("--cp-ring", type=positive_int, default=None, metavar="M",
                         help="ring attention over M processes, alone or with --cp N (Ulysses x ring: N * M "
                              f"processes); block-sparse methods {', '.join(ring_methods())}")
    add_cache_arguments(compare)
    compare.set_defaults(func=cmd_compare)
    return compare
