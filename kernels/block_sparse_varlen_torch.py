"""PyTorch fallback of variable-size block-sparse attention: exact, and fast on the CPU.

Batch and heads are folded into ``G = B * H`` groups, each with its own blocks. Within a group the
query blocks are independent, so their order is free: each group sorts its query blocks by size,
largest first, and step ``r`` of the loop computes the ``r``-th largest block of *every* group in
one batched call::

    for rank r:                                   (Mq steps, like the fixed path's Mq blocks)
        rows_g  = rows of group g's r-th largest query block, padded to R_r = max_g |rows_g|
        keys_g  = concat of the key blocks it lists, padded to L_r = max_g |keys_g|
        out, lse = softmax attention of rows_g over keys_g (padding keys and kv_valid-False keys
                   masked); padding rows are computed and dropped

Sorting pairs blocks of similar size across groups, so the padding stays small: on random
boundaries (sorted uniform cuts, mean 64 or 128 tokens, 8 groups) the computed pairs were 1.12x to
1.28x the attended ones, and ``python -m fastdit.eval.bench.varlen`` (N=12288, D=64, 8 heads,
density 0.25; three runs on a busy 2-core CPU, one or two threads) timed this path at 1.15x to
1.35x the fixed path's time at equal density, and 1.0x to 1.3x on the fixed form's own
boundaries (the per-step index work). A first version rewrote
the plan as a fixed-size one over a padded token order (every block padded to a multiple of a base
block) and ran the fixed path: exact too, but 2.5x the fixed path's time (N=4096), because small
base blocks multiply the loop steps and their key gathers.

Each step is one call of torch's fused CPU flash attention (``_fused_cpu_block`` of the fixed
path, which also gives the log-sum-exp); elsewhere (a GPU without Triton) a float32 masked softmax.
Host syncs: the block sizes and list lengths are read once per call. Rows with no attended key
get output 0 and ``lse = -inf``.
"""
from __future__ import annotations

import torch

from .block_sparse_torch import _CPU_FLASH, _fused_cpu_block


