"""The quality guard under ring attention: every rank decides as one process would (issue 39).

Under ring attention rank ``r`` holds the call's queries of ring shard ``r`` (``ring_shards``:
diffusers' equal chunks of each stream; no balancing order is applied at run time, see
``balance.py``) and attends the key shards one ring step at a time. The guard (``methods/guard.py``)
runs there with the decisions of one process on the same full-sequence call:

1. **The same rows.** ``sample_rows`` over the global sequence length ``S`` with the same key
   (layer, step, branch, round): rows in model token order, each rank taking those that fall in its
   query shard (at their local positions).
2. **Gathered to every rank** (``spread``): the sampled rows' queries, the method's output rows and
   their lse, each rank filling its own rows and zeros elsewhere, joined by one all-reduce (a sum
   with one non-zero term per entry: exact), so that every rank holds all ``n`` sampled rows in
   global order; the finiteness flag of the rank's queries and key shard rides along.
3. **Exact rows against every key** (``ring_exact_rows``): each rank attends all ``n`` rows to its
   own key shard (``exact_rows``, the shard's key mask) and the partial ``(out, lse)`` of every rank
   are all-gathered and merged exactly through the log-sum-exp (``merge_partials``, the same on
   every rank).
4. **One estimate.** Every rank runs ``estimate`` on the same gathered rows: the same per-head
   error, bound and kept mass (bitwise the same on every rank; against one process they differ by
   float rounding only: the exact rows are merged over shards, the method's output comes from the
   ring's merge), hence the same failed heads and the same actions on every rank, with no further
   agreement needed.
5. **Actions through the ring.** A failed head is re-run at the method's wider setting
   (``guard_widened``): its plan is selected over the whole sequence (dynamic methods from the
   gathered queries, keys and values in model order, as the ring call does) and run one ring step
   per key shard (``ring_attend``), then checked again the same way on the round's fresh rows
   (keyed to the global head index); when no wider setting is left, or it fails, the head runs dense
   through the ring (its local queries against each key shard, exact, merged through the lse).
   Levels are remembered per (layer, branch, global head) as in one process. Where the guard first
   widens a block-sparse head by the sampled rows' exact scores (``widen_head``, a method's
   ``guard_scores_widen``), the ring runs that level as one process does, on the call's queries,
   keys and values gathered in model order (the same on every rank), and keeps its own rows: the
   widened head is computed whole on every rank (``R`` times its work; a widened plan handed back
   apart from its run would let the ring cut it per shard).

``ctx.info["guard"]`` has the keys and values of one process (``rows``: the global ``n``;
``extra_density``: the same share of the call's dense work, which the rank's statistics count
against its own share of the call).

Cost beyond one process's check: per check (one per call, and one per re-run head) an all-reduce of
``B x H x n x (D_q + D_v + 1)`` floats (float32; float64 inputs: float64) and an all-gather of
``B x H x n x (D_v + 1)`` floats from each rank. The exact rows cost each rank ``n / S`` of its share
of dense work, as in one process (all ``n`` rows, against one key shard of ``S / R`` keys).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ..base import Method
from ..guard import (act_on_heads, all_finite, estimate, exact_rows, guard_report, head_context, head_fails,
                     head_run_density, remembered_levels, sample_rows, summarise)
from ..guard.widen import widen_head, widenable
from .ring import ring_attend

__all__ = ["RingCall", "merge_partials", "ring_exact_rows", "ring_check", "ring_guarded_call"]


@dataclass
class RingCall:
    """What the guard needs of one ring call (``intercept._ring_call``).

    ``shard`` / ``position``: ring shard and local position of each model-order token
    (``ring_shards``); ``k_all`` / ``v_all`` ``(B, H, S, D)`` and ``key_mask`` ``(B, S)`` in call
    order (ring rank 0's tokens, then 1's, ...): the key shards the ring steps read; ``q_model``:
    the queries of every rank in model order when the call gathered them (else gathered here)."""

    group: object
    rank: int
    ring: int
    shard: torch.Tensor
    position: torch.Tensor
    k_all: torch.Tensor
    v_all: torch.Tensor
    key_mask: Optional[torch.Tensor]
    backend: str = "auto"
    count_ring: Optional[Callable] = None
    q_model: Optional[torch.Tensor] = None
    _kv_model: Optional[tuple] = None

    @property
    def seq(self):
        return self.k_all.shape[2]

    @property
    def local(self):
        return self.seq // self.ring

    def order(self):
        """Call position of each model-order token."""
        return self.shard * self.local + self.position

    def key_shard(self, s, heads=slice(None)):
        """``(k, v, key_mask or None)`` of key shard ``s`` (heads ``heads``)."""
        part = slice(s * self.local, (s + 1) * self.local)
        mask = None if self.key_mask is None else self.key_mask[:, part]
        return self.k_all[:, heads, part], self.v_all[:, heads, part], mask

    def gathered_q(self, q):
        """Every rank's queries in model order (one all-gather, once per call; a collective: every
        rank asks at the same point, which the identical decisions guarantee)."""
        if self.q_model is None:
            parts = [torch.empty_like(q) for _ in range(self.ring)]
            dist.all_gather(parts, q.contiguous(), group=self.group)
            self.q_model = torch.cat(parts, 2).index_select(2, self.order().to(q.device))
        return self.q_model

    def model_kv(self):
        """Keys and values of the call in model order (every head)."""
        if self._kv_model is None:
            order = self.order().to(self.k_all.device)
            self._kv_model = (self.k_all.index_select(2, order), self.v_all.index_select(2, order))
        return self._kv_model

    def local_tokens(self, device):
        """Model token at each local query position of this rank."""
        inverse = torch.argsort(self.order().to(device))
        return inverse[self.rank * self.local:(self.rank + 1) * self.local]


def merge_partials(outs, lses):
    """Exact merge of attentions over disjoint key sets: ``outs`` ``(R, ..., n, D)``, ``lses``
    ``(R, ..., n)`` -> ``(out, lse)``; rows with no key anywhere give out 0 and lse -inf."""
    top = lses.amax(0)
    live = torch.isfinite(top)
    safe = torch.where(live, top, torch.zeros_like(top))
    weights = torch.where(live, torch.exp(lses - safe), torch.zeros_like(lses))
    total = weights.sum(0)
    out = (weights[..., None] * outs).sum(0) / total.clamp_min(1e-30)[..., None]
    lse = torch.where(live, safe + total.clamp_min(1e-30).log(), torch.full_like(top, float("-inf")))
    return out, lse


def ring_exact_rows(call, rows_q, scale=None, heads=slice(None)):
    """Dense attention of the gathered query rows ``rows_q`` ``(B, H, n, D)`` (the same on every
    rank) against every key: each rank's key shard, all-gathered and merged (``merge_partials``)."""
    k, v, mask = call.key_shard(call.rank, heads)
    out, lse = exact_rows(rows_q, k, v, torch.arange(rows_q.shape[2], device=rows_q.device), mask, scale)
    packed = torch.cat([out, lse[..., None].to(out.dtype)], -1).contiguous()
    parts = [torch.empty_like(packed) for _ in range(call.ring)]
    dist.all_gather(parts, packed, group=call.group)
    stacked = torch.stack(parts)
    return merge_partials(stacked[..., :-1], stacked[..., -1])


