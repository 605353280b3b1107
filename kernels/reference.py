"""Simple, exact references for the block-sparse engine: used by tests, pictures and debug mode.

Nothing here is fast, and nothing here should be: each function is the plainest statement of the
semantics the kernels must reproduce.

* ``dense_reference``   -- float64 attention under a token-level boolean mask, with log-sum-exp.
* ``plan_to_token_mask`` -- expands a block plan (``kv_indices`` / ``kv_counts``) to that mask.
* ``validate_plan``      -- the plan rules: count range, index range, duplicates (vectorised).
* ``skip_reference``     -- the skip rule (``skip_threshold``) walked literally, in float64.
* ``varlen_to_token_mask`` / ``varlen_reference`` / ``validate_varlen_plan`` -- the same for
  plans with variable-size blocks given by offsets (``block_sparse_attention_varlen``).
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


def _at(name, where):
    return f"{name}[{', '.join(str(int(i)) for i in where)}]"


def validate_plan(kv_indices, kv_counts, n_kv_blocks, n_q_blocks=None, *, n_k=None, block_n=None):
    """Check a block plan; return a list of problems (empty when the plan is valid).

    The one place the plan rules live (``block_sparse_attention`` raises ``ValueError`` with these
    messages). A plan is valid when:

    * ``kv_indices`` / ``kv_counts`` are int32 or int64 tensors of rank 4 / 3 with
      ``kv_counts.shape == kv_indices.shape[:3]`` (and ``n_q_blocks`` query blocks when given);
    * every count is in ``[0, max_blocks]`` (``max_blocks = kv_indices.shape[-1]``);
    * every *used* index (the first ``kv_counts[b, h, m]`` of row ``(b, h, m)``) is in
      ``[0, n_kv_blocks)``; with no key block at all (``Nk = 0``) every count must be 0;
    * no row lists a key block twice (duplicates are rejected, not merged).

    Entries past a row's count are never read and may hold anything. ``n_k`` / ``block_n`` only
    enrich the messages. Vectorised torch on the plan's device: two host syncs for a valid plan (the
    count range, then one flag for all index rules); the messages of an invalid plan cost more.
    """
    problems = []
    if kv_indices.dtype not in (torch.int32, torch.int64) or kv_counts.dtype not in (torch.int32, torch.int64):
        problems.append(f"kv_indices/kv_counts must be integer tensors, got {kv_indices.dtype}/{kv_counts.dtype}")
        return problems
    if kv_indices.dim() != 4 or kv_counts.dim() != 3:
        problems.append(f"kv_indices must be 4-D and kv_counts 3-D, got {tuple(kv_indices.shape)} and "
                        f"{tuple(kv_counts.shape)}")
        return problems
    if tuple(kv_counts.shape) != tuple(kv_indices.shape[:3]):
        problems.append(f"kv_counts shape {tuple(kv_counts.shape)} != kv_indices.shape[:3] "
                        f"{tuple(kv_indices.shape[:3])}")
        return problems
    if kv_indices.device != kv_counts.device:
        problems.append(f"kv_indices is on {kv_indices.device} but kv_counts on {kv_counts.device}")
        return problems
    if n_q_blocks is not None and kv_indices.shape[2] != n_q_blocks:
        problems.append(f"plan has {kv_indices.shape[2]} query blocks, expected {n_q_blocks}")
    if kv_counts.numel() == 0:
        return problems
    n_kv_blocks = int(n_kv_blocks)
    max_blocks = kv_indices.shape[3]
    keys = "" if n_k is None else f" (Nk={n_k}" + ("" if block_n is None else f", block_n={block_n}") + ")"

    # 1. counts: one sync for their range
    lo, hi = (int(x) for x in torch.stack(torch.aminmax(kv_counts)).tolist())
    if lo < 0:
        neg = kv_counts < 0
        where = neg.nonzero()[0]
        problems.append(
            f"{_at('kv_counts', where)} = {int(kv_counts[tuple(where)])} is negative "
            f"({int(neg.sum())} negative counts); counts must be in [0, max_blocks = {max_blocks}]"
        )
    if hi > max_blocks:
        over = kv_counts > max_blocks
        where = over.nonzero()[0]
        problems.append(
            f"{_at('kv_counts', where)} = {int(kv_counts[tuple(where)])} exceeds max_blocks = {max_blocks} "
            f"(kv_indices.shape[-1]); {int(over.sum())} counts outside [0, {max_blocks}]"
        )
    width = min(max(hi, 0), max_blocks)  # the used prefix of every row
    if width == 0:
        return problems
    if n_kv_blocks <= 0:
        where = (kv_counts > 0).nonzero()[0]
        problems.append(
            f"{_at('kv_counts', where)} = {int(kv_counts[tuple(where)])} but there are no keys{keys}: "
            "no key block exists, so every count must be 0"
        )
        return problems

    # 2. used indices: range and duplicates, one sync for both
    idx = kv_indices[..., :width]
    slot = torch.arange(width, device=idx.device, dtype=idx.dtype)
    used = slot < kv_counts.unsqueeze(-1)
    out_of_range = used & ((idx < 0) | (idx >= n_kv_blocks))
    flags = [out_of_range.any()]
    if width > 1:
        # in-range used entries keep their value, the rest get distinct negative sentinels; sorted
        # neighbours that are equal are duplicates
        keyed, order = torch.where(used & ~out_of_range, idx, -1 - slot).sort(dim=-1)
        dup = keyed[..., 1:] == keyed[..., :-1]
        flags.append(dup.any())
    bad_range, bad_dup = (torch.stack(flags).tolist() + [False])[:2]
    if bad_range:
        where = out_of_range.nonzero()[0]
        problems.append(
            f"{_at('kv_indices', where)} = {int(idx[tuple(where)])} is out of range: outside [0, {n_kv_blocks}), "
            f"the {n_kv_blocks} key blocks{keys}; {int(out_of_range.sum())} used indices out of range"
        )
    if bad_dup:
        where = dup.nonzero()[0]
        row = tuple(int(i) for i in where[:3])
        s0, s1 = sorted(int(order[row + (int(where[3]) + d,)]) for d in (0, 1))
        problems.append(
            f"{_at('kv_indices', row)} lists key block {int(keyed[tuple(where)])} twice (slots {s0} and {s1}): "
            f"duplicate key-block indices within a row are rejected; {int(dup.sum())} duplicates in all"
        )
    return problems


def skip_reference(q, k, v, kv_indices, kv_counts, block_m, block_n, skip_threshold, skip_tile=(64, 64),
                   scale=None, kv_valid=None):
    """The skip rule of ``block_sparse_attention`` walked literally, one sub-tile at a time, in float64.

    For every (batch, head, row tile) the listed key sub-tiles are visited in plan order with a
    running maximum over the *computed* ones; a sub-tile is skipped iff every row's largest score
    in it is below ``running max - skip_threshold``. (No shortcut: the running maximum is updated
    only by computed sub-tiles, which is what the kernel does.)

    Returns a dict: ``out`` / ``lse`` (float64, attention under the plan minus skipped
    sub-tiles), ``skipped`` (int64 ``(B, H)``), ``walked`` (sub-tiles visited, ``(B, H)``),
    ``mask`` (the token mask actually attended, ``(B, H, N, Nk)``) and ``margin``: the smallest
    distance of any decision from flipping (``min_i (m_i - threshold - tile_max_i)`` in absolute
    value), so that tests can avoid thresholds within float32 rounding of a decision.
    """
    batch, heads, n_q, _ = q.shape
    n_k = k.shape[2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    tile_m, tile_n = skip_tile
    scores = torch.einsum("bhnd,bhmd->bhnm", q.double(), k.double()) * scale
    key_ok = torch.ones(batch, n_k, dtype=torch.bool) if kv_valid is None else kv_valid.cpu().bool().expand(batch, n_k)
    scores = scores.cpu().masked_fill(~key_ok[:, None, None, :], float("-inf"))
    idx = kv_indices.cpu().long().expand(batch, heads, -1, -1)
    cnt = kv_counts.cpu().long().expand(batch, heads, -1)
    mask = torch.zeros(batch, heads, n_q, n_k, dtype=torch.bool)
    skipped = torch.zeros(batch, heads, dtype=torch.int64)
    walked = torch.zeros(batch, heads, dtype=torch.int64)
    margin = float("inf")
    for b in range(batch):
        for h in range(heads):
            for m in range(idx.shape[2]):
                block_end = min((m + 1) * block_m, n_q)
                for r0 in range(m * block_m, block_end, tile_m):
                    rows = slice(r0, min(r0 + tile_m, block_end))
                    running = torch.full((rows.stop - rows.start,), float("-inf"), dtype=torch.float64)
                    for slot in range(int(cnt[b, h, m])):
                        j = int(idx[b, h, m, slot])
                        for c0 in range(j * block_n, (j + 1) * block_n, tile_n):
                            cols = slice(min(c0, n_k), min(c0 + tile_n, (j + 1) * block_n, n_k))
                            tile = scores[b, h, rows, cols]
                            tile_max = tile.amax(1) if tile.shape[1] else torch.full_like(running, float("-inf"))
                            gap = (running - skip_threshold) - tile_max  # > 0 for every row: skip
                            worst = float(gap.min())
                            if math.isfinite(worst):
                                margin = min(margin, abs(worst))
                            walked[b, h] += 1
                            if worst > 0:
                                skipped[b, h] += 1
                                continue
                            mask[b, h, rows, cols] = True
                            running = torch.maximum(running, tile_max)
    mask &= key_ok[:, None, None, :]
    out, lse = dense_reference(q.cpu(), k.cpu(), v.cpu(), mask, scale)
    return {"out": out, "lse": lse, "skipped": skipped, "walked": walked, "mask": mask, "margin": margin}


# --------------------------------------------------------------------------------------------------
# Variable-size blocks (block boundaries given by offsets)
# --------------------------------------------------------------------------------------------------

def varlen_to_token_mask(q_offsets, k_offsets, kv_indices, kv_counts, n_q, n_k, kv_valid=None):
    """Token-level boolean mask ``(B, H, n_q, n_k)`` of a variable-size block plan (small sizes).

    Query block ``m`` of (batch, head) ``(b, h)`` is the rows ``[q_offsets[b, h, m],
    q_offsets[b, h, m + 1])``, key block ``j`` the keys ``[k_offsets[b, h, j], k_offsets[b, h, j + 1])``
    (leading dims of size 1 broadcast). Query ``i`` of block ``m`` attends key ``t`` iff ``t`` lies
    in one of the key blocks ``kv_indices[b, h, m, :kv_counts[b, h, m]]`` and ``kv_valid[b, t]``
    (when given). ``B`` / ``H`` are the broadcast leading dims of all the arguments. Written as
    plain loops over blocks: the independent statement the kernels are tested against.
    """
    tensors = [q_offsets, k_offsets, kv_indices, kv_counts]
    batch = max(int(t.shape[0]) for t in tensors + ([kv_valid] if kv_valid is not None else []))
    heads = max(int(t.shape[1]) for t in tensors)
    qo, ko, idx, cnt = (t.cpu().long() for t in tensors)
    mask = torch.zeros(batch, heads, n_q, n_k, dtype=torch.bool)
    for b in range(batch):
        for h in range(heads):
            qo_bh = qo[b % qo.shape[0], h % qo.shape[1]].tolist()
            ko_bh = ko[b % ko.shape[0], h % ko.shape[1]].tolist()
            idx_bh = idx[b % idx.shape[0], h % idx.shape[1]].tolist()
            cnt_bh = cnt[b % cnt.shape[0], h % cnt.shape[1]].tolist()
            for m in range(len(qo_bh) - 1):
                for j in idx_bh[m][:cnt_bh[m]]:
                    mask[b, h, qo_bh[m]:qo_bh[m + 1], ko_bh[j]:ko_bh[j + 1]] = True
    if kv_valid is not None:
        mask &= kv_valid.cpu().to(torch.bool)[:, None, None, :]
    return mask


def varlen_reference(q, k, v, q_offsets, k_offsets, kv_indices, kv_counts, scale=None, kv_valid=None):
    """``(out, lse)`` in float64 of attention under a variable-size block plan: ``dense_reference``
    under ``varlen_to_token_mask`` (rows with no attended key: out 0, lse -inf)."""
    mask = varlen_to_token_mask(q_offsets, k_offsets, kv_indices, kv_counts, q.shape[2], k.shape[2], kv_valid)
    return dense_reference(q.cpu(), k.cpu(), v.cpu(), mask, scale)


def _offset_problems(name, offsets, total, flags):
    """Messages for the offsets rules whose ``flags`` (first, last, monotone) are set."""
    problems = []
    first, last, falling = flags
    if first:
        where = (offsets[..., 0] != 0).nonzero()[0].tolist() + [0]
        problems.append(f"{_at(name, where)} = {int(offsets[tuple(where)])}: the first offset must be 0")
    if last:
        end = offsets.shape[-1] - 1
        where = (offsets[..., -1] != total).nonzero()[0].tolist() + [end]
        problems.append(f"{_at(name, where)} = {int(offsets[tuple(where)])}: the last offset must be "
                        f"{total} (the number of {'queries' if name == 'q_offsets' else 'keys'})")
    if falling:
        drop = offsets[..., 1:] < offsets[..., :-1]
        where = drop.nonzero()[0].tolist()
        before = where[:2] + [where[2]]
        where[2] += 1
        problems.append(f"{_at(name, where)} = {int(offsets[tuple(where)])} is below {_at(name, before)} = "
                        f"{int(offsets[tuple(before)])}: offsets must be non-decreasing "
                        f"({int(drop.sum())} decreasing steps)")
    return problems


def validate_varlen_plan(q_offsets, k_offsets, kv_indices, kv_counts, n_q, n_k):
    """Check a variable-size block plan; return a list of problems (empty when it is valid).

    The rules of ``block_sparse_attention_varlen``: ``q_offsets`` ``(B|1, H|1, Mq + 1)`` and
    ``k_offsets`` ``(B|1, H|1, Mk + 1)`` are int32 / int64, start at 0, end at ``n_q`` / ``n_k``
    and never decrease (empty blocks are fine); ``kv_indices`` / ``kv_counts`` follow
    ``validate_plan`` with ``Mq`` query blocks and ``Mk`` key blocks. Vectorised: one host sync for
    the offsets, then ``validate_plan``'s two.
    """
    problems = []
    for name, t in (("q_offsets", q_offsets), ("k_offsets", k_offsets)):
        if not isinstance(t, torch.Tensor) or t.dtype not in (torch.int32, torch.int64):
            problems.append(f"{name} must be an int32 or int64 tensor, got {getattr(t, 'dtype', type(t).__name__)}")
        elif t.dim() != 3 or t.shape[-1] < 1:
            problems.append(f"{name} must have shape (B|1, H|1, blocks + 1), got {tuple(t.shape)}")
    if problems:
        return problems
    n_q_blocks, n_k_blocks = q_offsets.shape[-1] - 1, k_offsets.shape[-1] - 1
    flags = []
    for t, total in ((q_offsets, n_q), (k_offsets, n_k)):
        flags += [(t[..., 0] != 0).any(), (t[..., -1] != total).any(), (t[..., 1:] < t[..., :-1]).any()]
    flags = torch.stack(flags).tolist()
    problems += _offset_problems("q_offsets", q_offsets, n_q, flags[:3])
    problems += _offset_problems("k_offsets", k_offsets, n_k, flags[3:])
    problems += validate_plan(kv_indices, kv_counts, n_k_blocks, n_q_blocks)
    return problems
