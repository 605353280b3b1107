"""PyTorch fallback backward of block-sparse attention (fixed-size and variable-size plans).

The gradient of ``out_i = sum_j P_ij v_j`` and ``lse_i = log sum_j exp(s_ij)`` with
``s_ij = scale * q_i . k_j`` over the attended set ``A(i)`` and ``P_ij = exp(s_ij - lse_i)`` (the
FlashAttention-2 backward, Dao 2023, eq. in section 3.1 written with the log-sum-exp)::

    delta_i = sum_d dout_id * out_id  -  dlse_i
    dP_ij   = dout_i . v_j
    dS_ij   = P_ij * (dP_ij - delta_i)                      (j in A(i); 0 elsewhere)
    dq_i    = scale * sum_j dS_ij k_j
    dk_j    = scale * sum_i dS_ij q_i
    dv_j    = sum_i P_ij dout_i

``P`` is recomputed from the saved ``lse`` (no softmax is stored by the forward); a row with no
attended key (``lse = -inf``) has ``P = 0`` and contributes nothing. The ``dlse`` term makes the
gradient exact also for callers that use the log-sum-exp (merging partial attentions).

The loops gather exactly the keys the forward gathers (one query block, or one rank of
variable-size blocks, at a time: memory stays ``O(block x attended keys)``), compute in float32
(float64 for float64 inputs, so ``torch.autograd.gradcheck`` can check the formulas) and add the
key / value gradients back with ``index_add_`` (deterministic on the CPU). Padding slots point at a
real key with a mask that zeroes ``P``, so their additions are exact zeros.
"""
from __future__ import annotations

import torch

from .block_sparse_varlen_torch import varlen_steps


def compute_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def softmax_delta(dout, out, dlse, compute):
    """``delta_i = dout_i . out_i - dlse_i`` in ``compute`` dtype, shape ``(B, H, N)``."""
    delta = (dout.to(compute) * out.to(compute)).sum(-1)
    if dlse is not None:
        delta = delta - dlse.to(compute)
    return delta


def block_backward(q_blk, keys, values, ok, lse_blk, dout_blk, delta_blk, scale):
    """``(dq, dkeys, dvalues)`` of one step: ``q_blk`` / ``dout_blk`` ``(..., R, D)``, ``keys`` /
    ``values`` ``(..., L, D)``, ``ok`` ``(..., L)`` bool or None, ``lse_blk`` / ``delta_blk``
    ``(..., R)``; all in the compute dtype."""
    scores = torch.matmul(q_blk, keys.transpose(-1, -2)) * scale
    # rows without a key: lse = -inf; subtracting +inf makes P = 0 there (never NaN)
    shift = torch.where(lse_blk == float("-inf"), torch.full_like(lse_blk, float("inf")), lse_blk)
    probs = torch.exp(scores - shift.unsqueeze(-1))
    if ok is not None:
        probs = probs.masked_fill(~ok.unsqueeze(-2), 0.0)
    dprobs = torch.matmul(dout_blk, values.transpose(-1, -2))
    dscores = probs * (dprobs - delta_blk.unsqueeze(-1))
    dq = torch.matmul(dscores, keys) * scale
    dkeys = torch.matmul(dscores.transpose(-1, -2), q_blk) * scale
    dvalues = torch.matmul(probs.transpose(-1, -2), dout_blk)
    return dq, dkeys, dvalues


