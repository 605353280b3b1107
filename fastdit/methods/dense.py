"""Dense attention through the patch: the model's own attention call, unchanged.

Useful as a baseline and as a check of the patching machinery (layouts, masks, step counting):
its outputs equal the unpatched model's, and its recorded mask is all pairs (minus padded keys).
"""
from __future__ import annotations

from dataclasses import dataclass

from .base import Method, MethodConfig, methods_with, register_method


@dataclass
class DenseConfig(MethodConfig):
    """Dense attention has no options beyond the shared ones (which change nothing here)."""


#: Options of block-sparse methods that mean nothing on dense attention (nothing is dropped or skipped).
BLOCK_SPARSE_ONLY = ("skip_threshold", "correction", "refresh_every")


@register_method
class Dense(Method):
    name = "dense"
    any_key_length = True  # plain attention
    rank = 0
    ring = True  # every key: the ring merges the shards' parts exactly
    config_cls = DenseConfig
    reports_lse = True

    @classmethod
    def make_config(cls, config=None, **options):
        misplaced = [name for name in BLOCK_SPARSE_ONLY if name in options]
        if misplaced:
            sparse = ", ".join(methods_with("block_sparse"))
            raise ValueError(f"{misplaced[0]} applies to block-sparse methods ({sparse}): 'dense' computes "
                             f"every key, so there is nothing to skip or correct; got {misplaced[0]}="
                             f"{options[misplaced[0]]!r}")
        return super().make_config(config, **options)

    def is_dense_call(self, ctx):
        return True
