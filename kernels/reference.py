"""Simple, exact references for the block-sparse engine: used by tests, pictures and debug mode.

Nothing here is fast, and nothing here should be: each function is the plainest statement of the
semantics the kernels must reproduce.

* ``dense_reference``   -- float64 attention under a token-level boolean mask, with log-sum-exp.
* ``plan_to_token_mask`` -- expands a block plan (``kv_indices`` / ``kv_counts``) to that mask.
* ``validate_plan``      -- reports out-of-range and duplicate block indices.
"""
from __future__ import annotations

import math

import torch


def dense_reference(q, k, v, mask=None, scale=None):
    """Masked softmax attention in float64.

    ``out[b, h, i] = sum_j softmax_j(scale * q_i . k_j  |  mask[b, h, i, j]) * v_j``

    ``mask`` is boolean and broadcasts to ``(B, H, N, Nk)`` (True = attend). A row with no allowed
    key has output 0 and ``lse = -inf``, the convention of the block-sparse engine.
    Returns ``(out, lse)`` in float64; ``lse`` is the natural log of the sum of exp of the scaled
    scores, shape ``(B, H, N)``.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    q64, k64, v64 = (t.to(torch.float64) for t in (q, k, v))
    scores = torch.einsum("bhnd,bhmd->bhnm", q64, k64) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask.to(torch.bool), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    finite = torch.isfinite(lse)
    probs = torch.exp(scores - torch.where(finite, lse, torch.zeros_like(lse)).unsqueeze(-1))
    probs = torch.where(finite.unsqueeze(-1), probs, torch.zeros_like(probs))
    out = torch.einsum("bhnm,bhmd->bhnd", probs, v64)
    return out, lse


def plan_to_token_mask(kv_indices, kv_counts, n_q, n_k, block_m=128, block_n=128, kv_valid=None):
    """Token-level boolean mask ``(B|1, H|1, n_q, n_k)`` of a block plan (for small sizes).

    Query ``i`` may attend key ``j`` iff ``j // block_n`` is among the first
    ``kv_counts[b, h, i // block_m]`` entries of ``kv_indices[b, h, i // block_m]``, ``j < n_k``
    and ``kv_valid[b, j]`` (when given; its batch dim then sets the mask's).
    """
    kv_indices = kv_indices.long()
    bp, hp, n_qblocks, max_blocks = kv_indices.shape
    n_kblocks = -(-n_k // block_n)
    slot = torch.arange(max_blocks, device=kv_indices.device)
    used = slot < kv_counts.long().unsqueeze(-1)
    block_mask = torch.zeros(bp, hp, n_qblocks, n_kblocks + 1, dtype=torch.bool, device=kv_indices.device)
    # Unused slots (and any out-of-range index) are scattered into the spare last column, then dropped.
    target = torch.where(used & (kv_indices >= 0) & (kv_indices < n_kblocks), kv_indices, n_kblocks)
    block_mask.scatter_(-1, target, True)
    block_mask = block_mask[..., :n_kblocks]
    mask = block_mask.repeat_interleave(block_m, dim=2)[:, :, :n_q]
    mask = mask.repeat_interleave(block_n, dim=3)[..., :n_k]
    if kv_valid is not None:
        mask = mask & kv_valid.to(torch.bool)[:, None, None, :]
    return mask


def validate_plan(kv_indices, kv_counts, n_kv_blocks, n_q_blocks=None):
    """Check a block plan cheaply; return a list of problems (empty when the plan is valid).

    Reports: wrong dtypes or ranks, count/index shape mismatch, counts outside
    ``[0, max_blocks]``, used indices outside ``[0, n_kv_blocks)``, and duplicate indices within a
    row. Called by tests and in debug mode, never on the hot path.
    """
    problems = []
    if kv_indices.dtype not in (torch.int32, torch.int64) or kv_counts.dtype not in (torch.int32, torch.int64):
        problems.append(f"kv_indices/kv_counts must be integer tensors, got {kv_indices.dtype}/{kv_counts.dtype}")
        return problems
    if kv_indices.dim() != 4 or kv_counts.dim() != 3:
        problems.append(f"kv_indices must be 4-D and kv_counts 3-D, got {tuple(kv_indices.shape)} and {tuple(kv_counts.shape)}")
        return problems
    if tuple(kv_counts.shape) != tuple(kv_indices.shape[:3]):
        problems.append(f"kv_counts shape {tuple(kv_counts.shape)} != kv_indices.shape[:3] {tuple(kv_indices.shape[:3])}")
        return problems
    if n_q_blocks is not None and kv_indices.shape[2] != n_q_blocks:
        problems.append(f"plan has {kv_indices.shape[2]} query blocks, expected {n_q_blocks}")
    max_blocks = kv_indices.shape[3]
    counts = kv_counts.long()
    bad_counts = (counts < 0) | (counts > max_blocks)
    if bad_counts.any():
        where = bad_counts.nonzero()[0].tolist()
        problems.append(f"{int(bad_counts.sum())} counts outside [0, {max_blocks}], first at (b, h, m) = {tuple(where)}")
    used = torch.arange(max_blocks, device=kv_indices.device) < counts.clamp(0, max_blocks).unsqueeze(-1)
    idx = kv_indices.long()
    out_of_range = used & ((idx < 0) | (idx >= n_kv_blocks))
    if out_of_range.any():
        where = out_of_range.nonzero()[0].tolist()
        problems.append(
            f"{int(out_of_range.sum())} indices outside [0, {n_kv_blocks}), first at (b, h, m, slot) = {tuple(where)}"
        )
    # Duplicates: sort used entries (unused ones get distinct sentinels) and compare neighbours.
    sentinel = n_kv_blocks + 1 + torch.arange(max_blocks, device=idx.device)
    keyed = torch.where(used, idx, sentinel).sort(dim=-1).values
    dup = keyed[..., 1:] == keyed[..., :-1]
    if dup.any():
        where = dup.nonzero()[0].tolist()
        problems.append(f"{int(dup.sum())} duplicate indices within rows, first in row (b, h, m) = {tuple(where[:3])}")
    return problems
