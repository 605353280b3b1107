"""What the patch keeps per layer (``LayerRecord``: the latest call; ``LayerSpec``: where the layer
lives), what it leaves in copies (``UnpatchedState``: the instance ``__getstate__`` that makes
``copy.deepcopy`` / ``torch.save`` of a patched object give the unpatched one) and what it reads
from an attention module (``attention_geometry``)."""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from fastdit.layout import TokenLayout

PATCH_MARK = "_fastdit_patch"


@dataclass
class LayerRecord:
    """What one patched layer did in its latest call."""

    layout: TokenLayout
    dense: bool
    plan: object = None
    key_mask: torch.Tensor | None = None
    num_heads: int = 0
    query_mask: torch.Tensor | None = None


@dataclass
class LayerSpec:
    name: str
    local_index: int
    transformer: object  # weakref.ref to the transformer


MISSING = object()


class UnpatchedState:
    """Instance ``__getstate__`` of an object the patch changed (the transformer, each patched
    attention module, each processor whose backend it pinned): the object's state without the
    patch, so that ``copy.deepcopy``, ``copy.copy`` and pickling (``torch.save``) make an unpatched
    object while the original stays patched. ``changes``: attribute -> (fastdit's value, a callable
    giving the value to put back, ``MISSING`` for none); ``hook_id``: the patch's forward pre-hook."""

    def __init__(self, obj, changes, hook_id=None):
        self.ref = weakref.ref(obj)
        self.changes = changes
        self.hook_id = hook_id

    def __call__(self):
        obj = self.ref()
        base = type(obj).__getstate__(obj)
        if not isinstance(base, dict):  # pragma: no cover - slots or a custom state: nothing to filter
            return base
        state = dict(base)
        state.pop("__getstate__", None)
        state.pop(PATCH_MARK, None)
        for name, (ours, previous) in self.changes.items():
            if state.get(name, MISSING) is ours:
                value = previous()
                if value is MISSING:
                    state.pop(name)
                else:
                    state[name] = value
        if self.hook_id is not None:
            for name in ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs"):
                if isinstance(state.get(name), dict):
                    state[name] = type(state[name])((k, v) for k, v in state[name].items() if k != self.hook_id)
        return state


def attention_geometry(module):
    """``(heads, head_dim)`` of a diffusers attention module (``heads`` and ``inner_dim`` or
    ``to_q``), ``(None, None)`` when it does not say."""
    heads = getattr(module, "heads", None)
    if not isinstance(heads, int) or heads < 1:
        return None, None
    inner = getattr(module, "inner_dim", None)
    if not isinstance(inner, int):
        inner = getattr(getattr(module, "to_q", None), "out_features", None)
    if not isinstance(inner, int) or inner % heads:
        return None, None
    return heads, inner // heads
