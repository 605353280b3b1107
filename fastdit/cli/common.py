"""What the ``fastdit`` subcommands share: one-line errors, option and size checks, argument groups.

``fastdit/cli/command.py`` (compare, methods, the entry point) and ``fastdit/cli/eval.py`` (eval) both import
from here, so neither imports the other's helpers (no import circle).
"""
from __future__ import annotations

import os
import sys

from fastdit.compare import COMPARE_TINY_SIZE
from fastdit.options import (  # noqa: F401 (the CLI's names)
    ArgumentParser, parse_value, port_int, positive_int, seed_int)

#: Latent video tokens (frames x height x width in tokens) a run may have: about 9x HunyuanVideo's
#: 720p x 129 frames (33 x 45 x 80 = 118,800 tokens); ``FASTDIT_MAX_TOKENS`` raises it.
MAX_LATENT_TOKENS = 1 << 20
#: Decoded video values per channel (frames x height x width): 2^30, 12 GiB as float32 RGB, about 9x
#: HunyuanVideo's 720p x 129 frames; ``FASTDIT_MAX_PIXELS`` raises it.
MAX_VIDEO_PIXELS = 1 << 30
#: ``(pixels, frames)`` per latent token of the tiny built-ins (VAE 8x spatial, 4x temporal, patch 2),
#: and the coarsest of diffusers' video DiTs (LTX-Video: 32, 8): sizes are checked against these
#: before a model loads (a lower bound of its tokens), then exactly once it is loaded.
TINY_GRANULARITY = (16, 4)
TRAINED_GRANULARITY = (4, 2)  # tiny-shapes: VAE factors 4 (space) and 2 (time), patch 1
COARSEST_GRANULARITY = (32, 8)


class CLIError(SystemExit):
    """A command-line error. ``main`` prints it as one line ``fastdit CMD: error: MESSAGE`` and
    exits with ``exit_code`` (2: bad arguments, like argparse); uncaught elsewhere it acts like
    ``SystemExit(message)``."""

    def __init__(self, message, exit_code=2):
        super().__init__(message)
        self.exit_code = exit_code


def debug_mode():
    return os.environ.get("FASTDIT_DEBUG", "0").lower() in ("1", "true", "yes", "on")


def run_command(func, args, prog):
    """``func(args)`` with every error as one line on stderr: ``CLIError`` as ``PROG: error: ...``
    (its exit code), anything unexpected as ``fastdit: error: ...`` (exit 1; ``FASTDIT_DEBUG=1``
    re-raises it with its traceback), Ctrl-C as ``PROG: interrupted`` (exit 130)."""
    try:
        return func(args)
    except CLIError as error:
        if not getattr(error, "reported", False):
            print(f"{prog}: error: {error}", file=sys.stderr)
            error.reported, error.code = True, error.exit_code
        raise
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        raise SystemExit(130) from None
    except BrokenPipeError:  # output piped into `head` and closed: not an error
        sys.stderr.close()
        raise SystemExit(0) from None
    except Exception as error:  # noqa: BLE001 - the CLI's last line of defence
        if debug_mode():
            raise
        lines = str(error).strip().splitlines()
        detail = f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
        print(f"fastdit: error: {detail} (FASTDIT_DEBUG=1 shows the traceback)", file=sys.stderr)
        raise SystemExit(1) from None


def method_config(method, options):
    """``method``'s config built (so validated) from ``options``; ValueError / TypeError when bad.
    The CLI's one call into the method API."""
    import fastdit.methods

    return fastdit.methods.get_method(method).make_config(**options)


def check_method_options(method, options, what):
    """CLIError naming ``what`` (e.g. ``--set sta.tile=0,0,0``) unless ``options`` make a valid config."""
    try:
        method_config(method, options)
    except (ValueError, TypeError) as error:
        raise CLIError(f"argument {what}: {error}") from None



def apply_calibration_argument(path, methods, options, user_options):
    """``--calibration FILE`` (alias ``--plan``): the file's method runs with ``calibration=FILE`` and
    the options the user set (``--set``) on top; the tiny models' presets do not apply to it (the
    calibration fixes its own tile). A ``--set`` of an option the calibration sets is refused here,
    before any model loads."""
    from fastdit.calibration.calibration_file import (
        CalibrationError, calibration_options, load_calibration, with_calibration)

    if path is None:
        return options
    try:
        method = load_calibration(path)["method"]
    except CalibrationError as error:
        raise CLIError(f"argument --calibration: {error}") from None
    if method not in methods:
        raise CLIError(f"argument --calibration: {path} is a calibration for method {method!r}; add it to --methods")
    try:
        with_calibration(calibration_options(path, method), user_options.get(method, {}), path)
    except CalibrationError as error:
        raise CLIError(f"argument --set: {error}") from None
    return {**options, method: {"calibration": path, **user_options.get(method, {})}}