def _masked_block(q_blk, keys, values, ok, scale):
    """``(out, lse)`` of one step in float32 (no fused kernel): ``ok`` ``(G, 1, L)`` or None."""
    scores = torch.matmul(q_blk.float(), keys.float().transpose(-1, -2)) * scale
    if ok is not None:
        scores = scores.masked_fill(~ok.unsqueeze(2), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    shift = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    probs = torch.exp(scores - shift.unsqueeze(-1))  # rows with no key: exp(-inf) = 0
    return torch.matmul(probs, values.float()).to(q_blk.dtype), lse


def block_sparse_attention_varlen_torch(q, k, v, q_offsets, k_offsets, kv_indices, kv_counts, scale, kv_valid,
                                        fused=None):
    """See ``fastdit.kernels.block_sparse_attention_varlen``; inputs already checked and validated.
    ``fused``: use torch's fused CPU kernel (default: on CPU tensors when it exists). Returns
    ``(out, lse)``: out in q's dtype ``(B, H, N, D)``, lse float32 ``(B, H, N)``."""
    batch, heads, n_q, dim = q.shape
    groups = batch * heads
    out = torch.zeros(groups * n_q, dim, dtype=q.dtype, device=q.device)
    lse = torch.full((groups * n_q,), float("-inf"), dtype=torch.float32, device=q.device)
    if fused is None:
        fused = _CPU_FLASH is not None and q.device.type == "cpu"
    attend = _fused_cpu_block if fused else _masked_block
    q_tab, k_tab, v_tab = (t.reshape(-1, dim) for t in (q, k, v))                  # (G * tokens, D) tables
    for rows, row_ok, cols, ok in varlen_steps(q, k, q_offsets, k_offsets, kv_indices, kv_counts, kv_valid):
        n_rows, n_cols = rows.shape[1], cols.numel() // groups
        q_blk = q_tab.index_select(0, rows.reshape(-1)).view(groups, 1, n_rows, dim)
        keys = k_tab.index_select(0, cols).view(groups, 1, n_cols, dim)
        values = v_tab.index_select(0, cols).view(groups, 1, n_cols, dim)
        blk_out, blk_lse = attend(q_blk, keys, values, None if ok is None else ok.unsqueeze(1), scale)
        keep = row_ok.reshape(-1)
        dest = rows.reshape(-1)[keep]
        out.index_copy_(0, dest, blk_out.reshape(-1, dim)[keep])
        lse.index_copy_(0, dest, blk_lse.reshape(-1)[keep].float())
    return out.view(batch, heads, n_q, dim), lse.view(batch, heads, n_q)


def varlen_steps(q, k, q_offsets, k_offsets, kv_indices, kv_counts, kv_valid):
    """The loop of the module docstring, shared by the forward and the backward
    (``block_sparse_bwd_torch.py``): yields ``(rows, row_ok, cols, ok)`` per step, ``rows`` int64
    ``(G, R)`` rows of the ``(G * N, D)`` query table (padding rows: the group's row 0, with
    ``row_ok`` False), ``cols`` int64 ``(G * L,)`` rows of the ``(G * Nk, D)`` key table (padding:
    the group's key 0) and ``ok`` ``(G, L)`` bool (None when every key is real and valid)."""
    batch, heads, n_q, dim = q.shape
    n_k = k.shape[2]
    device = q.device
    groups = batch * heads
    if n_k == 0 or groups * n_q == 0 or kv_indices.shape[-1] == 0:
        return

    def per_group(t):
        return t.long().expand(batch, heads, *t.shape[2:]).reshape(groups, *t.shape[2:])

    q_off, k_off, idx, cnt = (per_group(t) for t in (q_offsets, k_offsets, kv_indices, kv_counts))
    width = idx.shape[-1]
    q_size = q_off[:, 1:] - q_off[:, :-1]                                          # (G, Mq)
    k_size = k_off[:, 1:] - k_off[:, :-1]                                          # (G, Mk)
    slot_ok = torch.arange(width, device=device) < cnt.unsqueeze(-1)               # (G, Mq, W)
    blocks = torch.where(slot_ok, idx, torch.zeros_like(idx)).reshape(groups, -1)
    per_slot = torch.where(slot_ok, k_size.gather(1, blocks).view_as(idx), torch.zeros_like(idx))
    slot_end = per_slot.cumsum(-1)                                                 # keys up to each slot
    n_keys = slot_end[..., -1]                                                     # (G, Mq) keys per list
    group = torch.arange(groups, device=device)
    q_rows0, k_rows0 = (group * n_q).unsqueeze(-1), (group * n_k).unsqueeze(-1)
    # key t of a list lies in the slot s with slot_end[s - 1] <= t < slot_end[s]: the key-table row
    # first_key[s] - slot_start[s] + t (+ the group's base)
    key_shift = k_off.gather(1, blocks).view_as(idx) - (slot_end - per_slot) + k_rows0.unsqueeze(-1)

    # everything the loop reads, rank-major ((Mq, G, ...): step r reads views, no indexing op)
    order = torch.argsort(q_size, dim=1, descending=True, stable=True)             # rank -> block, per group

    def by_rank(t):  # (G, Mq, ...) -> (Mq, G, ...), block order -> rank order
        index = order.view(*order.shape, *([1] * (t.dim() - 2))).expand_as(t)
        return t.gather(1, index).transpose(0, 1).contiguous()

    q_size_r, n_keys_r = by_rank(q_size), by_rank(n_keys)
    q_start_r = by_rank(q_off[:, :-1]) + q_rows0.t()
    slot_end_r, key_shift_r = by_rank(slot_end), by_rank(key_shift)
    sizes_by_rank = torch.stack([q_size_r.amax(1), n_keys_r.amax(1), n_keys_r.amin(1)]).tolist()  # one sync
    key_valid = None
    if kv_valid is not None:
        key_valid = kv_valid.to(torch.bool)[:, None, :].expand(batch, heads, n_k).reshape(-1)
    arange = torch.arange(max(max(sizes_by_rank[0]), max(sizes_by_rank[1])), device=device)

    for r, (n_rows, n_cols, n_cols_min) in enumerate(zip(*sizes_by_rank)):
        if n_rows == 0:
            break  # every later block is empty too
        if n_cols == 0:
            continue  # no group's block lists a key: rows stay 0 / -inf
        row = arange[:n_rows]
        row_ok = row < q_size_r[r].unsqueeze(-1)                                   # (G, R)
        rows = torch.where(row_ok, q_start_r[r].unsqueeze(-1) + row, q_rows0)       # padding rows: row 0
        t = arange[:n_cols].expand(groups, n_cols).contiguous()
        slot = torch.searchsorted(slot_end_r[r], t, right=True).clamp_(max=width - 1)
        col_ok = t < n_keys_r[r].unsqueeze(-1)                                     # (G, L)
        cols = torch.where(col_ok, key_shift_r[r].gather(1, slot) + t, k_rows0).reshape(-1)  # padding: key 0
        ok = None
        if key_valid is not None:
            ok = col_ok & key_valid.index_select(0, cols).view(groups, n_cols)
        elif n_cols_min != n_cols:
            ok = col_ok
        yield rows, row_ok, cols, ok
