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
moves count x more key/value bytes at once); the loop keeps every gather cache-sized. On the CPU
each block's softmax-attention is one fused call of torch's flash-attention CPU kernel (which also
returns the log-sum-exp): the unfused score / max / exp / sum / matmul sequence was several times
slower on a busy 2-core machine, every small op waiting for its threads. Elsewhere (a GPU without
Triton, say) the unfused float32 path runs.
"""
from __future__ import annotations

import torch

_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _fused_cpu_block(q_blk, keys, values, ok, scale):
    """``(out, lse)`` of one query block with torch's fused CPU flash attention; ``ok`` is the
    gathered key validity ``(B, H, L)`` or None. Rows with no valid key: out 0, lse -inf."""
    bias = None
    if ok is not None:
        bias = torch.zeros(ok.shape, dtype=q_blk.dtype, device=q_blk.device)
        bias = bias.masked_fill_(~ok, float("-inf")).unsqueeze(2)
    out, lse = _CPU_FLASH(q_blk, keys, values, attn_mask=bias, scale=scale)
    if ok is not None:
        lse = torch.where(ok.any(-1, keepdim=True), lse, torch.full_like(lse, float("-inf")))
    return out, lse


def block_sparse_attention_torch(q, k, v, kv_indices, kv_counts, block_m, block_n, scale, kv_valid):
    """See ``fastdit.kernels.block_sparse_attention``; arguments are already validated and the plan
    is expanded to ``(B, H, n_q_blocks, max_blocks)`` int64 / ``(B, H, n_q_blocks)`` (a plan shared
    by all batches and heads keeps stride 0 there). Returns ``(out, lse)``: out in q's dtype, lse
    float32 ``(B, H, N)``.

    Gathering: keys and values are first laid out as 2-D tables with one short row per token
    (``(tokens, B*H*D)`` for a plan shared by all heads, ``(B*H*tokens, D)`` for per-head plans),
    so that each query block's gather is one ``index_select`` over rows. A shared row whose blocks
    are one consecutive run (dense rows, 1-D windows) reads a slice instead, with no copy. Gathering whole blocks of
    a 4-D tensor instead was 100x slower on a busy CPU (each small parallel copy waits for its
    threads).
    """
    batch, heads, n_q, dim = q.shape
    n_k = k.shape[2]
    if n_k == 0 or batch * heads * n_q == 0:  # no key (or no query): every row is empty
        out = torch.zeros(batch, heads, n_q, dim, dtype=q.dtype, device=q.device)
        return out, torch.full((batch, heads, n_q), float("-inf"), dtype=torch.float32, device=q.device)
    n_kblocks = -(-n_k // block_n)
    n_tok = n_kblocks * block_n
    device = q.device
    fused = _CPU_FLASH is not None and device.type == "cpu"
    compute = q.dtype if fused else torch.float32
    shared = all(kv_indices.shape[d] == 1 or kv_indices.stride(d) == 0 for d in (0, 1))

    pad = n_tok - n_k
    k_pad = torch.nn.functional.pad(k, (0, 0, 0, pad)).to(compute)  # (B, H, n_tok, D)
    v_pad = torch.nn.functional.pad(v, (0, 0, 0, pad)).to(compute)
    key_ok = (torch.arange(n_tok, device=device) < n_k).expand(batch, -1)
    if kv_valid is not None:
        key_ok = key_ok & torch.nn.functional.pad(kv_valid.to(torch.bool), (0, pad)).expand(batch, -1)
    has_invalid_keys = not bool(key_ok.all())
    in_block = torch.arange(block_n, device=device)

    if shared:  # rows = tokens; a gathered (L, B*H*D) table is viewed back as (B, H, L, D)
        k_table = k_pad.permute(2, 0, 1, 3).reshape(n_tok, batch * heads * dim)
        v_table = v_pad.permute(2, 0, 1, 3).reshape(n_tok, batch * heads * dim)
        ok_table = key_ok.t().contiguous()  # (n_tok, B)
        indices = kv_indices[0, 0]
        indices_all = indices.tolist()
    else:  # rows = (batch*head, token) pairs
        k_table = k_pad.reshape(batch * heads * n_tok, dim)
        v_table = v_pad.reshape(batch * heads * n_tok, dim)
        ok_table = key_ok[:, None].expand(batch, heads, n_tok).reshape(-1)
        base = (torch.arange(batch * heads, device=device) * n_tok).view(batch, heads, 1, 1)

    out = torch.zeros(batch, heads, n_q, dim, dtype=q.dtype, device=device)
    lse = torch.full((batch, heads, n_q), float("-inf"), dtype=torch.float32, device=device)
    counts_all = kv_counts.tolist()  # one host sync for the whole call

    for m in range(kv_indices.shape[2]):
        q0, q1 = m * block_m, min((m + 1) * block_m, n_q)
        ok = None
        if shared:
            count = counts_all[0][0][m]
            if count == 0:
                continue  # query pruning: output 0, lse -inf
            row = indices_all[m][:count]
            first = min(row)
            if max(row) - first + 1 == count:  # one run of consecutive blocks: a view, no copy
                a, b = first * block_n, (first + count) * block_n
                keys, values = k_pad[:, :, a:b], v_pad[:, :, a:b]
                if has_invalid_keys:
                    ok = key_ok[:, None, a:b].expand(batch, heads, b - a)
            else:
                rows = (indices[m, :count, None] * block_n + in_block).reshape(-1)
                length = rows.numel()
                keys = k_table.index_select(0, rows).view(length, batch, heads, dim).permute(1, 2, 0, 3)
                values = v_table.index_select(0, rows).view(length, batch, heads, dim).permute(1, 2, 0, 3)
                if has_invalid_keys:
                    ok = ok_table.index_select(0, rows).t()[:, None].expand(batch, heads, length)
        else:
            row_counts = [counts_all[b][h][m] for b in range(batch) for h in range(heads)]
            width = max(row_counts)
            if width == 0:
                continue
            idx = kv_indices[:, :, m, :width]
            ragged = min(row_counts) != width
            if ragged:
                slot_ok = torch.arange(width, device=device) < kv_counts[:, :, m].unsqueeze(-1)
                idx = torch.where(slot_ok, idx, torch.zeros_like(idx))
            rows = (base + idx[..., None] * block_n + in_block).reshape(-1)  # (B, H, width, block_n)
            length = width * block_n
            keys = k_table.index_select(0, rows).view(batch, heads, length, dim)
            values = v_table.index_select(0, rows).view(batch, heads, length, dim)
            if ragged or has_invalid_keys:
                ok = ok_table.index_select(0, rows).view(batch, heads, width, block_n)
                if ragged:
                    ok = ok & slot_ok.unsqueeze(-1)
                ok = ok.reshape(batch, heads, length)

        if fused:
            block_out, block_lse = _fused_cpu_block(q[:, :, q0:q1], keys, values, ok, scale)
            out[:, :, q0:q1] = block_out
            lse[:, :, q0:q1] = block_lse
            continue

        scores = torch.matmul(q[:, :, q0:q1].to(compute), keys.transpose(-1, -2)).mul_(scale)
        if ok is not None:
            scores.masked_fill_(~ok.unsqueeze(2), float("-inf"))
        row_max = scores.amax(dim=-1, keepdim=True)
        if ok is not None:
            row_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
        probs = scores.sub_(row_max).exp_()
        denom = probs.sum(dim=-1, keepdim=True)
        block_out = torch.matmul(probs, values)
        if ok is not None:
            block_out = block_out / torch.where(denom > 0, denom, torch.ones_like(denom))
        else:
            block_out = block_out.div_(denom)
        out[:, :, q0:q1] = block_out.to(q.dtype)
        lse[:, :, q0:q1] = (row_max + denom.log()).squeeze(-1)
    return out, lse