def shipped_auto_elsewhere(model, grid):
    """Why the auto calibration shipped with the trained ``model`` cannot serve a call on ``grid``."""
    from fastdit.pipelines.loading import trained_grid, trained_name

    return (f"the auto calibration shipped with {model} is for its native latent grid "
            f"{list(trained_grid(trained_name(model)))}, this call's is {list(grid)}")


def auto_calibration_missing(model, grid=None):
    """The ``--methods`` error for ``auto`` with no calibration to run: how to make one and pass it, and
    for a trained model called on another latent ``grid``, why its shipped calibration does not serve."""
    from fastdit.methods.auto import NEEDS_CALIBRATION
    from fastdit.pipelines.loading import trained_name

    why = f" ({shipped_auto_elsewhere(model, grid)})" if grid is not None and trained_name(model) else ""
    return f"argument --methods: {NEEDS_CALIBRATION}; pass it here with --calibration auto.json{why}"


def add_calibration_argument(parser, help_text):
    """``--calibration FILE``, with ``--plan`` (its earlier name) as an alias of the same argument."""
    parser.add_argument("--calibration", "--plan", dest="calibration", default=None, metavar="FILE", help=help_text)


def parse_options(settings, methods, calibration=None):
    """``["sta.tile=6,8,8", ...]`` -> ``{"sta": {"tile": (6, 8, 8)}}``. ``calibration``: the
    ``--calibration`` file, whose method's options are checked with the file's own under them
    (``auto`` has no config without its calibration's candidates and choices)."""
    base = {}
    if calibration is not None:
        from fastdit.calibration.calibration_file import CalibrationError, calibration_options, load_calibration

        try:
            calibrated = load_calibration(calibration)["method"]
            base = {calibrated: calibration_options(calibration, calibrated)}
        except CalibrationError as error:
            raise CLIError(f"argument --calibration: {error}") from None
    options = {}
    for setting in settings or []:
        key, sep, value = setting.partition("=")
        method, dot, option = key.partition(".")
        if not sep or not dot or not option:
            raise CLIError(f"argument --set: expects METHOD.OPTION=VALUE, got {setting!r}")
        if method not in methods:
            raise CLIError(f"argument --set: {setting!r} names method {method!r}, which is not in --methods "
                           f"{','.join(methods)}")
        # empty: None, what the option tables' "empty: ..." means (format_value writes None as "")
        parsed = None if not value.strip() else parse_value(value)
        check_method_options(method, {**base.get(method, {}), option: parsed}, f"--set {setting}")
        options.setdefault(method, {})[option] = parsed
    for method, values in options.items():
        check_method_options(method, {**base.get(method, {}), **values}, f"--set {method}.*")
    return options


def default_prompts(model, command):
    """``--prompts`` when none is given. tiny-shapes (trained here on captions of one grammar) gets
    captions of that grammar: ``calibrate`` the training captions shipped beside its weights
    (``calibration_captions.txt``), ``eval`` the 32 held-out captions of the shipped ``shapes`` set
    (its adherence metric scores only such captions); every other model the shipped COCO captions."""
    from fastdit.pipelines.loading import TRAINED_MODELS, WEIGHTS_DIR, trained_name

    if trained_name(model) != "tiny-shapes":
        return "coco"
    if command == "calibrate":
        return os.path.join(WEIGHTS_DIR, TRAINED_MODELS["tiny-shapes"], "calibration_captions.txt")
    return "shapes"


def check_shapes_prompts(model, prompts, flag="--prompts"):
    """CLIError (one line, naming ``flag``) when ``model`` is tiny-shapes and a prompt is not a caption
    of its grammar: the model was trained on nothing else (its output on other text, and the
    adherence score of it, mean nothing), as ``fastdit compare`` already refuses."""
    from fastdit.pipelines.loading import trained_name

    if trained_name(model) != "tiny-shapes":
        return
    from fastdit.pipelines.shapes_data import DEMO_CAPTION, parse_caption

    for text in prompts:
        try:
            parse_caption(text)
        except ValueError as error:
            raise CLIError(f"argument {flag}: tiny-shapes takes captions like {DEMO_CAPTION!r} (the default "
                           f"prompts are such captions); {text[:60]!r}: {error}") from None


def add_generation_arguments(parser, steps_default=None, model_default="tiny-wan"):
    parser.add_argument("--model", default=model_default,
                        help="tiny-shapes (trained here), tiny-wan, tiny-wan-i2v, tiny-hunyuan-video (random "
                             f"weights), a hub id or a local folder (default {model_default})")
    parser.add_argument("--steps", type=positive_int, default=steps_default, help="denoising steps")
    parser.add_argument("--frames", type=positive_int, default=None,
                        help="video frames (rounded to what the model takes)")
    parser.add_argument("--height", type=positive_int, default=None)
    parser.add_argument("--width", type=positive_int, default=None)
    parser.add_argument("--guidance", type=float, default=None, help="guidance scale")
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    parser.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--backend", default="auto", choices=["auto", "triton", "torch"], help="kernel backend")


