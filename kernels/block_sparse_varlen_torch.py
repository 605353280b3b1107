"""PyTorch fallback of variable-size block-sparse attention: the plan rewritten as a fixed-size one.

Each (batch, head) pair ``g`` gets a *padded token order*: its variable query blocks laid end to
end, each padded up to a multiple of a base block ``Pq`` (empty blocks take no room), and the same
for its key blocks with a base ``Pk``. In that order every padded block of ``Pq`` rows belongs to
one variable query block ``m`` and attends the padded key blocks of ``m``'s listed key blocks: an
ordinary fixed-size plan (``block_m = Pq``, ``block_n = Pk``). Padding keys are marked invalid
through ``kv_valid``, padding rows are computed and dropped. The softmax of a real row runs over
exactly its attended keys, so the rewrite is exact; the fixed PyTorch path
(``block_sparse_torch.py``) does the attention, with batch and heads folded into one batch dim
(every pair has its own order and key validity, as ``fastdit/methods/svg.py`` does for per-head
token orders).

Cost: padding rows and keys are computed; the fixed path also runs one loop step per padded query
block, whose key gather costs about as much as computing ``GAMMA_Q`` rows. The base blocks are
chosen per call (host syncs are fine on this path) to minimise ``padded + GAMMA * padded / P``
over the powers of two from 8 to 128. Offsets that are already uniform (``m * b`` clipped at the
end) skip the rewrite and run the fixed path on the plan as given.
"""
from __future__ import annotations

import torch

from .block_sparse_torch import block_sparse_attention_torch

BASE_CHOICES = (8, 16, 32, 64, 128)
GAMMA_Q = 16  # rows' worth of work per padded query block (its key gather, the loop step)
GAMMA_K = 2   # keys' worth of work per padded key block (plan entries)


