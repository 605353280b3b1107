"""Model-family adapters: what fastdit needs to know about each diffusers transformer.

An adapter states, for one family:
  * which attention modules are patched (self / joint attention only, never cross-attention),
    as a regular expression over ``transformer.named_modules()`` names;
  * where text (or other conditioning) tokens sit in the joint sequence: none, prefix or suffix;
  * how the latent token grid ``(T, H, W)`` follows from the transformer's input and patch sizes;
  * the family's default options per method.

Attention masks passed by the model (e.g. HunyuanVideo's text-padding mask) are read from the
attention call itself, so adapters need not describe them.

Registering a new family takes a few lines::

    from fastdit.pipelines import Adapter, register_adapter

    register_adapter(Adapter(
        family="my_dit",
        transformer_classes=("MyDiTTransformer3DModel",),   # names in `diffusers`, or classes
        attention_pattern=r"blocks\\.\\d+\\.attn1",          # named_modules() names to patch
        text_position="none",
    ))

When the grid is not a plain function of the latent tensor's shape, give ``grid_fn``
(``(adapter, transformer, call) -> (T, H, W)`` with ``call`` the transformer's bound forward
arguments as a dict, or None to run that call dense) or subclass ``Adapter`` and override ``grid``.
A family that fastdit recognises but cannot patch sets ``unsupported`` (a reason); ``check_fn``
(``(transformer) -> reason or None``) rejects individual configurations at patch time.
"""
from __future__ import annotations

import inspect
import math
import re
from dataclasses import dataclass, field

import torch

from fastdit.methods.base import set_family_defaults_source

_ADAPTERS = []


def _as_tuple3(patch, patch_t=None):
    if isinstance(patch, int):
        return (patch_t or 1, patch, patch)
    patch = tuple(patch)
    if len(patch) == 2:
        return (patch_t or 1,) + patch
    return patch


