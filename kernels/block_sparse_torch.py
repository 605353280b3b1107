"""PyTorch fallback of block-sparse attention: right on any device, and fast on the CPU.

Algorithm (one pass per query block, all batches and heads at once)::

    for each query block m:
        keys   = concat of key blocks kv_indices[b, h, m, :kv_counts[b, h, m]]   (gathered)
        s      = scale * q_m @ keys^T            masked where a key is padding / invalid
        lse    = logsumexp(s)                    (-inf for a row with no valid key)
        out_m  = softmax(s) @ values             (0 for such a row)

Only ``block_m x (count * block_n)`` scores exist at a time, so memory stays far below O(N^2).
Rows of a query block with different counts across (b, h) are padded to the largest count and the
padding slots masked. Scores and accumulation are float32 whatever the input dtype.

A single batched gather over all query blocks was measured slower than dense SDPA on the CPU (it
moves count x more key/value bytes at once); the loop keeps every gather cache-sized.
"""
from __future__ import annotations

import torch


def block_sparse_attention_torch(q, k, v, kv_indices, kv_counts, block_m, block_n, scale, kv_valid):
    """See ``fastdit.kernels.block_sparse_attention``; arguments are already validated and the plan
    is expanded to ``(B, H, n_q_blocks, max_blocks)`` int64 / ``(B, H, n_q_blocks)``.
    Returns ``(out, lse)``: out in q's dtype, lse float32 ``(B, H, N)``."""
    batch, heads, n_q, dim = q.shape
    n_k = k.shape[2]
    n_kblocks = -(-n_k // block_n)
    compute = torch.float32
    device = q.device

    # Keys and values as (B*H*n_kblocks, block_n, D), padded to whole blocks.
    pad = n_kblocks * block_n - n_k
    k_blocks = torch.nn.functional.pad(k, (0, 0, 0, pad)).to(compute).reshape(batch * heads * n_kblocks, block_n, dim)
    v_blocks = torch.nn.functional.pad(v, (0, 0, 0, pad)).to(compute).reshape(batch * heads * n_kblocks, block_n, dim)
    key_ok = torch.arange(n_kblocks * block_n, device=device) < n_k
    key_ok = key_ok.expand(batch, -1)
    if kv_valid is not None:
        key_ok = key_ok & torch.nn.functional.pad(kv_valid.to(torch.bool), (0, pad)).expand(batch, -1)
    # (B*H*n_kblocks, block_n): one validity row per gathered block; all-True blocks skip masking.
    key_ok_blocks = key_ok.reshape(batch, 1, n_kblocks, block_n).expand(batch, heads, n_kblocks, block_n)
    key_ok_blocks = key_ok_blocks.reshape(batch * heads * n_kblocks, block_n)
    has_invalid_keys = not bool(key_ok.all())

    out = torch.zeros(batch, heads, n_q, dim, dtype=q.dtype, device=device)
    lse = torch.full((batch, heads, n_q), float("-inf"), dtype=torch.float32, device=device)
    base = (torch.arange(batch * heads, device=device) * n_kblocks).view(batch, heads, 1)
    counts_all = kv_counts.tolist()  # one host sync for the whole call

    for m in range(kv_indices.shape[2]):
        row_counts = [counts_all[b][h][m] for b in range(batch) for h in range(heads)]
        width = max(row_counts)
        if width == 0:
            continue  # query pruning: output 0, lse -inf
        q0, q1 = m * block_m, min((m + 1) * block_m, n_q)
        idx = kv_indices[:, :, m, :width]
        ragged = min(row_counts) != width
        slot_ok = None
        if ragged:
            slot_ok = torch.arange(width, device=device) < kv_counts[:, :, m].unsqueeze(-1)
            idx = torch.where(slot_ok, idx, torch.zeros_like(idx))
        flat = (base + idx).reshape(-1)
        keys = k_blocks.index_select(0, flat).view(batch, heads, width * block_n, dim)
        values = v_blocks.index_select(0, flat).view(batch, heads, width * block_n, dim)

        scores = torch.matmul(q[:, :, q0:q1].to(compute), keys.transpose(-1, -2)).mul_(scale)
        masked = ragged or has_invalid_keys
        if masked:
            ok = key_ok_blocks.index_select(0, flat).view(batch, heads, width, block_n)
            if ragged:
                ok = ok & slot_ok.unsqueeze(-1)
            scores.masked_fill_(~ok.view(batch, heads, 1, width * block_n), float("-inf"))
        row_max = scores.amax(dim=-1, keepdim=True)
        if masked:
            row_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
        probs = scores.sub_(row_max).exp_()
        denom = probs.sum(dim=-1, keepdim=True)
        block_out = torch.matmul(probs, values)
        if masked:
            block_out = block_out / torch.where(denom > 0, denom, torch.ones_like(denom))
        else:
            block_out = block_out.div_(denom)
        out[:, :, q0:q1] = block_out.to(q.dtype)
        lse[:, :, q0:q1] = (row_max + denom.log()).squeeze(-1)
    return out, lse
