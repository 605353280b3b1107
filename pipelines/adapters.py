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


def registered_adapters():
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
