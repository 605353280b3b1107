"""Corrections for the key blocks a block plan drops (``correction=`` of every block-sparse method).

Notation, per (batch, head, query i): the plan computes the keys ``C_i`` and drops ``D_i`` (the
key blocks not listed for i's query block). With ``Z_X = sum_{j in X} exp(s_ij)`` and ``O_X`` the
softmax-weighted mean of ``v_j`` over ``X``, dense attention is exactly

    O = a O_C + (1 - a) O_D,        a = Z_C / (Z_C + Z_D),     lse = log(Z_C + Z_D)

The sparse engine gives ``O_C`` and ``lse_C = log Z_C``; both corrections estimate the dropped
part and merge it through the log-sum-exp.

``"pooled"`` (after Rectified SpaAttn, 2025, "Revisiting Attention Sparsity for Efficient Video
Generation", which rectifies the attention given to unselected blocks with pooled block
representatives): each dropped key block ``b`` (a fixed-size run of the kernel order, or one of
svg2's key clusters) stands in as ``n_b`` copies of one token
with the block's mean key ``k_b`` and mean value ``v_b`` (``n_b`` = its valid keys; padding slots
and masked keys excluded), so ``Z_D ~ sum_b n_b exp(scale q_i . k_b)`` and ``O_D`` the matching
mix of the ``v_b``. A block with no valid key contributes nothing; with nothing dropped the output
is the sparse output unchanged (bit for bit). Work: one score per (query, dropped key block),
``1 / block_n`` of dense attention's scores, computed in query chunks of bounded memory.

``"cached"`` (after Re-ttention, Chen et al., 2025: "Ultra Sparse Visual Generation via Attention
Statistical Reshape"): on a refresh step the call runs the plan *and its complement* (the dropped
blocks, as a second block plan), so it gets ``O_C, Z_C`` and ``O_D, Z_D`` for the price of one
dense attention; the output is their exact merge (dense attention, up to float rounding), and per
layer, branch and head it stores the residual ``R = O - a O_C = (1 - a) O_D`` together with the
captured mass, as ``lse`` and ``log Z_D``. On the following sparse steps (fresh ``O_C'``,
``Z_C'``) the dropped mass is taken from the refresh step and the mix re-weighted:

    a' = Z_C' / (Z_C' + Z_D),      O' = a' O_C' + (1 - a') / (1 - a) R
                                      = a' O_C' + exp(lse - log(Z_C' + Z_D)) R

Re-ttention's own rule is ``O' = rho O_C' + R`` with ``rho = a`` frozen at the refresh step (plus
a hand-set drift of rho per step); re-estimating ``a'`` from the fresh sparse log-sum-exp and the
cached dropped mass needs no drift parameter and reduces to it when the sparse mass does not
change. Unchanged inputs give ``O' = O`` exactly. Memory: ``R`` is one output-sized tensor per
layer and CFG branch (in the output dtype) plus two float32 ``(B, H, S)`` statistics.
"""
from __future__ import annotations

import dataclasses

import torch

#: Upper bound on (batch * heads * queries * dropped-block) scores held at once by "pooled".
POOLED_CHUNK_ELEMENTS = 1 << 26


def computed_block_mask(plan):
    """Bool ``(1|B, 1|H, n_q_blocks, n_kv_blocks)``: True where the plan computes the block pair."""
    idx = plan.kv_indices.long()
    n_kb = plan.num_kv_blocks
    used = torch.arange(idx.shape[-1], device=idx.device) < plan.kv_counts.long().unsqueeze(-1)
    mask = torch.zeros(idx.shape[:3] + (n_kb + 1,), dtype=torch.bool, device=idx.device)
    mask.scatter_(-1, torch.where(used, idx, n_kb), True)  # unused slots land in the spare column
    return mask[..., :n_kb]


def complement_plan(plan):
    """The plan of the key blocks ``plan`` drops (same token order, blocks and padding): the
    dropped blocks in increasing order, then unused slots."""
    mask = computed_block_mask(plan)
    order = torch.sort(mask.to(torch.int8), dim=-1, stable=True).indices  # dropped (0) first
    counts = (~mask).sum(-1)
    return dataclasses.replace(plan, kv_indices=order.to(torch.int32).contiguous(),
                               kv_counts=counts.to(torch.int32).contiguous(), name=f"{plan.name}_complement")


def merge_lse(out_a, lse_a, out_b, lse_b):
    """Exact merge of two attentions over disjoint key sets: ``(out, lse)`` in float32. Rows
    where one side has no key keep the other side as it is."""
    lse = torch.logaddexp(lse_a, lse_b)
    live = torch.isfinite(lse)
    safe = torch.where(live, lse, torch.zeros_like(lse))
    w_a = torch.where(live, torch.exp(lse_a - safe), torch.zeros_like(lse))
    w_b = torch.where(live, torch.exp(lse_b - safe), torch.zeros_like(lse))
    out = w_a.unsqueeze(-1) * out_a.float() + w_b.unsqueeze(-1) * out_b.float()
    return out, lse


def _kernel_positions(plan, batch, heads, seq, device):
    """Kernel position of every model token, ``(B, H, S)`` (an expanded view): one order for all
    heads, or each head's own (plans with ``head_inverses``, e.g. svg's)."""
    per_head = getattr(plan, "head_inverses", None)
    if per_head is not None:
        return per_head.to(device).expand(batch, heads, seq)
    if plan.inverse is not None:
        return plan.inverse.to(device).expand(batch, heads, seq)
    return torch.arange(seq, device=device).expand(batch, heads, seq)


