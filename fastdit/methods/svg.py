"""Sparse VideoGen: per-head choice of a spatial, temporal or textural pattern from sampled queries.

After "Sparse VideoGen: Accelerating Video Diffusion Transformers with Spatial-Temporal Sparsity"
(Xi, Yang et al., 2025), whose online profiling gives each head either a spatial or a temporal
mask, with the textural pattern of "RainFusion: Adaptive Video Generation Acceleration via
Multi-Dimensional Visual Redundancy" (Chen et al., 2025) as a third candidate.

Kernel orders
-------------
Video tokens ``(t, y, x)`` of a ``(T, H, W)`` grid sit frame-major in the model, index
``t * F + p`` with ``F = H * W`` and ``p = y * W + x``. A head runs in one of two kernel orders:

* frame-major (the model's): kernel position ``i = t * F + p``; a frame is ``F`` consecutive tokens;
* position-major: kernel position ``i = p * T + t``; a "position" (one ``p`` in every frame) is
  ``T`` consecutive tokens.

Either way the video fills kernel positions ``[0, N)`` (``N = T * F``), padded to whole blocks of
``b = block_size`` (padding slots are masked keys and dropped rows), then the text / conditioning
tokens in their own blocks. Query block ``m`` holds kernel positions ``[m b, (m + 1) b)``.

Patterns (``density`` ``d`` in (0, 1], the kept fraction of the video key blocks)
-----------------------------------------------------------------------------------
* band of whole units (``spatial``: units are frames, ``U = F``, ``n = T``, frame-major order;
  ``temporal``: units are positions, ``U = T``, ``n = F``, position-major order). The real tokens
  of query block ``m`` cover units ``u0 .. u1``. The band keeps ``K = max(round(d n), u1 - u0 + 1)``
  units: ``extra = K - (u1 - u0 + 1)``, ``lo = u0 - extra // 2``, ``hi = u1 + extra - extra // 2``,
  shifted (not cut) back inside ``[0, n - 1]`` at the ends so every block keeps ``K`` units (balanced
  work, as sliding tile). Key block ``j`` is computed iff it overlaps key positions
  ``[lo U, (hi + 1) U)``. Spatial: the query's frame and its neighbouring frames, whole; temporal:
  the same spatial positions (and their neighbours in raster order) in every frame.
* ``textural`` (frame-major order): key block ``j < n_video_blocks`` is computed iff
  ``(j - m) mod s = 0`` with stride ``s = max(1, round(1 / d))``: a strided subsample of the
  video, own block included.

Text: video query blocks also compute every text key block; text query blocks compute every block
(text rows and columns stay dense). ``density = 1`` keeps every block (the call equals dense).
A single frame (``T = 1``, images) has no spatial/temporal split: the spatial pattern would be the
whole image (dense), so it is dropped from the candidates there; temporal then is a band of
neighbouring tokens in raster order (rows above and below) and textural stays as it is. When no
candidate is left the call runs dense.

Selection (per call, per batch element and head)
------------------------------------------------
``n_samples`` video query rows are drawn once per layout (a fixed-seed random subset, sorted;
clamped to the number of video tokens when the video is shorter: the documented call-time rule,
since the grid is unknown at patch time). Their exact attention ``o`` over all valid keys is
computed in float32, and for each candidate ``c`` the same rows under the candidate's mask,
``o_c`` (the softmax renormalised over the kept keys). The head takes

    argmin_c  sum_samples |o_c - o|^2 / sum_samples |o|^2      (relative squared L2 error),

the first candidate on ties (order: spatial, temporal, textural). Everything stays on the device
(no host synchronisation): the per-head choice indexes stacked static block lists and kernel
orders. Every head is gathered into its own kernel order (one ``index_select`` over the
``(B*H*S, D)`` rows with a per-head index: position-major for temporal heads), all heads run in ONE
engine call (per-head plans; heads folded into the batch so the key validity can differ per head),
and outputs are gathered back. No head is computed twice, and ``run_plan`` accepts the plan (it
hands plans with a ``run`` method to it), so svg goes through the same entry as every method.

Defaults: ``dense_steps = 0.25`` and ``dense_layers = 1``: the papers keep the first denoising
steps (and Sparse VideoGen the first layers) dense, where attention is not yet sparse.

Corrections (``BlockSparseConfig``): ``skip_threshold`` applies inside the one engine call, in
each head's kernel order; ``correction="cached"`` works as for every block-sparse method (its
complement plan keeps the per-head orders); ``"pooled"`` pools each head's dropped key blocks in
that head's own kernel order (``head_inverses``).

Statistics: the recorded ``BlockPlan`` is dynamic and its ``kv_counts`` are the chosen patterns'
per (batch, head). The selection (one score product and ``1 + P`` value products over the ``n``
sampled rows, about ``(2 + P) n / (2 S)`` of a dense call's work: 1.3% at 64 samples of 12288
tokens) is overhead in the timings and is not counted as computed pairs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fastdit.kernels import block_sparse_attention, plan_to_token_mask, validate_plan
from fastdit.plan import BlockPlan

from .base import GUARD_DEFAULT, check_int, check_number, option, register_method
from .block_sparse import BlockSparseConfig, BlockSparseMethod
from .selection.reuse import ReuseOptions, ReuseSelection

PATTERNS = ("spatial", "temporal", "textural")
#: Kernel order of each pattern: 0 frame-major, 1 position-major.
PATTERN_ORDER = {"spatial": 0, "temporal": 1, "textural": 0}
#: Seed of the sampled query rows (fixed: the same rows for a layout in every call and run).
SAMPLE_SEED = 0
#: float32 score entries per chunk of heads in the sampled exact attention (bounds peak memory).
_SCORE_BUDGET = 1 << 25


@dataclass
class SVGConfig(ReuseOptions, BlockSparseConfig):
    """Options of Sparse VideoGen (see the module docstring).

    Attributes:
        density: kept fraction of the video key blocks of each pattern, in (0, 1].
        n_samples: query rows sampled per call to choose each head's pattern (>= 1; clamped to the
            number of video tokens at call time).
        block_size: kernel block (query and key), >= 1.
        patterns: the candidate patterns, a non-empty subset of spatial, temporal, textural (a
            sequence, or one comma-separated string); kept in that canonical order (the tie-break).
        dense_steps: see ``MethodConfig``; default 0.25 (the first quarter of the steps dense).
        dense_layers: see ``MethodConfig``; default 1 (the first layer dense).
        reuse_threshold, reuse_max_steps: selection reuse across steps (``reuse.py``).
    """

    density: float = option(0.25, "kept fraction of the video key blocks of each pattern, in (0, 1]",
                            range=(0.0, 1.0), widget="slider")
    n_samples: int = option(64, "query rows sampled per call to choose each head's pattern",
                            range=(1, None), widget="number")
    block_size: int = option(128, "kernel block size (query and key)", range=(1, None), widget="number")
    patterns: tuple = option(PATTERNS, "candidate patterns: spatial, temporal and/or textural", widget="text")

    def validate(self):
        super().validate()
        self.density = check_number("density", self.density, 0, 1, low_open=True,
                                    note="the kept fraction of each pattern")
        check_int("n_samples", self.n_samples, note="more samples than video tokens are clamped per call")
        check_int("block_size", self.block_size)
        patterns = self.patterns
        if isinstance(patterns, str):  # "spatial,temporal" as the CLI's --set and the app's text box give it
            patterns = tuple(p.strip() for p in patterns.split(",") if p.strip())
        if (not isinstance(patterns, (tuple, list)) or not patterns or any(p not in PATTERNS for p in patterns)
                or len(set(patterns)) != len(patterns)):
            raise ValueError(f"patterns must be a non-empty list of distinct names from {PATTERNS}, "
                             f"got {self.patterns!r}")
        self.patterns = tuple(p for p in PATTERNS if p in patterns)  # canonical order: the tie-break


# -- static block lists -------------------------------------------------------------------------------

def band_block_mask(n_video, unit, n_units, kept_units, block):
    """Key blocks of a band of whole units: bool ``(n_video_blocks, n_video_blocks)``."""
    n_blocks = -(-n_video // block)
    m = torch.arange(n_blocks)
    u0 = m * block // unit
    u1 = (torch.clamp((m + 1) * block, max=n_video) - 1) // unit
    span = u1 - u0 + 1
    extra = (kept_units - span).clamp(min=0)
    lo, hi = u0 - extra // 2, u1 + extra - extra // 2
    up = (-lo).clamp(min=0)
    lo, hi = lo + up, hi + up
    down = (hi - (n_units - 1)).clamp(min=0)
    lo, hi = (lo - down).clamp(min=0), hi - down
    first, end = lo * unit // block, -(-(hi + 1) * unit // block)
    j = torch.arange(n_blocks)
    return (j >= first[:, None]) & (j < end[:, None])


def strided_block_mask(n_video_blocks, stride):
    """Textural: key block ``j`` for query block ``m`` iff ``(j - m) mod stride == 0``."""
    m = torch.arange(n_video_blocks)
    return (m[None, :] - m[:, None]) % stride == 0


def kept_units(density, n_units):
    return max(1, min(n_units, math.floor(density * n_units + 0.5)))


def kernel_orders(layout, block):
    """``(2, L)`` model token at each kernel position (frame-major, position-major), -1 padding."""
    t_, f_ = layout.frames, layout.frame_len
    n_video = layout.video_len
    video_len = -(-n_video // block) * block
    text_len = -(-layout.text_len // block) * block
    i = torch.arange(n_video)
    frame_major = layout.video_start + i
    position_major = layout.video_start + (i % t_) * f_ + i // t_
    orders = torch.full((2, video_len + text_len), -1, dtype=torch.long)
    orders[0, :n_video], orders[1, :n_video] = frame_major, position_major
    orders[:, video_len:video_len + layout.text_len] = layout.text_positions()
    return orders


def pattern_block_masks(layout, patterns, density, block):
    """Block mask ``(P, n_blocks, n_blocks)`` of each pattern in its kernel order (text dense)."""
    n_video = layout.video_len
    n_vb = -(-n_video // block)
    n_blocks = n_vb + -(-layout.text_len // block)
    masks = torch.ones(len(patterns), n_blocks, n_blocks, dtype=torch.bool)
    for p, name in enumerate(patterns):
        if name == "spatial":
            video = band_block_mask(n_video, layout.frame_len, layout.frames, kept_units(density, layout.frames), block)
        elif name == "temporal":
            video = band_block_mask(n_video, layout.frames, layout.frame_len,
                                    kept_units(density, layout.frame_len), block)
        else:
            video = strided_block_mask(n_vb, max(1, math.floor(1.0 / density + 0.5)))
        masks[p, :n_vb, :n_vb] = video
    return masks


@dataclass
class SVGLayoutPlan:
    """What svg prepares once per layout: candidate block lists, kernel orders, sampled rows."""

    patterns: tuple
    block: int
    kv_indices: torch.Tensor  # int32 (P, n_blocks, width)
    kv_counts: torch.Tensor  # int32 (P, n_blocks)
    pattern_order: torch.Tensor  # long (P,): kernel order of each pattern
    orders: torch.Tensor  # long (2, L): model token per kernel position, -1 padding
    inverses: torch.Tensor  # long (2, S): kernel position of each model token
    kv_valid: torch.Tensor  # bool (1, L)
    samples: torch.Tensor  # long (n,): sampled video query rows (model order)
    sample_masks: torch.Tensor  # bool (P, n, S): each candidate's mask on the sampled rows

    def validate(self):
        n_blocks = self.kv_counts.shape[-1]
        problems = validate_plan(self.kv_indices[None], self.kv_counts[None], n_blocks, n_blocks)
        if problems:
            raise ValueError("invalid svg block lists: " + "; ".join(problems))
        return self


def layout_plan(layout, config, device):
    """The ``SVGLayoutPlan`` of ``layout``, or None when no candidate is sparse-able (dense call)."""
    patterns = tuple(p for p in config.patterns if not (p == "spatial" and layout.frames == 1))
    if not patterns:
        return None
    block = config.block_size
    orders = kernel_orders(layout, block)
    seq = layout.seq_len
    inverses = torch.empty(2, seq, dtype=torch.long)
    real = orders[0] >= 0
    for o in range(2):
        inverses[o, orders[o][real]] = real.nonzero().squeeze(1)
    masks = pattern_block_masks(layout, patterns, config.density, block)
    counts = masks.sum(-1).to(torch.int32)
    # Stable sort puts each row's computed blocks first, in increasing order.
    indices = torch.sort((~masks).to(torch.int8), dim=-1, stable=True).indices[..., : int(counts.max())]
    pattern_order = torch.tensor([PATTERN_ORDER[p] for p in patterns])

    generator = torch.Generator().manual_seed(SAMPLE_SEED)
    n = min(config.n_samples, layout.video_len)
    samples = layout.video_start + torch.randperm(layout.video_len, generator=generator)[:n].sort().values
    sample_masks = torch.empty(len(patterns), n, seq, dtype=torch.bool)
    for p in range(len(patterns)):
        inverse = inverses[pattern_order[p]]
        rows = masks[p][inverse[samples] // block]  # (n, n_blocks) block rows of the samples
        kernel = rows.repeat_interleave(block, dim=1)[:, : orders.shape[1]] & real
        sample_masks[p] = kernel[:, inverse]
    return SVGLayoutPlan(
        patterns=patterns, block=block, kv_indices=indices.to(torch.int32).contiguous().to(device),
        kv_counts=counts.to(device), pattern_order=pattern_order.to(device), orders=orders.to(device),
        inverses=inverses.to(device), kv_valid=real[None].to(device), samples=samples.to(device),
        sample_masks=sample_masks.to(device))


# -- the per-call plan ------------------------------------------------------------------------------

@dataclass
class HeadOrderPlan(BlockPlan):
    """A ``BlockPlan`` whose kernel order differs per (batch, head).

    ``perm`` is the frame-major order (its padding slots are those of every head, so sizes,
    ``pair_counts`` and densities are right); ``head_orders`` ``(B, H, L)`` and ``head_inverses``
    ``(B, H, S)`` are each head's own order and its inverse. ``choice`` ``(B, H)``: index into
    ``info["patterns"]`` of each head's pattern.
    """

    head_orders: torch.Tensor | None = None
    head_inverses: torch.Tensor | None = None
    choice: torch.Tensor | None = None

    def __post_init__(self):
        # No ``nonzero`` here (the base class's inverse would synchronise every call on a GPU).
        self.inverse = None
        self.gather_index = None if self.perm is None else self.perm.clamp(min=0)

    def select_heads(self, offset, count):
        raise NotImplementedError("a per-call svg plan covers exactly the heads of its call")

    def token_mask(self, head=0, key_mask=None, batch=0):
        """The ``(S, S)`` mask of one (batch, head), in model token order (small sizes only)."""
        valid = self.kv_valid[:1] if self.kv_valid is not None else None
        if key_mask is not None:
            km = key_mask[batch].to(torch.bool)[self.head_orders[batch, head].clamp(min=0)][None]
            valid = km if valid is None else valid & km
        b = min(batch, self.kv_indices.shape[0] - 1)
        mask = plan_to_token_mask(self.kv_indices[b:b + 1, head:head + 1], self.kv_counts[b:b + 1, head:head + 1],
                                  self.kernel_len, self.kernel_len, self.block_m, self.block_n, valid)[0, 0]
        inverse = self.head_inverses[batch, head]
        return mask[inverse][:, inverse]

    def run(self, q, k, v, key_mask=None, scale=None, backend="auto", query_mask=None, return_lse=False,
            skip_threshold=None, skip_tile=(64, 64), return_skipped=False, quant=None):
        """``fastdit.run_plan`` of this plan (same arguments and results): see ``run_head_order_plan``."""
        out, lse, skipped = run_head_order_plan(q, k, v, self, key_mask=key_mask, query_mask=query_mask, scale=scale,
                                                backend=backend, skip_threshold=skip_threshold, skip_tile=skip_tile,
                                                quant=quant)
        result = (out, lse) if return_lse else (out,)
        result = result + ((skipped,) if return_skipped else ())
        return result if len(result) > 1 else out


def run_head_order_plan(q, k, v, plan, key_mask=None, query_mask=None, scale=None, backend="auto",
                        skip_threshold=None, skip_tile=(64, 64), quant=None):
    """Attention of model-order ``(B, H, S, D)`` tensors under a ``HeadOrderPlan``: one engine call
    for all heads; returns ``(out, lse, skipped)`` in model order (``skipped``: int32 ``(B, H)``
    key sub-tiles the in-kernel skip rule skipped, zeros without it)."""
    batch, heads, seq, dim = q.shape
    length = plan.kernel_len
    order = plan.head_orders.clamp(min=0)
    # Rows of the (B*H*S, D) tables: one index_select per tensor (several times faster than a
    # torch.gather with an index expanded over D on the CPU).
    rows = (order + (torch.arange(batch * heads, device=q.device) * seq).view(batch, heads, 1)).reshape(-1)
    q_k, k_k, v_k = (t.reshape(batch * heads * seq, dim).index_select(0, rows).view(batch * heads, 1, length, dim)
                     for t in (q, k, v))
    valid = plan.kv_valid
    if key_mask is not None:
        keys = key_mask.to(device=q.device, dtype=torch.bool)[:, None, :].expand(batch, heads, seq)
        valid = (torch.gather(keys, 2, order) & plan.kv_valid).reshape(batch * heads, length)
    n_blocks, width = plan.kv_indices.shape[-2:]
    out, lse, skipped = block_sparse_attention(
        q_k, k_k, v_k, plan.kv_indices.reshape(batch * heads, 1, n_blocks, width),
        plan.kv_counts.reshape(batch * heads, 1, n_blocks), plan.block_m, plan.block_n, scale=scale,
        kv_valid=valid, return_lse=True, backend=backend, validate=False,  # block lists validated when built
        skip_threshold=skip_threshold, skip_tile=skip_tile, return_skipped=True, quant=quant)
    back = (plan.head_inverses + (torch.arange(batch * heads, device=q.device) * length).view(batch, heads, 1))
    back = back.reshape(-1)
    out = out.reshape(batch * heads * length, dim).index_select(0, back).view(batch, heads, seq, dim)
    lse = lse.reshape(-1).index_select(0, back).view(batch, heads, seq)
    if query_mask is not None:
        out = out * query_mask.to(device=out.device, dtype=out.dtype)[:, None, :, None]
        lse = lse.masked_fill(~query_mask.to(device=lse.device, dtype=torch.bool)[:, None, :], float("-inf"))
    return out, lse, skipped.reshape(batch, heads)


def sample_errors(q, k, v, prepared, key_mask=None, scale=None):
    """Relative squared L2 error of each candidate on the sampled rows: float32 ``(B, H, P)``."""
    batch, heads, seq, dim = q.shape
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    n = prepared.samples.numel()
    masks = prepared.sample_masks
    q_s = q.index_select(2, prepared.samples).float()
    errors = torch.empty(batch, heads, masks.shape[0], dtype=torch.float32, device=q.device)
    tiny = torch.finfo(torch.float32).tiny
    chunk = max(1, _SCORE_BUDGET // max(1, batch * n * seq))
    for h0 in range(0, heads, chunk):  # chunks of heads bound the (B, h, n, S) scores
        h1 = min(heads, h0 + chunk)
        values = v[:, h0:h1].float()
        scores = torch.matmul(q_s[:, h0:h1], k[:, h0:h1].float().transpose(-1, -2)).mul_(scale)
        if key_mask is not None:
            scores.masked_fill_(~key_mask.to(torch.bool)[:, None, None, :], float("-inf"))
        peak = scores.amax(-1, keepdim=True)
        probs = scores.sub_(torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))).exp_()
        exact = torch.matmul(probs, values) / probs.sum(-1, keepdim=True).clamp_min(tiny)
        norm = exact.square().sum((-1, -2)).clamp_min(tiny)
        for p in range(masks.shape[0]):
            kept = probs * masks[p]
            approx = torch.matmul(kept, values) / kept.sum(-1, keepdim=True).clamp_min(tiny)
            errors[:, h0:h1, p] = (approx - exact).square().sum((-1, -2)) / norm
    return errors


@register_method
class SparseVideoGen(ReuseSelection, BlockSparseMethod):
    name = "svg"
    config_cls = SVGConfig
    default_options = {"dense_steps": 0.25, "dense_layers": 1}
    #: ``fastdit compare``'s tiny grid has 8 frames (8 x 32 x 48 tokens): 1/8 keeps one whole frame
    #: (spatial), 192 of 1536 positions (temporal) or every 8th block (textural); the CPU engine
    #: runs 128-token blocks faster than 64.
    tiny_options = {"block_size": 128, "density": 0.125}
    rank, auto_candidate, engine_geometry, cost_model = 40, True, "frames", "density"

    @classmethod
    def candidates(cls, layout):
        return [{"density": d} for d in (0.5, 0.3, 0.2, 0.1)]
    #: the quality guard's bound (relative L2 error per head) when ``guard`` is left empty
    guard_default = GUARD_DEFAULT

    def guard_levels(self):
        return 1

    def guard_widen_options(self, level):
        """One wider setting: twice the kept fraction of key blocks."""
        return {"density": min(1.0, 2 * self.config.density)}

    def prepare(self, layout, heads, device):
        return layout_plan(layout, self.config, device)

    #: per-head parts of a ``HeadOrderPlan`` (what reuse replaces at re-selected heads)
    reuse_fields = ("kv_indices", "kv_counts", "head_orders", "head_inverses", "choice")
    reuse_info = ("errors",)

    def fresh_select(self, ctx, q, k, v=None):
        """The ``HeadOrderPlan`` of this call (``select`` adds reuse across steps, ``reuse.py``). Heads
        are chosen by the error of the sampled outputs, which needs ``v``: passed here, or left in
        ``ctx.info["values"]`` by ``attend``."""
        v = ctx.info.get("values") if v is None else v
        if v is None:
            raise ValueError("svg chooses each head's pattern by the error of the sampled outputs: pass v")
        prepared = self.prepared(ctx.layout, ctx.total_heads or ctx.num_heads, q.device)
        if prepared is None:
            return None
        errors = sample_errors(q, k, v, prepared, key_mask=ctx.key_mask, scale=ctx.scale)
        choice = errors.argmin(-1)  # (B, H); the first candidate on ties
        order_id = prepared.pattern_order[choice]
        return HeadOrderPlan(
            kv_indices=prepared.kv_indices[choice], kv_counts=prepared.kv_counts[choice], block_m=prepared.block,
            block_n=prepared.block, seq_len=ctx.layout.seq_len, perm=prepared.orders[0], kv_valid=prepared.kv_valid,
            padding_fraction=prepared.orders.shape[1] / ctx.layout.seq_len - 1.0,
            name=f"svg_d{self.config.density:g}_b{prepared.block}", dynamic=True,
            info={"patterns": prepared.patterns, "errors": errors},
            head_orders=prepared.orders[order_id], head_inverses=prepared.inverses[order_id], choice=choice)

    def attend(self, ctx, q, k, v):
        """``BlockSparseMethod.attend`` (skip rule, cached correction), whose ``select(ctx, q, k)``
        gets ``v`` through this call's own ``ctx.info``; ``run_plan`` hands the plan its ``run``."""
        ctx.info["values"] = v
        try:
            return super().attend(ctx, q, k, v)
        finally:
            ctx.info.pop("values", None)
