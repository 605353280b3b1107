"""Dense attention through the patch: the model's own attention call, unchanged.

Useful as a baseline and as a check of the patching machinery (layouts, masks, step counting):
its outputs equal the unpatched model's, and its recorded mask is all pairs (minus padded keys).
"""
from __future__ import annotations

from dataclasses import dataclass

from .base import Method, MethodConfig, register_method


@dataclass
class DenseConfig(MethodConfig):
    """Dense attention has no options beyond the shared ones (which change nothing here)."""


@register_method
class Dense(Method):
    name = "dense"
    config_cls = DenseConfig

    def is_dense_call(self, ctx):
        return True