def call_arguments(pipe, model, height=None, width=None, frames=None, steps=None, guidance=None):
    """Pipeline call kwargs: the tiny model's defaults, then the user's sizes (fitted to the model)."""
    from fastdit.pipelines.loading import TRAINED_DEFAULTS, fitted_call, tiny_name, trained_name

    base = {}
    name = tiny_name(model)
    if name is not None:
        from fastdit.pipelines.tiny import TINY_DEFAULTS

        base = {**TINY_DEFAULTS[name], **COMPARE_TINY_SIZE}
    elif trained_name(model) is not None:  # trained built-ins run at their native size
        base = dict(TRAINED_DEFAULTS[model])
    kwargs, notes = fitted_call(pipe, base, height, width, frames, steps, guidance)
    for note in notes:
        print(f"note: {note}")
    check_loaded_size(pipe, kwargs, {"frames": frames, "height": height, "width": width})
    return kwargs


def _limit(name, default):
    try:
        return max(int(os.environ.get(name, default)), 1)
    except ValueError:
        return default


def fit_to_granularity(value, multiple, offset=0):
    """What ``fit_size`` makes of a requested size (nearest multiple, at least one)."""
    return max(multiple, round((value - offset) / multiple) * multiple) + offset


def check_size(frames, height, width, requested, spatial, temporal):
    """CLIError naming the offending option when ``frames`` x ``height`` x ``width`` (sizes as the
    model gets them; None: unknown, counted as the smallest) has more latent tokens than
    ``MAX_LATENT_TOKENS`` or more decoded pixels than ``MAX_VIDEO_PIXELS``. ``requested``:
    option name -> the value the user gave (None: not given)."""
    max_tokens = _limit("FASTDIT_MAX_TOKENS", MAX_LATENT_TOKENS)
    max_pixels = _limit("FASTDIT_MAX_PIXELS", MAX_VIDEO_PIXELS)
    f, h, w = frames or 1, height or spatial, width or spatial
    grid = ((f - 1) // temporal + 1, max(h // spatial, 1), max(w // spatial, 1))
    tokens, pixels = grid[0] * grid[1] * grid[2], f * h * w
    if tokens <= max_tokens and pixels <= max_pixels:
        return

    def largest(name):
        """The largest value of option ``name`` that fits, the other sizes kept."""
        if name == "frames":
            latent = max_tokens // (grid[1] * grid[2])
            by_pixels = max_pixels // (h * w)
            return min((latent - 1) * temporal + 1, (by_pixels - 1) // temporal * temporal + 1) if latent else 0
        other_tokens = grid[0] * (grid[2] if name == "height" else grid[1])
        other_pixels = f * (w if name == "height" else h)
        return min(max_tokens // other_tokens * spatial, max_pixels // other_pixels // spatial * spatial)

    given = [name for name in ("frames", "height", "width") if requested.get(name) is not None]
    # Blame the given size furthest over what would fit, among those that can fit on their own.
    name = max(given, key=lambda n: (largest(n) >= 1, requested[n] / max(largest(n), 1))) if given else None
    option = f"--{name}" if name else "--frames/--height/--width"
    value = f" {requested[name]}" if name else ""
    if tokens > max_tokens:
        why = (f"{f} frame{'s' * (f != 1)} of {h}x{w} make {grid[0]}x{grid[1]}x{grid[2]} = {tokens} latent tokens "
               f"({spatial} pixels, {temporal} frames per token); at most {max_tokens} fit (FASTDIT_MAX_TOKENS)")
    else:
        why = (f"{f} frame{'s' * (f != 1)} of {h}x{w} decode to {pixels} pixels per channel; at most {max_pixels} fit "
               f"(FASTDIT_MAX_PIXELS)")
    if name:
        allowed = largest(name)
        why += f"; {option} <= {allowed} here" if allowed >= 1 else f"; no {option} fits with the other sizes"
    raise CLIError(f"argument {option}:{value} is too large: {why}")


def check_requested_size(model, frames, height, width):
    """Before loading: refuse sizes that cannot fit (the tiny models' real granularity and sizes,
    else the coarsest granularity and unknown sizes as the smallest: a lower bound)."""
    from fastdit.pipelines.loading import TRAINED_DEFAULTS, tiny_name, trained_name

    requested = {"frames": frames, "height": height, "width": width}
    name = tiny_name(model)
    spatial, temporal = TINY_GRANULARITY if name is not None else COARSEST_GRANULARITY
    base = None
    if name is not None:
        from fastdit.pipelines.tiny import TINY_DEFAULTS

        base = {**TINY_DEFAULTS[name], **COMPARE_TINY_SIZE}
    elif trained_name(model) is not None:
        spatial, temporal = TRAINED_GRANULARITY
        base = TRAINED_DEFAULTS[model]
    if base is not None:
        frames = base.get("num_frames") if frames is None else frames
        height = base.get("height") if height is None else height
        width = base.get("width") if width is None else width
    fit = {"frames": None if frames is None else fit_to_granularity(frames, temporal, 1 if temporal > 1 else 0),
           "height": None if height is None else fit_to_granularity(height, spatial),
           "width": None if width is None else fit_to_granularity(width, spatial)}
    check_size(fit["frames"], fit["height"], fit["width"], requested, spatial, temporal)


def check_loaded_size(pipe, kwargs, requested):
    """Once loaded, before generating: the exact check (the pipeline's granularity and defaults)."""
    import inspect

    from fastdit.pipelines.loading import size_granularity

    try:
        defaults = {k: p.default for k, p in inspect.signature(pipe.__call__).parameters.items()}
    except (TypeError, ValueError):
        defaults = {}

    def size(key):
        value = kwargs.get(key, defaults.get(key))
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None

    spatial, temporal = size_granularity(pipe)
    check_size(size("num_frames"), size("height"), size("width"), requested, spatial, temporal)


def check_out_folder(path, option="--out"):
    """CLIError unless ``path`` is a folder or can be created as one (and written to)."""
    path = os.path.abspath(os.path.expanduser(str(path)))
    if os.path.exists(path) and not os.path.isdir(path):
        raise CLIError(f"argument {option}: {path} is an existing file; give a folder (created when missing)")
    existing = path
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise CLIError(f"argument {option}: {existing} is a file, so the folder {path} cannot be created")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise CLIError(f"argument {option}: {existing} is not writable; give a folder you can write to")


def check_device(device):
    """CLIError unless ``device`` (None: automatic) names a torch device this machine has."""
    if device is None:
        return
    import torch

    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError):
        raise CLIError(f"argument --device: {device!r} is not a torch device; e.g. cpu, cuda, cuda:1") from None
    if parsed.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise CLIError(f"argument --device: {device!r}, but torch {torch.__version__} sees no CUDA device here; "
                           f"use --device cpu")
        if parsed.index is not None and parsed.index >= count:
            raise CLIError(f"argument --device: {device!r}, but there are {count} CUDA device(s) (cuda:0 to "
                           f"cuda:{count - 1})")


def check_generation_arguments(args):
    """Everything about the shared generation options that can be checked before loading."""
    from fastdit.pipelines.loading import ModelNotFoundError

    check_device(args.device)
    check_out_folder(args.out)
    try:
        check_requested_size(args.model, args.frames, args.height, args.width)
    except ModelNotFoundError as error:
        raise CLIError(f"argument --model: {error}") from None


def add_cache_arguments(parser):
    """``--cache`` / ``--cache-set`` (compare and eval): every method also runs under cache-dit."""
    from fastdit.integrations.caches import CACHES

    parser.add_argument("--cache", default=None, choices=CACHES,
                        help="also run every method with cache-dit's block cache (pip install \"fastdit[cache]\"): "
                             "rows dense, dense+CACHE, METHOD, METHOD+CACHE")
    parser.add_argument("--cache-set", action="append", metavar="FIELD=VALUE",
                        help="a cache-dit DBCacheConfig field, e.g. --cache-set residual_diff_threshold=0.12 "
                             "(default: fitted to the model, see fastdit/integrations/caches.py; repeatable)")


def cache_arguments(args, parallel=False):
    """``(cache name or None, {field: value})`` from ``--cache`` / ``--cache-set``; CLIError when the
    cache cannot run (cache-dit missing, with --cp) or a setting is malformed."""
    from fastdit.integrations.caches import check_cache, check_cache_values

    overrides = {}
    for setting in args.cache_set or []:
        field_name, sep, value = setting.partition("=")
        if not sep or not field_name:
            raise CLIError(f"argument --cache-set: expects FIELD=VALUE, got {setting!r}")
        overrides[field_name.strip()] = parse_value(value)
    if args.cache is None:
        if overrides:
            raise CLIError("argument --cache-set: needs --cache")
        return None, {}
    try:
        check_cache(args.cache, parallel)
    except ValueError as error:
        raise CLIError(f"argument --cache: {error}") from None
    try:  # the values too, before any model loads (cache-dit fails on them inside its first run)
        check_cache_values(overrides, getattr(args, "steps", None))
    except ValueError as error:
        raise CLIError(f"argument {error}") from None
    return args.cache, overrides
