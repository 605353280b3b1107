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

#: Models trained in this repository and shipped with the package: name -> folder under ``WEIGHTS_DIR``.
WEIGHTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "weights")
TRAINED_MODELS = {"tiny-shapes": "tiny-shapes"}
#: Their native call (``pipe(prompt=..., **TRAINED_DEFAULTS[name], output_type="np")``):
#: tiny-shapes: 17 frames of 128 x 128 -> latent 9 x 32 x 32 -> patch (1, 1, 1) -> 9216 video tokens
#: (retrained at this size in issue 40, warm-started from the 64 x 64 model of issue 24).
TRAINED_DEFAULTS = {
    "tiny-shapes": dict(num_frames=17, height=128, width=128, num_inference_steps=12, guidance_scale=4.0,
                        max_sequence_length=48),
}
#: How to re-create each trained model's weights.
RETRAIN_COMMANDS = {"tiny-shapes": "python -m fastdit.pipelines.train_tiny --preset short --out runs/tiny-shapes-64 && "
                                   "python -m fastdit.pipelines.train_tiny --preset large"}
#: The method presets shipped beside a trained model's weights (see :func:`trained_presets`).
PRESETS_FILE = "presets.json"


class ModelNotFoundError(ValueError):
    """The model's weights are neither in the given folder nor in the local hub cache."""


def default_device():
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_dtype(device):
    if str(device).startswith("cuda"):
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def tiny_name(model):
    """The tiny built-in (random-weight) name for ``tiny-wan`` style model strings, else None
    (also None for the trained built-ins of ``TRAINED_MODELS``: see :func:`trained_name`)."""
    if not isinstance(model, str) or not model.startswith(TINY_PREFIX) or model in TRAINED_MODELS:
        return None
    from .tiny import TINY_MODELS

    name = TINY_ALIASES.get(model, model[len(TINY_PREFIX):].replace("-", "_"))
    if name not in TINY_MODELS:
        choices = ", ".join([TINY_PREFIX + n.replace("_", "-") for n in TINY_MODELS] + list(TRAINED_MODELS))
        raise ModelNotFoundError(f"unknown tiny model {model!r}; built-in tiny models: {choices}")
    return name


def trained_name(model):
    """``model`` when it names a model trained in this repository (``tiny-shapes``), else None."""
    return model if isinstance(model, str) and model in TRAINED_MODELS else None


def builtin_model(model):
    """Whether ``model`` is one of fastdit's own small models (random-weight tiny or trained)."""
    return trained_name(model) is not None or tiny_name(model) is not None


def trained_presets(name, folder=None, grid=None, calibrations=True):
    """``{method: options}`` shipped with the trained model ``name`` (``presets.json`` beside its
    weights; ``{}`` when there is none). A method whose preset is a calibration file (under
    ``"calibrations"``; ``"plans"``, the earlier name, is read too) gets ``{"calibration":
    <absolute path>}``. The file records the model and the latent grid it was made for;
    ``CalibrationError`` names both when they are not this model's.

    ``grid``: the latent grid of the run (None: the native one). A calibration whose settings do
    not carry over to it (``calibration_file.grid_reason``: all but sta windows in a fixed tile)
    gives way to the method's entry under ``"methods"`` (options found on the native grid; ``{}``:
    its defaults); ``calibrations=False``: those entries alone, for every method (what a user
    setting a calibration's own options gets instead of it)."""
    import json

    from fastdit.calibration.calibration_file import CalibrationError, grid_reason, load_calibration

    folder = folder or os.path.join(WEIGHTS_DIR, TRAINED_MODELS[name])
    path = os.path.join(folder, PRESETS_FILE)
    if not os.path.isfile(path):
        return {}
    try:
        with open(path) as f:
            data = json.load(f)
    except ValueError as error:
        raise CalibrationError(f"preset file {path} is not valid JSON ({error}); "
                               f"restore it with git checkout -- {path}") from None
    if data.get("model") != name:
        raise CalibrationError(f"preset file {path} was made for model {data.get('model')!r}, not {name!r}")
    native = trained_grid(name) if name in TRAINED_DEFAULTS else None
    if native is not None and "grid" in data and list(data["grid"] or []) != list(native):
        raise CalibrationError(f"preset file {path} was made for the latent grid {data['grid']} of {name}; {name}'s "
                               f"native grid is {list(native)}: re-calibrate it (see its model card)")
    presets = {method: dict(options) for method, options in (data.get("methods") or {}).items()}
    files = data.get("calibrations", data.get("plans")) or {}
    for method, rel in files.items() if calibrations else ():
        calibration = os.path.join(folder, rel)
        if not os.path.isfile(calibration):
            raise CalibrationError(f"preset file {path} names the calibration {calibration} for {method!r}, which "
                                   "is missing")
        if (grid is None or tuple(grid) == tuple(native or ())
                or grid_reason(load_calibration(calibration), [tuple(grid)]) is None):
            presets[method] = {"calibration": calibration}
    return presets


