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
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import torch

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
    """

    family: str
    transformer_classes: tuple
    attention_pattern: str
    text_position: str = "none"
    video: bool = True
    pipelines: tuple = ()
    method_defaults: dict = field(default_factory=dict)
    hidden_states_arg: str = "hidden_states"
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

    def latents(self, args, kwargs):
        if self.hidden_states_arg in kwargs:
            return kwargs[self.hidden_states_arg]
        if args:
            return args[0]
        raise ValueError(f"{self.family}: could not find `{self.hidden_states_arg}` in the transformer call")

    def grid(self, transformer, args, kwargs):
        """Latent token grid ``(T, H, W)`` of a transformer call.

        Video latents are ``(B, C, F, H, W)``; image latents ``(B, C, H, W)`` (T = 1). Each axis
        is divided by its patch size (rounded up, as patch embeddings with padding do).
        """
        latents = self.latents(args, kwargs)
        p_t, p_h, p_w = self.patch_size(transformer)
        if latents.dim() == 5:
            _, _, frames, height, width = latents.shape
            return (-(-frames // p_t), -(-height // p_h), -(-width // p_w))
        if latents.dim() == 4:
            _, _, height, width = latents.shape
            return (1, -(-height // p_h), -(-width // p_w))
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


def adapters():
    """All registered adapters, in lookup order."""
    return list(_ADAPTERS)


def supported_families():
    return [a.family for a in _ADAPTERS]


class UnsupportedModelError(ValueError):
    """The transformer (or pipeline) is not a DiT that fastdit knows how to patch."""


def find_adapter(transformer):
    """The adapter of ``transformer``; raises ``UnsupportedModelError`` listing the families."""
    for adapter in _ADAPTERS:
        if adapter.matches(transformer):
            return adapter
    raise UnsupportedModelError(
        f"fastdit cannot patch {type(transformer).__name__}: supported families are "
        f"{', '.join(supported_families())}. Register your own with "
        "fastdit.pipelines.register_adapter(Adapter(...)) (see its docstring)."
    )


# ---------------------------------------------------------------------------------------------
# Built-in families
# ---------------------------------------------------------------------------------------------

register_adapter(Adapter(
    family="wan",
    transformer_classes=("WanTransformer3DModel",),
    attention_pattern=r"blocks\.\d+\.attn1",
    text_position="none",
    pipelines=("WanPipeline", "WanImageToVideoPipeline", "WanVideoToVideoPipeline"),
    notes="self-attention `attn1` over video tokens; text and image context go through `attn2` "
          "(cross-attention, never patched). Wan 2.2's `transformer` and `transformer_2` share one step counter.",
))

register_adapter(Adapter(
    family="hunyuan_video",
    transformer_classes=("HunyuanVideoTransformer3DModel",),
    attention_pattern=r"(transformer_blocks|single_transformer_blocks)\.\d+\.attn",
    text_position="suffix",
    pipelines=("HunyuanVideoPipeline", "HunyuanVideoImageToVideoPipeline"),
    notes="joint attention in double- and single-stream blocks, text after video; the text-padding "
          "mask the model passes is honoured (padded text keys are never attended).",
))
