"""Loading pipelines (tiny built-ins, hub ids, local folders) and fitting call sizes to them.

Real models keep their real loading path, ``DiffusionPipeline.from_pretrained``: a local folder,
or a hub id (from the local cache first; then the hub unless ``HF_HUB_OFFLINE=1``). When the
weights are not there, ``ModelNotFoundError`` says what is missing and how to get it.
"""
from __future__ import annotations

import inspect
import os

import torch

TINY_PREFIX = "tiny-"
TINY_ALIASES = {"tiny-hunyuan": "hunyuan_video", "tiny-hunyuanvideo": "hunyuan_video"}


class ModelNotFoundError(ValueError):
    """The model's weights are neither in the given folder nor in the local hub cache."""


def default_device():
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_dtype(device):
    if str(device).startswith("cuda"):
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def tiny_name(model):
    """The tiny built-in name for ``tiny-wan`` style model strings, else None."""
    if not isinstance(model, str) or not model.startswith(TINY_PREFIX):
        return None
    from .tiny import TINY_MODELS

    name = TINY_ALIASES.get(model, model[len(TINY_PREFIX):].replace("-", "_"))
    if name not in TINY_MODELS:
        choices = ", ".join(TINY_PREFIX + n.replace("_", "-") for n in TINY_MODELS)
        raise ModelNotFoundError(f"unknown tiny model {model!r}; built-in tiny models: {choices}")
    return name


def load_pipeline(model="tiny-wan", device=None, dtype=None):
    """Load a diffusers pipeline.

    Args:
        model: ``"tiny-wan"``, ``"tiny-wan-i2v"``, ``"tiny-hunyuan-video"`` (random weights, no
            downloads), a hub id such as ``"Wan-AI/Wan2.1-T2V-1.3B-Diffusers"``, or a local folder.
        device: default CUDA when available, else CPU. dtype: default bf16 on CUDA, fp32 on CPU.
    """
    device = device or default_device()
    name = tiny_name(model)
    if name is not None:
        from .tiny import tiny

        pipe = tiny(name)
        dtype = torch.float32 if dtype is None else dtype
        return pipe.to(device=device, dtype=dtype)
    dtype = default_dtype(device) if dtype is None else dtype
    from diffusers import DiffusionPipeline

    if os.path.isdir(model):
        if not os.path.isfile(os.path.join(model, "model_index.json")):
            raise ModelNotFoundError(f"{model} is a folder but holds no model_index.json: not a diffusers pipeline folder")
        try:
            pipe = DiffusionPipeline.from_pretrained(model, torch_dtype=dtype, local_files_only=True)
        except (OSError, ValueError) as error:
            raise ModelNotFoundError(f"could not load the pipeline in {model}: {error}") from None
        return pipe.to(device)
    looks_like_path = model.startswith((".", "/", "~")) or model.count("/") > 1
    if looks_like_path:
        raise ModelNotFoundError(f"no such folder: {model} (a hub id looks like 'org/name')")
    try:
        pipe = DiffusionPipeline.from_pretrained(model, torch_dtype=dtype, local_files_only=True)
    except Exception as cached_error:  # noqa: BLE001 - any failure here means "not in the cache"
        if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false"):
            raise ModelNotFoundError(
                f"{model!r} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set. Download it first "
                f"(`huggingface-cli download {model}`) or pass a local folder. ({type(cached_error).__name__})"
            ) from None
        try:
            pipe = DiffusionPipeline.from_pretrained(model, torch_dtype=dtype)
        except Exception as error:  # noqa: BLE001
            raise ModelNotFoundError(
                f"could not load {model!r}: not in the local cache and not downloadable here "
                f"({type(error).__name__}: {str(error).splitlines()[0][:200]}). Download it on a machine with network "
                f"access (`huggingface-cli download {model}`) and pass the folder, or use --model tiny-wan."
            ) from None
    return pipe.to(device)


def call_parameters(pipe):
    return set(inspect.signature(pipe.__call__).parameters)


def size_granularity(pipe):
    """``(spatial multiple, temporal multiple)`` of pixel sizes / frame counts the pipeline accepts.

    Spatial: VAE scale factor x patch size (16 for Wan and HunyuanVideo); temporal: frame counts
    of the form ``k * factor + 1``.
    """
    spatial = getattr(pipe, "vae_scale_factor_spatial", None) or getattr(pipe, "vae_scale_factor", 8)
    transformer = getattr(pipe, "transformer", None)
    patch = getattr(getattr(transformer, "config", None), "patch_size", 1) or 1
    patch = patch[-1] if isinstance(patch, (tuple, list)) else patch
    temporal = getattr(pipe, "vae_scale_factor_temporal", 1) or 1
    return int(spatial) * int(patch), int(temporal)


def fit_size(pipe, height=None, width=None, frames=None):
    """Round a requested size to the nearest one the pipeline takes. Returns ``(h, w, f, notes)``."""
    spatial, temporal = size_granularity(pipe)
    notes = []

    def nearest(value, multiple, offset=0, name=""):
        if value is None:
            return None
        fitted = max(multiple, round((value - offset) / multiple) * multiple) + offset
        if fitted != value:
            notes.append(f"{name} {value} -> {fitted} (the model takes multiples of {multiple}{' plus 1' if offset else ''})")
        return fitted

    height = nearest(height, spatial, name="height")
    width = nearest(width, spatial, name="width")
    if frames is not None and "num_frames" in call_parameters(pipe) and temporal > 1:
        frames = nearest(frames, temporal, offset=1, name="frames")
    return height, width, frames, notes


def fitted_call(pipe, base=None, height=None, width=None, frames=None, steps=None, guidance=None):
    """``(kwargs, notes)``: ``base`` call kwargs updated with the requested size (rounded to what
    the pipeline takes, with a note per change), steps and guidance, keeping only the arguments
    the pipeline's ``__call__`` accepts."""
    kwargs = dict(base or {})
    height, width, frames, notes = fit_size(pipe, height, width, frames)
    params = call_parameters(pipe)
    for key, value in (("height", height), ("width", width), ("num_frames", frames),
                       ("num_inference_steps", steps), ("guidance_scale", guidance)):
        if value is not None and key in params:
            kwargs[key] = value
    return kwargs, notes


def latent_grid(pipe, call):
    """The latent token grid ``(T, H, W)`` of a call's ``num_frames`` / ``height`` / ``width``."""
    spatial, temporal = size_granularity(pipe)
    frames = call.get("num_frames", 1)
    return ((frames - 1) // temporal + 1, max(call.get("height", 0) // spatial, 1), max(call.get("width", 0) // spatial, 1))
