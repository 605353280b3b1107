"""Models for the app: the pipeline cache (one pipeline and one run lock per model) and the call
sizes a run may take, checked before any work starts."""
from __future__ import annotations

import math
import os
import threading
from dataclasses import dataclass, field

from .errors import AppError

__all__ = ["KNOWN_MODELS", "MAX_FRAMES", "MAX_SIDE", "MAX_TOKENS", "TINY_MODELS", "PipelineCache", "PipelineEntry",
           "free_cuda", "is_oom", "max_tokens_for", "plan_call", "size_defaults"]

TINY_MODELS = ["tiny-wan", "tiny-hunyuan-video", "tiny-wan-i2v", "tiny-shapes"]
#: Hub ids offered in the model box (any other id or a local folder can be typed in).
KNOWN_MODELS = {
    "Wan-AI/Wan2.1-T2V-1.3B-Diffusers": dict(num_frames=81, height=480, width=832, num_inference_steps=50,
                                             guidance_scale=5.0),
    "Wan-AI/Wan2.1-T2V-14B-Diffusers": dict(num_frames=81, height=720, width=1280, num_inference_steps=50,
                                            guidance_scale=5.0),
    "hunyuanvideo-community/HunyuanVideo": dict(num_frames=61, height=544, width=960, num_inference_steps=30,
                                                guidance_scale=6.0),
}
#: Size limits checked before any work starts. Pixel sides and frames beyond these are absurd for
#: any model; the token limit is per device (CPU runs are meant for the tiny models) and can be
#: set with ``FASTDIT_APP_MAX_TOKENS`` or ``fastdit app --max-tokens``.
MAX_SIDE = 4096
MAX_FRAMES = 1025
MAX_STEPS = 1000
MAX_TOKENS = {"cpu": 16384, "cuda": 262144}


@dataclass
class PipelineEntry:
    """A loaded pipeline, the lock every run on it holds, and the sizes already warmed up."""

    model: str
    pipe: object
    lock: threading.Lock = field(default_factory=threading.Lock)
    warm: set = field(default_factory=set)


class PipelineCache:
    """One pipeline per (model, device, dtype), loaded on first use."""

    def __init__(self, device=None, dtype=None):
        self.device = device
        self.dtype = dtype
        self._entries = {}
        self._lock = threading.Lock()

    def _key(self, model):
        from fastdit.pipelines.loading import default_device

        return (model, str(self.device or default_device()), str(self.dtype))

    def get(self, model):
        """The ``PipelineEntry`` of ``model`` (loaded now if needed); ``AppError`` when it cannot be."""
        import torch

        from fastdit.pipelines.loading import ModelNotFoundError, default_device, load_pipeline

        model = (model or "").strip()
        if not model:
            raise AppError("Choose a model: tiny-wan, tiny-hunyuan-video, a hub id or a local folder.")
        device = self.device or default_device()
        with self._lock:
            entry = self._entries.get(self._key(model))
            if entry is not None:
                return entry
            dtype = getattr(torch, self.dtype) if isinstance(self.dtype, str) else self.dtype
            try:
                pipe = load_pipeline(model, device, dtype)
            except ModelNotFoundError as error:
                raise AppError(f"Model not found: {error}") from None
            except torch.cuda.OutOfMemoryError:
                free_cuda()
                raise AppError(f"{model} does not fit in the GPU memory of {device}: use a smaller model "
                               "(e.g. the 1.3B Wan) or a GPU with more memory.") from None
            if getattr(pipe, "transformer", None) is None:
                raise AppError(f"{model} has no DiT transformer (fastdit patches DiT pipelines such as Wan and "
                               "HunyuanVideo).")
            if hasattr(pipe, "set_progress_bar_config"):
                pipe.set_progress_bar_config(disable=True)
            entry = PipelineEntry(model, pipe)
            self._entries[self._key(model)] = entry
            return entry

    def entries(self):
        """The loaded entries."""
        with self._lock:
            return list(self._entries.values())

    def evict(self, entry):
        """Forget ``entry`` (the next request for its model loads a fresh pipeline)."""
        with self._lock:
            for key, value in list(self._entries.items()):
                if value is entry:
                    del self._entries[key]


def free_cuda():
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def is_oom(error):
    import torch

    return isinstance(error, torch.cuda.OutOfMemoryError) or "out of memory" in str(error).lower()


def max_tokens_for(device):
    env = os.environ.get("FASTDIT_APP_MAX_TOKENS")
    if env:
        return int(env)
    return MAX_TOKENS["cuda" if str(device).startswith("cuda") else "cpu"]


def size_defaults(model):
    """Default call sizes (``num_frames``, ``height``, ``width``, ``num_inference_steps``,
    ``guidance_scale``) of a tiny or known model, else None."""
    from fastdit.pipelines.loading import TRAINED_DEFAULTS, ModelNotFoundError, tiny_name, trained_name

    try:
        name = tiny_name(model)
    except ModelNotFoundError:
        name = None
    if name is not None:
        from fastdit.pipelines.tiny import TINY_DEFAULTS

        return TINY_DEFAULTS[name]
    if trained_name(model) is not None:
        return TRAINED_DEFAULTS[model]
    return KNOWN_MODELS.get(model)


def _int(value):
    return None if value is None else int(round(float(value)))


def plan_call(pipe, model, steps, guidance, frames, height, width, max_tokens=None):
    """``(call kwargs, notes, tokens)``: the requested size fitted to the model, notes for the
    user, and the latent token count. ``AppError`` for sizes absurd for the device."""
    from fastdit.compare import pipeline_device
    from fastdit.pipelines.loading import TRAINED_DEFAULTS, call_parameters, fitted_call, latent_grid, tiny_name

    bounds = (("height", height, MAX_SIDE), ("width", width, MAX_SIDE), ("frames", frames, MAX_FRAMES))
    for name, value, limit in bounds:
        if value is None:
            continue
        if not math.isfinite(float(value)) or value < 1:
            raise AppError(f"{name} must be a positive number, got {value}.")
        if value > limit:
            raise AppError(f"{name} {int(value)} is too large: at most {limit}.")
    if steps is None or not math.isfinite(float(steps)) or not 1 <= int(steps) <= MAX_STEPS:
        raise AppError(f"steps must be between 1 and {MAX_STEPS}, got {steps}.")
    if guidance is not None and not math.isfinite(float(guidance)):
        raise AppError(f"guidance must be a finite number, got {guidance}.")
    base = {}
    name = tiny_name(model)
    if name is not None:
        from fastdit.pipelines.tiny import TINY_DEFAULTS

        base = TINY_DEFAULTS[name]
    elif model in TRAINED_DEFAULTS:
        base = TRAINED_DEFAULTS[model]
    guidance = None if guidance is None else float(guidance)
    kwargs, notes = fitted_call(pipe, base, _int(height), _int(width), _int(frames), int(steps), guidance)
    if frames is not None and "num_frames" not in call_parameters(pipe):
        notes.append("this model makes images: the frame count is ignored")
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
        config = pipe.transformer.config
        inner = getattr(config, "num_attention_heads", 24) * getattr(config, "attention_head_dim", 128)
        need = tokens * inner * 2 * 2 * 16 + f_ * h_ * w_ * 3 * 4 * 16  # activations (CFG x2) + VAE decode, rough
        if need > free:
            raise AppError(f"{f_} frames at {h_}x{w_} ({tokens:,} tokens) need roughly {need / 2**30:.1f} GiB of GPU "
                           f"memory; {free / 2**30:.1f} GiB are free on {device}. Use fewer frames or a smaller size.")
    return kwargs, notes, tokens
