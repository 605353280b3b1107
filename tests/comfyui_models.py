"""Test helper: ComfyUI's own source and its models, tiny, random weights, on the CPU.

The source comes from ``FASTDIT_COMFYUI_SRC`` (a ComfyUI checkout) or from the shared tarball
``../shared/thirdparty/comfyui-94c298f9-src.tar.gz`` extracted to a temporary folder; ``load_comfy()``
returns None when neither exists (the tests then skip with that message). Nothing of ComfyUI is
copied here: every model, the model patcher and the sampler are imported from that tree.

``build(kind)`` makes a ComfyUI ``ModelPatcher`` around ComfyUI's ``BaseModel`` of one family
(``wan``, ``wan_i2v``, ``hunyuan_video``, ``ltx_video``, ``flux``) with a tiny config and seeded
random weights; ``inputs(kind)`` the arguments of one diffusion-model forward (odd grids, text
tokens); ``forward(patcher, kind, ...)`` calls the diffusion model with the ``transformer_options``
ComfyUI's sampler builds (the patcher's model options, its wrappers, ``sigmas``, ``sample_sigmas``).
"""
import importlib.machinery
import os
import sys
import tarfile
import tempfile
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
TARBALL = "comfyui-94c298f9-src.tar.gz"
SKIP_REASON = (f"ComfyUI's source not found: set FASTDIT_COMFYUI_SRC to a ComfyUI checkout, or put {TARBALL} in "
               "../shared/thirdparty/ (see its README.md)")
_STATE = {}


def comfy_source():
    """A folder holding ComfyUI's ``comfy/`` package, or None."""
    given = os.environ.get("FASTDIT_COMFYUI_SRC")
    if given:
        if (Path(given) / "comfy" / "model_patcher.py").exists():
            return Path(given)
        _STATE["reason"] = f"FASTDIT_COMFYUI_SRC={given} is not a ComfyUI checkout (no comfy/model_patcher.py in it)"
        return None
    for folder in (ROOT.parent / "shared" / "thirdparty", ROOT / "shared" / "thirdparty"):
        if (folder / TARBALL).exists():
            target = Path(tempfile.mkdtemp(prefix="fastdit-comfyui-"))
            with tarfile.open(folder / TARBALL) as tar:
                tar.extractall(target, filter="data")
            return target
    return None


def skip_reason():
    """Why the ComfyUI tests skip (after ``load_comfy()`` returned None)."""
    return _STATE.get("reason", SKIP_REASON)


def load_comfy():
    """Import ComfyUI (CPU only) from its source; None when the source is absent."""
    if "comfy" in _STATE:
        return _STATE["comfy"]
    source = comfy_source()
    if source is None:
        _STATE["comfy"] = None
        return None
    sys.path.insert(0, str(source))
    stub = _torchvision_stub()
    try:
        import comfy.cli_args

        comfy.cli_args.args.cpu = True
        import comfy.model_management  # noqa: F401
        import comfy.model_base  # noqa: F401
        import comfy.model_patcher  # noqa: F401
        import comfy.sample  # noqa: F401
        import comfy.samplers  # noqa: F401
        import comfy.supported_models  # noqa: F401
        import comfy.latent_formats  # noqa: F401
    finally:
        for name in stub:  # only ComfyUI's Cosmos / cascade modules import torchvision; drop the stand-in
            sys.modules.pop(name, None)
    _STATE["comfy"] = comfy
    return comfy


def _torchvision_stub():
    """ComfyUI's ``model_base`` imports modules (Cosmos) that import torchvision at import time;
    where torchvision is not installed, an empty stand-in lets the import finish (no test here
    touches those models). Returns the names put in ``sys.modules``."""
    try:
        import torchvision  # noqa: F401
        return []
    except ImportError:
        pass
    # diffusers and transformers read torchvision's availability once (cached): read it before the stand-in
    import diffusers.utils.import_utils  # noqa: F401
    from transformers.utils import import_utils

    import_utils.is_torchvision_available()
    names = []
    for name in ("torchvision", "torchvision.transforms"):
        module = types.ModuleType(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)
        sys.modules[name] = module
        names.append(name)
    sys.modules["torchvision"].transforms = sys.modules["torchvision.transforms"]
    return names


