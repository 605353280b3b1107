"""Error-aware routing with centroid compensation (``correction="ear"`` of every block-sparse method).

After SVG-EAR (Zhou, Mang, Yang et al., 2026, "SVG-EAR: Parameter-Free Linear Compensation for
Sparse Video Generation via Error-aware Routing", arXiv:2603.08982). Its two published ideas:

1. **Centroid compensation**: a skipped key block ``b`` (one of SVG2's semantic clusters there; here
   any plan block, clusters included) is summarised by its centroids, ``n_b`` copies of one key
   ``k_b`` (the block's mean valid key) carrying the mean value ``v_b``. This is exactly fastdit's
   ``correction="pooled"`` (``corrections.pooled_correction``), reused here unchanged.
2. **Error-aware routing**: which blocks to compute exactly is decided not by their attention mass
   but by how badly the centroid would stand in for them, per unit of cost: a cheap probe
   estimates each (query block, key block) pair's compensation error, and the blocks with the
   highest error-to-cost ratio are computed while the others are compensated.

The probe (fastdit's formulation; the paper's text was not available to us beyond its abstract and
project page, so the probe's exact form is ours and stated here): for query block ``a`` with mean
query ``q_a`` (its valid queries), scores ``s_aj = scale q_a . k_j`` against every valid key, and
with ``u_j = [v_j, 1]`` (value and a unit for the softmax mass)

    E_ab   = || sum_{j in b} exp(s_aj - m_a) u_j  -  n_b exp(scale q_a . k_b - m_a) [v_b, 1] ||
    err_ab = E_ab / sum_j exp(s_aj - m_a)                (m_a = max_j s_aj, for range only)
    ratio_ab = err_ab / c_b                              (c_b: the cost of computing b)

``c_b`` is what the engine pays for the block: ``block_n`` key slots for a fixed-size block
(padding slots included: the kernel walks them), the cluster's token count for a variable-size
(cluster) block

i.e. the exact error of centroid compensation for the block's *mean* query, on the numerator and
the denominator of the softmax at once, relative to the row's total mass. Routing keeps the
method's budget: for every (batch, head, query block) the key blocks are taken in decreasing
``ratio`` until their cost reaches what the method's own plan computed for that query block
(for fixed-size blocks: the same number of blocks), so ``correction="ear"`` runs at the density
the method chose (equal-density comparisons with ``"pooled"`` and ``"none"`` are fair by
construction). Blocks without a valid key are never routed. The routed plan is run on the engine
and the blocks it drops are compensated by centroids.

Cost: the probe scores every key against each query block's mean and scatters ``(D + 1)`` sums
into the key blocks, about ``2 / block_m`` of dense attention's FLOPs, in chunks of bounded
memory; the compensation is ``pooled``'s (``1 / block_n`` of dense). Under ring attention it is
refused like every correction (it needs the whole key range). ``ctx.info["routed_changed"]``: the
fraction of the method's kept block pairs that routing replaced (a device scalar).
"""
from __future__ import annotations

import copy

import torch

from . import POOLED_CHUNK_ELEMENTS, block_means, token_blocks


def _finite(x):
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x))


def grouped_index(key_block, n_kb, max_growth=4):
    """Each key block's model tokens side by side: long ``(B, H, n_kb, width)`` (``width`` the
    largest block; ``S`` marks an empty slot), or None when that would take more than
    ``max_growth`` times the sequence (very uneven clusters)."""
    batch, heads, seq = key_block.shape
    counts = torch.zeros(batch, heads, n_kb, dtype=torch.long, device=key_block.device).scatter_add_(
        2, key_block, torch.ones_like(key_block))
    width = int(counts.max()) if counts.numel() else 0
    if width == 0 or n_kb * width > max_growth * seq:
        return None
    order = torch.argsort(key_block, dim=-1, stable=True)
    sorted_blocks = torch.gather(key_block, 2, order)
    starts = counts.cumsum(-1) - counts
    slot = torch.arange(seq, device=key_block.device) - torch.gather(starts, 2, sorted_blocks)
    index = torch.full((batch, heads, n_kb * width), seq, dtype=torch.long, device=key_block.device)
    index.scatter_(2, sorted_blocks * width + slot, order)
    return index.view(batch, heads, n_kb, width)