@dataclass
class Adapter:
    """How fastdit patches one family of diffusers transformers.

    Attributes:
        family: short family name used in errors, defaults and the README table.
        transformer_classes: diffusers class names (looked up in ``diffusers``) or classes.
        attention_pattern: regex that ``fullmatch``-es the names of the modules to patch.
        text_position: ``"none"``, ``"prefix"`` or ``"suffix"``: where non-video tokens sit in the
            sequence of the patched attention calls (their count is what is left over after the
            video tokens).
        video: True for video families (3-D grids); False for image families (T = 1).
        pipelines: the diffusers pipelines of this family (for the docs).
        method_defaults: method name -> option defaults for this family.
        hidden_states_arg: name of the transformer forward argument holding the latents.
        latent_layout: axis order of 5-D latents, ``"BCFHW"`` (default), ``"BFCHW"`` (CogVideoX)
            or ``"BFHWC"`` (Kandinsky 5); 4-D latents are ``(B, C, H, W)``.
        round_up: the grid rounds partial patches up (patch embeddings that pad); False: floor.
        grid_fn: optional ``(adapter, transformer, call) -> (T, H, W) | None`` replacing the
            shape rule (``call``: the forward's arguments by name). None from it: run that call dense.
        unsupported: non-empty when fastdit knows the family but cannot patch it (the reason).
        check_fn: optional ``(transformer) -> reason | None``; a reason rejects that model at patch time.
        notes: patched modules, text position, masks, grid rule, for the docs.
    """

    family: str
    transformer_classes: tuple
    attention_pattern: str
    text_position: str = "none"
    video: bool = True
    pipelines: tuple = ()
    method_defaults: dict = field(default_factory=dict)
    hidden_states_arg: str = "hidden_states"
    latent_layout: str = "BCFHW"
    round_up: bool = True
    grid_fn: object = None
    unsupported: str = ""
    check_fn: object = None
    notes: str = ""

    def classes(self):
        import diffusers

        found = []
        for cls in self.transformer_classes:
            if isinstance(cls, str):
                cls = getattr(diffusers, cls, None)
            if cls is not None:
                found.append(cls)
        return tuple(found)

    def matches(self, transformer):
        classes = self.classes()
        return bool(classes) and isinstance(transformer, classes)

    def attention_modules(self, transformer):
        """``[(name, module)]`` of the attention modules to patch, in model order."""
        pattern = re.compile(self.attention_pattern)
        return [(name, module) for name, module in transformer.named_modules() if pattern.fullmatch(name)]

    def patch_size(self, transformer):
        """``(p_t, p_h, p_w)`` from the transformer config."""
        config = transformer.config
        return _as_tuple3(config.patch_size, getattr(config, "patch_size_t", None))

    def check(self, transformer):
        """Raise ``UnsupportedModelError`` when this family (or this model's config) cannot be patched."""
        reason = self.unsupported or (self.check_fn(transformer) if self.check_fn is not None else None)
        if reason:
            raise UnsupportedModelError(f"fastdit cannot patch {type(transformer).__name__} ({self.family}): {reason}")

    def call_arguments(self, transformer, args, kwargs):
        """The transformer call's arguments by name (positional ones bound to the forward signature)."""
        if not args:
            return dict(kwargs)
        try:
            bound = inspect.signature(transformer.forward).bind_partial(*args, **kwargs)
        except TypeError:
            return {self.hidden_states_arg: args[0], **kwargs}
        return dict(bound.arguments)

    def latents(self, args, kwargs):
        if self.hidden_states_arg in kwargs:
            return kwargs[self.hidden_states_arg]
        if args:
            return args[0]
        raise ValueError(f"{self.family}: could not find `{self.hidden_states_arg}` in the transformer call")

    def _div(self, size, patch):
        return -(-size // patch) if self.round_up else size // patch

    def grid(self, transformer, args, kwargs):
        """Latent token grid ``(T, H, W)`` of a transformer call (None: run this call dense).

        Video latents are ``(B, C, F, H, W)`` (or the order in ``latent_layout``); image latents
        ``(B, C, H, W)`` (T = 1). Each axis is divided by its patch size (rounded up, as patch
        embeddings with padding do, unless ``round_up`` is False).
        """
        if self.grid_fn is not None:
            return self.grid_fn(self, transformer, self.call_arguments(transformer, args, kwargs))
        latents = self.latents(args, kwargs)
        p_t, p_h, p_w = self.patch_size(transformer)
        if latents.dim() == 5:
            dims = dict(zip(self.latent_layout, latents.shape))
            frames, height, width = dims["F"], dims["H"], dims["W"]
            return (self._div(frames, p_t), self._div(height, p_h), self._div(width, p_w))
        if latents.dim() == 4:
            _, _, height, width = latents.shape
            return (1, self._div(height, p_h), self._div(width, p_w))
        raise ValueError(f"{self.family}: unexpected latent shape {tuple(latents.shape)}")

    def timestep(self, args, kwargs):
        timestep = kwargs.get("timestep")
        if isinstance(timestep, torch.Tensor):
            return float(timestep.flatten()[0]) if timestep.numel() else None
        return None if timestep is None else float(timestep)


def register_adapter(adapter, first=False):
    """Add an adapter (``first=True`` puts it before the built-in ones, to override them)."""
    if not isinstance(adapter, Adapter):
        raise ValueError(f"register_adapter takes an Adapter, got {type(adapter).__name__}")
    _ADAPTERS[:] = [a for a in _ADAPTERS if a.family != adapter.family]
    if first:
        _ADAPTERS.insert(0, adapter)
    else:
        _ADAPTERS.append(adapter)
    return adapter


def unregister_adapter(family):
    """Remove the adapter of ``family`` (returns it, or None when none is registered)."""
    for adapter in list(_ADAPTERS):
        if adapter.family == family:
            _ADAPTERS.remove(adapter)
            return adapter
    return None


def adapters():
    """All registered adapters, in lookup order."""
    return list(_ADAPTERS)


def supported_families():
    """Families fastdit can patch (adapters without an ``unsupported`` reason)."""
    return [a.family for a in _ADAPTERS if not a.unsupported]


def adapter_for_family(family):
    """The registered adapter of ``family`` (None when there is none)."""
    return next((a for a in _ADAPTERS if a.family == family), None)


set_family_defaults_source(adapter_for_family)


class UnsupportedModelError(ValueError):
    """The transformer (or pipeline) is not a DiT that fastdit knows how to patch."""


def find_adapter(transformer):
    """The adapter of ``transformer``; raises ``UnsupportedModelError`` listing the families."""
    for adapter in _ADAPTERS:
        if adapter.matches(transformer):
            adapter.check(transformer)
            return adapter
    unet = " (a UNet: fastdit patches DiT transformers only)" if "UNet" in type(transformer).__name__ else ""
    raise UnsupportedModelError(
        f"fastdit cannot patch {type(transformer).__name__}{unet}: supported families are "
        f"{', '.join(supported_families())}. Register your own with "
        "fastdit.pipelines.register_adapter(Adapter(...)) (see its docstring)."
    )


# ---------------------------------------------------------------------------------------------
# Grid rules that need more than the latent tensor's shape
# ---------------------------------------------------------------------------------------------

def _distinct(values):
    return int(torch.unique(values).numel())


def _grid_from_ids(ids, axes):
    """``(T, H, W)`` of packed image tokens from their position ids ``(S, A)`` or ``(B, S, A)``.

    ``axes`` are the id columns of (T, H, W). Tokens must form a full grid in frame-major order
    (the order the Flux pipelines pack them); otherwise None (the call then runs dense).
    """
    if ids is None:
        return None
    if ids.dim() == 3:
        ids = ids[0]
    cols = [ids[:, a] for a in axes]
    grid = tuple(_distinct(c) for c in cols)
    if math.prod(grid) != ids.shape[0]:
        return None  # e.g. reference images of another size appended (Kontext / edit): not one grid
    # frame-major order: the ids must run through the grid t, then h, then w
    ranks = [torch.unique(c, return_inverse=True)[1] for c in cols]
    flat = (ranks[0] * grid[1] + ranks[1]) * grid[2] + ranks[2]
    if not bool((flat == torch.arange(flat.numel(), device=flat.device)).all()):
        return None
    return grid


def _flux_grid(adapter, transformer, call):
    return _grid_from_ids(call.get("img_ids"), (0, 1, 2))


def _qwen_image_grid(adapter, transformer, call):
    shapes = call.get("img_shapes")
    if not shapes:
        return None
    first = shapes[0]
    if isinstance(first, tuple) and len(first) == 3 and all(isinstance(x, int) for x in first):
        first = [first]  # a flat list of shapes (one per batch element)
    first = [tuple(int(x) for x in s) for s in first]
    frames = sum(s[0] for s in first)
    if len({s[1:] for s in first}) != 1:
        return None  # edit model with a reference image of another size: not one grid, run dense
    return (frames, first[0][1], first[0][2])


def _ltx_grid(adapter, transformer, call):
    p = transformer.config.patch_size
    p_t = transformer.config.patch_size_t
    frames, height, width = call.get("num_frames"), call.get("height"), call.get("width")
    if frames is not None and height is not None and width is not None:
        return (int(frames) // p_t, int(height) // p, int(width) // p)
    coords = call.get("video_coords")  # (B, 3, S): frame, row, column of every token
    if coords is not None:
        return _grid_from_ids(coords[0].transpose(0, 1), (0, 1, 2))
    return None


def _kandinsky5_grid(adapter, transformer, call):
    if call.get("sparse_params") is not None:
        return None  # the model's own NABLA attention, with tokens in its fractal order: leave it alone
    latents = call[adapter.hidden_states_arg]
    _, frames, height, width, _ = latents.shape  # (B, T, H, W, C)
    p_t, p_h, p_w = transformer.config.patch_size
    return (frames // p_t, height // p_h, width // p_w)


def _kandinsky5_check(transformer):
    attention_type = getattr(transformer.config, "attention_type", "regular")
    if attention_type not in (None, "regular"):
        return (f"this checkpoint uses Kandinsky's built-in sparse attention (attention_type={attention_type!r}, "
                "tokens in its own fractal order); fastdit patches checkpoints with attention_type='regular'")
    return None


_LINEAR_ATTENTION = ("its self-attention `attn1` is linear (ReLU-kernel) attention, not softmax attention, so "
                     "there is no attention matrix to sparsify; its `attn2` is cross-attention")


# ---------------------------------------------------------------------------------------------
# Built-in families (lookup order = table order)
# ---------------------------------------------------------------------------------------------

register_adapter(Adapter(
    family="wan",
    transformer_classes=("WanTransformer3DModel",),
    attention_pattern=r"blocks\.\d+\.attn1",
    text_position="none",
    pipelines=("WanPipeline", "WanImageToVideoPipeline", "WanVideoToVideoPipeline"),
    # Radial Attention's Wan settings (reference scripts: decay 0.2, sink, first 12 of 50 steps and
    # the first layer dense; adjacent frames dense, as the current reference mask code does).
    method_defaults={"radial": {"decay": 0.2, "sink": True, "adjacent": "dense", "dense_steps": 0.24,
                                "dense_layers": 1}},
    notes="Wan 2.1 and 2.2. Self-attention `blocks.N.attn1` over video tokens; text and image context go "
          "through `attn2` (cross-attention, never patched). Grid: latents (B, C, F, H, W) / patch_size. "
          "Wan 2.2's `transformer` and `transformer_2` share one step counter.",
))

register_adapter(Adapter(
    family="wan_vace",
    transformer_classes=("WanVACETransformer3DModel",),
    attention_pattern=r"(vace_blocks|blocks)\.\d+\.attn1",
    text_position="none",
    pipelines=("WanVACEPipeline",),
    notes="Self-attention `blocks.N.attn1` and `vace_blocks.N.attn1` (the control branch runs on the same "
          "grid); `attn2` is cross-attention. Grid: latents (B, C, F, H, W) / patch_size.",
))

register_adapter(Adapter(
    family="skyreels_v2",
    transformer_classes=("SkyReelsV2Transformer3DModel",),
    attention_pattern=r"blocks\.\d+\.attn1",
    text_position="none",
    pipelines=("SkyReelsV2Pipeline", "SkyReelsV2ImageToVideoPipeline", "SkyReelsV2DiffusionForcingPipeline",
               "SkyReelsV2DiffusionForcingImageToVideoPipeline", "SkyReelsV2DiffusionForcingVideoToVideoPipeline"),
    notes="Wan-style: self-attention `blocks.N.attn1`, grid latents (B, C, F, H, W) / patch_size. Diffusion "
          "forcing with `num_frame_per_block > 1` passes a block-causal mask (not a key mask): those calls run dense.",
))

register_adapter(Adapter(
    family="hunyuan_video",
    transformer_classes=("HunyuanVideoTransformer3DModel",),
    attention_pattern=r"(transformer_blocks|single_transformer_blocks)\.\d+\.attn",
    text_position="suffix",
    pipelines=("HunyuanVideoPipeline", "HunyuanVideoImageToVideoPipeline"),
    # Radial Attention's HunyuanVideo settings (reference scripts).
    method_defaults={"radial": {"decay": 0.95, "sink": False, "adjacent": "dense", "dense_steps": 0.24,
                                "dense_layers": 0}},
    notes="Joint attention in double- and single-stream blocks, text after video; the text-padding "
          "mask the model passes is honoured (padded text keys are never attended). The text refiner's "
          "self-attention is not patched. Grid: latents (B, C, F, H, W) / (patch_size_t, patch_size, patch_size).",
))

register_adapter(Adapter(
    family="hunyuan_video15",
    transformer_classes=("HunyuanVideo15Transformer3DModel",),
    attention_pattern=r"transformer_blocks\.\d+\.attn",
    text_position="suffix",
    pipelines=("HunyuanVideo15Pipeline", "HunyuanVideo15ImageToVideoPipeline"),
    notes="Joint attention `transformer_blocks.N.attn`, conditioning (text, second text encoder, image "
          "tokens) after video. The model passes a (query x key) mask valid[q] & valid[k]; see the README "
          "for how fastdit treats it. Grid: latents (B, C, F, H, W) / (patch_size_t, patch_size, patch_size).",
))

register_adapter(Adapter(
    family="cogvideox",
    transformer_classes=("CogVideoXTransformer3DModel",),
    attention_pattern=r"transformer_blocks\.\d+\.attn1",
    text_position="prefix",
    latent_layout="BFCHW",
    round_up=False,
    pipelines=("CogVideoXPipeline", "CogVideoXImageToVideoPipeline", "CogVideoXVideoToVideoPipeline",
               "CogVideoXFunControlPipeline"),
    notes="CogVideoX 1.0 and 1.5. Joint attention `transformer_blocks.N.attn1` with text before video. "
          "Latents are (B, F, C, H, W) (frames on axis 1); grid (F // patch_size_t, H // patch_size, "
          "W // patch_size), patch_size_t = 1 for 1.0 (1.5 patches time too).",
))

register_adapter(Adapter(
    family="ltx_video",
    transformer_classes=("LTXVideoTransformer3DModel",),
    attention_pattern=r"transformer_blocks\.\d+\.attn1",
    text_position="none",
    grid_fn=_ltx_grid,
    pipelines=("LTXPipeline", "LTXImageToVideoPipeline", "LTXConditionPipeline", "LTXLatentUpsamplePipeline"),
    notes="Self-attention `transformer_blocks.N.attn1`; `attn2` is cross-attention. Latents are already "
          "packed tokens (B, S, C); the grid is (num_frames // patch_size_t, height // patch_size, "
          "width // patch_size) from the call's `num_frames`, `height`, `width` (latent sizes), else from "
          "`video_coords`; when neither gives a full grid the call runs dense.",
))

register_adapter(Adapter(
    family="mochi",
    transformer_classes=("MochiTransformer3DModel",),
    attention_pattern=r"transformer_blocks\.\d+\.attn1",
    text_position="suffix",
    pipelines=("MochiPipeline",),
    notes="Asymmetric joint attention `transformer_blocks.N.attn1`: the processor calls SDPA once per "
          "sample with the video tokens followed by that sample's valid (unpadded) text tokens only, so each "
          "call's text length is its own; the layout is computed per call from its sequence length. "
          "Grid: latents (B, C, F, H, W) / (1, patch_size, patch_size).",
))

register_adapter(Adapter(
    family="cosmos",
    transformer_classes=("CosmosTransformer3DModel",),
    attention_pattern=r"transformer_blocks\.\d+\.attn1",
    text_position="none",
    round_up=False,
    pipelines=("Cosmos2TextToImagePipeline", "Cosmos2VideoToWorldPipeline", "CosmosTextToWorldPipeline",
               "CosmosVideoToWorldPipeline", "Cosmos2_5_PredictBasePipeline"),
    notes="Cosmos (Predict 1 and 2). Self-attention `transformer_blocks.N.attn1`; `attn2` is cross-attention. "
          "Condition and padding masks are extra channels, not tokens. Grid: latents (B, C, F, H, W) / patch_size.",
))

register_adapter(Adapter(
    family="allegro",
    transformer_classes=("AllegroTransformer3DModel",),
    attention_pattern=r"transformer_blocks\.\d+\.attn1",
    text_position="none",
    round_up=False,
    pipelines=("AllegroPipeline",),
    notes="Self-attention `transformer_blocks.N.attn1` (its optional video-padding mask is a key mask and is "
          "honoured); `attn2` is cross-attention. Grid: latents (B, C, F, H, W) / (patch_size_t, patch_size, patch_size).",
))

register_adapter(Adapter(
    family="kandinsky5",
    transformer_classes=("Kandinsky5Transformer3DModel",),
    attention_pattern=r"visual_transformer_blocks\.\d+\.self_attention",
    text_position="none",
    grid_fn=_kandinsky5_grid,
    check_fn=_kandinsky5_check,
    pipelines=("Kandinsky5T2VPipeline", "Kandinsky5I2VPipeline", "Kandinsky5T2IPipeline", "Kandinsky5I2IPipeline"),
    notes="Visual self-attention `visual_transformer_blocks.N.self_attention`; the text encoder blocks' "
          "self-attention and the visual cross-attention are not patched. Latents are (B, F, H, W, C) "
          "(channels last); grid (F, H, W) / patch_size. Checkpoints with the built-in NABLA sparse attention "
          "(attention_type='nabla') are rejected.",
))

register_adapter(Adapter(
    family="sana_video",
    transformer_classes=("SanaVideoTransformer3DModel",),
    attention_pattern=r"transformer_blocks\.\d+\.attn1",
    unsupported=_LINEAR_ATTENTION,
    pipelines=("SanaVideoPipeline", "SanaImageToVideoPipeline"),
    notes="Not patchable: " + _LINEAR_ATTENTION + ".",
))

# -- image families (single frame, 2-D grids) ----------------------------------------------------

register_adapter(Adapter(
    family="flux",
    transformer_classes=("FluxTransformer2DModel",),
    attention_pattern=r"(transformer_blocks|single_transformer_blocks)\.\d+\.attn",
    text_position="prefix",
    video=False,
    grid_fn=_flux_grid,
    pipelines=("FluxPipeline", "FluxImg2ImgPipeline", "FluxInpaintPipeline", "FluxFillPipeline",
               "FluxControlPipeline", "FluxKontextPipeline"),
    notes="Joint attention in double- and single-stream blocks with text (`txt_ids`) before the image. "
          "Latents are packed (B, S, C); the grid comes from `img_ids` columns (t, h, w): distinct values per "
          "column, tokens in row-major order. Kontext's same-size reference image (t = 1) makes T = 2; "
          "ids that are not one full grid run dense.",
))

register_adapter(Adapter(
    family="flux2",
    transformer_classes=("Flux2Transformer2DModel",),
    attention_pattern=r"(transformer_blocks|single_transformer_blocks)\.\d+\.attn",
    text_position="prefix",
    video=False,
    grid_fn=_flux_grid,
    pipelines=("Flux2Pipeline", "Flux2KleinPipeline"),
    notes="Flux.2: joint attention in double- and single-stream blocks, text first. Grid from `img_ids` "
          "columns (t, h, w, l). Reference-image KV-cache calls (query and key lengths differ) run dense.",
))

register_adapter(Adapter(
    family="sd3",
    transformer_classes=("SD3Transformer2DModel",),
    attention_pattern=r"transformer_blocks\.\d+\.attn2?",
    text_position="suffix",
    video=False,
    round_up=False,
    pipelines=("StableDiffusion3Pipeline", "StableDiffusion3Img2ImgPipeline", "StableDiffusion3InpaintPipeline"),
    notes="Stable Diffusion 3 / 3.5. Joint attention `transformer_blocks.N.attn` with the context appended "
          "after the image tokens, and SD3.5's extra image self-attention `attn2` (dual attention layers). "
          "Grid: latents (B, C, H, W) / patch_size.",
))

register_adapter(Adapter(
    family="pixart_sigma",
    transformer_classes=("PixArtTransformer2DModel",),
    attention_pattern=r"transformer_blocks\.\d+\.attn1",
    text_position="none",
    video=False,
    round_up=False,
    pipelines=("PixArtSigmaPipeline", "PixArtAlphaPipeline"),
    notes="PixArt-Sigma (and Alpha): self-attention `transformer_blocks.N.attn1` (head dim 72); `attn2` is "
          "cross-attention. Grid: latents (B, C, H, W) / patch_size.",
))

register_adapter(Adapter(
    family="qwen_image",
    transformer_classes=("QwenImageTransformer2DModel",),
    attention_pattern=r"transformer_blocks\.\d+\.attn",
    text_position="prefix",
    video=False,
    grid_fn=_qwen_image_grid,
    pipelines=("QwenImagePipeline", "QwenImageImg2ImgPipeline", "QwenImageInpaintPipeline", "QwenImageEditPipeline"),
    notes="Joint attention `transformer_blocks.N.attn` with text before the image; the text-padding mask is "
          "honoured. Latents are packed (B, S, C); the grid is (frames, h, w) from `img_shapes` (edit models: "
          "the target and same-size reference images stack along T; other sizes run dense).",
))

register_adapter(Adapter(
    family="sana",
    transformer_classes=("SanaTransformer2DModel",),
    attention_pattern=r"transformer_blocks\.\d+\.attn1",
    video=False,
    unsupported=_LINEAR_ATTENTION,
    pipelines=("SanaPipeline", "SanaSprintPipeline", "SanaPAGPipeline"),
    notes="Not patchable: " + _LINEAR_ATTENTION + ".",
))
