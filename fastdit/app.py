"""The fastdit Gradio app: dense and accelerated generation side by side.

    python app.py                 # or: fastdit app [--host 0.0.0.0] [--port 7860] [--share]

It runs out of the box on the embedded tiny models (random weights, no downloads) and takes a hub
id or a local folder for real models. "Compare" runs the dense pipeline and the chosen method
with the same seed and shows both videos, latency and speedup, PSNR/SSIM (LPIPS when its weights
are present) against dense, the attention mask of a chosen layer and head, and a table and a
speed-against-quality scatter of every run in the session.

The app is a thin layer over the public API: ``fastdit.compare.generate`` / ``fidelity``,
``fastdit.pipelines.loading`` and ``fastdit.eval.fidelity``. One pipeline per model is loaded and
cached; every run patches, generates and removes the patch under that pipeline's lock, so two users
with different methods never see each other's patch, and a failed or cancelled run leaves the
pipeline unpatched.

Method options are built from each method's config dataclass (``fastdit.methods.get_method(name)
.config_cls``) plus the widget hints in ``OPTION_HINTS``; a newly registered method shows up with
its options without any change here.
"""
from __future__ import annotations

import argparse
import dataclasses
import html
import inspect
import logging
import math
import os
import tempfile
import threading
import traceback
from collections import OrderedDict

import numpy as np

log = logging.getLogger("fastdit.app")

TINY_MODELS = ["tiny-wan", "tiny-hunyuan-video", "tiny-wan-i2v"]
#: Hub ids offered in the model box (any other id or a local folder can be typed in).
KNOWN_MODELS = {
    "Wan-AI/Wan2.1-T2V-1.3B-Diffusers": dict(num_frames=81, height=480, width=832, num_inference_steps=50,
                                             guidance_scale=5.0),
    "Wan-AI/Wan2.1-T2V-14B-Diffusers": dict(num_frames=81, height=720, width=1280, num_inference_steps=50,
                                            guidance_scale=5.0),
    "hunyuanvideo-community/HunyuanVideo": dict(num_frames=61, height=544, width=960, num_inference_steps=30,
                                                guidance_scale=6.0),
}
DEFAULT_PROMPT = "A red fox runs through fresh snow in a pine forest at sunrise"
DEFAULT_NEGATIVE = "blurry, low quality, distorted"
FPS = 16
#: Size limits checked before any work starts. Pixel sides and frames beyond these are absurd for
#: any model; the token limit is per device (CPU runs are meant for the tiny models) and can be
#: set with ``FASTDIT_APP_MAX_TOKENS`` or ``fastdit app --max-tokens``.
MAX_SIDE = 4096
MAX_FRAMES = 1025
MAX_TOKENS = {"cpu": 16384, "cuda": 262144}
#: Above this many tokens the mask picture is drawn from the block plan (no S x S mask is built).
MASK_TOKEN_LIMIT = 8192
MASK_PIXELS = 512
#: Dense results kept for reuse when only the method or its options change.
DENSE_CACHE_SIZE = 2

#: Widget hints per method option ("*" applies to every method). Keys: label, info, kind
#: ("number", "int", "float", "steps", "triple", "text", "choice", "bool"), choices, step.
#: Options without hints get a widget from their type annotation.
OPTION_HINTS = {
    "*": {
        "dense_steps": dict(kind="steps", label="dense warm-up steps",
                            info="first steps run dense: a count (2) or a fraction (0.25); blank = method default"),
        "dense_layers": dict(kind="int", label="dense layers", info="the first N layers stay dense; blank = default"),
    },
    "sta": {
        "tile": dict(kind="triple", label="tile (t, h, w tokens)", info="e.g. 6,8,8; blank = chosen per resolution"),
        "window": dict(kind="triple", label="window (t, h, w tiles)", info="odd entries, e.g. 3,3,3"),
    },
    "radial": {
        "decay": dict(kind="float", label="decay", step=0.05,
                      info="band width factor; blank = family default (Wan 0.2, HunyuanVideo 0.95)"),
        "block_size": dict(kind="choice", choices=[64, 128], label="block size"),
        "sink": dict(kind="bool", label="attention sink (frame 0)"),
        "adjacent": dict(kind="choice", choices=["band", "dense"], label="adjacent frames"),
        "block_fill": dict(kind="float", label="block fill", step=0.05, info="fraction of a block pair that must be allowed"),
    },
    "sparge": {
        "simthreshd1": dict(kind="float", label="similarity threshold", step=0.05),
        "cdfthreshd": dict(kind="float", label="CDF threshold", step=0.01),
        "pvthreshd": dict(kind="float", label="PV threshold", step=1),
    },
}
DEFAULT_HINT = "model default"

HEADER = """
<div class="fd-header">
  <h1>⚡ fastdit</h1>
  <p>Sparse attention for diffusers video DiTs, in one line:
  <code>fastdit.patch(pipe, "sta")</code>. <b>Compare</b> runs the dense pipeline and the chosen method
  with the same seed: both videos, the speedup, the quality against dense and the attention mask.
  The <code>tiny-*</code> models are built in (random weights: their videos are noise-like, but timing,
  fidelity and masks are real); type a hub id or a local folder for a real model.</p>
</div>
"""

