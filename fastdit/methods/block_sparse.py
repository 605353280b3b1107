"""What every block-sparse method shares: in-kernel skipping and corrections for the dropped mass.

Sliding tile, radial, sparge and svg all end in one engine call on a ``BlockPlan``. On top of the
plan each accepts

* ``skip_threshold`` (after SpargeAttn's second stage): inside the kernel a key sub-tile whose
  largest scaled score lies more than ``skip_threshold`` (natural-log units) below the row
  block's running maximum is skipped without exp and P.V (``None``: off, the same as ``inf``);
* ``correction`` for the key blocks the plan drops: ``"none"``, ``"pooled"`` (after Rectified
  SpaAttn: every dropped key block stands in as its size times one token with the block's mean
  key and value, merged exactly through the log-sum-exp) or ``"cached"`` (after Re-ttention:
  dense refresh steps every ``refresh_every`` steps store the dense - sparse residual per layer
  and head, the following sparse steps add it back, rescaled by the softmax mass).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .base import Method, MethodConfig, option

CORRECTIONS = ("none", "pooled", "cached")


@dataclass
class BlockSparseConfig(MethodConfig):
    """Options of every block-sparse method (see the module docstring).

    Attributes:
        skip_threshold: skip a key sub-tile inside the kernel when its largest scaled score is
            more than this many natural-log units below the running row maximum; None: never.
        correction: ``"none"``, ``"pooled"`` or ``"cached"``.
        refresh_every: with ``correction="cached"``: every ``refresh_every``-th sparse step runs
            dense and refreshes the cached residual (>= 1).
    """

    skip_threshold: float | None = option(None, "skip key sub-tiles scoring this far (log units) below the row "
                                          "maximum inside the kernel; empty: never", range=(0.0, None),
                                          widget="number")
    correction: str = option("none", "correction for dropped key blocks: none, pooled (block means, "
                             "Rectified SpaAttn) or cached (residual from dense refresh steps, Re-ttention)",
                             choices=CORRECTIONS, widget="dropdown")
    refresh_every: int = option(5, "correction=cached: a dense refresh step every N sparse steps",
                                range=(1, None), widget="number")

    def validate(self):
        super().validate()
        if self.skip_threshold is not None:
            value = self.skip_threshold
            if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value < 0:
                raise ValueError(f"skip_threshold must be a number >= 0 (log units below the row maximum) or None, "
                                 f"got {value!r}")
            self.skip_threshold = float(value)
        if self.correction not in CORRECTIONS:
            raise ValueError(f"correction must be one of {CORRECTIONS}, got {self.correction!r}")
        if isinstance(self.refresh_every, bool) or not isinstance(self.refresh_every, int) or self.refresh_every < 1:
            raise ValueError(f"refresh_every must be an int >= 1, got {self.refresh_every!r}")


class BlockSparseMethod(Method):
    """Base of methods whose call is one (or a few) engine calls on block plans."""

    config_cls = BlockSparseConfig
