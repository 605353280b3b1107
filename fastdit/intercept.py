"""The one interception point: ``scaled_dot_product_attention`` calls inside a patched module.

Diffusers has two attention styles: legacy processors call
``torch.nn.functional.scaled_dot_product_attention`` directly; newer ones call
``dispatch_attention_fn``, whose native backend calls the same function (fastdit pins the patched
modules' processors to the native backend while patched). A ``TorchFunctionMode`` pushed by a
forward pre-hook of the attention module and popped by its forward hook (``always_call=True``, so
an exception cannot leave it behind) catches that call in both styles, without copying or
replacing any upstream ``forward``.
"""
from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

_SDPA = torch.nn.functional.scaled_dot_product_attention
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


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


class SDPAIntercept(TorchFunctionMode):
    """Routes SDPA calls to ``handler(call, original)``; ``original()`` runs the call unchanged."""

    def __init__(self, handler):
        super().__init__()
        self.handler = handler

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not _is_sdpa(func):
            return func(*args, **kwargs)
        # The mode is inactive inside this method, so `original` reaches the real kernel.
        return self.handler(sdpa_arguments(args, kwargs), lambda: func(*args, **kwargs))


class ModuleInterceptor:
    """Installs an ``SDPAIntercept`` around one module's forward with removable hooks."""

    def __init__(self, module, handler):
        self.module = module
        self.handler = handler
        self._modes = []
        self._handles = [
            module.register_forward_pre_hook(self._enter),
            module.register_forward_hook(self._exit, always_call=True),
        ]

    def _enter(self, module, args):
        mode = SDPAIntercept(self.handler)
        mode.__enter__()
        self._modes.append(mode)

    def _exit(self, module, args, output):
        if self._modes:
            self._modes.pop().__exit__(None, None, None)

    def remove(self):
        for handle in self._handles:
            handle.remove()
        self._handles = []