CSS = """
.fd-header h1 {margin-bottom: 0.2em;}
.fd-header p {margin-top: 0; opacity: 0.85;}
.fd-cards {display: grid; grid-template-columns: repeat(auto-fit, minmax(110px, 1fr)); gap: 8px;}
.fd-card {border: 1px solid var(--border-color-primary); border-radius: 10px; padding: 8px 10px;
          background: var(--background-fill-secondary);}
.fd-card .fd-label {font-size: 0.78em; opacity: 0.75; text-transform: uppercase; letter-spacing: 0.03em;}
.fd-card .fd-value {font-size: 1.35em; font-weight: 600;}
.fd-card.fd-accent .fd-value {color: var(--color-accent);}
.fd-empty {opacity: 0.7; padding: 8px 2px;}
#fd-compare {min-height: 48px;}
.fd-options {padding: 2px;}
"""


class RunCancelled(Exception):
    """Raised from the step callback when the user pressed Stop."""


class AppError(ValueError):
    """A message for the user (shown as a Gradio error)."""


# --------------------------------------------------------------------------------------------- #
# Method options: widgets from config dataclasses
# --------------------------------------------------------------------------------------------- #


def method_choices():
    import fastdit

    return [name for name in fastdit.methods() if name != "dense"]


def _tiny_presets():
    from fastdit.compare import TINY_METHOD_OPTIONS

    return TINY_METHOD_OPTIONS


def option_specs(method):
    """``[(field name, kind, hint dict, default)]`` for ``method``'s config dataclass."""
    import fastdit

    config_cls = fastdit.methods.get_method(method).config_cls
    specs = []
    for f in dataclasses.fields(config_cls):
        hint = {**OPTION_HINTS.get("*", {}).get(f.name, {}), **OPTION_HINTS.get(method, {}).get(f.name, {})}
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        kind = hint.get("kind") or _kind_from_type(str(f.type), default)
        specs.append((f.name, kind, hint, default))
    return specs


def _kind_from_type(annotation, default):
    annotation = annotation.replace(" ", "")
    parts = set(annotation.split("|")) - {"None"}
    if parts == {"bool"}:
        return "bool"
    if parts == {"int"}:
        return "int"
    if parts == {"float"}:
        return "float"
    if parts == {"int", "float"}:
        return "steps"
    if parts & {"tuple", "list"}:
        return "triple"
    return "text"


def _optional(default):
    return default is None


def _display_value(kind, default):
    if default is None:
        return DEFAULT_HINT if kind in ("bool", "choice") else ""
    if kind == "triple":
        return _format_triple(default)
    if kind == "bool":
        return "on" if default else "off"
    if kind == "choice":
        return default
    return default


def _format_triple(value):
    if value is None:
        return ""
    if isinstance(value, (list, tuple)) and value and isinstance(value[0], (list, tuple)):
        return "; ".join(",".join(map(str, v)) for v in value)
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    return str(value)


def make_option_widget(gr, method, name, kind, hint, default):
    label = hint.get("label", name.replace("_", " "))
    info = hint.get("info")
    value = _display_value(kind, default)
    if kind in ("int", "float", "steps", "number") and default is None:
        import fastdit

        generic = fastdit.methods.get_method(method).generic_defaults.get(name)
        placeholder = f"default: {generic}" if generic is not None else "default: per model family"
        return gr.Textbox(value="", label=label, info=info, placeholder=placeholder, max_lines=1)
    if kind in ("int", "float", "steps", "number"):
        return gr.Number(value=value, label=label, info=info, precision=0 if kind == "int" else None,
                         step=hint.get("step", 1 if kind in ("int", "steps") else 0.05), minimum=0)
    if kind == "bool":
        choices = ([DEFAULT_HINT] if default is None else []) + ["on", "off"]
        return gr.Radio(choices=choices, value=value, label=label, info=info)
    if kind == "choice":
        choices = ([DEFAULT_HINT] if default is None else []) + list(hint.get("choices", []))
        return gr.Dropdown(choices=choices, value=value, label=label, info=info)
    return gr.Textbox(value=value, label=label, info=info, max_lines=1)


def parse_option(kind, value, default):
    """A widget value back to a config value (blank -> the dataclass default)."""
    from fastdit.cli import parse_value

    if value is None or (isinstance(value, str) and value.strip() in ("", DEFAULT_HINT)):
        return default
    if kind == "int":
        return int(round(float(value)))
    if kind == "float":
        return float(value)
    if kind == "steps":
        value = float(value)
        return int(value) if value.is_integer() else value
    if kind == "bool":
        return value == "on" if isinstance(value, str) else bool(value)
    if kind == "choice":
        return value
    if kind == "triple":
        text = str(value).strip()
        if ";" in text:
            return [tuple(parse_value(part.strip())) for part in text.split(";") if part.strip()]
        parsed = parse_value(text)
        return tuple(parsed) if isinstance(parsed, (list, tuple)) else parsed
    if isinstance(value, str):
        return parse_value(value)
    return value


# --------------------------------------------------------------------------------------------- #
# Pipelines: loaded once, cached, one lock each
# --------------------------------------------------------------------------------------------- #