def block_costs(plan, key_block, n_kb):
    """``c_b`` of the module doc, float32 broadcastable to ``(B, H, n_kb)``."""
    if getattr(plan, "token_blocks", None) is not None:  # clusters: the engine walks their tokens
        return torch.zeros(*key_block.shape[:2], n_kb, device=key_block.device).scatter_add_(
            2, key_block, torch.ones(key_block.shape, device=key_block.device))
    return torch.full((1, 1, n_kb), float(plan.block_n), device=key_block.device)


def compensation_error(q, k, v, plan, key_mask=None, query_mask=None, scale=None):
    """The probe of the module doc: ``(ratio, costs)``, float32 ``(B, H, n_qb, n_kb)`` (``-inf``
    for blocks without a valid key) and ``(B, H, n_kb)``."""
    batch, heads, seq, dim = q.shape
    device = q.device
    scale = dim ** -0.5 if scale is None else float(scale)
    query_block, key_block, dropped, n_kb = token_blocks(plan, batch, heads, seq, device)
    n_qb = dropped.shape[2]
    key_valid = torch.ones(batch, seq, device=device) if key_mask is None else key_mask.to(device, torch.float32)
    key_valid = key_valid[:, None, :].expand(batch, heads, seq)
    query_valid = torch.ones(batch, seq, device=device) if query_mask is None else query_mask.to(device, torch.float32)
    query_valid = query_valid[:, None, :].expand(batch, heads, seq)
    q_mean, q_counts = block_means(q, query_block, query_valid, n_qb)
    empty_rows = q_counts == 0  # a query block with no valid query (padding): probe its plain mean
    if empty_rows.any():
        q_plain, _ = block_means(q, query_block, torch.ones_like(query_valid), n_qb)
        q_mean = torch.where(empty_rows.unsqueeze(-1), q_plain, q_mean)
    k_mean, k_counts = block_means(k, key_block, key_valid, n_kb)
    v_mean, _ = block_means(v, key_block, key_valid, n_kb)
    key_dead = key_valid == 0
    log_counts = torch.where(k_counts > 0, k_counts.log(), torch.full_like(k_counts, float("-inf"))).unsqueeze(2)
    costs = block_costs(plan, key_block, n_kb).expand(batch, heads, n_kb)
    groups = grouped_index(key_block, n_kb)
    if groups is None:  # very uneven clusters: one (query block, key) score matrix, summed by scatter
        index, width = key_block.unsqueeze(2), seq
    else:  # every key block's tokens side by side: batched matmuls (pad slots point at a zero row)
        width = groups.shape[-1]
        k, v = (torch.cat([x.float(), x.new_zeros(batch, heads, 1, dim, dtype=torch.float32)], 2) for x in (k, v))
        key_dead = torch.cat([key_dead, key_dead.new_ones(batch, heads, 1)], 2)
        flat = groups.reshape(batch, heads, -1)
        k, v = (torch.gather(x, 2, flat.unsqueeze(-1).expand(-1, -1, -1, dim)).view(batch, heads, n_kb, width, dim)
                for x in (k, v))
        key_dead = torch.gather(key_dead, 2, flat).view(batch, heads, n_kb, width)
    ratio = torch.empty(batch, heads, n_qb, n_kb, device=device)
    chunk = max(1, POOLED_CHUNK_ELEMENTS // max(1, batch * heads * n_kb * width * (1 if groups is not None else dim)))
    for start in range(0, n_qb, chunk):  # bounded memory: query blocks in chunks
        rows = slice(start, min(start + chunk, n_qb))
        probe = q_mean[:, :, rows]
        if groups is None:
            scores = torch.matmul(probe, k.float().transpose(-1, -2)).mul_(scale)  # (B, H, c, S)
            scores = scores.masked_fill(key_dead.unsqueeze(2), float("-inf"))
            peak = _finite(scores.amax(-1, keepdim=True))
            weights = torch.exp(scores - peak)
            units = torch.cat([v.float(), torch.ones(batch, heads, seq, 1, device=device)], -1)
            exact = torch.zeros(batch, heads, weights.shape[2], n_kb, dim + 1, device=device).scatter_add_(
                3, index.expand(-1, -1, weights.shape[2], -1).unsqueeze(-1).expand(-1, -1, -1, -1, dim + 1),
                weights.unsqueeze(-1) * units.unsqueeze(2))
            exact_v, exact_mass = exact[..., :dim], exact[..., dim]
        else:
            scores = torch.einsum("bhcd,bhknd->bhckn", probe, k).mul_(scale)  # (B, H, c, n_kb, width)
            scores = scores.masked_fill(key_dead.unsqueeze(2), float("-inf"))
            peak = _finite(scores.amax((-1, -2)))[..., None]  # (B, H, c, 1)
            weights = torch.exp(scores - peak.unsqueeze(-1))
            exact_v = torch.einsum("bhckn,bhknd->bhckd", weights, v)
            exact_mass = weights.sum(-1)
        total = exact_mass.sum(-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
        centroid = torch.exp(torch.matmul(probe, k_mean.transpose(-1, -2)).mul_(scale).add_(log_counts) - peak)
        error_sq = (exact_v - centroid.unsqueeze(-1) * v_mean.unsqueeze(2)).square().sum(-1)
        error = (error_sq + (exact_mass - centroid).square()).sqrt() / total
        ratio[:, :, rows] = error / costs.clamp(min=1.0).unsqueeze(2)
    return ratio.masked_fill(k_counts.unsqueeze(2) == 0, float("-inf")), costs


def route_plan(q, k, v, plan, key_mask=None, query_mask=None, scale=None):
    """The plan with its key blocks re-chosen by error-to-cost ratio at the same key budget per
    (batch, head, query block) (see the module doc). Returns ``(routed_plan, changed)``:
    ``changed`` is the fraction of the original kept block pairs that were replaced (a device
    scalar). Every other attribute of the plan (token order, block sizes, clusters) is kept."""
    batch, heads, seq, _ = q.shape
    ratio, costs = compensation_error(q, k, v, plan, key_mask, query_mask, scale)
    _, _, dropped, n_kb = token_blocks(plan, batch, heads, seq, q.device)
    kept = (~dropped).expand(batch, heads, -1, -1)
    sizes = costs.unsqueeze(2).expand_as(ratio)  # (B, H, n_qb, n_kb)
    routable = torch.isfinite(ratio)
    budget = (kept & routable).mul(sizes).sum(-1, keepdim=True)  # the method's own cost per query block
    order = torch.argsort(ratio, dim=-1, descending=True, stable=True)
    ordered_sizes = torch.gather(sizes, -1, order)
    before = ordered_sizes.cumsum(-1) - ordered_sizes  # cost taken before this block
    take = (before < budget) & torch.gather(routable, -1, order)
    routed = torch.zeros_like(kept).scatter_(-1, order, take)
    counts = routed.sum(-1)
    width = max(1, int(counts.max()))
    # kept blocks first, in increasing block order (what the engine and the cut plans expect)
    keys = (~routed).long() * n_kb + torch.arange(n_kb, device=q.device)
    indices = torch.sort(keys, dim=-1).values[..., :width]
    indices = torch.where(torch.arange(width, device=q.device) < counts.unsqueeze(-1), indices,
                          torch.zeros_like(indices))
    changed = (kept & ~routed).sum() / kept.sum().clamp(min=1)
    routed_plan = copy.copy(plan)
    routed_plan.__dict__.pop("density", None)  # a cached property of the original plan
    routed_plan.kv_indices = indices.to(torch.int32).contiguous()
    routed_plan.kv_counts = counts.to(torch.int32).contiguous()
    routed_plan.name = f"{plan.name}_ear"
    routed_plan.dynamic = True
    return routed_plan, changed