def spread(call, local_rows, mine, n, extra=None):
    """``local_rows`` ``(B, H, n_r, X)`` (this rank's sampled rows) at their places ``mine`` among the
    ``n`` rows, zeros elsewhere, summed over the ring: every rank's rows, exact (one non-zero term
    per entry). ``extra`` (a 1-D tensor) is summed along. Returns ``(rows (B, H, n, X), extra sum)``."""
    batch, heads, _, width = local_rows.shape
    full = local_rows.new_zeros(batch, heads, n, width)
    full[:, :, mine] = local_rows
    flat = full.flatten() if extra is None else torch.cat([full.flatten(), extra.to(full.dtype)])
    dist.all_reduce(flat, group=call.group)
    return flat[:full.numel()].view_as(full), (None if extra is None else flat[full.numel():])


def ring_check(call, q, out, lse, key, fraction, scale=None, heads=slice(None), finite=False):
    """The guard's check of a ring call's output: ``out`` ``(B, h, L, D)`` (and ``lse``, or None) of
    the local queries ``q`` (heads ``heads`` of the call) on the rows one process samples with
    ``key``. Returns ``(error, bound, mass, live, rows, finite)``: ``estimate``'s tensors (the same on
    every rank), the sampled rows (model positions) and, when asked, a device bool: every rank's
    queries and key shard are finite."""
    device = q.device
    rows = sample_rows(call.seq, fraction, key, device)
    n = rows.numel()
    mine = call.shard.to(device)[rows] == call.rank
    local_rows = call.position.to(device)[rows[mine]]
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    pieces = [q.index_select(2, local_rows).to(dtype), out.index_select(2, local_rows).to(dtype)]
    if lse is not None:
        pieces.append(lse.index_select(2, local_rows).to(dtype)[..., None])
    flag = None
    if finite:
        k, v, _ = call.key_shard(call.rank, heads)
        flag = (~all_finite(q, k, v)).to(dtype).reshape(1)
    gathered, bad = spread(call, torch.cat(pieces, -1), mine, n, flag)
    dim_q, dim_v = q.shape[-1], out.shape[-1]
    rows_q = gathered[..., :dim_q].to(q.dtype)  # exact: the values came from q
    rows_out = gathered[..., dim_q:dim_q + dim_v]
    rows_lse = None if lse is None else gathered[..., -1]
    ref_out, ref_lse = ring_exact_rows(call, rows_q, scale, heads)
    error, bound, mass, live = estimate(rows_out, ref_out, ref_lse, rows_lse)
    return error, bound, mass, live, rows, (None if bad is None else bad[0] == 0)


