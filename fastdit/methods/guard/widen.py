"""The guard's first widening of a failed block-sparse head: key blocks added by exact scores of its rows.

When the quality guard (``methods/guard``) finds a head of a block-sparse call over its bound, exact
attention of a few query rows per query block says which key blocks the plan dropped and how much
of the attention mass and output each carried; the head is widened with those blocks instead of
re-selecting at a looser threshold (issue 39: "key blocks or clusters added in order of the
sampled rows' exact scores"). Per (batch, head), with ``P`` the
exact softmax of the rows (float32, valid keys only)::

    M[r, j]  = sum_{t in key block j} P[r, t]          mass of key block j for row r
    W[r, j]  = sum_{t in key block j} P[r, t] v_t      its share of row r's exact output o_r = sum_j W[r, j]
    A[i, j]  = mean_{r in query block i} M[r, j]

and for each query block ``i`` its blocks are walked in the order: the plan's kept blocks, then the
dropped ones by decreasing ``A[i, j]``. Over a prefix ``J`` a row's output would be
``sum_{j in J} W[r, j] / sum_{j in J} M[r, j]``; ``plan'(i)`` is the shortest prefix whose rows'
relative L2 error against ``o_r`` is at most ``guard / 2`` and whose mean kept mass is at least the
method's promise (``cdf`` / ``top_p``; none: 0). A mass target alone does not bound the error:
on a diffuse head ``||o||`` is small (an average of many values), so 3% of dropped mass can
cost 12% of error (seen on the guard benchmark's offset-norm heads); the prefix is chosen on the
error itself, with half the bound as margin for the rows the guard re-checks on.

The rows are ``ROWS_PER_BLOCK`` tokens of every query block, spread over it (``block_rows``): every
query block is judged by rows of its own (the guard's sampled rows follow model order, which
svg2's clusters and svg's orders do not), and the widened plan depends on the call's inputs only.

The plan's own kernel order is kept (sliding tile's tile order, svg's per-head order, svg2's
clusters, with their block sizes): only each query block's key-block list grows, in the plan's
own blocks. Keys are read through the plan's token-to-block maps, so text tokens and padding need
no case of their own. The head then runs on its widened plan through the engine, with the
method's ``pooled`` / ``ear`` correction for what is still dropped (``ear``: the routed plan is
widened). Not used for ``correction="cached"`` (its cached residual belongs to the plan it was
stored for), for methods whose output is more than the plan's engine call (sla, vsa, skip_softmax:
``Method.guard_scores_widen`` False) or when the call recorded no plan; the guard then goes on to
the method's wider settings and dense.

Cost per widened head: ``n = ROWS_PER_BLOCK x Mq`` rows x ``S`` keys of scores and ``P V``
(``4 / block_m`` of the head's dense attention: 6% with 64-token blocks), ``n x Mk x Dv`` prefix
sums, and the re-run on the widened plan.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from fastdit.plan import run_plan

#: Per-head tensors of the block plans (``BlockPlan``, svg's ``HeadOrderPlan``, svg2's ``ClusterPlan``).
HEAD_FIELDS = ("kv_indices", "kv_counts", "head_orders", "head_inverses", "choice", "q_order", "q_inverse",
               "k_order", "q_offsets", "k_offsets", "q_blocks", "k_blocks")

__all__ = ["head_plan", "row_block_sums", "block_rows", "grown_lists", "widen_head", "widenable"]


def widenable(method, ctx):
    """Whether this call's failed heads can be widened by scores: a method whose output is the
    plan's engine call (plus a ``pooled`` / ``ear`` correction) and a recorded plan."""
    from fastdit.plan import BlockPlan

    if not getattr(method, "guard_scores_widen", False):
        return False
    if getattr(method.config, "correction", "none") == "cached":
        return False
    return isinstance(ctx.info.get("plan"), BlockPlan)


def head_plan(plan, head):
    """The plan of one head of the call (per-head fields sliced; fields shared by all heads kept)."""
    changes = {}
    for name in HEAD_FIELDS:
        tensor = getattr(plan, name, None)
        if isinstance(tensor, torch.Tensor) and tensor.dim() >= 2 and tensor.shape[1] > 1:
            changes[name] = tensor[:, head:head + 1]
    return dataclasses.replace(plan, **changes) if changes else plan