class PipelineCache:
    """One pipeline per (model, device, dtype), each with its own run lock."""

    def __init__(self, device=None, dtype=None):
        self.device = device
        self.dtype = dtype
        self._entries = {}
        self._load_lock = threading.Lock()

    def get(self, model):
        import torch

        from fastdit.pipelines.loading import ModelNotFoundError, default_device, load_pipeline

        model = (model or "").strip()
        if not model:
            raise AppError("Choose a model: tiny-wan, tiny-hunyuan-video, a hub id or a local folder.")
        device = self.device or default_device()
        key = (model, str(device), str(self.dtype))
        with self._load_lock:
            entry = self._entries.get(key)
            if entry is None:
                dtype = getattr(torch, self.dtype) if isinstance(self.dtype, str) else self.dtype
                try:
                    pipe = load_pipeline(model, device, dtype)
                except ModelNotFoundError as error:
                    raise AppError(f"Model not found: {error}") from None
                except torch.cuda.OutOfMemoryError:
                    _free_cuda()
                    raise AppError(f"{model} does not fit in the GPU memory of {device}: use a smaller model "
                                   "(e.g. the 1.3B Wan) or a GPU with more memory.") from None
                if getattr(pipe, "transformer", None) is None:
                    raise AppError(f"{model} has no DiT transformer (fastdit patches DiT pipelines such as Wan and "
                                   "HunyuanVideo).")
                if hasattr(pipe, "set_progress_bar_config"):
                    pipe.set_progress_bar_config(disable=True)
                entry = {"pipe": pipe, "lock": threading.Lock(), "warm": set()}
                self._entries[key] = entry
        return entry


def _free_cuda():
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _is_oom(error):
    import torch

    return isinstance(error, torch.cuda.OutOfMemoryError) or "out of memory" in str(error).lower()


# --------------------------------------------------------------------------------------------- #
# Sizes
# --------------------------------------------------------------------------------------------- #


def max_tokens_for(device):
    env = os.environ.get("FASTDIT_APP_MAX_TOKENS")
    if env:
        return int(env)
    return MAX_TOKENS["cuda" if str(device).startswith("cuda") else "cpu"]


def plan_call(pipe, model, steps, guidance, frames, height, width, max_tokens=None):
    """Pipeline call kwargs for the requested size, fitted to the model, and notes for the user.

    Raises ``AppError`` for sizes that are absurd for the device, before any work starts.
    """
    from fastdit.compare import pipeline_device
    from fastdit.pipelines.loading import call_parameters, fitted_call, latent_grid, tiny_name

    for name, value, limit in (("height", height, MAX_SIDE), ("width", width, MAX_SIDE), ("frames", frames, MAX_FRAMES)):
        if value is None:
            continue
        if not math.isfinite(float(value)) or value < 1:
            raise AppError(f"{name} must be a positive number, got {value}.")
        if value > limit:
            raise AppError(f"{name} {int(value)} is too large: at most {limit}.")
    if steps is None or not 1 <= int(steps) <= 1000:
        raise AppError(f"steps must be between 1 and 1000, got {steps}.")
    params = call_parameters(pipe)
    base = {}
    name = tiny_name(model)
    if name is not None:
        from fastdit.pipelines.tiny import TINY_DEFAULTS

        base = TINY_DEFAULTS[name]
    steps = int(steps)
    guidance = None if guidance is None else float(guidance)
    kwargs, notes = fitted_call(pipe, base, _int(height), _int(width), _int(frames), steps, guidance)
    if frames is not None and "num_frames" not in params:
        notes.append("this model makes images: the frame count is ignored")
    # Token count of the latent grid, checked against the device before any work.
    h_, w_, f_ = kwargs.get("height", 0), kwargs.get("width", 0), kwargs.get("num_frames", 1)
    tokens = math.prod(latent_grid(pipe, kwargs))
    device = pipeline_device(pipe)
    limit = max_tokens or max_tokens_for(device)
    if tokens > limit:
        raise AppError(f"{f_} frames at {h_}x{w_} make {tokens:,} video tokens, more than this app allows on "
                       f"{device} ({limit:,}). Use fewer frames or a smaller size"
                       + (" (or run on a GPU)." if str(device) == "cpu" else "."))
    if str(device).startswith("cuda"):
        import torch

        free, _total = torch.cuda.mem_get_info(device)
        transformer = pipe.transformer
        inner = getattr(transformer.config, "num_attention_heads", 24) * getattr(transformer.config, "attention_head_dim", 128)
        need = tokens * inner * 2 * 2 * 16 + f_ * h_ * w_ * 3 * 4 * 16  # activations (CFG x2) + VAE decode, rough
        if need > free:
            raise AppError(f"{f_} frames at {h_}x{w_} ({tokens:,} tokens) need roughly {need / 2**30:.1f} GiB of GPU "
                           f"memory; {free / 2**30:.1f} GiB are free on {device}. Use fewer frames or a smaller size.")
    return kwargs, notes, tokens


def _int(value):
    return None if value is None else int(round(float(value)))


# --------------------------------------------------------------------------------------------- #
# Mask picture
# --------------------------------------------------------------------------------------------- #


