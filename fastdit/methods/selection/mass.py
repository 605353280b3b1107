"""Attention mass per key block, measured exactly on a few sampled query rows.

Shared by the methods that select key blocks by a mass threshold (sparge's ``cdf``, svg2's
``top_p``). Their published rules predict the mass query block ``m`` puts on key block ``j`` from
pooled vectors, ``softmax_j(scale qbar_m . kbar_j)``: that estimates ``exp(mean score)`` over the
block pair, which is far below ``mean exp(score)`` when a head is sharper than a block (Jensen), so
on sharp, local heads the prediction is much more peaked than the truth and a threshold keeps far
less mass than it says (issue 23 measures it in ``eval/bench/selection.py``).

The estimator here: for each query block, ``s`` of its rows ``i`` (a stratified random sample,
drawn once per layout with a fixed seed) are scored exactly against every valid key; their softmax
``p_i(k) = exp(scale q_i . k - lse_i)`` is summed per key block, and the block's predicted mass is
the mean over its sampled rows::

    P[m, j] = (1 / s) sum_{i in sample(m)} sum_{k in block j} p_i(k)

Each ``P[m, :]`` is a distribution over key blocks whatever the head's temperature: no assumption
on how scores spread inside a block. What it assumes: a block's rows put their mass on similar key
blocks, so ``s`` of them represent all (the mean over rows is unbiased for the block's true mean
mass; its variance comes from rows that attend elsewhere, e.g. at a tile's edge on a local head).
Cost: ``s`` exact score rows per query block, ``s / block`` of dense attention's scores (4 rows of
128: 3%), reported by the benchmarks as selection time.
"""
from __future__ import annotations

import torch

#: float32 score entries held at once (rows x keys x heads per chunk).
SCORE_BUDGET = 1 << 25


