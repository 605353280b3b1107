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
  and head, the following sparse steps add it back, rescaled by the softmax mass) or ``"ear"``
  (after SVG-EAR: the plan's key budget re-routed to the blocks whose centroid compensation would
  err most per key, the rest compensated as in ``"pooled"``; ``corrections/error_routing.py``);
* ``quant`` (after SageAttention): ``None``, ``"int8"`` (smoothed K, INT8 Q.K^T with one scale per
  plan block, P.V in the input's half type) or ``"int8-fp8"`` (P.V in FP8 e4m3 as well; CUDA
  compute capability 8.9 or later). Formulas: ``fastdit.kernels.quant``. float16 / bfloat16 inputs
  only (checked at the first call, like the device for ``"int8-fp8"``); not with the skip rule;
  no backward. Refresh steps of ``"cached"`` run quantised too (their result is the reference the
  following steps are corrected towards).

The formulas of the corrections are in ``corrections/__init__.py`` and ``corrections/error_routing.py``; the skip
rule's exact statement is in ``fastdit.kernels.block_sparse`` (methods run it on the engine's default 64 x 64
sub-tiles, cut by the plan blocks; the kernel then uses exactly those tiles instead of autotuned ones). A call with
the rule on records ``ctx.info["skipped_subtiles"]`` and ``["walked_subtiles"]`` (device tensors
per (batch, head)).

Refresh steps of ``"cached"``: the sparse steps ``s`` with ``(s - first) % refresh_every == 0``,
``first`` the first step after ``dense_steps`` (so the first sparse step refreshes), and any step
that finds no stored refresh for its layer / branch / shape. A refresh step computes the plan and
its complement (together exactly one dense attention), returns their exact merge and is counted
as a dense call in the statistics. The skip rule does not apply on refresh steps (they are exact);
on other steps, the keys it skips are neither in the sparse result nor in the correction.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from fastdit.kernels import skip_subtiles_walked
from fastdit.kernels.quant import QUANT_MODES, check_quant, check_quant_mode

from . import base as _base  # run_plan is looked up on the base module (tests wrap it there)
from .base import Method, MethodConfig, OptionError, check_number, option
from .corrections import cached_apply, cached_entry, cached_store, complement_plan, merge_lse, pooled_correction
from .corrections.error_routing import route_plan

CORRECTIONS = ("none", "pooled", "cached", "ear")


@dataclass
class BlockSparseConfig(MethodConfig):
    """Options of every block-sparse method (see the module docstring).

    Attributes:
        skip_threshold: skip a key sub-tile inside the kernel when its largest scaled score is
            more than this many natural-log units below the running row maximum; None: never.
        correction: ``"none"``, ``"pooled"``, ``"cached"`` or ``"ear"``.
        refresh_every: with ``correction="cached"``: every ``refresh_every``-th sparse step runs
            dense and refreshes the cached residual (>= 1).
        quant: None, ``"int8"`` or ``"int8-fp8"`` (see the module docstring).
    """

    skip_threshold: float | None = option(None, "skip key sub-tiles scoring this far (log units) below the row "
                                          "maximum inside the kernel; empty: never", range=(0.0, None),
                                          widget="number", advanced=True)
    correction: str = option("none", "correction for dropped key blocks: none, pooled (block means, "
                             "Rectified SpaAttn), cached (residual from dense refresh steps, Re-ttention) or ear "
                             "(error-aware routing + centroid compensation, SVG-EAR)",
                             choices=CORRECTIONS, widget="dropdown", advanced=True)
    refresh_every: int = option(5, "correction=cached: a dense refresh step every N sparse steps",
                                range=(1, None), widget="number", advanced=True)
    quant: str | None = option(None, "quantised attention (SageAttention): empty = off, int8 (INT8 QK^T, half "
                               "P.V) or int8-fp8 (FP8 P.V too, sm_89+); float16/bfloat16 only",
                               choices=QUANT_MODES, widget="dropdown", advanced=True)

    def validate(self):
        super().validate()
        if self.skip_threshold is not None:
            self.skip_threshold = check_number("skip_threshold", self.skip_threshold, 0,
                                               note="log units below the row maximum; or None")
        if self.correction is None:  # the command line's parse_value reads `--set sta.correction=none` as None
            self.correction = "none"
        if self.correction not in CORRECTIONS:
            raise ValueError(f"correction must be one of {CORRECTIONS}, got {self.correction!r}")
        if isinstance(self.refresh_every, bool) or not isinstance(self.refresh_every, int) or self.refresh_every < 1:
            raise ValueError(f"refresh_every must be an int >= 1, got {self.refresh_every!r}")
        try:
            check_quant_mode(self.quant)
        except ValueError as error:
            raise OptionError(str(error)) from None
        if self.quant is not None and self.skip_threshold is not None:
            raise OptionError(f"quant={self.quant!r} cannot be combined with skip_threshold (the quantised kernel "
                              f"has no skip rule); set one of them")