def ring_dense_head(call, q, h, scale=None):
    """Head ``h`` of the local queries ``q`` dense through the ring: against each key shard (exact
    rows, float32 accumulation), merged through the lse; ``(out in q's dtype, lse float32)``."""
    qh = q[:, h:h + 1]
    outs, lses = [], []
    for step in range(call.ring):
        k, v, mask = call.key_shard((call.rank + step) % call.ring, slice(h, h + 1))
        out, lse = exact_rows(qh, k, v, torch.arange(qh.shape[2], device=q.device), mask, scale)
        outs.append(out)
        lses.append(lse)
    out, lse = merge_partials(torch.stack(outs), torch.stack(lses))
    return out.to(q.dtype), lse.float()


def ring_widened(wider, head_ctx, call, q, h, scale=None):
    """Head ``h`` re-run by ``wider`` through the ring: its plan over the whole sequence (as the ring
    call selects), one ring step per key shard. Returns ``(out in q's dtype, lse or None)``."""
    heads = slice(h, h + 1)
    qh = q[:, heads]
    if type(wider).select is Method.select:  # a static plan
        plan = wider.select(head_ctx, qh, call.key_shard(call.rank, heads)[0])
    else:  # a dynamic selection from the whole sequence, in model order
        k_model, v_model = call.model_kv()
        head_ctx.info["values"] = v_model[:, heads]
        try:
            plan = wider.select(head_ctx, call.gathered_q(q)[:, heads], k_model[:, heads])
        finally:
            head_ctx.info.pop("values", None)
    if plan is None:  # a layout the wider setting computes densely
        head_ctx.info["dense"] = True
        return ring_dense_head(call, q, h, scale)[0], None
    head_ctx.record(plan=plan)
    out, lse, steps, skipped, pairs = ring_attend(plan, qh, lambda s: call.key_shard(s, heads), call.shard.to(q.device),
                                                  call.position.to(q.device), call.rank, call.ring, scale, call.backend)
    if call.count_ring is not None:
        call.count_ring(steps, skipped, pairs)
    return out.to(q.dtype), lse


