"""The one interception point: ``scaled_dot_product_attention`` calls inside a patched module.

Diffusers has two attention styles: legacy processors call
``torch.nn.functional.scaled_dot_product_attention`` directly; newer ones call
``dispatch_attention_fn``, whose native backend calls the same function (fastdit pins the patched
modules' processors to the native backend while patched). One mechanism catches both:

* each patched attention module gets an instance-level ``forward`` (``AttentionForward``) that
  calls the module's own forward inside ``with SDPAIntercept(...)``, a ``TorchFunctionMode``.
  A ``with`` block, not hooks that push and pop: ``torch.compile`` traces it, and any exception
  (``KeyboardInterrupt`` included) leaves the mode stack as it was;
* the mode turns the SDPA call into one call of the custom op ``fastdit::patched_attention``
  (``torch.library``, with a fake implementation), so ``torch.compile`` sees one opaque node per
  attention call. Everything else (reading the per-call context, the method, plan caches, the
  kernel, the statistics) runs inside the op, outside any traced graph;
* per-call information reaches the op through ``contextvars`` (``fastdit/context.py``), set by a
  forward pre-hook of the transformer that ``torch.compile`` does not trace
  (``torch.compiler.disable``: one graph break per transformer call, none per layer).

Why not a registered diffusers attention backend: diffusers' backend registry is keyed by a closed
``Enum``, it is process-wide, and legacy processors never consult it.
"""
from __future__ import annotations

import functools
import itertools
import weakref

import torch
from torch.overrides import TorchFunctionMode

_SDPA = torch.nn.functional.scaled_dot_product_attention
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")

#: patch id -> live Patch (the op finds its patch by this id; removed patches disappear).
_PATCHES = weakref.WeakValueDictionary()
_IDS = itertools.count(1)


def register_patch(patch):
    """Give ``patch`` an id the op can find it by."""
    patch_id = next(_IDS)
    _PATCHES[patch_id] = patch
    return patch_id


def unregister_patch(patch_id):
    _PATCHES.pop(patch_id, None)


def _is_sdpa(func):
    return func is _SDPA or getattr(func, "__name__", "") == "scaled_dot_product_attention"


def sdpa_arguments(args, kwargs):
    """Normalise an SDPA call's arguments to a dict keyed by ``_SDPA_ARGS``."""
    call = dict(zip(_SDPA_ARGS, args))
    call.update(kwargs or {})
    call.setdefault("attn_mask", None)
    call.setdefault("dropout_p", 0.0)
    call.setdefault("is_causal", False)
    call.setdefault("scale", None)
    call.setdefault("enable_gqa", False)
    return call


def plain_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """``F.scaled_dot_product_attention`` with the call's own arguments (``enable_gqa`` passed only
    when set, for torch versions without it)."""
    extra = {"enable_gqa": True} if enable_gqa else {}
    return _SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, **extra)


@torch.library.custom_op("fastdit::patched_attention", mutates_args=())
def patched_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None,
                      dropout_p: float, is_causal: bool, scale: float | None, enable_gqa: bool, patch_id: int,
                      layer: int) -> torch.Tensor:
    """One intercepted attention call of patched layer ``layer`` of patch ``patch_id``."""
    call = {"query": query, "key": key, "value": value, "attn_mask": attn_mask, "dropout_p": dropout_p,
            "is_causal": is_causal, "scale": scale, "enable_gqa": enable_gqa}
    patch = _PATCHES.get(patch_id)
    if patch is None:  # removed since this graph was compiled: the model's own attention
        out = plain_sdpa(**call)
    else:
        out = patch.handle_call(layer, call, lambda: plain_sdpa(**call))
    # Outputs of a custom op must be fresh, contiguous tensors (the fake says so).
    return out.contiguous()


@patched_attention.register_fake
def _patched_attention_fake(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, patch_id, layer):
    return query.new_empty((*query.shape[:-1], value.shape[-1]))


class SDPAIntercept(TorchFunctionMode):
    """Routes SDPA calls to ``fastdit::patched_attention`` for one patched layer."""

    def __init__(self, patch_id, layer):
        super().__init__()
        self.patch_id = patch_id
        self.layer = layer

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not _is_sdpa(func):
            return func(*args, **kwargs)
        call = sdpa_arguments(args, kwargs)
        q, k, v = call["query"], call["key"], call["value"]
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            # The op has no backward: with gradients requested, the model's own attention runs.
            _note_fallback(self.patch_id, self.layer, "gradients requested (fastdit's attention is inference-only)")
            return func(*args, **kwargs)
        scale = call["scale"]
        return torch.ops.fastdit.patched_attention(
            q, k, v, call["attn_mask"], float(call["dropout_p"]), bool(call["is_causal"]),
            None if scale is None else float(scale), bool(call["enable_gqa"]), self.patch_id, self.layer,
        )


@torch.compiler.disable
def _note_fallback(patch_id, layer, reason):
    patch = _PATCHES.get(patch_id)
    if patch is not None:
        patch.stats.count_fallback(reason)


class AttentionForward:
    """Instance-level ``forward`` of one patched attention module: the module's own forward, run
    with ``SDPAIntercept`` entered. ``remove()`` puts the previous ``forward`` back."""

    def __init__(self, module, patch_id, layer):
        self.module_ref = weakref.ref(module)
        missing = object()
        self._previous = module.__dict__.get("forward", missing)
        self._missing = missing
        self.original = module.forward
        self.patch_id = patch_id
        self.layer = layer
        functools.update_wrapper(self, self.original)
        module.forward = self

    def __call__(self, *args, **kwargs):
        with SDPAIntercept(self.patch_id, self.layer):
            return self.original(*args, **kwargs)

    def remove(self):
        module = self.module_ref()
        if module is None or module.__dict__.get("forward") is not self:
            return
        if self._previous is self._missing:
            del module.__dict__["forward"]
        else:
            module.forward = self._previous