def token_blocks(plan, batch, heads, seq, device):
    """``(query_block, key_block, dropped, n_kb)``: each model token's query and key block
    ``(B, H, S)``, the dropped block pairs bool ``(1|B, 1|H, n_q_blocks, n_kb)`` and the number of
    key blocks. Plans whose blocks are not fixed-size runs of a kernel order (svg2's clusters)
    provide their own ``token_blocks(batch, heads, seq)``."""
    own = getattr(plan, "token_blocks", None)
    if own is not None:
        return own(batch, heads, seq)
    positions = _kernel_positions(plan, batch, heads, seq, device)
    return (positions // plan.block_m, positions // plan.block_n, ~computed_block_mask(plan), plan.num_kv_blocks)


def block_means(x, blocks, weights, n_blocks):
    """Mean of ``x`` ``(B, H, S, D)`` over each block (``blocks`` ``(B, H, S)``), weighted by
    ``weights`` ``(B, H, S)`` (1 valid, 0 not); float32 ``(B, H, n_blocks, D)`` and the counts."""
    batch, heads, _, dim = x.shape
    counts = torch.zeros(batch, heads, n_blocks, device=x.device).scatter_add_(2, blocks, weights)
    index = blocks.unsqueeze(-1).expand(-1, -1, -1, dim)
    sums = torch.zeros(batch, heads, n_blocks, dim, device=x.device)
    sums.scatter_add_(2, index, x.float() * weights[..., None])
    return sums / counts.clamp(min=1.0).unsqueeze(-1), counts


def pooled_correction(q, k, v, plan, out, lse, key_mask=None, query_mask=None, scale=None):
    """``out`` (model order, the plan's sparse result with its ``lse``) merged with the pooled
    dropped key blocks (see the module doc). Returns the corrected ``(B, H, S, D)`` in out's dtype."""
    batch, heads, seq, dim = q.shape
    device = q.device
    scale = dim ** -0.5 if scale is None else float(scale)
    query_block, key_block, dropped, n_kb = token_blocks(plan, batch, heads, seq, device)
    valid = torch.ones(batch, seq, device=device) if key_mask is None else key_mask.to(device, torch.float32)
    valid = valid[:, None, :].expand(batch, heads, seq)
    k_mean, counts = block_means(k, key_block, valid, n_kb)  # counts: valid keys per block
    v_mean, _ = block_means(v, key_block, valid, n_kb)
    log_counts = torch.where(counts > 0, counts.log(), torch.full_like(counts, float("-inf"))).unsqueeze(2)
    dropped = dropped.expand(batch, heads, -1, -1)  # (B, H, n_qb, n_kb)

    corrected = torch.empty_like(out)
    chunk = max(1, POOLED_CHUNK_ELEMENTS // max(1, batch * heads * n_kb))
    for start in range(0, seq, chunk):  # bounded memory: a few chunks even at 100k tokens
        rows = slice(start, min(start + chunk, seq))
        scores = torch.matmul(q[:, :, rows].float(), k_mean.transpose(-1, -2)).mul_(scale).add_(log_counts)
        row_blocks = query_block[:, :, rows].unsqueeze(-1).expand(-1, -1, -1, n_kb)
        scores = scores.masked_fill(~torch.gather(dropped, 2, row_blocks), float("-inf"))
        lse_d = torch.logsumexp(scores, dim=-1)  # -inf where nothing is dropped
        probs = torch.exp(scores - torch.where(torch.isfinite(lse_d), lse_d, torch.zeros_like(lse_d)).unsqueeze(-1))
        out_d = torch.matmul(probs, v_mean)
        merged, _ = merge_lse(out[:, :, rows], lse[:, :, rows], out_d, lse_d)
        # rows with nothing dropped keep the sparse output exactly
        corrected[:, :, rows] = torch.where(torch.isfinite(lse_d).unsqueeze(-1), merged.to(out.dtype), out[:, :, rows])
    if query_mask is not None:
        corrected = corrected * query_mask.to(device=device, dtype=out.dtype)[:, None, :, None]
    return corrected


def cached_store(state, out_full, lse_full, out_dropped, lse_dropped, dtype):
    """Keep what a refresh step learnt: ``R = (1 - a) O_D`` and the masses (see the module doc)."""
    live = torch.isfinite(lse_full)
    share = torch.where(live, torch.exp(lse_dropped - torch.where(live, lse_full, torch.zeros_like(lse_full))),
                        torch.zeros_like(lse_full))
    state["cached_correction"] = {
        "residual": (share.unsqueeze(-1) * out_dropped.float()).to(dtype),
        "lse_full": lse_full.float(),
        "lse_dropped": lse_dropped.float(),
    }


def cached_entry(state, out):
    """The stored refresh of this layer, or None when there is none for this call's shape."""
    entry = state.get("cached_correction")
    if entry is None or entry["residual"].shape != out.shape or entry["residual"].device != out.device:
        return None
    return entry


def cached_apply(entry, out, lse, query_mask=None):
    """A sparse step: ``a' O_C' + exp(lse_refresh - log(Z_C' + Z_D)) R`` (see the module doc)."""
    total = torch.logaddexp(lse, entry["lse_dropped"])
    live = torch.isfinite(total)
    safe = torch.where(live, total, torch.zeros_like(total))
    share = torch.where(live, torch.exp(lse - safe), torch.zeros_like(total))
    factor = torch.where(live & torch.isfinite(entry["lse_full"]), torch.exp(entry["lse_full"] - safe),
                         torch.zeros_like(total))
    corrected = share.unsqueeze(-1) * out.float() + factor.unsqueeze(-1) * entry["residual"].float()
    # a row with no computed key and no dropped mass keeps the engine's 0
    corrected = corrected.to(out.dtype)
    if query_mask is not None:
        corrected = corrected * query_mask.to(device=out.device, dtype=out.dtype)[:, None, :, None]
    return corrected