def row_block_sums(q_rows, k, v, key_block, n_key_blocks, key_valid=None, scale=None):
    """Exact attention of some query rows, per key block: ``(mass (n, Mk), weighted (n, Mk, Dv))``
    float32, ``mass[r, j] = sum_{t in j} P[r, t]`` and ``weighted[r, j] = sum_{t in j} P[r, t] v_t``
    (so ``weighted[r].sum(0)`` is row ``r``'s exact output). ``q_rows`` ``(n, D)``, ``k, v``
    ``(S, D)``, ``key_block`` ``(S,)`` long, ``key_valid`` ``(S,)`` bool or None; rows with no valid
    key carry nothing. Chunked over rows (``n x S x Dv`` products at most ~8M floats at a time)."""
    scale = 1.0 / math.sqrt(q_rows.shape[-1]) if scale is None else scale
    scores = (q_rows.float() @ k.float().T) * scale
    if key_valid is not None:
        scores = scores.masked_fill(~key_valid[None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    rows, keys = probs.shape
    values = v.float()
    mass = torch.zeros(rows, n_key_blocks, dtype=torch.float32, device=probs.device).index_add_(1, key_block, probs)
    weighted = torch.zeros(rows, n_key_blocks, values.shape[-1], dtype=torch.float32, device=probs.device)
    step = max(1, (1 << 23) // max(1, keys * values.shape[-1]))
    for r in range(0, rows, step):
        weighted[r:r + step].index_add_(1, key_block, probs[r:r + step, :, None] * values[None])
    return mass, weighted


#: Rows each query block is judged by, besides the guard's own (spread evenly over the block).
ROWS_PER_BLOCK = 4


def block_rows(query_block, n_query_blocks, per_block=ROWS_PER_BLOCK):
    """``per_block`` tokens of every query block, spread evenly over the block's tokens (model
    order), ascending: the rows a widening is judged by. Chosen by position, not drawn: the widened
    plan then depends on the call's inputs alone (the guard's own rows are keyed to the CFG branch,
    and two identical calls must give identical outputs). Several per block, because rows of one
    block differ (measured: one row per block left the widened spatial heads of the structured
    generator at 0.18 error, four at 0.14)."""
    tokens = query_block.numel()
    device = query_block.device
    order = torch.argsort(query_block, stable=True)
    sizes = torch.bincount(query_block, minlength=n_query_blocks)
    starts = sizes.cumsum(0) - sizes
    rank = torch.empty(tokens, dtype=torch.long, device=device)
    rank[order] = torch.arange(tokens, device=device) - starts.index_select(0, query_block.index_select(0, order))
    targets = (torch.arange(per_block, device=device)[None, :] * sizes[:, None]) // per_block  # (Mq, per_block)
    return (rank[:, None] == targets.index_select(0, query_block)).any(1).nonzero().squeeze(1)


def grown_lists(kv_indices, kv_counts, mass, weighted, row_block, target_mass, target_error):
    """One head's key-block lists grown by the rows' exact scores (the module's rule).

    ``kv_indices`` ``(Mq, W)`` / ``kv_counts`` ``(Mq,)``: the plan's lists; ``mass`` / ``weighted``:
    ``row_block_sums`` of the rows; ``row_block`` ``(n,)``: each row's query block. Per query block
    with rows: its kept blocks, then the dropped ones in decreasing mean mass ``A``, the shortest
    such prefix whose rows' relative L2 error (their output over the prefix's keys against their
    exact output) is at most ``target_error`` and whose mean kept mass is at least ``target_mass``
    (all blocks of any mass when none is). Blocks of no mass are never added; query blocks without
    rows keep their lists. Returns ``(indices (Mq, W'), counts (Mq,))`` int32, each row's block ids
    ascending."""
    n_rows, n_blocks = mass.shape
    n_query_blocks = kv_counts.shape[0]
    device = mass.device
    width = kv_indices.shape[-1]
    used = (torch.arange(width, device=device)[None, :] < kv_counts[:, None].long()).int()
    kept = torch.zeros(n_query_blocks, n_blocks, dtype=torch.int32, device=device)
    kept = kept.scatter_add_(1, kv_indices.long().clamp(0, n_blocks - 1), used) > 0
    rows_in = torch.bincount(row_block, minlength=n_query_blocks).float()
    mean_mass = torch.zeros(n_query_blocks, n_blocks, device=device).index_add_(0, row_block, mass)
    mean_mass = mean_mass / rows_in.clamp(min=1)[:, None]
    order = torch.where(kept, 2.0 + mean_mass, mean_mass).sort(dim=1, descending=True, stable=True).indices
    row_order = order.index_select(0, row_block)  # each row walks its query block's order
    prefix_mass = torch.gather(mass, 1, row_order).cumsum(1)
    prefix_sum = torch.gather(weighted, 1, row_order[..., None].expand(-1, -1, weighted.shape[-1])).cumsum(1)
    exact = weighted.sum(1)
    prefix_out = prefix_sum / prefix_mass.clamp(min=1e-30)[..., None]
    row_error = ((prefix_out - exact[:, None]) ** 2).sum(-1)
    error = torch.zeros(n_query_blocks, n_blocks, device=device).index_add_(0, row_block, row_error)
    norm = torch.zeros(n_query_blocks, device=device).index_add_(0, row_block, (exact ** 2).sum(-1))
    block_mass = torch.zeros(n_query_blocks, n_blocks, device=device).index_add_(0, row_block, prefix_mass)
    block_mass = block_mass / rows_in.clamp(min=1)[:, None]
    n_kept = kept.sum(1)
    useful = n_kept + ((mean_mass > 0) & ~kept).sum(1)  # blocks of any mass: never more
    position = torch.arange(n_blocks, device=device)[None, :]
    within = (error <= target_error ** 2 * norm[:, None]) & (block_mass >= target_mass)
    good = within & (position + 1 >= n_kept[:, None])  # a prefix holds at least the kept blocks
    first_good = torch.where(good.any(1), good.int().argmax(1) + 1, useful)
    count = torch.minimum(torch.maximum(first_good, n_kept), torch.maximum(useful, n_kept))
    count = torch.where(rows_in > 0, count, n_kept)
    grown = torch.zeros(n_query_blocks, n_blocks, dtype=torch.bool, device=device)
    grown.scatter_(1, order, position.expand(n_query_blocks, -1) < count[:, None])
    grown |= kept
    counts = grown.sum(1)
    positions = position.expand(n_query_blocks, n_blocks)
    # ascending block ids of each row first, the rest after (the engine reads only counts[i] of them)
    indices = torch.where(grown, positions, positions + n_blocks).sort(1).values % n_blocks
    new_width = max(int(counts.max()), 1)
    return indices[:, :new_width].to(torch.int32).contiguous(), counts.to(torch.int32)


def widen_head(method, ctx, q, k, v, head, bound):
    """Re-run head ``head`` of the call on its plan widened by its rows' exact scores (``block_rows``).

    ``q, k, v``: the call's ``(B, H, S, D)``; returns ``(out (B, 1, S, D), lse (B, 1, S), density)``
    (``density``: the widened plan's share of the head's block pairs) or None when nothing can be
    added (every row already at its target: widening would change nothing)."""
    from ..corrections import pooled_correction, token_blocks

    plan = head_plan(ctx.info["plan"], head)
    batch = q.shape[0]
    # each model token's query / key block (B|1, 1, S): the same map pooled / ear corrections read
    query_blocks, key_blocks = token_blocks(plan, batch, 1, q.shape[2], q.device)[:2]
    plan_batch = plan.kv_indices.shape[0]
    n_query_blocks, n_key_blocks = plan.kv_counts.shape[-1], plan.num_kv_blocks
    promise = method.guard_promise()
    target_mass, target_error = (0.0 if promise is None else promise), bound / 2
    key_mask = None if ctx.key_mask is None else ctx.key_mask.to(device=q.device, dtype=torch.bool)
    query_mask = None if ctx.query_mask is None else ctx.query_mask.to(device=q.device, dtype=torch.bool)
    new_indices, new_counts, grew = [], [], False
    for pb in range(plan_batch):  # a plan shared by the batch is widened by all its elements' rows
        parts = []
        for b in (range(batch) if plan_batch == 1 else [pb]):
            row = min(b, query_blocks.shape[0] - 1)
            query_block, key_block = query_blocks[row, 0].long(), key_blocks[row, 0].long()
            live = block_rows(query_block, n_query_blocks)
            if query_mask is not None:
                live = live[query_mask[b].index_select(0, live)]
            sums = row_block_sums(q[b, head].index_select(0, live), k[b, head], v[b, head], key_block, n_key_blocks,
                                  None if key_mask is None else key_mask[b], ctx.scale)
            parts.append((*sums, query_block.index_select(0, live)))
        indices, counts = plan.kv_indices[pb, 0], plan.kv_counts[pb, 0]
        mass, weighted, row_block = (torch.cat(column) for column in zip(*parts))
        grown_indices, grown_counts = grown_lists(indices, counts, mass, weighted, row_block, target_mass,
                                                  target_error)
        grew = grew or bool((grown_counts > counts).any())
        new_indices.append(grown_indices)
        new_counts.append(grown_counts)
    if not grew:
        return None
    width = max(t.shape[-1] for t in new_indices)
    padded = [torch.nn.functional.pad(t, (0, width - t.shape[-1])) for t in new_indices]
    widened = dataclasses.replace(plan, kv_indices=torch.stack(padded)[:, None].contiguous(),
                                  kv_counts=torch.stack(new_counts)[:, None].contiguous(),
                                  name=f"{plan.name}_guard_widened")
    qh, kh, vh = q[:, head:head + 1], k[:, head:head + 1], v[:, head:head + 1]
    config = method.config
    out, lse = run_plan(qh, kh, vh, widened, key_mask=ctx.key_mask, query_mask=ctx.query_mask, scale=ctx.scale,
                              backend=ctx.backend, return_lse=True, quant=getattr(config, "quant", None))
    if getattr(config, "correction", "none") in ("pooled", "ear"):
        out = pooled_correction(qh, kh, vh, widened, out, lse, ctx.key_mask, ctx.query_mask, ctx.scale)
    return out, lse, float(widened.block_density_tensor().double().mean())
