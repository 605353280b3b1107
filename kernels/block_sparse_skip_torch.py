"""PyTorch fallback of the skip rule (``skip_threshold``): the Triton kernel's decisions, vectorised.

The rule (stated in full in ``block_sparse.py``) is sequential as the kernel runs it: a key
sub-tile is skipped when, for every valid row of the query row tile, its largest scaled score is
more than ``threshold`` below the row's running maximum *over the sub-tiles computed so far*. A
skipped sub-tile's scores are all below that maximum, so it would not have raised it: the running
maximum before sub-tile ``t`` is the maximum over *all* earlier sub-tiles of the walk, skipped or
not. That makes every decision a function of the sub-tile row maxima alone::

    tile_max[i, t] = max_{j in sub-tile t} s_ij                          (-inf: no valid key)
    before[i, t]   = max_{t' < t} tile_max[i, t']                        (exclusive cummax)
    skip[R, t]     = all_{i in row tile R} tile_max[i, t] < before[i, t] - threshold

so one query block is scores -> (amax per sub-tile, cummax, all over row tiles) -> masked softmax,
with no loop over sub-tiles. Scores are float32 (the kernel's float32 accumulation; decisions
within float32 rounding of the threshold may differ from the kernel's log2-domain arithmetic).
"""
from __future__ import annotations

import torch


def _row_tile_skips(scores, slot_ok, block_n, tile_m, tile_n, threshold):
    """Skip decisions of one query block.

    ``scores``: float32 ``(B, H, r, W * block_n)`` (invalid keys already -inf), the ``W`` listed
    key blocks in plan order; ``slot_ok``: bool ``(B, H, W)`` (False past the row's count).
    Returns ``skip`` bool ``(B, H, R, W, sub_n)`` for the ``R = ceil(r / tile_m)`` row tiles and
    the ``sub_n = ceil(block_n / tile_n)`` sub-tiles of each listed key block."""
    batch, heads, rows, length = scores.shape
    width = slot_ok.shape[-1]
    sub_n = -(-block_n // tile_n)
    tiles = width * sub_n
    per_block = scores.view(batch, heads, rows, width, block_n)
    per_block = torch.nn.functional.pad(per_block, (0, sub_n * tile_n - block_n), value=float("-inf"))
    tile_max = per_block.view(batch, heads, rows, tiles, tile_n).amax(-1)  # (B, H, r, T)
    before = torch.full_like(tile_max, float("-inf"))
    if tiles > 1:
        before[..., 1:] = tile_max[..., :-1].cummax(-1).values
    below = tile_max < before - threshold
    n_row_tiles = -(-rows // tile_m)
    below = torch.nn.functional.pad(below, (0, 0, 0, n_row_tiles * tile_m - rows), value=True)
    skip = below.view(batch, heads, n_row_tiles, tile_m, tiles).all(3)  # (B, H, R, T)
    skip = skip.view(batch, heads, n_row_tiles, width, sub_n) & slot_ok[:, :, None, :, None]
    return skip


def block_sparse_attention_skip_torch(q, k, v, kv_indices, kv_counts, block_m, block_n, scale, kv_valid,
                                      threshold, tile_m, tile_n):
    """``(out, lse, skipped)`` of block-sparse attention under the skip rule (see the module doc).

    Arguments as ``block_sparse_attention_torch`` (plan expanded to ``(B, H, n_q_blocks, W)``
    int64), plus the threshold (natural log, >= 0, may be inf) and the rule's row / key sub-tile
    sizes. ``skipped``: int32 ``(B, H)``, skipped (row tile, key sub-tile) pairs."""
    batch, heads, n_q, dim = q.shape
    n_k = k.shape[2]
    device = q.device
    out = torch.zeros(batch, heads, n_q, dim, dtype=q.dtype, device=device)
    lse = torch.full((batch, heads, n_q), float("-inf"), dtype=torch.float32, device=device)
    skipped = torch.zeros(batch, heads, dtype=torch.int64, device=device)
    if n_k == 0 or batch * heads * n_q == 0:
        return out, lse, skipped.to(torch.int32)
    n_tok = -(-n_k // block_n) * block_n
    pad = n_tok - n_k
    k_pad = torch.nn.functional.pad(k, (0, 0, 0, pad)).float()
    v_pad = torch.nn.functional.pad(v, (0, 0, 0, pad)).float()
    key_ok = (torch.arange(n_tok, device=device) < n_k).expand(batch, n_tok)
    if kv_valid is not None:
        key_ok = key_ok & torch.nn.functional.pad(kv_valid.to(torch.bool), (0, pad)).expand(batch, n_tok)
    in_block = torch.arange(block_n, device=device)
    counts_max = kv_counts.amax(dim=(0, 1)).tolist()  # one host sync: the widest row of each query block

    for m, width in enumerate(counts_max):
        if width == 0:
            continue
        q0, q1 = m * block_m, min((m + 1) * block_m, n_q)
        slot_ok = torch.arange(width, device=device) < kv_counts[:, :, m, None]  # (B, H, W)
        idx = torch.where(slot_ok, kv_indices[:, :, m, :width], torch.zeros_like(kv_indices[:, :, m, :width]))
        cols = (idx[..., None] * block_n + in_block).reshape(batch, heads, width * block_n)
        keys = k_pad.gather(2, cols[..., None].expand(-1, -1, -1, dim))
        values = v_pad.gather(2, cols[..., None].expand(-1, -1, -1, dim))
        ok = key_ok[:, None, :].expand(batch, heads, n_tok).gather(2, cols)
        ok = ok & slot_ok.repeat_interleave(block_n, dim=2)  # (B, H, L)

        scores = torch.matmul(q[:, :, q0:q1].float(), keys.transpose(-1, -2)).mul_(scale)
        scores.masked_fill_(~ok[:, :, None, :], float("-inf"))
        skip = _row_tile_skips(scores, slot_ok, block_n, tile_m, tile_n, threshold)  # (B, H, R, W, sub_n)
        skipped += skip.sum(dim=(2, 3, 4))
        rows = q1 - q0
        skip_cols = skip.repeat_interleave(tile_n, dim=4)[..., :block_n].reshape(batch, heads, -1, width * block_n)
        skip_tok = skip_cols.repeat_interleave(tile_m, dim=2)[:, :, :rows]  # (B, H, r, L)
        scores.masked_fill_(skip_tok, float("-inf"))

        row_max = scores.amax(dim=-1, keepdim=True)
        finite = torch.isfinite(row_max)
        probs = (scores - torch.where(finite, row_max, torch.zeros_like(row_max))).exp_()
        denom = probs.sum(dim=-1, keepdim=True)
        block_out = torch.matmul(probs, values) / torch.where(denom > 0, denom, torch.ones_like(denom))
        out[:, :, q0:q1] = block_out.to(q.dtype)
        lse[:, :, q0:q1] = torch.where(finite, row_max + denom.log(), row_max).squeeze(-1)
    return out, lse, skipped.to(torch.int32)