def block_sparse_attention_backward_torch(dout, dlse, q, k, v, out, lse, kv_indices, kv_counts, block_m, block_n,
                                          scale, kv_valid):
    """``(dq, dk, dv)`` in the dtypes of ``q``, ``k``, ``v`` for ``block_sparse_attention`` (plan
    ``(B|1, H|1, Mq, W)``, validated); ``dlse`` may be None (the log-sum-exp unused)."""
    batch, heads, n_q, dim = q.shape
    n_k = k.shape[2]
    compute = compute_dtype(q.dtype)
    device = q.device
    dq = torch.zeros(batch, heads, n_q, dim, dtype=compute, device=device)
    n_kblocks = -(-n_k // block_n) if n_k else 0
    n_tok = n_kblocks * block_n
    dk_table = torch.zeros(batch * heads * n_tok, dim, dtype=compute, device=device)
    dv_table = torch.zeros_like(dk_table)
    if n_k == 0 or batch * heads * n_q == 0:
        return dq.to(q.dtype), torch.zeros_like(k), torch.zeros_like(v)
    pad = n_tok - n_k
    k_table = torch.nn.functional.pad(k, (0, 0, 0, pad)).to(compute).reshape(-1, dim)
    v_table = torch.nn.functional.pad(v, (0, 0, 0, pad)).to(compute).reshape(-1, dim)
    key_ok = (torch.arange(n_tok, device=device) < n_k).expand(batch, -1)
    if kv_valid is not None:
        key_ok = key_ok & torch.nn.functional.pad(kv_valid.to(torch.bool), (0, pad)).expand(batch, -1)
    ok_table = key_ok[:, None].expand(batch, heads, n_tok).reshape(-1)
    delta = softmax_delta(dout, out, dlse, compute)
    dout_c, q_c = dout.to(compute), q.to(compute)
    idx = kv_indices.long().expand(batch, heads, *kv_indices.shape[2:])
    cnt = kv_counts.long().expand(batch, heads, kv_counts.shape[2])
    widths = cnt.amax(dim=(0, 1)).tolist()  # one host sync
    base = (torch.arange(batch * heads, device=device) * n_tok).view(batch, heads, 1, 1)
    in_block = torch.arange(block_n, device=device)
    for m, width in enumerate(widths):
        if width == 0:
            continue
        q0, q1 = m * block_m, min((m + 1) * block_m, n_q)
        slot_ok = torch.arange(width, device=device) < cnt[:, :, m].unsqueeze(-1)      # (B, H, W)
        blocks = torch.where(slot_ok, idx[:, :, m, :width], torch.zeros_like(idx[:, :, m, :width]))
        rows = (base + blocks[..., None] * block_n + in_block).reshape(-1)              # (B, H, W, block_n)
        length = width * block_n
        keys = k_table.index_select(0, rows).view(batch, heads, length, dim)
        values = v_table.index_select(0, rows).view(batch, heads, length, dim)
        ok = (ok_table.index_select(0, rows).view(batch, heads, width, block_n) & slot_ok.unsqueeze(-1))
        dq_blk, dkeys, dvalues = block_backward(
            q_c[:, :, q0:q1], keys, values, ok.reshape(batch, heads, length), lse[:, :, q0:q1].to(compute),
            dout_c[:, :, q0:q1], delta[:, :, q0:q1], scale,
        )
        dq[:, :, q0:q1] = dq_blk
        dk_table.index_add_(0, rows, dkeys.reshape(-1, dim))
        dv_table.index_add_(0, rows, dvalues.reshape(-1, dim))
    dk = dk_table.view(batch, heads, n_tok, dim)[:, :, :n_k]
    dv = dv_table.view(batch, heads, n_tok, dim)[:, :, :n_k]
    return dq.to(q.dtype), dk.to(k.dtype).contiguous(), dv.to(v.dtype).contiguous()


def block_sparse_attention_varlen_backward_torch(dout, dlse, q, k, v, out, lse, q_offsets, k_offsets, kv_indices,
                                                 kv_counts, scale, kv_valid):
    """``(dq, dk, dv)`` for ``block_sparse_attention_varlen``: the forward's steps (``varlen_steps``,
    every group's r-th largest query block at once), each differentiated by ``block_backward``."""
    batch, heads, n_q, dim = q.shape
    n_k = k.shape[2]
    compute = compute_dtype(q.dtype)
    groups = batch * heads
    dq = torch.zeros(groups * n_q, dim, dtype=compute, device=q.device)
    dk = torch.zeros(groups * n_k, dim, dtype=compute, device=q.device)
    dv = torch.zeros_like(dk)
    delta = softmax_delta(dout, out, dlse, compute).reshape(-1)
    q_tab, k_tab, v_tab, do_tab = (t.to(compute).reshape(-1, dim) for t in (q, k, v, dout))
    lse_tab = lse.to(compute).reshape(-1)
    for rows, row_ok, cols, ok in varlen_steps(q, k, q_offsets, k_offsets, kv_indices, kv_counts, kv_valid):
        n_rows, n_cols = rows.shape[1], cols.numel() // groups
        flat = rows.reshape(-1)
        live = row_ok.reshape(-1, 1).to(compute)
        # padding rows repeat a real row: their dout and delta are zeroed, so they add nothing
        q_blk = q_tab.index_select(0, flat).view(groups, n_rows, dim)
        do_blk = (do_tab.index_select(0, flat) * live).view(groups, n_rows, dim)
        delta_blk = (delta.index_select(0, flat) * live[:, 0]).view(groups, n_rows)
        lse_blk = torch.where(row_ok.reshape(-1), lse_tab.index_select(0, flat),
                              torch.full_like(lse_tab[:1], float("-inf"))).view(groups, n_rows)
        keys = k_tab.index_select(0, cols).view(groups, n_cols, dim)
        values = v_tab.index_select(0, cols).view(groups, n_cols, dim)
        dq_blk, dkeys, dvalues = block_backward(q_blk, keys, values, ok, lse_blk, do_blk, delta_blk, scale)
        keep = row_ok.reshape(-1)
        dq.index_add_(0, flat[keep], dq_blk.reshape(-1, dim)[keep])
        dk.index_add_(0, cols, dkeys.reshape(-1, dim))
        dv.index_add_(0, cols, dvalues.reshape(-1, dim))
    return (dq.view(batch, heads, n_q, dim).to(q.dtype), dk.view(batch, heads, n_k, dim).to(k.dtype),
            dv.view(batch, heads, n_k, dim).to(v.dtype))


def transpose_plan(kv_indices, kv_counts, n_kblocks):
    """``(q_indices, q_counts)`` of a plan ``(B|1, H|1, Mq, W)``: for each key block ``j``, the query
    blocks that list it, ascending: ``q_indices`` int32 ``(B|1, H|1, Mk, Mq)`` (the first
    ``q_counts[..., j]`` entries used; the width ``Mq`` bounds any count because a row lists a
    block at most once) and ``q_counts`` int32 ``(B|1, H|1, Mk)``. Torch ops on the plan's device,
    no host sync: each used slot becomes the sort key ``j * Mq + m``, unused slots sort last."""
    pb, ph, n_qblocks, width = kv_indices.shape
    device = kv_indices.device
    used = torch.arange(width, device=device) < kv_counts.long().unsqueeze(-1)              # (P.., Mq, W)
    block = torch.where(used, kv_indices.long(), torch.full_like(kv_indices, n_kblocks, dtype=torch.long))
    rows = torch.arange(n_qblocks, device=device).view(n_qblocks, 1)
    key = (block * n_qblocks + rows).reshape(pb * ph, n_qblocks * width)
    key, _ = torch.sort(key, dim=-1)
    block_sorted, query_sorted = key // n_qblocks, key % n_qblocks
    counts = torch.zeros(pb * ph, n_kblocks + 1, dtype=torch.long, device=device)
    counts.scatter_add_(1, block_sorted, torch.ones_like(block_sorted))
    starts = torch.cumsum(counts, dim=-1) - counts
    position = torch.arange(key.shape[-1], device=device) - starts.gather(1, block_sorted)
    # unused slots (block n_kblocks) all land in one spare column past the table, dropped after
    target = torch.where(block_sorted < n_kblocks, block_sorted * n_qblocks + position, n_kblocks * n_qblocks)
    q_indices = torch.zeros(pb * ph, n_kblocks * n_qblocks + 1, dtype=torch.int32, device=device)
    q_indices.scatter_(1, target, query_sorted.to(torch.int32))
    q_indices = q_indices[:, :-1].reshape(pb, ph, n_kblocks, n_qblocks).contiguous()
    return q_indices, counts[:, :n_kblocks].to(torch.int32).view(pb, ph, n_kblocks).contiguous()