#: ComfyUI unet configs (tiny): (supported-model class, config). Grids and text lengths are odd.
CONFIGS = {
    "wan": ("WAN21_T2V", dict(image_model="wan2.1", model_type="t2v", patch_size=(1, 2, 2), text_len=8, in_dim=4,
                              dim=32, ffn_dim=64, freq_dim=32, text_dim=12, out_dim=4, num_heads=2, num_layers=2)),
    "wan_i2v": ("WAN21_I2V", dict(image_model="wan2.1", model_type="i2v", patch_size=(1, 2, 2), text_len=8, in_dim=8,
                                  dim=32, ffn_dim=64, freq_dim=32, text_dim=12, out_dim=4, num_heads=2, num_layers=2,
                                  in_dim_ref_conv=None)),
    "hunyuan_video": ("HunyuanVideo", dict(image_model="hunyuan_video", in_channels=4, out_channels=4, vec_in_dim=8,
                                           context_in_dim=12, hidden_size=32, mlp_ratio=2.0, num_heads=2, depth=1,
                                           depth_single_blocks=1, axes_dim=[4, 6, 6], theta=256, patch_size=[1, 2, 2],
                                           qkv_bias=True, guidance_embed=False, byt5=False, meanflow=False)),
    "ltx_video": ("LTXV", dict(image_model="ltxv", in_channels=4, cross_attention_dim=32, attention_head_dim=16,
                               num_attention_heads=2, caption_channels=12, num_layers=2)),
    "flux": ("Flux", dict(image_model="flux", in_channels=4, out_channels=4, vec_in_dim=8, context_in_dim=12,
                          hidden_size=32, mlp_ratio=2.0, num_heads=2, depth=1, depth_single_blocks=2,
                          axes_dim=[4, 6, 6], theta=256, patch_size=2, qkv_bias=True, guidance_embed=False)),
}
#: Latent input size per kind: (frames, height, width) in latent pixels (images: frames 0).
SIZES = {"wan": (5, 12, 18), "wan_i2v": (5, 12, 18), "hunyuan_video": (5, 10, 18), "ltx_video": (5, 6, 9),
         "flux": (0, 14, 22)}
#: The token grid of those sizes (patch (1, 2, 2); LTX-Video's patchifier is (1, 1, 1)).
GRIDS = {"wan": (5, 6, 9), "wan_i2v": (5, 6, 9), "hunyuan_video": (5, 5, 9), "ltx_video": (5, 6, 9),
         "flux": (1, 7, 11)}
TEXT = 7


def build(kind, seed=0):
    """A ComfyUI ``ModelPatcher`` of ComfyUI's model for ``kind`` (tiny, seeded random weights)."""
    comfy = load_comfy()
    name, config = CONFIGS[kind]
    model_config = getattr(comfy.supported_models, name)(dict(config))
    model_config.set_inference_dtype(torch.float32, None)
    model_config.latent_format = comfy.latent_formats.LatentFormat()  # tiny channels: no per-channel statistics
    model = model_config.get_model({}, device="cpu")
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.diffusion_model.named_parameters():
            if param.dim() == 1 and ("norm" in name or "scale" in name) and "bias" not in name:
                param.fill_(1.0)
            else:
                fan_in = param.shape[-1] if param.dim() > 1 else 16
                param.copy_(torch.randn(param.shape, generator=generator) * fan_in ** -0.5)
    model.eval()
    cpu = torch.device("cpu")
    return comfy.model_patcher.ModelPatcher(model, load_device=cpu, offload_device=cpu)


def inputs(kind, batch=1, seed=1, text=TEXT):
    """Keyword arguments of one diffusion-model forward of ``kind``."""
    g = torch.Generator().manual_seed(seed)
    frames, height, width = SIZES[kind]
    channels = {"wan_i2v": 8}.get(kind, 4)
    shape = (batch, channels, height, width) if frames == 0 else (batch, channels, frames, height, width)
    out = dict(x=torch.randn(shape, generator=g), timestep=torch.full((batch,), 0.7),
               context=torch.randn(batch, text, 12, generator=g))
    if kind == "wan_i2v":
        out["clip_fea"] = torch.randn(batch, 5, 1280, generator=g)
        out["timestep"] = torch.full((batch,), 700.0)
    elif kind == "wan":
        out["timestep"] = torch.full((batch,), 700.0)
    elif kind in ("hunyuan_video", "flux"):
        out["y"] = torch.randn(batch, 8, generator=g)
    elif kind == "ltx_video":
        out["attention_mask"] = None
    return out


def options_of(patcher, sigma=None, schedule=None, cond_or_uncond=(0,)):
    """The ``transformer_options`` ComfyUI's sampler passes the diffusion model (``samplers.py``:
    the model options' transformer_options with the patcher's wrappers, ``sigmas``, ``sample_sigmas``)."""
    comfy = load_comfy()
    options = comfy.patcher_extension.copy_nested_dicts(patcher.model_options.get("transformer_options", {}))
    comfy.patcher_extension.merge_nested_dicts(options.setdefault("wrappers", {}), patcher.wrappers, copy_dict1=False)
    options["cond_or_uncond"] = list(cond_or_uncond)
    if sigma is not None:
        options["sigmas"] = torch.tensor([float(sigma)])
    if schedule is not None:
        options["sample_sigmas"] = torch.as_tensor(schedule, dtype=torch.float32)
    return options


def forward(patcher, kind, args=None, sigma=None, schedule=None):
    """One forward of the patcher's diffusion model, as ComfyUI's sampler calls it."""
    args = dict(args if args is not None else inputs(kind))
    x = args.pop("x")
    timestep = args.pop("timestep")
    with torch.no_grad():
        return patcher.model.diffusion_model(x, timestep, transformer_options=options_of(patcher, sigma, schedule),
                                             **args)