class BlockSparseMethod(Method):
    """Base of methods whose call is one (or a few) engine calls on block plans: select the plan,
    run it (with the skip rule when ``skip_threshold`` is set), apply the correction, finalize."""

    config_cls = BlockSparseConfig
    reports_lse = True
    block_sparse = True
    ring = True  # methods/parallel/ring.py cuts any BlockPlan (one or per-head orders, cluster blocks)
    guard_scores_widen = True  # the output is the plan's engine call (+ correction): guard/widen.py grows the plan

    def is_refresh_step(self, ctx):
        """Whether this call of a ``correction="cached"`` method refreshes (see the module doc)."""
        first = math.ceil(ctx.call.dense_threshold(self.config.dense_steps))
        return (ctx.step - first) % self.config.refresh_every == 0

    def attend(self, ctx, q, k, v):
        plan = self.select(ctx, q, k)
        if plan is None:  # a layout the method computes densely anyway
            ctx.info["dense"] = True
            return ctx.dense()
        config = self.config
        if config.quant is not None:  # dtype and device are known only now
            try:
                check_quant(config.quant, q.dtype, q.device)
            except ValueError as error:
                raise OptionError(f"method {self.name!r}: {error}") from None
        common = dict(key_mask=ctx.key_mask, query_mask=ctx.query_mask, scale=ctx.scale, backend=ctx.backend,
                      return_lse=True, quant=config.quant)
        if config.correction == "cached":
            entry = cached_entry(ctx.state, q)
            if entry is None or self.is_refresh_step(ctx):
                return self._refresh(ctx, q, k, v, plan, common)
        if config.correction == "ear":  # same key budget, re-routed by estimated compensation error
            plan, ctx.info["routed_changed"] = route_plan(q, k, v, plan, ctx.key_mask, ctx.query_mask, ctx.scale)
        ctx.record(plan=plan)
        skip = config.skip_threshold is not None
        out, lse, *skipped = _base.run_plan(q, k, v, plan, skip_threshold=config.skip_threshold,
                                            return_skipped=skip, **common)
        ctx.info["lse"] = lse  # of the computed scores (before any correction)
        if skip:  # int (B, H) / (1|B, 1|H) tensors on the device: no sync here
            ctx.info["skipped_subtiles"] = skipped[0]
            ctx.info["walked_subtiles"] = skip_subtiles_walked(plan.kv_counts, plan.kernel_len, plan.block_m,
                                                               plan.block_n)
        if config.correction in ("pooled", "ear"):
            out = pooled_correction(q, k, v, plan, out, lse, ctx.key_mask, ctx.query_mask, ctx.scale)
        elif config.correction == "cached":
            out = cached_apply(entry, out, lse, ctx.query_mask)
        return self.finalize(ctx, out, lse)

    def _refresh(self, ctx, q, k, v, plan, common):
        """A refresh step: the plan and its complement (one dense attention in all), merged exactly;
        the residual and masses are stored for the following sparse steps."""
        out_kept, lse_kept = _base.run_plan(q, k, v, plan, **common)
        out_dropped, lse_dropped = _base.run_plan(q, k, v, complement_plan(plan), **common)
        out, lse = merge_lse(out_kept, lse_kept, out_dropped, lse_dropped)
        ctx.info["lse"] = lse
        cached_store(ctx.state, out, lse, out_dropped, lse_dropped, q.dtype)
        ctx.info["dense"] = True  # the work of a dense call (counted as one)
        ctx.info["refresh"] = True
        out = out.to(q.dtype)
        if ctx.query_mask is not None:
            out = out * ctx.query_mask.to(device=out.device, dtype=out.dtype)[:, None, :, None]
        return self.finalize(ctx, out, lse)
