"""A block plan under ring attention: each ring step is the rank's query shard against one key shard.

Diffusers' context parallelism cuts every input stream into equal chunks along the sequence; under
ring attention (``ring_degree = R``, possibly after a Ulysses all-to-all that joins the ``U``
chunks of a ring rank's group) ring rank ``r`` holds the queries at call positions
``r * L .. (r + 1) * L`` and, one ring step at a time, the keys and values of one shard ``s``
(diffusers' order: ``s = r, r + 1, ...`` modulo ``R``). ``ring_shards`` says, for every model-order
token, which shard holds it and where (``fastdit.layout.shard_order`` over ``R * U`` chunks).

A method's plan is built once per call over the whole sequence (global token positions, exactly as
in one process); ``shard_part`` cuts out of it the part of one ring step: the plan's query blocks
holding a token of shard ``r``, their kept key blocks holding a token of shard ``s`` (renumbered),
and, per sub-kernel position, the token's index in the local query / key shard (-1 where the
block's token belongs to another shard: a query row that is dropped, a key that is masked). Each
token sits in exactly one shard, so the steps' key sets are disjoint and together every kept key:
merging the steps' ``(out, lse)`` through the log-sum-exp (``merge_lse``, fastdit's own merge:
diffusers' ring merge takes no step without keys, whose lse is ``-inf``) gives the single-process
result up to rounding. A step whose part keeps no block pair is skipped without computing and
counted. Works for plans with one kernel order (``BlockPlan.perm``), per-head orders (svg's
``HeadOrderPlan.head_orders``) and variable-size cluster blocks (svg2's ``ClusterPlan``: its
kernel orders restricted to one shard's tokens keep every cluster contiguous, so the part is the
same cluster-pair list over the clusters' shard-local sizes, ``cluster_part``; empty blocks are
allowed by the variable-size engine).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fastdit.kernels import block_sparse_attention, block_sparse_attention_varlen
from fastdit.layout import shard_order

from ..base import methods_with
from ..corrections import merge_lse

def ring_methods():
    """The block-sparse methods whose plans ``shard_part`` / ``cluster_part`` cut (``Method.ring``
    and ``Method.block_sparse``), in rank order; dense runs under ring attention too."""
    return methods_with("ring", "block_sparse")


def ring_refusal(method):
    """None when ``method`` (a ``Method`` instance) runs under ring attention, else the reason."""
    name = getattr(method, "name", type(method).__name__)
    if not getattr(method, "ring", False):
        why = (f"{name} is a token method: it attends pooled, merged or cached tokens of the whole sequence, "
               "which one ring shard does not hold") if not getattr(method, "block_sparse", False) else (
            f"{name} declares no ring support (Method.ring)"
            + (f": {method.ring_reason}" if getattr(method, "ring_reason", None) else ""))
        return (f"method {name!r} does not run under ring attention ({why}); ring runs {', '.join(ring_methods())}. "
                "Use Ulysses context parallelism (ContextParallelConfig(ulysses_degree=N), every method) for it")
    if not getattr(method, "block_sparse", False):
        return None
    for variant in method.variants():
        config = variant.config
        if getattr(config, "correction", "none") != "none":
            return (f"{name} with correction={config.correction!r} does not run under ring attention (the correction "
                    "needs the dropped blocks of the whole key range); use correction='none' or Ulysses")
        if getattr(config, "skip_threshold", None) is not None:
            return (f"{name} with skip_threshold does not run under ring attention (the in-kernel skip rule compares "
                    "with a running maximum over the whole key range); leave it None or use Ulysses")
    return None


def ring_shards(layout, ring, ulysses=1):
    """``(shard, local)``: long ``(S,)`` ring shard holding each model-order token and its position
    in that shard's local sequence; None when the streams do not split into ``ring * ulysses``
    equal chunks (diffusers' rule)."""
    order = shard_order(layout, ring * ulysses)
    if order is None:
        return None
    length = layout.seq_len // ring
    return order // length, order % length


def _kernel_order(plan):
    """Model token at each kernel position, ``(1|B, 1|H, L)``, -1 for padding slots."""
    orders = getattr(plan, "head_orders", None)
    if orders is None:
        orders = plan.perm if plan.perm is not None else torch.arange(plan.seq_len, device=plan.kv_counts.device)
        orders = orders.view(1, 1, -1)
    if plan.kv_valid is not None:
        orders = torch.where(plan.kv_valid.view(1, 1, -1).to(orders.device), orders, -1)
    return orders


@dataclass
class RingParts:
    """One ring step's part of a plan, in sub-kernel order (``(1|B, 1|H, ...)`` tensors).

    ``q_index`` / ``k_index``: position in the local query / key shard of each sub-kernel row /
    column, -1 where the token belongs to another shard; ``kv_indices`` / ``kv_counts``: the part's
    plan over the sub-kernel's blocks; ``pairs``: its computed block pairs (all heads)."""

    q_index: torch.Tensor
    k_index: torch.Tensor
    kv_indices: torch.Tensor
    kv_counts: torch.Tensor
    block_m: int
    block_n: int
    pairs: int


def _first(flags, count):
    """Indices of the True entries of ``flags`` (last dim) first, in order, cut to ``count``."""
    return torch.argsort((~flags).to(torch.int8), dim=-1, stable=True)[..., :count]


def _positions(blocks, ok, size, owned, local, length):
    """Local index of every token of the chosen blocks (``-1``: another shard's token or padding)."""
    pos = (blocks[..., None] * size + torch.arange(size, device=blocks.device)).flatten(-2)
    inside = (pos < length) & ok.repeat_interleave(size, -1)
    pos = pos.clamp(max=length - 1)
    mine = owned.expand(*pos.shape[:2], length).gather(-1, pos) & inside
    return torch.where(mine, local.expand(*pos.shape[:2], length).gather(-1, pos), -1)


def shard_part(plan, shard, local, q_shard, k_shard):
    """The part of ``plan`` for queries of shard ``q_shard`` against keys of shard ``k_shard``
    (``shard`` / ``local`` from ``ring_shards``), or None when it keeps no block pair."""
    order = _kernel_order(plan)
    length, bm, bn = order.shape[-1], plan.block_m, plan.block_n
    where = torch.where(order >= 0, shard.to(order.device)[order.clamp(min=0)], -1)
    at = torch.where(order >= 0, local.to(order.device)[order.clamp(min=0)], -1)
    n_m, n_n = -(-length // bm), -(-length // bn)

    def has(size, n, which):
        return (F.pad(where, (0, n * size - length), value=-1).view(*where.shape[:2], n, size) == which).any(-1)

    q_has, k_has = has(bm, n_m, q_shard), has(bn, n_n, k_shard)
    index, counts = plan.kv_indices.long(), plan.kv_counts.long()
    batch, heads = max(index.shape[0], order.shape[0]), max(index.shape[1], order.shape[1])
    index = index.expand(batch, heads, *index.shape[2:])
    width = index.shape[-1]
    keep = (torch.arange(width, device=index.device) < counts[..., None]) & q_has[..., None]
    keep &= k_has.expand(batch, heads, n_n).gather(-1, index.clamp(0, n_n - 1).flatten(-2)).view_as(index)
    pairs = int(keep.sum())
    if pairs == 0:
        return None
    n_q, n_k = q_has.sum(-1), k_has.sum(-1)
    q_blocks, k_blocks = _first(q_has, int(n_q.max())), _first(k_has, int(n_k.max()))
    q_ok = torch.arange(q_blocks.shape[-1], device=index.device) < n_q[..., None]
    k_ok = torch.arange(k_blocks.shape[-1], device=index.device) < n_k[..., None]
    renumber = k_has.long().cumsum(-1) - 1  # key block -> its index among the shard's key blocks
    rows = q_blocks.expand(batch, heads, -1)[..., None].expand(-1, -1, -1, width)
    keep = keep.gather(-2, rows) & q_ok.expand(batch, heads, -1)[..., None]
    new = renumber.expand(batch, heads, n_n).gather(-1, index.gather(-2, rows).clamp(0, n_n - 1).flatten(-2))
    new = new.view_as(keep)
    front = _first(keep, width)  # kept entries first
    sub_counts = keep.sum(-1)
    used = int(sub_counts.max())
    sub_index = torch.where(keep.gather(-1, front), new.gather(-1, front), 0)[..., :used]
    owned_q, owned_k = where == q_shard, where == k_shard
    return RingParts(_positions(q_blocks, q_ok, bm, owned_q, at, length),
                     _positions(k_blocks, k_ok, bn, owned_k, at, length),
                     sub_index.to(torch.int32).contiguous(), sub_counts.to(torch.int32).contiguous(), bm, bn, pairs)


def _rows(tensor, index):
    """``tensor`` ``(B, H, L, D)`` rows at ``index`` ``(1|B, 1|H, N)`` (clamped), as ``(B*H, 1, N, D)``."""
    batch, heads, length, dim = tensor.shape
    index = index.expand(batch, heads, -1).clamp(min=0)
    flat = index + (torch.arange(batch * heads, device=tensor.device) * length).view(batch, heads, 1)
    return tensor.reshape(-1, dim).index_select(0, flat.reshape(-1)).view(batch * heads, 1, -1, dim)


def run_part(q, k, v, part, key_mask=None, scale=None, backend="auto"):
    """``(out, lse)`` ``(B, H, Lq, D)`` float32 / ``(B, H, Lq)`` of local queries ``q`` against one
    key shard ``k, v`` ``(B, H, Lk, D)`` under ``part``; ``key_mask`` ``(B, Lk)`` of the shard."""
    batch, heads = q.shape[:2]
    n_m = part.kv_counts.shape[-1]
    out, lse = block_sparse_attention(
        _rows(q, part.q_index), _rows(k, part.k_index), _rows(v, part.k_index),
        part.kv_indices.expand(batch, heads, -1, -1).reshape(batch * heads, 1, n_m, -1),
        part.kv_counts.expand(batch, heads, -1).reshape(batch * heads, 1, n_m), part.block_m, part.block_n,
        scale=scale, kv_valid=_key_valid(part.k_index, key_mask, q), return_lse=True, backend=backend,
        validate=False)
    return _to_local(out, lse, part.q_index, q)


def _key_valid(k_index, key_mask, q):
    """Bool ``(B*H, N)``: each sub-kernel column holds a key of the shard (``k_index >= 0``) that
    ``key_mask`` ``(B, Lk)`` (if any) keeps."""
    batch, heads = q.shape[:2]
    k_index = k_index.expand(batch, heads, -1)
    valid = k_index >= 0
    if key_mask is not None:
        keys = key_mask.to(device=q.device, dtype=torch.bool)[:, None, :].expand(batch, heads, -1)
        valid = valid & keys.gather(-1, k_index.clamp(min=0))
    return valid.reshape(batch * heads, -1)


def _to_local(out, lse, q_index, q):
    """Sub-kernel rows ``out`` ``(B*H, 1, N, D)`` / ``lse`` back at their local query positions
    ``q_index`` ``(1|B, 1|H, N)`` (-1: another shard's row, dropped): float32 ``(B, H, L, D)`` and
    ``(B, H, L)``, zeros and ``-inf`` where no row landed."""
    batch, heads, length, dim = q.shape
    q_index = q_index.expand(batch, heads, -1)
    mine = (q_index >= 0).reshape(-1)
    target = (q_index + (torch.arange(batch * heads, device=q.device) * length).view(batch, heads, 1)).reshape(-1)[mine]
    full_out = q.new_zeros(batch * heads * length, dim, dtype=torch.float32)
    full_lse = torch.full((batch * heads * length,), float("-inf"), device=q.device)
    full_out[target] = out.reshape(-1, dim)[mine].float()
    full_lse[target] = lse.reshape(-1)[mine]
    return full_out.view(batch, heads, length, dim), full_lse.view(batch, heads, length)


@dataclass
class ClusterPart:
    """One ring step's part of a variable-size cluster plan (svg2), ``(B, H, ...)`` tensors.

    ``q_index`` / ``k_index`` ``(B, H, L)``: local query / key shard position at each sub-kernel
    row / column (every shard token once, clusters contiguous); ``q_offsets`` / ``k_offsets``: the
    clusters' boundaries over the shard's tokens (empty clusters allowed); ``kv_indices`` /
    ``kv_counts``: the plan's own cluster pairs; ``pairs``: kept cluster pairs with tokens on both sides."""

    q_index: torch.Tensor
    k_index: torch.Tensor
    q_offsets: torch.Tensor
    k_offsets: torch.Tensor
    kv_indices: torch.Tensor
    kv_counts: torch.Tensor
    pairs: int


def _shard_clusters(order, offsets, shard, local, which, length):
    """Kernel order ``order`` ``(B, H, S)`` (clusters at ``offsets``) cut to the tokens of shard
    ``which``: their local positions ``(B, H, length)`` in kernel order, the cut clusters' offsets
    (int32) and sizes."""
    owned = shard.to(order.device)[order] == which
    positions = torch.arange(order.shape[-1], device=order.device).expand_as(order).contiguous()
    cluster = torch.searchsorted(offsets.long().contiguous(), positions, right=True) - 1
    sizes = torch.zeros(*order.shape[:2], offsets.shape[-1] - 1, dtype=torch.long, device=order.device)
    sizes.scatter_add_(-1, cluster, owned.long())
    tokens = order.gather(-1, _first(owned, length))  # stable: each cluster's tokens stay together, in order
    return local.to(order.device)[tokens], F.pad(sizes.cumsum(-1), (1, 0)).to(torch.int32), sizes


def cluster_part(plan, shard, local, q_shard, k_shard):
    """The part of a ``ClusterPlan`` for queries of shard ``q_shard`` against keys of shard
    ``k_shard``, or None when no kept cluster pair has tokens of both shards."""
    length = int((shard == q_shard).sum())
    q_index, q_offsets, q_sizes = _shard_clusters(plan.q_order, plan.q_offsets, shard, local, q_shard, length)
    k_index, k_offsets, k_sizes = _shard_clusters(plan.k_order, plan.k_offsets, shard, local, k_shard, length)
    kept = plan.kept_pairs() & (q_sizes > 0)[..., :, None] & (k_sizes > 0)[..., None, :]
    pairs = int(kept.sum())
    if pairs == 0:
        return None
    return ClusterPart(q_index, k_index, q_offsets, k_offsets, plan.kv_indices, plan.kv_counts, pairs)


def run_cluster_part(q, k, v, part, key_mask=None, scale=None, backend="auto"):
    """``(out, lse)`` of local queries ``q`` against one key shard under a ``ClusterPart``
    (the arguments and results of ``run_part``)."""
    batch, heads = q.shape[:2]
    groups = batch * heads
    n_m, width = part.kv_indices.shape[-2:]

    def flat(t, last):
        return t.expand(batch, heads, *t.shape[2:]).reshape(groups, 1, *last)

    out, lse = block_sparse_attention_varlen(
        _rows(q, part.q_index), _rows(k, part.k_index), _rows(v, part.k_index), flat(part.q_offsets, (-1,)),
        flat(part.k_offsets, (-1,)), flat(part.kv_indices, (n_m, width)), flat(part.kv_counts, (n_m,)),
        scale=scale, kv_valid=None if key_mask is None else _key_valid(part.k_index, key_mask, q),
        return_lse=True, backend=backend, validate=False)
    return _to_local(out, lse, part.q_index, q)  # every local query lands exactly once


def ring_attend(plan, q, key_shard, shard, local, rank, ring, scale=None, backend="auto"):
    """The rank's queries ``q`` ``(B, H, L, D)`` (shard ``rank``) against every key shard, one ring
    step at a time in diffusers' order; ``key_shard(s)`` gives ``(k, v, key_mask or None)`` of
    shard ``s``. Returns ``(out float32, lse, steps computed, steps skipped, block pairs)``."""
    out = lse = None
    skipped = pairs = 0
    clusters = getattr(plan, "q_offsets", None) is not None  # svg2's variable-size cluster blocks
    cut, run = (cluster_part, run_cluster_part) if clusters else (shard_part, run_part)
    for step in range(ring):
        target = (rank + step) % ring
        part = cut(plan, shard, local, rank, target)
        if part is None:  # no kept block of this key shard for these queries: nothing to compute
            skipped += 1
            continue
        k, v, key_mask = key_shard(target)
        part_out, part_lse = run(q, k, v, part, key_mask, scale, backend)
        pairs += part.pairs
        out, lse = (part_out, part_lse) if out is None else merge_lse(out, lse, part_out, part_lse)
    if out is None:
        out = q.new_zeros(q.shape, dtype=torch.float32)
        lse = torch.full(q.shape[:-1], float("-inf"), device=q.device)
    return out, lse, ring - skipped, skipped, pairs