@torch.no_grad()  # a selection estimate: nothing differentiates through it (training calls select too)
def row_block_masses(q_rows, k, key_valid, blocks, n_blocks, scale):
    """Exact softmax mass of each row of ``q_rows`` ``(B, H, R, D)`` on each key block: float32
    ``(B, H, R, n_blocks)``, rows summing to 1 (0 for a row without a valid key).

    ``k`` ``(B, H, L, D)``; ``key_valid`` bool ``(B|1, L)`` or None; ``blocks``: an int (keys are in
    contiguous blocks of that many, ``L = n_blocks * blocks``) or a long ``(B, H, L)`` block index
    per key (values in ``[0, n_blocks)``)."""
    batch, heads, rows, _ = q_rows.shape
    length = k.shape[2]
    out = torch.zeros(batch, heads, rows, n_blocks, dtype=torch.float32, device=q_rows.device)
    bias = None
    if key_valid is not None:
        bias = torch.zeros(key_valid.shape[0], 1, 1, length, device=q_rows.device).masked_fill(
            ~key_valid.to(torch.bool)[:, None, None, :], float("-inf"))
    chunk = max(1, SCORE_BUDGET // max(1, batch * rows * length))
    for h0 in range(0, heads, chunk):
        h1 = min(heads, h0 + chunk)
        scores = (q_rows[:, h0:h1] @ k[:, h0:h1].transpose(-1, -2)).float().mul_(scale)
        if bias is not None:
            scores = scores + bias
        probs = torch.softmax(scores, dim=-1).nan_to_num_(0.0)
        if isinstance(blocks, int):
            out[:, h0:h1] = probs.view(batch, h1 - h0, rows, n_blocks, blocks).sum(-1)
        else:
            index = blocks[:, h0:h1, None, :].expand(batch, h1 - h0, rows, length)
            out[:, h0:h1].scatter_add_(-1, index, probs)
    return out


def stratified_rows(starts, sizes, samples, seed=0):
    """``(rows, weight)``: ``samples`` positions per block of a sequence cut into blocks at
    ``starts`` with ``sizes`` members (long tensors ``(..., n)``), one drawn uniformly from each of
    ``samples`` equal parts of the block (a fixed seed: the same rows every call); ``weight`` is 1,
    or 0 for an empty block (its position is then ``starts``)."""
    gen = torch.Generator().manual_seed(seed)
    u = torch.rand(samples, generator=gen, dtype=torch.float64).to(sizes.device)
    parts = (torch.arange(samples, device=sizes.device, dtype=torch.float64) + u) / samples
    offset = (parts * sizes[..., None].double()).floor().long()
    offset = torch.minimum(offset, (sizes[..., None] - 1).clamp(min=0))
    weight = (sizes > 0)[..., None].expand(*sizes.shape, samples).float()
    return starts[..., None] + offset, weight


def _segment_sum(x, blocks, n_blocks):
    """Sum of ``x`` ``(B, H, L, ...)`` per key block: ``(B, H, n_blocks, ...)``; ``blocks`` an int
    (contiguous blocks) or a long ``(B, H, L)`` index."""
    if isinstance(blocks, int):
        return x.view(*x.shape[:2], n_blocks, blocks, *x.shape[3:]).sum(3)
    out = x.new_zeros(*x.shape[:2], n_blocks, *x.shape[3:])
    index = blocks.view(*blocks.shape, *([1] * (x.dim() - 3))).expand_as(x)
    return out.scatter_add_(2, index, x)


def block_moments(k, key_valid, blocks, n_blocks):
    """Per key block of ``k`` ``(B, H, L, D)`` over its valid keys: ``(mean, var, count)`` float32,
    ``(B, H, n, D)``, ``(B, H, n, D)`` (per-dim variance) and ``(B|1, 1|H, n)``."""
    weight = torch.ones(1, 1, k.shape[2], device=k.device) if key_valid is None else \
        key_valid.to(torch.float32)[:, None, :]
    if not isinstance(blocks, int):
        weight = weight.expand(blocks.shape).contiguous()
    count = _segment_sum(weight, blocks, n_blocks)
    x = k.float() * weight[..., None]
    safe = count.clamp_min(1.0)[..., None]
    mean = _segment_sum(x, blocks, n_blocks) / safe
    var = (_segment_sum(x * k.float(), blocks, n_blocks) / safe - mean.square()).clamp_min_(0.0)
    return mean, var, count


def _segment_max(x, blocks, n_blocks):
    """Maximum of ``x`` ``(B, H, L, n)`` (non-negative) over the rows of each block: ``(B, H,
    n_blocks, n)`` (0 for an empty block); ``blocks`` as in ``_segment_sum``."""
    if isinstance(blocks, int):
        return x.view(*x.shape[:2], n_blocks, blocks, *x.shape[3:]).amax(3)
    out = x.new_zeros(*x.shape[:2], n_blocks, *x.shape[3:])
    return out.scatter_reduce_(2, blocks[..., None].expand_as(x), x, reduce="amax", include_self=True)


def block_key_sample(k, key_valid, blocks, n_blocks, count, per_block):
    """Up to ``per_block`` valid keys of every key block, spread evenly over the block (every key
    of a block that has at most that many): ``(keys (B, H, n, r, D) float32, used (B, H, n, r) bool,
    log_count (B, H, n), log_taken (B, H, n))`` with ``r = per_block``: the slots a block fills,
    ``log`` of its valid keys and of the slots it fills (``-inf`` for an empty block).
    ``count`` ``(B|1, 1|H, n)``: the valid keys per block (``block_moments``)."""
    batch, heads, length, dim = k.shape
    index = blocks if not isinstance(blocks, int) else \
        (torch.arange(length, device=k.device) // blocks).expand(batch, heads, length)
    if key_valid is not None:  # invalid keys sort after every block
        index = torch.where(key_valid.to(device=k.device, dtype=torch.bool)[:, None, :], index, n_blocks)
    order = torch.sort(index, dim=-1, stable=True).indices  # keys grouped by block, model order inside
    count = count.expand(batch, heads, n_blocks).long()
    starts = count.cumsum(-1) - count
    slot = torch.arange(per_block, device=k.device)
    taken = count.clamp(max=per_block)
    # slot t of a block of n keys: its key floor((t + 1/2) n / r) when n > r, else key t
    offset = torch.where(count[..., None] > per_block, ((2 * slot + 1) * count[..., None]) // (2 * per_block),
                         slot.expand(*count.shape, per_block))
    used = slot < taken[..., None]
    position = (starts[..., None] + offset).clamp(max=length - 1) * used
    key_index = order.gather(-1, position.view(batch, heads, -1))
    keys = k.float().gather(2, key_index[..., None].expand(-1, -1, -1, dim)).view(batch, heads, n_blocks, per_block,
                                                                                 dim)
    keys = keys.masked_fill(~used[..., None], 0.0)
    log_taken = torch.where(taken > 0, taken.clamp(min=1).float().log(), torch.full_like(taken, float("-inf"),
                                                                                          dtype=torch.float32))
    log_count = torch.where(count > 0, count.clamp(min=1).float().log(), torch.full_like(count, float("-inf"),
                                                                                         dtype=torch.float32))
    return keys, used, log_count, log_taken


#: least rows per tile in ``refine_top_blocks`` (the rows that chose one key block are scored
#: against its sampled keys in tiles of at least this many rows, and of at least the block's slots,
#: so that reading the block's keys costs no more than reading the rows).
REFINE_ROWS = 32


def refine_top_blocks(logits, q, sample, h0, h1, scale, top):
    """In place: ``logits`` ``(B, h, L, n)`` of rows ``q`` ``(B, h, L, D)`` (heads ``h0:h1``) get,
    on each row's ``top`` largest entries, ``log n_j + log mean exp(scale q . k)`` over block
    ``j``'s sampled keys (``block_key_sample``).

    Grouped by key block, not gathered per row (a key gather per row moves ``D`` floats per score):
    the (row, block) choices are sorted by block, cut into tiles of ``max(REFINE_ROWS, slots)`` rows
    of one block, and each tile is one ``(rows, D) @ (D, slots)`` matmul against that block's keys,
    read once per tile. Scores: the chosen ones (``top x slots`` per row) plus at most one tile per
    block of padding; no host sync."""
    keys, used, log_count, log_taken = (t[:, h0:h1] for t in sample)
    batch, heads, rows, n = logits.shape
    per_block, dim = keys.shape[-2], keys.shape[-1]
    tile_rows = max(REFINE_ROWS, per_block)
    chosen = logits.topk(top, dim=-1).indices  # (B, h, L, top)
    head = torch.arange(batch * heads, device=q.device).view(batch, heads, 1, 1)
    block = (head * n + chosen).view(-1)  # each choice's block among all (b, h) blocks
    block, order = torch.sort(block, stable=True)
    count = torch.bincount(block, minlength=batch * heads * n)
    tiles = -(-count // tile_rows)
    first_tile = tiles.cumsum(0) - tiles
    rank = torch.arange(block.numel(), device=q.device) - (count.cumsum(0) - count)[block]
    tile = first_tile[block] + rank // tile_rows
    slot = tile * tile_rows + rank % tile_rows  # each sorted choice's place in the tiles
    # sum_j ceil(c_j / T) <= C / T + (blocks): a bound known from the shapes, so no host sync; the
    # tiles past the real ones score row 0 against block 0 and are never read
    n_tiles = -(-block.numel() // tile_rows) + batch * heads * n
    row_of = torch.zeros(n_tiles * tile_rows, dtype=torch.long, device=q.device)
    row_of[slot] = order // top  # the choice's row among all (b, h, row); padding reads row 0
    block_of = torch.zeros(n_tiles, dtype=torch.long, device=q.device).scatter_(0, tile, block)
    q_rows = q.float().reshape(-1, dim) * scale
    keys = keys.reshape(-1, per_block, dim)
    unused = torch.zeros(used.shape, device=q.device).masked_fill_(~used, float("-inf")).view(-1, 1, per_block)
    offset = torch.where(torch.isfinite(log_taken), log_count - log_taken, torch.full_like(log_taken, float("-inf")))
    offset = offset.reshape(-1)
    values = torch.empty(n_tiles, tile_rows, device=q.device)
    step = max(1, SCORE_BUDGET // (tile_rows * per_block + (tile_rows + per_block) * dim))
    for t0 in range(0, n_tiles, step):
        b = block_of[t0:t0 + step]
        rows_here = q_rows[row_of[t0 * tile_rows:(t0 + step) * tile_rows]].view(-1, tile_rows, dim)
        scores = torch.bmm(rows_here, keys[b].transpose(-1, -2)).add_(unused[b])  # (tiles, rows, slots)
        top_score = scores.amax(-1, keepdim=True)  # log sum exp in place: the scores are the big tensor
        top_score = torch.where(torch.isfinite(top_score), top_score, torch.zeros_like(top_score))
        total = scores.sub_(top_score).exp_().sum(-1).log_()
        values[t0:t0 + step] = total + top_score.squeeze(-1) + offset[b][:, None]
    refined = torch.empty(block.numel(), device=q.device)
    refined[order] = values.view(-1)[slot]  # back to (b, h, row, top) order
    logits.scatter_(-1, chosen, refined.view_as(chosen))


@torch.no_grad()  # a selection estimate: nothing differentiates through it (training calls select too)
def rowwise_block_masses(q, k, key_valid, q_blocks, n_q, k_blocks, n_k, scale, query_valid=None, spread=True,
                         row_max=False, refine=0, refine_keys=256):
    """Predicted mass of every query row on every key block, averaged per query block: float32
    ``(B, H, n_q, n_k)`` (rows summing to 1; 0 for a query block without a valid row).

    Row ``i``'s predicted mass on key block ``j`` (``n_j`` valid keys, mean ``kbar_j``, per-dim
    variance ``var_j``) is ``softmax_j(scale q_i . kbar_j + log n_j + c_ij)`` with the key-spread
    term ``c_ij = (scale^2 / 2) sum_d q_id^2 var_jd`` (``spread=True``): the second-order (log-normal)
    estimate of ``log mean_{k in j} exp(scale q_i . (k - kbar_j))``, exact when the scores of a
    block are Gaussian with independent dims; without it the softmax estimates ``n_j exp(mean
    score)``, which Jensen's inequality puts below the true block sum. Every query row is scored
    (``n_k`` scores per row: ``n_k / L`` of dense attention's, twice with ``spread``), so a query
    block whose rows attend to different key blocks gets all of them (its mean is exact in the
    rows; only the within-key-block spread is modelled). ``q_blocks`` / ``k_blocks``: an int
    (contiguous blocks of that size) or a long ``(B, H, L)`` block index; ``query_valid``
    ``(B|1, S)``: rows left out of the mean. ``row_max=True`` also returns the largest predicted
    mass any single valid row of the query block puts on each key block (same shape): what
    dropping that key block would cost the row that needs it most.

    ``refine = m > 0``: each row's ``m`` key blocks of largest estimate are scored again from
    their keys (``block_key_sample``: all of them for a block of at most ``refine_keys`` valid keys,
    else ``refine_keys`` spread evenly over the block), ``log n_j + log mean_t exp(scale q_i .
    k_t)`` in place of the second-order term, before the softmax. Why: the log-normal term assumes
    Gaussian scores inside a block; on sharp, local heads they are not (bounded above by the
    nearest key, correlated across dims), so it misjudges the few blocks a row really attends to
    and with them the row's normaliser (issue 23: a row guard driven by it forced the wrong key
    clusters, 2.3x the oracle's error; with 4 exact blocks per row 0.94x). A sample of a large
    block is biased low on a sharp head (it misses the few keys a row attends to: 16 keys per
    block let temporal rows lose a cluster, 18x the oracle), so callers should let
    ``refine_keys`` cover their blocks (svg2: 256). Cost: ``m * min(refine_keys, 4 L / n_k)`` more
    scores per row (blocks padded to that; a block of more than 4x the mean size is sampled), as
    matmuls per key block (``refine_top_blocks``)."""
    batch, heads, seq, dim = q.shape
    mean, var, count = block_moments(k, key_valid, k_blocks, n_k)
    sample = None
    if refine > 0:  # slots per block: refine_keys, at most 4x the mean block (a shape: no host sync)
        sample = block_key_sample(k, key_valid, k_blocks, n_k, count, min(refine_keys, 4 * -(-k.shape[2] // n_k)))
    log_count = torch.where(count > 0, count.clamp_min(1.0).log(), torch.full_like(count, float("-inf")))
    weight = torch.ones(1, 1, seq, device=q.device) if query_valid is None else \
        query_valid.to(torch.float32)[:, None, :]
    if not isinstance(q_blocks, int):
        weight = weight.expand(q_blocks.shape).contiguous()
    out = torch.zeros(batch, heads, n_q, n_k, dtype=torch.float32, device=q.device)
    most = torch.zeros_like(out) if row_max else None
    chunk = max(1, SCORE_BUDGET // max(1, batch * seq * n_k))
    for h0 in range(0, heads, chunk):
        h1 = min(heads, h0 + chunk)
        qh = q[:, h0:h1].float()
        counts = log_count[:, h0:h1] if log_count.shape[1] > 1 else log_count  # one count row shared by the heads
        logits = (qh @ mean[:, h0:h1].transpose(-1, -2)).mul_(scale) + counts[:, :, None, :]
        if spread:
            logits += (qh.square() @ var[:, h0:h1].transpose(-1, -2)).mul_(0.5 * scale * scale)
        if sample is not None:
            refine_top_blocks(logits, qh, sample, h0, h1, scale, min(refine, n_k))
        probs = torch.softmax(logits, dim=-1).nan_to_num_(0.0)
        w = weight if weight.shape[1] == 1 else weight[:, h0:h1]
        qb = q_blocks if isinstance(q_blocks, int) else q_blocks[:, h0:h1]
        out[:, h0:h1] = _segment_sum(probs * w[..., None], qb, n_q)
        if row_max:
            most[:, h0:h1] = _segment_max(probs * w[..., None], qb, n_q)
    rows = _segment_sum(weight[..., None], q_blocks, n_q)  # (B|1, 1|H, n_q, 1)
    mean = out / rows.clamp_min(1.0)
    return (mean, most) if row_max else mean


def representative_rows(x, valid, samples):
    """``(rows, weight)`` float32: per block of ``x`` ``(B, H, n, b, D)`` (contiguous blocks of ``b``
    rows), ``samples`` representative rows chosen by farthest-point sampling (the first: the valid
    row nearest the block's mean; each next: the valid row farthest from those chosen) and each
    one's weight, the number of valid rows nearest to it. ``valid`` ``(B|1, n, b)`` bool. Rows
    ``(B, H, n, samples)`` index ``b``; a block without a valid row gets weight 0."""
    xf = x.float()
    batch, heads, n, b, _ = x.shape
    ok = valid[:, None].expand(batch, heads, n, b)
    mean = (xf * ok[..., None]).sum(3, keepdim=True) / ok.sum(3, keepdim=True).clamp_min(1)[..., None]
    far = torch.full(ok.shape, -1.0, device=x.device)
    nearest = ((xf - mean).square().sum(-1)).masked_fill(~ok, float("inf")).argmin(-1)
    rows = [nearest]
    best = torch.full(ok.shape, float("inf"), device=x.device)
    for _ in range(samples - 1):
        chosen = xf.gather(3, rows[-1][..., None, None].expand(batch, heads, n, 1, xf.shape[-1]))
        best = torch.minimum(best, (xf - chosen).square().sum(-1))
        rows.append(torch.where(ok, best, far).argmax(-1))
    rows = torch.stack(rows, -1)  # (B, H, n, s)
    chosen = xf.gather(3, rows[..., None].expand(*rows.shape, xf.shape[-1]))  # (B, H, n, s, D)
    distance = torch.cdist(xf, chosen)  # (B, H, n, b, s)
    owner = distance.argmin(-1)
    weight = torch.zeros(*rows.shape, device=x.device).scatter_add_(-1, owner, ok.float())
    return rows, weight
