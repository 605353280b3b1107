"""Step-aware query-block pruning with a per-layer output cache ("prune").

After AT-EDM ("Attention-Driven Training-Free Efficiency Enhancement of Diffusion Models", Wang et
al., CVPR 2024: prune tokens, and prune less in the early steps) and ToCa ("Accelerating Diffusion
Transformers with Token-wise Feature Caching", Zou et al., ICLR 2025: recompute only the tokens
whose features changed most since they were cached, reuse the cache for the rest).

Video query tokens are cut into blocks of ``block_size`` consecutive tokens in model order
(frame-major ``t, h, w``; the last block may be shorter). Per layer (and CFG branch):

* a **full step** computes every query row against every key and caches the output ``O`` and the
  block means of the queries ``qbar_b = mean_{i in b} q_i`` (per batch and head). The first step
  the method runs (after ``dense_steps``) is a full step, then every ``refresh_every``-th one;
* on the ``refresh_every - 1`` steps in between, for each (batch, head) the relative change of
  every video block's mean query since it was cached is

      c_b = || qbar_b(now) - qbar_b(cache) || / (|| qbar_b(cache) || + eps)

  and the ``n_keep = n_blocks - floor(r_s * n_blocks)`` blocks with the largest ``c_b``
  (``torch.topk``: a fixed count, so no host synchronisation) are recomputed against all keys; all
  other rows are the cached output, bit for bit. Recomputed blocks refresh their cache entries
  (output and reference mean), as ToCa refreshes the tokens it recomputes. Text / conditioning
  query rows are always recomputed (text is never pruned), and every key is always attended.
* The schedule ``r_s`` prunes less early: with ``s0`` the first step the method runs and ``N`` the
  steps of the pipeline call, ``r_s = ratio * min(1, (s - s0) / (warmup * N))`` (``r_s = ratio``
  when ``warmup = 0`` or ``N`` is unknown). A step with ``floor(r_s * n_blocks) = 0`` recomputes
  everything.

The kept rows (text rows, then the kept video blocks, per batch and head) are gathered into a
compact query tensor and run through ``fastdit.kernels.block_sparse_attention`` with a plan that is
dense over the keys; the result is scattered into the cached output. Cost of a pruned step:
``(text_len + n_keep * block_size) / seq_len`` of dense attention plus O(S * D) gathers.
Memory: per patched layer and CFG branch one output ``(B, H, S, D)`` in the model dtype and the
block means ``(B, H, n_blocks, D)`` in float32.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fastdit.kernels import block_sparse_attention
from fastdit.plan import ENGINE_BLOCK, BlockPlan, dense_plan  # noqa: F401 (ENGINE_BLOCK: re-exported)

from . import base
from .base import Method, MethodConfig, check_int, check_number, option, register_method

def compact_attention(q_rows, k, v, key_mask, scale, backend):
    """Rows ``q_rows`` ``(B, H, R, D)`` attending every (valid) key of ``k, v``: one engine call."""
    plan = dense_plan(q_rows.shape[2], k.shape[2], q_rows.device)
    valid = None if key_mask is None else key_mask.to(torch.bool)
    return block_sparse_attention(q_rows, k, v, plan.kv_indices, plan.kv_counts, plan.block_m, plan.block_n,
                                  scale=scale, kv_valid=valid, return_lse=False, backend=backend, validate=False)


def full_attention(ctx, q, k, v):
    """Every query against every key on the engine (``base.run_plan``, the path the layer tests trace)."""
    plan = dense_plan(q.shape[2], k.shape[2], q.device)
    return base.run_plan(q, k, v, plan, key_mask=ctx.key_mask, query_mask=ctx.query_mask, scale=ctx.scale,
                         backend=ctx.backend)


def first_method_step(ctx, config):
    """The first step this method runs in the pipeline call (after the dense steps)."""
    return math.ceil(ctx.call.dense_threshold(config.dense_steps))


def is_refresh_step(ctx, config):
    """Full steps: the first step the method runs, then every ``refresh_every``-th step."""
    return (ctx.step - first_method_step(ctx, config)) % config.refresh_every == 0


@dataclass
class PruneConfig(MethodConfig):
    """Options of step-aware query-block pruning (see the module docstring).

    Attributes:
        ratio: fraction of the video query blocks taken from the cache on a pruned step, in [0, 1).
        refresh_every: a full step (every query computed, cache refreshed) every N steps (>= 1;
            1: every step is full, i.e. dense attention).
        block_size: video query tokens per block, in model order (>= 1).
        warmup: fraction of the call's steps over which the pruned fraction ramps linearly from 0
            (at the first step the method runs) to ``ratio``; 0: ``ratio`` from the start.
        dense_steps, dense_layers: see ``MethodConfig`` (default 0: the first step is a full step).
    """

    ratio: float = option(0.5, "fraction of video query blocks reused from the cache on a pruned step, in [0, 1)",
                          range=(0.0, 1.0), widget="slider")
    refresh_every: int = option(4, "a full step (every query recomputed, cache refreshed) every N steps",
                                range=(1, None), widget="number")
    block_size: int = option(64, "video query tokens per block (model order)", range=(1, None), widget="number")
    warmup: float = option(0.25, "fraction of the steps over which the pruned fraction ramps from 0 to ratio",
                           range=(0.0, 1.0), widget="slider")

    def validate(self):
        super().validate()
        self.ratio = check_number("ratio", self.ratio, 0, 1, high_open=True)
        check_int("refresh_every", self.refresh_every)
        check_int("block_size", self.block_size)
        self.warmup = check_number("warmup", self.warmup, 0, 1)


@register_method
class Prune(Method):
    """Query-block pruning with cached outputs (AT-EDM / ToCa); see the module docstring."""

    untrainable = "it reuses each layer's output cached at earlier steps for the pruned query blocks"
    name = "prune"
    any_key_length = True  # full rows against every key; pruned rows come from its cache
    config_cls = PruneConfig
    default_options = {"dense_steps": 0, "dense_layers": 0}
    rank = 85

    @classmethod
    def candidates(cls, layout):
        return [{"ratio": r} for r in (0.25, 0.5, 0.75)]
    #: The tiny models (8 x 32 x 48 tokens, 8 steps): reuse 60% of the blocks between full steps
    #: every 4 steps, ramped over the first step after a full one.
    tiny_options = {"ratio": 0.6, "refresh_every": 4, "warmup": 0.125}

    def pruned_fraction(self, ctx):
        """``r_s`` of this step (see the schedule in the module docstring)."""
        config = self.config
        ramp = config.warmup * ctx.num_steps if ctx.num_steps else 0.0
        if ramp <= 0:
            return config.ratio
        return config.ratio * min(1.0, (ctx.step - first_method_step(ctx, config)) / ramp)

    def attend(self, ctx, q, k, v):
        batch, heads, seq, dim = q.shape
        layout, config, state = ctx.layout, self.config, ctx.state
        n_keys = k.shape[2]
        total = batch * heads * seq * n_keys
        n_blocks = -(-layout.video_len // config.block_size)
        n_pruned = math.floor(self.pruned_fraction(ctx) * n_blocks)
        cache = state.get("out")
        fresh = (cache is None or cache.shape != q.shape or cache.dtype != q.dtype or cache.device != q.device
                 or state.get("keys") != n_keys)
        if fresh or n_pruned == 0 or is_refresh_step(ctx, config):
            out = full_attention(ctx, q, k, v)
            state.update(out=out, means=self.block_means(q, layout), keys=n_keys)
            ctx.record(performed=total, total=total)
            ctx.info["attention_shape"] = (seq, n_keys)
            ctx.info["recomputed_blocks"] = None  # all
            return out

        means = self.block_means(q, layout)  # (B, H, n_blocks, D) float32
        reference = state["means"]
        change = (means - reference).norm(dim=-1) / (reference.norm(dim=-1) + 1e-6)
        keep = change.topk(n_blocks - n_pruned, dim=-1, sorted=False).indices.sort(dim=-1).values
        rows = self.rows_of(keep, layout, q.device)  # (B, H, R) model-order query rows to recompute
        gather = rows[..., None].expand(-1, -1, -1, dim)
        computed = compact_attention(q.gather(2, gather), k, v, ctx.key_mask, ctx.scale, ctx.backend)
        if ctx.query_mask is not None:  # rows the model masks out stay 0, as in its own attention
            row_ok = ctx.query_mask.to(torch.bool)[:, None, :].expand(-1, heads, -1).gather(2, rows)
            computed = computed * row_ok[..., None].to(computed.dtype)
        out = cache.scatter(2, gather, computed)
        keep_means = keep[..., None].expand(-1, -1, -1, dim)
        state.update(out=out, means=reference.scatter(2, keep_means, means.gather(2, keep_means)))
        ctx.record(performed=batch * heads * rows.shape[2] * n_keys, total=total)
        ctx.info["attention_shape"] = (rows.shape[2], n_keys)
        ctx.info["recomputed_blocks"] = keep
        return out

    def block_means(self, q, layout):
        """Mean query of every video block: float32 ``(B, H, n_blocks, D)`` (a short last block
        is averaged over its real tokens)."""
        size, length = self.config.block_size, layout.video_len
        n_blocks = -(-length // size)
        video = q[:, :, layout.video_start:layout.video_start + length].float()
        padded = torch.nn.functional.pad(video, (0, 0, 0, n_blocks * size - length))
        sums = padded.view(*q.shape[:2], n_blocks, size, q.shape[-1]).sum(3)
        counts = torch.full((n_blocks,), float(size), device=q.device)
        counts[-1] = length - (n_blocks - 1) * size
        return sums / counts[:, None]

    def rows_of(self, keep, layout, device):
        """Model-order rows to recompute: the text rows, then the tokens of the kept blocks ``keep``
        ``(B, H, n_keep)`` (the slots of a short last block past the video repeat its last token,
        which is harmless: the duplicate computes and writes the same row)."""
        size = self.config.block_size
        offsets = torch.arange(size, device=device)
        video = (keep[..., None] * size + offsets).clamp(max=layout.video_len - 1).flatten(2) + layout.video_start
        if not layout.text_len:
            return video
        text = layout.text_positions(device).expand(*keep.shape[:2], -1)
        return torch.cat([text, video], dim=2)