def pooled_mask(mask, size=MASK_PIXELS):
    """Max-pool an ``(S, S)`` boolean mask to at most ``size`` cells a side; returns (array, factor)."""
    import torch

    mask = torch.as_tensor(mask)
    seq = mask.shape[0]
    factor = max(1, -(-seq // size))
    if factor == 1:
        return mask.numpy().astype(bool), 1
    pad = -seq % factor
    m = torch.nn.functional.pad(mask.float()[None, None], (0, pad, 0, pad))
    return (torch.nn.functional.max_pool2d(m, factor)[0, 0] > 0).numpy(), factor


def pooled_plan_mask(plan, head=0, size=MASK_PIXELS):
    """The max-pooled mask of a ``BlockPlan`` without building the ``(S, S)`` token mask.

    A block plan's mask is a union of (query block x key block) rectangles, so the pooled picture
    is ``Rq^T B Rk > 0`` with ``B`` the block mask and ``Rq``/``Rk`` the pooled cells each block's
    tokens fall in.
    """
    import torch

    seq = plan.seq_len
    factor = max(1, -(-seq // size))
    cells = -(-seq // factor)
    head = min(head, plan.kv_indices.shape[1] - 1)
    idx = plan.kv_indices[0, head].long().cpu()
    cnt = plan.kv_counts[0, head].long().cpu()
    kernel_len = plan.kernel_len
    n_q, n_k = -(-kernel_len // plan.block_m), -(-kernel_len // plan.block_n)
    blocks = torch.zeros(n_q, n_k)
    used = torch.arange(idx.shape[1])[None, :] < cnt[:, None]
    rows = torch.arange(n_q)[:, None].expand_as(idx)
    blocks[rows[used], idx[used]] = 1.0
    perm = plan.perm.cpu().long() if plan.perm is not None else torch.arange(kernel_len)
    pos = torch.arange(perm.shape[0])
    real = perm >= 0
    r_q = torch.zeros(n_q, cells)
    r_q[pos[real] // plan.block_m, perm[real] // factor] = 1.0
    r_k = torch.zeros(n_k, cells)
    r_k[pos[real] // plan.block_n, perm[real] // factor] = 1.0
    return ((r_q.T @ blocks @ r_k) > 0).numpy(), factor


def mask_picture(pooled, factor, path, boundaries=(), size=MASK_PIXELS, frames=()):
    """Draw a pooled mask (attended = dark) as a PNG of at most ``size`` px: ``boundaries`` (token
    indices, e.g. video | text) as orange lines, ``frames`` (frame starts) as thin grey lines."""
    from PIL import Image, ImageDraw

    cells = pooled.shape[0]
    scale = max(1, size // max(cells, 1))
    light, dark = np.array([240, 243, 250], np.uint8), np.array([49, 70, 160], np.uint8)
    rgb = np.where(pooled[..., None], dark, light).astype(np.uint8)
    image = Image.fromarray(rgb).resize((cells * scale, cells * scale), Image.NEAREST)
    draw = ImageDraw.Draw(image)
    for token in frames:
        x = int(round(token / factor * scale))
        if 0 < x < image.width:
            draw.line([(x, 0), (x, image.height)], fill=(140, 140, 140), width=1)
            draw.line([(0, x), (image.width, x)], fill=(140, 140, 140), width=1)
    for token in boundaries:
        x = int(round(token / factor * scale))
        if 0 < x < image.width:
            draw.line([(x, 0), (x, image.height)], fill=(245, 130, 32), width=2)
            draw.line([(0, x), (image.width, x)], fill=(245, 130, 32), width=2)
    image.save(path)
    return path


def draw_patch_mask(patch, layer, head, path):
    """Mask picture of ``layer``/``head`` from a kept patch. Returns ``(path, caption)``."""
    layer_index = patch.layer_index(int(layer))
    heads = None
    record = getattr(patch, "_records", {}).get(layer_index)  # best effort: layout for the boundaries
    layout = getattr(record, "layout", None)
    if record is not None:
        heads = getattr(record, "num_heads", None)
    if heads and not 0 <= head < heads:
        raise AppError(f"head {head} out of range: layer {layer_index} has {heads} heads (0..{heads - 1})")
    plan = patch.last_plan(layer_index)
    seq = layout.seq_len if layout is not None else (plan.seq_len if plan is not None else None)
    if plan is not None and seq is not None and seq > MASK_TOKEN_LIMIT:
        pooled, factor = pooled_plan_mask(plan, head)
    else:
        pooled, factor = pooled_mask(patch.mask(layer_index, head))
    boundaries = []
    if layout is not None and layout.text_len:
        boundaries = [layout.video_start, layout.video_start + layout.video_len] if hasattr(layout, "video_start") else []
    frame_starts = []
    if layout is not None and 1 < layout.frames <= 64 and layout.frame_len / factor * (MASK_PIXELS / pooled.shape[0]) >= 6:
        frame_starts = [layout.video_start + k * layout.frame_len for k in range(1, layout.frames)]
    mask_picture(pooled, factor, path, boundaries, frames=frame_starts)
    density = float(pooled.mean())
    kind = "dense (warm-up step or dense layer)" if plan is None else plan.name
    caption = (f"layer {layer_index} ({patch.layers[layer_index]}), head {head}, last step: {kind}; "
               f"{seq or '?'} tokens, {factor}x{factor} tokens per pixel, {100 * density:.0f}% of cells attended")
    if frame_starts:
        caption += "; grey lines: frames"
    if boundaries:
        caption += "; orange lines: video | text tokens"
    return path, caption


# --------------------------------------------------------------------------------------------- #
# Runs
# --------------------------------------------------------------------------------------------- #


def _lpips(frames, reference):
    """LPIPS against dense, or None when its weights are not present (or frames are too small)."""
    try:
        from fastdit.eval.fidelity import lpips_distance

        return float(lpips_distance(frames, reference))
    except (FileNotFoundError, ValueError, ImportError):
        return None


def _fmt(value, spec, suffix=""):
    if value is None:
        return "–"
    if isinstance(value, float) and math.isinf(value):
        return "∞" + suffix
    return format(value, spec) + suffix


def metrics_html(metrics):
    if not metrics:
        return '<div class="fd-empty">Press <b>Compare</b> to run dense and the chosen method with the same seed.</div>'
    cards = [
        ("dense", _fmt(metrics["dense_latency_s"], ".2f", " s"), ""),
        (metrics["method"], _fmt(metrics["method_latency_s"], ".2f", " s"), ""),
        ("speedup", _fmt(metrics["speedup"], ".2f", "×"), " fd-accent"),
        ("PSNR", _fmt(metrics["psnr_db"], ".2f", " dB"), " fd-accent"),
        ("SSIM", _fmt(metrics["ssim"], ".4f"), ""),
        ("LPIPS", _fmt(metrics.get("lpips"), ".4f"), ""),
        ("density", _fmt(None if metrics.get("density") is None else 100 * metrics["density"], ".0f", "%"), ""),
    ]
    body = "".join(f'<div class="fd-card{extra}"><div class="fd-label">{html.escape(str(label))}</div>'
                   f'<div class="fd-value">{html.escape(value)}</div></div>' for label, value, extra in cards)
    return f'<div class="fd-cards">{body}</div>'


TABLE_COLUMNS = ["#", "model", "method", "options", "size", "steps", "dense (s)", "method (s)", "speedup",
                 "PSNR (dB)", "SSIM", "LPIPS", "density"]


def history_frame(history):
    import pandas as pd

    rows = []
    for run in history:
        rows.append([run["run"], run["model"], run["method"], run["options_text"], run["size"], run["steps"],
                     round(run["dense_latency_s"], 3), round(run["method_latency_s"], 3), round(run["speedup"], 3),
                     None if run["psnr_db"] is None or math.isinf(run["psnr_db"]) else round(run["psnr_db"], 2),
                     round(run["ssim"], 4), None if run.get("lpips") is None else round(run["lpips"], 4),
                     None if run.get("density") is None else round(run["density"], 3)])
    return pd.DataFrame(rows, columns=TABLE_COLUMNS)


def scatter_frame(history):
    import pandas as pd

    rows = [{"speedup": run["speedup"], "PSNR (dB)": run["psnr_db"], "method": run["method"],
             "run": f"#{run['run']} {run['method']} {run['options_text']}"}
            for run in history if run["psnr_db"] is not None and math.isfinite(run["psnr_db"])]
    return pd.DataFrame(rows, columns=["speedup", "PSNR (dB)", "method", "run"])


def _options_text(options):
    shown = {k: v for k, v in options.items() if v is not None}
    return ", ".join(f"{k}={_format_triple(v) if isinstance(v, (tuple, list)) else v}" for k, v in shown.items())


class Runner:
    """Runs dense and a method on cached pipelines; shared by every session of one app."""

    def __init__(self, device=None, dtype=None, max_tokens=None):
        self.pipes = PipelineCache(device, dtype)
        self.max_tokens = max_tokens
        self._cancel = {}
        self._dense = OrderedDict()
        self._dense_lock = threading.Lock()
        self.out_root = tempfile.mkdtemp(prefix="fastdit_app_")

    # cancellation: one Event per run, the latest run of each session
    def new_run(self, session):
        event = threading.Event()
        self._cancel[session] = event
        return event

    def cancel(self, session):
        event = self._cancel.get(session)
        if event is not None:
            event.set()

    def compare(self, model, prompt, negative, seed, steps, guidance, frames, height, width, method, options,
                mask_layer=0, mask_head=0, reuse_dense=True, image=None, progress=None, cancel=None):
        """Dense, then ``method``; returns a dict of paths and numbers (see ``metrics`` keys)."""
        from fastdit.compare import fidelity, generate
        from fastdit.pipelines.loading import call_parameters, tiny_name
        from fastdit.video import write_video

        progress = progress or (lambda *a, **k: None)
        cancel = cancel or threading.Event()
        if method not in method_choices():
            raise AppError(f"unknown method {method!r}; available: {', '.join(method_choices())}")
        if not (prompt or "").strip():
            raise AppError("Write a prompt.")
        try:
            import fastdit

            fastdit.methods.get_method(method).make_config(**options)
        except (ValueError, TypeError) as error:
            raise AppError(f"{method} options: {error}") from None
        progress(0.0, desc=f"loading {model}")
        entry = self.pipes.get(model)
        pipe = entry["pipe"]
        call, notes, tokens = plan_call(pipe, model, steps, guidance, frames, height, width, self.max_tokens)
        params = call_parameters(pipe)
        if negative and negative.strip() and "negative_prompt" in params:
            call["negative_prompt"] = negative
        if "image" in params and "image" not in call:
            if image is None:
                raise AppError(f"{model} is an image-to-video model: give a conditioning image.")
            call["image"] = image
        elif "image" in params and image is not None:
            call["image"] = image
        if tiny_name(model) is not None:
            options = {**_tiny_presets().get(method, {}), **{k: v for k, v in options.items() if v is not None}}
        n_steps = int(call.get("num_inference_steps", steps))
        size = f"{call.get('num_frames', 1)}x{call.get('height', '?')}x{call.get('width', '?')}"
        out_dir = tempfile.mkdtemp(prefix="run_", dir=self.out_root)
        dense_key = (model, prompt, call.get("negative_prompt"), int(seed), repr(sorted(
            (k, v) for k, v in call.items() if isinstance(v, (int, float, str)))), image is not None)
        dense = self._dense.get(dense_key) if reuse_dense and image is None else None
        phases = 1 if dense is not None else 2
        total = phases * n_steps
        state = {"offset": 0, "phase": ""}

        def on_step(_pipe, step, _timestep, _callback_kwargs):
            if cancel.is_set():
                raise RunCancelled()
            done = state["offset"] + step + 1
            progress(done / total, desc=f"{state['phase']}: step {step + 1}/{n_steps}")
            return {}

        if "callback_on_step_end" in params:
            call["callback_on_step_end"] = on_step
        with entry["lock"]:  # one run per pipeline at a time: patch, generate, remove
            if cancel.is_set():
                raise RunCancelled()
            warm_key = (size, n_steps)
            if warm_key not in entry["warm"]:  # first-call costs stay out of the timings
                progress(0.0, desc="warm-up (1 step, not timed)")
                warm = {k: v for k, v in call.items() if k != "callback_on_step_end"}
                generate(pipe, prompt, seed, {**warm, "num_inference_steps": 1})
                entry["warm"].add(warm_key)
            if dense is None:
                state["phase"] = "dense"
                progress(0.0, desc="dense")
                dense = generate(pipe, prompt, seed, call, "dense")
                if image is None:
                    with self._dense_lock:
                        self._dense[dense_key] = dense
                        while len(self._dense) > DENSE_CACHE_SIZE:
                            self._dense.popitem(last=False)
            else:
                notes.append("dense run reused from an earlier run with the same inputs")
            state["phase"], state["offset"] = method, n_steps * (phases - 1)
            result = generate(pipe, prompt, seed, call, method, options, record_masks=True, keep_patch=True)
            try:
                mask_path, mask_caption = None, ""
                try:
                    mask_path, mask_caption = draw_patch_mask(result.patch, int(mask_layer or 0), int(mask_head or 0),
                                                              os.path.join(out_dir, "mask.png"))
                except (AppError, ValueError, RuntimeError) as error:
                    notes.append(f"mask: {error}")
                layers = list(result.patch.layers)
            finally:
                result.patch.remove()
        progress(1.0, desc="writing videos")
        dense_path = write_video(os.path.join(out_dir, "dense.mp4"), dense.frames, fps=FPS)
        method_path = write_video(os.path.join(out_dir, f"{method}.mp4"), result.frames, fps=FPS)
        psnr_db, ssim_value = fidelity(result.frames, dense.frames)
        metrics = {
            "model": model, "method": method, "options": {k: (list(v) if isinstance(v, tuple) else v)
                                                          for k, v in (result.options or {}).items()},
            "size": size, "steps": n_steps, "tokens": tokens, "seed": int(seed),
            "dense_latency_s": dense.latency_s, "method_latency_s": result.latency_s,
            "speedup": dense.latency_s / result.latency_s, "psnr_db": psnr_db, "ssim": ssim_value,
            "lpips": _lpips(result.frames, dense.frames), "density": result.density,
            "padding_fraction": result.padding_fraction, "layers": len(layers),
            "device": str(pipe.device), "notes": list(notes),
        }
        return {"dense_video": dense_path, "method_video": method_path, "mask": mask_path,
                "mask_caption": mask_caption, "metrics": metrics, "notes": notes}


# --------------------------------------------------------------------------------------------- #
# The Blocks
# --------------------------------------------------------------------------------------------- #


def _json_safe(value):
    if isinstance(value, float) and not math.isfinite(value):
        return "inf" if value > 0 else str(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, (np.floating, np.integer)):
        return value.item()
    return value


def _size_defaults(model):
    from fastdit.pipelines.loading import tiny_name

    try:
        name = tiny_name(model)
    except ValueError:
        name = None
    if name is not None:
        from fastdit.pipelines.tiny import TINY_DEFAULTS

        return TINY_DEFAULTS[name]
    return KNOWN_MODELS.get(model)


def build_app(default_model="tiny-wan", device=None, dtype=None, max_tokens=None):
    """The Gradio app (a ``gr.Blocks``); ``.launch()`` it. ``device``/``dtype``: default CUDA + bf16
    when available, else CPU + fp32. ``max_tokens``: the largest latent token count a run may take."""
    import gradio as gr

    runner = Runner(device, dtype, max_tokens)
    methods = method_choices()
    default_method = "sta" if "sta" in methods else methods[0]
    sizes = _size_defaults(default_model) or {}
    is_tiny = default_model.startswith("tiny-")
    presets = _tiny_presets() if is_tiny else {}

    option_widgets = []  # (method, name, kind, default, component)
    groups = {}

    class _App(gr.Blocks):
        def launch(self, *args, **kwargs):
            kwargs.setdefault("theme", gr.themes.Soft(primary_hue="indigo", secondary_hue="orange"))
            kwargs.setdefault("css", CSS)
            return super().launch(*args, **kwargs)

    with _App(title="fastdit: sparse attention for video DiTs") as demo:
        demo.runner = runner
        history = gr.State([])
        gr.HTML(HEADER)
        with gr.Row(equal_height=False):
            with gr.Column(scale=2, min_width=340):
                model = gr.Dropdown(choices=TINY_MODELS + list(KNOWN_MODELS), value=default_model, label="model",
                                    allow_custom_value=True, elem_id="fd-model",
                                    info="built-in tiny models, a hub id or a local folder (loaded once, cached)")
                prompt = gr.Textbox(value=DEFAULT_PROMPT, label="prompt", lines=2, elem_id="fd-prompt")
                negative = gr.Textbox(value=DEFAULT_NEGATIVE, label="negative prompt", lines=1)
                with gr.Row(elem_classes=["fd-tight"]):
                    seed = gr.Number(value=0, label="seed", precision=0, minimum=0)
                    steps = gr.Number(value=sizes.get("num_inference_steps", 3), label="steps", precision=0, minimum=1)
                    guidance = gr.Number(value=sizes.get("guidance_scale", 5.0), label="guidance", step=0.5)
                with gr.Row(elem_classes=["fd-tight"]):
                    frames = gr.Number(value=sizes.get("num_frames", 29), label="frames", precision=0, minimum=1)
                    height = gr.Number(value=sizes.get("height", 384), label="height", precision=0, minimum=16, step=16)
                    width = gr.Number(value=sizes.get("width", 384), label="width", precision=0, minimum=16, step=16)
                method = gr.Dropdown(choices=methods, value=default_method, label="method", elem_id="fd-method",
                                     info="the attention method compared against dense")
                for name in methods:
                    specs = option_specs(name)
                    with gr.Group(visible=name == default_method, elem_classes=["fd-options"]) as group:
                        for start in range(0, len(specs), 2):
                            with gr.Row():
                                for field_name, kind, hint, default in specs[start:start + 2]:
                                    shown = presets.get(name, {}).get(field_name, default)
                                    component = make_option_widget(gr, name, field_name, kind, hint, shown)
                                    option_widgets.append((name, field_name, kind, default, component))
                    groups[name] = group
                with gr.Row():
                    mask_layer = gr.Number(value=-1, label="mask: layer", precision=0,
                                           info="patched layer to draw (-1 = the last)")
                    mask_head = gr.Number(value=0, label="mask: head", precision=0, minimum=0)
                with gr.Accordion("more", open=False):
                    reuse_dense = gr.Checkbox(value=False, label="reuse the dense run when its inputs are unchanged",
                                              info="faster exploring; the speedup then compares against an earlier "
                                                   "dense timing")
                    image = gr.Image(label="conditioning image (image-to-video models)", type="pil", height=160)
                with gr.Row():
                    run_btn = gr.Button("Compare", variant="primary", elem_id="fd-compare", scale=3)
                    stop_btn = gr.Button("Stop", variant="stop", elem_id="fd-stop", scale=1)
                notes = gr.Markdown(label="notes", elem_id="fd-notes")
            with gr.Column(scale=3, min_width=480):
                with gr.Row():
                    dense_video = gr.Video(label="dense (reference)", elem_id="fd-dense-video", autoplay=True, loop=True,
                                           interactive=False, height=300)
                    method_video = gr.Video(label="sparse attention (chosen method)", elem_id="fd-method-video", autoplay=True, loop=True,
                                            interactive=False, height=300)
                metrics_box = gr.HTML(metrics_html(None), label="metrics", elem_id="fd-metrics")
                with gr.Row():
                    mask_image = gr.Image(label="attention mask", type="filepath", interactive=False, height=300,
                                          elem_id="fd-mask")
                    scatter = gr.ScatterPlot(scatter_frame([]), x="speedup", y="PSNR (dB)", color="method",
                                             tooltip=["run", "speedup", "PSNR (dB)"], title="speed against quality", label="scatter",
                                             height=300, elem_id="fd-scatter")
                mask_caption = gr.Markdown(label="mask caption")
        table = gr.Dataframe(history_frame([]), label="runs in this session", interactive=False, elem_id="fd-table",
                             wrap=True)
        with gr.Accordion("run details (JSON)", open=False):
            details = gr.JSON(label="metrics")
        example_rows = _examples(default_model, sizes, methods)
        if example_rows:
            gr.Examples(example_rows, [prompt, negative, seed, steps, guidance, frames, height, width, method],
                        label=f"examples (sizes for {default_model})", examples_per_page=8)

        widgets = [c for *_, c in option_widgets]

        def show_options(selected):
            return [gr.update(visible=name == selected) for name in groups]

        method.change(show_options, method, list(groups.values()), queue=False, api_visibility="private")

        preset_widgets = [(m, f, k, d, c) for m, f, k, d, c in option_widgets
                          if f in _tiny_presets().get(m, {})]

        def on_model(selected):
            defaults = _size_defaults(selected)
            tiny = (selected or "").startswith("tiny-")
            size_updates = [gr.update()] * 5 if not defaults else [
                gr.update(value=defaults.get(key)) for key in
                ("num_inference_steps", "guidance_scale", "num_frames", "height", "width")]
            option_updates = [gr.update(value=_display_value(k, _tiny_presets()[m][f] if tiny else d))
                              for m, f, k, d, c in preset_widgets]
            return size_updates + option_updates

        model.change(on_model, model, [steps, guidance, frames, height, width] + [c for *_, c in preset_widgets],
                     queue=False, api_visibility="private")

        fixed_names = ["model", "prompt", "negative_prompt", "seed", "steps", "guidance", "frames", "height", "width",
                       "method", "mask_layer", "mask_head", "reuse_dense", "image", "history"]
        option_names = [f"{m}_{f}" for m, f, *_ in option_widgets]

        def run(*args):
            # Gradio passes the inputs in order, then the request and the progress tracker (see the
            # signature set below: it names the API parameters after the options).
            *values, request, progress = args
            (model_v, prompt_v, negative_v, seed_v, steps_v, guidance_v, frames_v, height_v, width_v, method_v,
             layer_v, head_v, reuse_v, image_v, history_v) = values[:len(fixed_names)]
            option_values = values[len(fixed_names):]
            session = getattr(request, "session_hash", None) or "default"
            cancel = runner.new_run(session)
            try:
                options = {}
                for (m, f, kind, default, _), value in zip(option_widgets, option_values):
                    if m == method_v:
                        try:
                            options[f] = parse_option(kind, value, default)
                        except (ValueError, SyntaxError) as error:
                            raise AppError(f"{m} option {f}: cannot read {value!r} ({error})") from None
                out = runner.compare(model_v, prompt_v, negative_v, int(seed_v or 0), steps_v, guidance_v, frames_v,
                                     height_v, width_v, method_v, options, layer_v, head_v, reuse_v, image_v,
                                     progress=progress, cancel=cancel)
            except RunCancelled:
                raise gr.Error("Run cancelled.", title="cancelled") from None
            except AppError as error:
                raise gr.Error(str(error), title="fastdit") from None
            except Exception as error:  # noqa: BLE001 - every failure becomes a message; the app keeps working
                log.error("run failed:\n%s", traceback.format_exc())
                _free_cuda()
                if _is_oom(error):
                    raise gr.Error("Out of memory at this size: use fewer frames, a smaller size or a smaller model.",
                                   title="fastdit") from None
                raise gr.Error(f"{type(error).__name__}: {error}", title="run failed") from None
            finally:
                if runner._cancel.get(session) is cancel:
                    runner._cancel.pop(session, None)
            metrics = out["metrics"]
            history_v = list(history_v or []) + [{**metrics, "run": len(history_v or []) + 1,
                                                  "options_text": _options_text(metrics["options"])}]
            for note in out["notes"]:
                gr.Info(note)
            notes_md = "\n".join(f"- {note}" for note in out["notes"])
            return (out["dense_video"], out["method_video"], metrics_html(metrics), out["mask"],
                    out["mask_caption"], notes_md, history_frame(history_v), scatter_frame(history_v),
                    _json_safe(metrics), history_v)

        P = inspect.Parameter
        run.__signature__ = inspect.Signature(
            [P(n, P.POSITIONAL_OR_KEYWORD, default=None) for n in fixed_names + option_names]
            + [P("request", P.POSITIONAL_OR_KEYWORD, default=None, annotation=gr.Request),
               P("progress", P.POSITIONAL_OR_KEYWORD, default=gr.Progress())])
        run.__annotations__ = {"request": gr.Request}

        inputs = [model, prompt, negative, seed, steps, guidance, frames, height, width, method, mask_layer, mask_head,
                  reuse_dense, image, history] + widgets
        outputs = [dense_video, method_video, metrics_box, mask_image, mask_caption, notes, table, scatter, details,
                   history]
        run_event = run_btn.click(
            run, inputs, outputs, api_name="compare", concurrency_limit=1,
            show_progress_on=[dense_video, method_video])

        def stop(request: gr.Request = None):
            runner.cancel(getattr(request, "session_hash", None) or "default")

        stop_btn.click(stop, None, None, cancels=[run_event], queue=False, api_name="stop")
    return demo


def _examples(model, sizes, methods):
    """Example rows (prompt, negative, seed, steps, guidance, frames, height, width, method) for ``model``."""
    if not sizes:
        return []
    steps, guidance = sizes.get("num_inference_steps", 3), sizes.get("guidance_scale", 5.0)
    frames, height, width = sizes.get("num_frames", 29), sizes.get("height", 384), sizes.get("width", 384)
    tiny = model.startswith("tiny-")
    quick = (9, 256, 256, 2) if tiny else (max((frames - 1) // 2 + 1, 1), height, width, max(steps // 2, 1))
    longer = (45, 256, 256, steps) if tiny else (frames, height, width, steps)
    rows = [
        [DEFAULT_PROMPT, DEFAULT_NEGATIVE, 0, steps, guidance, frames, height, width, "sta"],
        ["A paper boat drifts down a rain-soaked street, cinematic lighting", DEFAULT_NEGATIVE, 7, steps, guidance,
         frames, height, width, "radial"],
        ["A corgi astronaut floats inside a space station, soft light", DEFAULT_NEGATIVE, 3, quick[3], guidance,
         *quick[:3], "sta"],
        ["Aerial shot of waves breaking on a black sand beach, golden hour", "", 42, longer[3], guidance,
         *longer[:3], "radial"],
    ]
    return [row for row in rows if row[-1] in methods]


# --------------------------------------------------------------------------------------------- #
# Command line
# --------------------------------------------------------------------------------------------- #


def _add_arguments(parser):
    parser.add_argument("--host", default=None, help="server address (default 127.0.0.1; 0.0.0.0 to serve the network)")
    parser.add_argument("--port", type=int, default=None, help="server port (default 7860, or the next free one)")
    parser.add_argument("--share", action="store_true", help="create a public gradio.live link (off by default)")
    parser.add_argument("--model", default="tiny-wan", help="the model selected when the page opens")
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    parser.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--max-tokens", type=int, default=None,
                        help=f"largest latent token count a run may take (default CPU {MAX_TOKENS['cpu']}, "
                             f"GPU {MAX_TOKENS['cuda']})")


def cmd_app(args):
    demo = build_app(args.model, device=args.device, dtype=args.dtype, max_tokens=args.max_tokens)
    demo.queue(default_concurrency_limit=1)
    demo.launch(server_name=args.host, server_port=args.port, share=args.share)
    return 0


def add_app_parser(subparsers):
    """Add ``fastdit app`` to the CLI's subparsers."""
    parser = subparsers.add_parser("app", help="the Gradio app: dense and accelerated side by side")
    _add_arguments(parser)
    parser.set_defaults(func=cmd_app)
    return parser


def main(argv=None):
    parser = argparse.ArgumentParser(prog="fastdit app", description=__doc__.splitlines()[0])
    _add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    return cmd_app(args)


if __name__ == "__main__":
    main()