def uniform_block(offsets, total):
    """``b`` when ``offsets`` (every batch / head) is ``[0, b, 2b, ..., total]`` with only the last
    block shorter, else None (one host sync)."""
    n_blocks = offsets.shape[-1] - 1
    if n_blocks < 1 or total < 1:
        return None
    size = int(offsets.reshape(-1)[1])
    if size < 1 or -(-total // size) != n_blocks:
        return None
    grid = (torch.arange(n_blocks + 1, device=offsets.device, dtype=torch.int64) * size).clamp(max=total)
    return size if bool((offsets == grid).all()) else None


def pick_base(sizes, gamma, choices=BASE_CHOICES):
    """The base block ``P`` minimising ``T(P) + gamma * T(P) / P``, ``T(P)`` the padded length of
    the longest group (``sizes``: block sizes ``(G, M)``)."""
    best = None
    for base in choices:
        padded = int((((sizes + base - 1) // base) * base).sum(-1).max())
        cost = padded + gamma * padded / base
        if best is None or cost < best[0]:
            best = (cost, base)
    return best[1]


def padded_order(offsets, base):
    """Padded token order of variable blocks ``offsets`` (``(G, M + 1)`` int64) with base ``base``.

    Returns ``(start, n_padded, token, real)``: ``start`` ``(G, M + 1)``, the first padded block
    of each block (cumulative, ``start[:, M]`` the group's total); ``n_padded`` the number of padded
    blocks of the longest group; ``token`` ``(G, n_padded * base)`` the original token at each
    padded position (0 where padding) and ``real`` (bool, same shape) which positions hold one."""
    groups, n_blocks = offsets.shape[0], offsets.shape[1] - 1
    sizes = offsets[:, 1:] - offsets[:, :-1]
    start = torch.zeros_like(offsets)
    start[:, 1:] = torch.cumsum((sizes + base - 1) // base, dim=1)
    n_padded = int(start[:, -1].max())
    pos = torch.arange(n_padded * base, device=offsets.device, dtype=torch.int64).expand(groups, -1).contiguous()
    owner = torch.searchsorted(start[:, 1:].contiguous(), pos // base, right=True)  # block of each position
    owner_c = owner.clamp(max=max(n_blocks - 1, 0))
    within = pos - start.gather(1, owner_c) * base
    real = (owner < n_blocks) & (within < sizes.gather(1, owner_c))
    token = torch.where(real, offsets.gather(1, owner_c) + within, torch.zeros_like(within))
    return start, n_padded, token, real


def padded_plan(q_start, n_q_padded, k_start, kv_indices, kv_counts):
    """The fixed-size plan over the padded orders: ``(idx, cnt)`` int64 ``(G, n_q_padded, W)`` /
    ``(G, n_q_padded)``. Padded query block ``p`` of variable block ``m`` lists the padded key
    blocks of ``m``'s key blocks, in plan order; padded blocks past the group's end list none."""
    groups, n_qblocks, width = kv_indices.shape
    device = kv_indices.device
    slot_ok = torch.arange(width, device=device) < kv_counts.unsqueeze(-1)
    blocks = torch.where(slot_ok, kv_indices, torch.zeros_like(kv_indices))       # (G, Mq, W)
    k_first = k_start.gather(1, blocks.reshape(groups, -1)).view_as(blocks)        # first padded key block
    k_sizes = k_start[:, 1:] - k_start[:, :-1]
    per_slot = torch.where(slot_ok, k_sizes.gather(1, blocks.reshape(groups, -1)).view_as(blocks), 0)
    cum = torch.cumsum(per_slot, dim=-1)                                          # (G, Mq, W)
    total = cum[..., -1] if width else torch.zeros_like(kv_counts)
    new_width = int(total.max()) if total.numel() else 0
    t = torch.arange(new_width, device=device).expand(groups, n_qblocks, new_width).contiguous()
    slot = torch.searchsorted(cum.contiguous(), t, right=True).clamp(max=max(width - 1, 0))
    first_of_slot = (cum - per_slot).gather(2, slot)
    idx = k_first.gather(2, slot) + (t - first_of_slot)
    idx = torch.where(t < total.unsqueeze(-1), idx, torch.zeros_like(idx))
    # padded query block -> its variable block
    p = torch.arange(n_q_padded, device=device).expand(groups, -1).contiguous()
    owner = torch.searchsorted(q_start[:, 1:].contiguous(), p, right=True)
    owner_c = owner.clamp(max=max(n_qblocks - 1, 0))
    idx = idx.gather(1, owner_c.unsqueeze(-1).expand(-1, -1, new_width))
    cnt = torch.where(owner < n_qblocks, total.gather(1, owner_c), torch.zeros_like(owner_c))
    return idx, cnt


def block_sparse_attention_varlen_torch(q, k, v, q_offsets, k_offsets, kv_indices, kv_counts, scale, kv_valid):
    """See ``fastdit.kernels.block_sparse_attention_varlen``; inputs already checked and validated.
    Returns ``(out, lse)``: out in q's dtype ``(B, H, N, D)``, lse float32 ``(B, H, N)``."""
    batch, heads, n_q, dim = q.shape
    n_k = k.shape[2]
    device = q.device
    out = torch.zeros(batch, heads, n_q, dim, dtype=q.dtype, device=device)
    lse = torch.full((batch, heads, n_q), float("-inf"), dtype=torch.float32, device=device)
    if n_k == 0 or batch * heads * n_q == 0 or kv_indices.shape[-1] == 0:
        return out, lse
    bm, bn = uniform_block(q_offsets, n_q), uniform_block(k_offsets, n_k)
    if bm is not None and bn is not None:  # the fixed-size plan itself
        shape = (batch, heads) + tuple(kv_indices.shape[2:])
        return block_sparse_attention_torch(q, k, v, kv_indices.long().expand(shape),
                                            kv_counts.long().expand(shape[:3]), bm, bn, scale, kv_valid)

    groups = batch * heads

    def per_group(t):
        return t.long().expand(batch, heads, *t.shape[2:]).reshape(groups, *t.shape[2:])

    q_off, k_off = per_group(q_offsets), per_group(k_offsets)
    base_q = pick_base(q_off[:, 1:] - q_off[:, :-1], GAMMA_Q)
    base_k = pick_base(k_off[:, 1:] - k_off[:, :-1], GAMMA_K)
    q_start, n_q_padded, q_token, q_real = padded_order(q_off, base_q)
    k_start, _, k_token, k_real = padded_order(k_off, base_k)
    idx, cnt = padded_plan(q_start, n_q_padded, k_start, per_group(kv_indices), per_group(kv_counts))
    if idx.shape[-1] == 0:
        return out, lse

    group_base = torch.arange(groups, device=device).unsqueeze(-1)
    q_rows = (q_token + group_base * n_q).reshape(-1)
    k_rows = (k_token + group_base * n_k).reshape(-1)
    q_p = q.reshape(groups * n_q, dim).index_select(0, q_rows).view(groups, 1, -1, dim)
    k_p = k.reshape(groups * n_k, dim).index_select(0, k_rows).view(groups, 1, -1, dim)
    v_p = v.reshape(groups * n_k, dim).index_select(0, k_rows).view(groups, 1, -1, dim)
    valid = k_real
    if kv_valid is not None:
        per_key = kv_valid.to(torch.bool)[:, None, :].expand(batch, heads, n_k).reshape(groups, n_k)
        valid = valid & per_key.gather(1, k_token)
    out_p, lse_p = block_sparse_attention_torch(
        q_p, k_p, v_p, idx.unsqueeze(1), cnt.unsqueeze(1), base_q, base_k, scale, valid)
    # every original row sits at exactly one real padded position: copy those back
    real = q_real.reshape(-1)
    dest = q_rows[real]
    out.view(groups * n_q, dim).index_copy_(0, dest, out_p.reshape(-1, dim)[real])
    lse.view(groups * n_q).index_copy_(0, dest, lse_p.reshape(-1)[real])
    return out, lse