def ring_scores_widened(method, ctx, call, q, h, bound):
    """Head ``h`` on its plan widened by its rows' exact scores (``guard/widen.py``) as one process
    computes it: on the call's queries, keys and values in model order (every rank the same), then
    this rank's rows. ``(out, lse, density)`` or None (nothing to add, or no plan to add to)."""
    if not widenable(method, ctx):
        return None
    k_model, v_model = call.model_kv()
    widened = widen_head(method, ctx, call.gathered_q(q), k_model, v_model, h, bound)
    if widened is None:
        return None
    out, head_lse, density = widened
    local = call.local_tokens(q.device)
    return out.index_select(2, local).to(q.dtype), head_lse.index_select(2, local), density


class _RingReruns:
    """``guard.act_on_heads``' re-runs and checks of a ring call (every rank the same heads)."""

    def __init__(self, method, ctx, call, q, bound, fraction, key):
        self.method, self.ctx, self.call, self.q = method, ctx, call, q
        self.bound, self.fraction, self.key = bound, fraction, key

    def scored(self, h):
        return ring_scores_widened(self.method, self.ctx, self.call, self.q, h, self.bound)

    def wider(self, wider, h):
        ctx, call, q = self.ctx, self.call, self.q
        head_ctx = head_context(ctx, h, lambda: ring_dense_head(call, q, h, ctx.scale)[0])
        result, head_lse = ring_widened(wider, head_ctx, call, q, h, ctx.scale)
        head_lse = head_lse if getattr(wider, "reports_lse", False) else None
        return result, head_lse, head_run_density(head_ctx.info)

    def dense(self, h):
        return ring_dense_head(self.call, self.q, h, self.ctx.scale)

    def check(self, h, result, head_lse, round_index):
        check_key = self.key + (round_index, self.ctx.head_offset + h)  # the global head: Ulysses x ring agree
        e, e_upper, m, alive, checked, _ = ring_check(self.call, self.q[:, h:h + 1], result, head_lse, check_key,
                                                      self.fraction, self.ctx.scale, heads=slice(h, h + 1))
        return e, e_upper, m, alive, checked.numel()


def ring_guarded_call(method, ctx, q, out, lse, call):
    """The guard on a ring call (``guard.guarded_call``'s decisions, reports and memory, through the
    same ``act_on_heads``): ``out`` ``(B, H, L, D)`` / ``lse`` ``(B, H, L)`` of the rank's queries ``q``
    as the ring computed them. Writes ``ctx.info["guard"]`` and returns the checked output (the same
    heads re-run on every rank)."""
    config = method.config
    limit, fraction, refresh = float(config.guard), float(config.guard_rows), int(config.guard_refresh)
    heads, seq = q.shape[1], call.seq
    memory, levels = remembered_levels(ctx, heads, refresh)
    started = time.perf_counter()
    promise = method.guard_promise()
    key = (ctx.layer, ctx.step, ctx.branch)
    own_lse = lse if getattr(method, "reports_lse", False) else None
    error, upper, mass, live, rows, finite = ring_check(call, q, out, own_lse, key + (0,), fraction, ctx.scale,
                                                        finite=True)
    failed = head_fails(upper, mass, live, limit, promise)
    errors, masses, fails, first, finite = summarise(error, upper, mass, failed, finite)
    n = rows.numel()
    extra = n / seq
    if not finite:
        ctx.info["guard"] = guard_report(errors, masses, first, n, ["nonfinite"] * heads, levels, [None] * heads,
                                         limit, promise, extra, started, nonfinite=True)
        return out
    reruns = _RingReruns(method, ctx, call, q, limit, fraction, key)
    replaced, final_density, actions, extra = act_on_heads(method, reruns, memory, ctx.head_offset, levels, fails,
                                                           errors, masses, limit, seq, extra)
    if replaced:
        out = out.clone()
        for h, (result, _) in replaced.items():
            out[:, h:h + 1] = result.to(out.dtype)
    ctx.info["guard"] = guard_report(errors, masses, first, n, actions, levels, final_density, limit, promise, extra,
                                     started)
    return out