def trained_grid(name, call=None):
    """The latent grid (frames, height, width) of the trained model's native call, or of ``call``
    (``num_frames`` / ``height`` / ``width``; those it leaves out are the native ones). tiny-shapes:
    VAE factors 2 in time and 4 in space, patch (1, 1, 1)."""
    call = {**TRAINED_DEFAULTS[name], **{k: v for k, v in (call or {}).items() if v is not None}}
    return ((call["num_frames"] - 1) // 2 + 1, call["height"] // 4, call["width"] // 4)


def _safetensors_problem(path):
    """Why the safetensors file ``path`` is unreadable (missing, bad header, truncated), or None."""
    import json
    import struct

    if not os.path.isfile(path):
        return "is missing"
    size = os.path.getsize(path)
    try:
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len > size - 8:
                return f"is corrupt (header of {header_len} bytes in a {size}-byte file)"
            header = json.loads(f.read(header_len))
        end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    except (struct.error, ValueError, KeyError, TypeError, UnicodeDecodeError) as error:
        return f"is corrupt (unreadable safetensors header: {type(error).__name__})"
    if 8 + header_len + end != size:
        return f"is corrupt ({size} bytes, the header describes {8 + header_len + end}: truncated or padded)"
    return None


#: The files a trained WanPipeline folder needs (relative paths).
_TRAINED_FILES = ("model_index.json", "scheduler/scheduler_config.json", "tokenizer/tokenizer.json",
                  "tokenizer/tokenizer_config.json", "text_encoder/config.json", "text_encoder/model.safetensors",
                  "transformer/config.json", "transformer/diffusion_pytorch_model.safetensors", "vae/config.json",
                  "vae/diffusion_pytorch_model.safetensors")


def check_trained_weights(name, folder=None):
    """Raise ``ModelNotFoundError`` naming the first missing or corrupt file of the trained model
    ``name`` (in ``folder``, default its folder under ``WEIGHTS_DIR``) and how to re-create it."""
    import json

    folder = folder or os.path.join(WEIGHTS_DIR, TRAINED_MODELS[name])
    how = (f"re-create the weights with `{RETRAIN_COMMANDS[name]}` (it writes {folder}), "
           f"or restore them from the fastdit repository (git checkout -- {folder})")
    for rel in _TRAINED_FILES:
        path = os.path.join(folder, rel)
        if rel.endswith(".safetensors"):
            problem = _safetensors_problem(path)
        elif not os.path.isfile(path):
            problem = "is missing"
        else:
            try:
                with open(path) as f:
                    json.load(f)
                problem = None
            except (ValueError, UnicodeDecodeError) as error:
                problem = f"is corrupt (not valid JSON: {type(error).__name__})"
        if problem:
            raise ModelNotFoundError(f"{name}: weight file {path} {problem}; {how}")
    return folder


def dtype_argument(dtype):
    """``from_pretrained``'s dtype keyword: ``dtype`` where diffusers takes it (newer releases deprecate
    ``torch_dtype``: 0.42 warns on every load), ``torch_dtype`` on the releases before it."""
    try:
        from diffusers.utils import deprecation_utils
    except ImportError:
        return {"torch_dtype": dtype}
    return {"dtype": dtype} if hasattr(deprecation_utils, "_resolve_dtype") else {"torch_dtype": dtype}


def load_trained(name, device=None, dtype=None):
    """Load the trained built-in ``name`` from the package's weights folder (offline)."""
    from diffusers import DiffusionPipeline

    folder = check_trained_weights(name)
    try:
        pipe = DiffusionPipeline.from_pretrained(folder, **dtype_argument(dtype or torch.float32),
                                                 local_files_only=True)
    except Exception as error:  # noqa: BLE001 - any failure here is a broken weights folder
        raise ModelNotFoundError(
            f"{name}: could not load the pipeline in {folder} ({type(error).__name__}: "
            f"{str(error).splitlines()[0][:200] if str(error) else ''}); re-create the weights with "
            f"`{RETRAIN_COMMANDS[name]}`") from None
    pipe = pipe.to(device or default_device())
    pipe._fastdit_call_defaults = dict(TRAINED_DEFAULTS[name])  # the native call (fastdit.optimize_noise reads it)
    return pipe


def load_pipeline(model="tiny-wan", device=None, dtype=None):
    """Load a diffusers pipeline.

    Args:
        model: ``"tiny-wan"``, ``"tiny-wan-i2v"``, ``"tiny-hunyuan-video"`` (random weights, no
            downloads), ``"tiny-shapes"`` (trained here, shipped with the package), a hub id such as
            ``"Wan-AI/Wan2.1-T2V-1.3B-Diffusers"``, or a local folder.
        device: default CUDA when available, else CPU. dtype: default bf16 on CUDA, fp32 on CPU.
    """
    device = device or default_device()
    if trained_name(model) is not None:
        return load_trained(model, device, dtype)  # fp32 unless asked: these models are tiny
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
            raise ModelNotFoundError(f"{model} is a folder but holds no model_index.json: "
                                     "not a diffusers pipeline folder")
        try:
            pipe = DiffusionPipeline.from_pretrained(model, **dtype_argument(dtype), local_files_only=True)
        except (OSError, ValueError) as error:
            raise ModelNotFoundError(f"could not load the pipeline in {model}: {error}") from None
        return pipe.to(device)
    looks_like_path = model.startswith((".", "/", "~")) or model.count("/") > 1
    if looks_like_path:
        raise ModelNotFoundError(f"no such folder: {model} (a hub id looks like 'org/name')")
    try:
        pipe = DiffusionPipeline.from_pretrained(model, **dtype_argument(dtype), local_files_only=True)
    except Exception as cached_error:  # noqa: BLE001 - any failure here means "not in the cache"
        if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false"):
            raise ModelNotFoundError(
                f"{model!r} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set. Download it first "
                f"(`huggingface-cli download {model}`) or pass a local folder. ({type(cached_error).__name__})"
            ) from None
        try:
            pipe = DiffusionPipeline.from_pretrained(model, **dtype_argument(dtype))
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
            plus = " plus 1" if offset else ""
            notes.append(f"{name} {value} -> {fitted} (the model takes multiples of {multiple}{plus})")
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
    return ((frames - 1) // temporal + 1, max(call.get("height", 0) // spatial, 1),
            max(call.get("width", 0) // spatial, 1))
