"""The quality guard: every sparse call checks its own error on sampled query rows (issue 39).

A sparse method trusts a threshold (``cdf``, ``top_p``, a pruning ratio) chosen offline; on heads
it never saw the threshold can keep a small fraction of the attention mass. The guard measures
each call instead. Per (batch, head) it

1. **samples query rows, stratified**: the call's ``S`` query positions (model token order) are cut
   into ``n = max(ceil(guard_rows * S), ceil(S / 128), min(S, 32))`` strata of equal length and one
   row is drawn in each (so every 128-token stretch, the size of an engine block, has a row); the
   draw is keyed to (layer, step, branch, round), never to a call counter, so the same call gives
   the same rows;
2. **attends those rows exactly**: float32 scores against every valid key (the call's key mask
   and scale), float32 softmax and ``P V`` (float64 for float64 inputs): ``O_d``, ``lse_d``;
3. **estimates the call's error and kept mass on them**::

       err  = || O_m[rows] - O_d ||_F / || O_d ||_F            (relative L2 over the sampled rows)
       mass = mean_rows exp(lse_m[rows] - lse_d)                 (block-sparse methods: their lse)

   The estimate assumes the sampled rows represent the head: it is an unbiased estimate of the
   per-row squared error's mean (stratified sampling without replacement), and its relative
   sampling error is about ``cv / sqrt(n)`` where ``cv`` is the coefficient of variation of the
   per-row squared errors over the head; a head whose error sits in a few rows that no stratum
   drew (one sharp row in 128) is under-estimated. With ``n >= S / 128`` a block-level failure
   (a whole 128-token stretch attended wrongly) is always sampled.
4. **acts per head**: a head fails when the upper 95% confidence bound of ``err`` (``estimate``)
   exceeds ``guard`` or ``mass < promise - 0.05`` (``promise``:
   the method's own ``cdf`` / ``top_p``; other methods promise no mass). A failed head of a
   block-sparse method is first re-run on its own plan **widened by the sampled rows' exact
   scores** (the key blocks / clusters the plan dropped, added in decreasing order of the mass
   they carry for the sampled rows of each query block, until that block keeps
   ``1 - min(1 - promise, guard / 2)``; ``guard/widen.py``); a head that still fails, or of a
   method without plans (token methods, window, prune), is re-run at the method's next wider
   setting (``Method.guard_widened``: a higher ``cdf`` / ``top_p``, a lower pruning ratio, ...);
   each re-run is checked again on fresh rows; when no wider setting is left or it fails too,
   the head runs dense for this call (exact: float32-accumulating SDPA over its valid keys).
5. **remembers**: the level a head reached (0 = the method, then the score-widened plan for the
   block-sparse methods, the wider settings, last = dense) is
   kept per (layer, branch, head) in the call's method state and used from the next call on, so
   a head that failed starts at its wider setting in later steps instead of failing again. The
   levels are forgotten every ``guard_refresh`` steps (a new step bucket) and at every pipeline
   call: attention sharpens as denoising proceeds, so a head that needed dense at a noisy step
   may pass at a later one, and only a fresh try at level 0 finds out.

Non-finite input (NaN or inf anywhere in q, k or v) is reported (``nonfinite``) and nothing is
re-run: the call keeps what the method computed, as without the guard, so no dense re-run hides
the NaN.

Cost: the check is ``n / S`` of dense attention's work per head (0.8% with the defaults past 4096
tokens), one pass over q, k, v for the
finiteness test, and one host synchronisation per call (all heads' decisions together; on a GPU
that is one device-to-host copy of ``3 B H`` floats per attention call). Re-runs add what they
compute. All of it is counted in the patch's statistics as computed work (``guard_density``).

Context parallelism: every rank takes the decisions one process takes on the same call. Under
Ulysses a rank holds some heads over the whole sequence (rows and re-checks are keyed to the global
head index). Under ring attention a rank holds a query shard (``methods/parallel/ring_guard.py``):
the ranks draw one process's rows over the global sequence, each contributes those in its shard
(queries, the method's output rows and lse: one all-reduce of ``B H n (D_q + D_v + 1)`` floats),
attends all ``n`` rows to its own key shard and all-gathers the partial rows (``B H n (D_v + 1)``
floats per rank) for an exact log-sum-exp merge; every rank then runs the same ``estimate`` on the
same rows and so re-runs the same heads, through the ring (wider settings: the head's plan over the
whole sequence, one ring step per key shard; dense: the head's queries against each key shard).
Each check (one per call, one per re-run head) costs these two collectives.

What a method tells the guard, and how a call runs under it, is ``GuardHooks``, a mixin of
``Method``: ``guard_promise`` (the kept mass the method's options promise), ``guard_levels`` /
``guard_widen_options`` (its wider settings, tried on a failed head before dense), and
``run_checked`` (``attend`` under the guard when ``config.guard`` is a number).
"""
from __future__ import annotations

import dataclasses
import math
import time

import torch

from .widen import widen_head, widenable
#: ``ctx.state`` key of the remembered per-head levels.
STATE_KEY = "fastdit.guard"
#: Kept mass may fall this far below the method's promise before the head fails.
MASS_TOLERANCE = 0.05
#: At least this many sampled rows per head (small calls), and at least one per this many tokens.
MIN_ROWS = 32
STRATUM = 128
#: Score entries one chunk of the exact rows holds (float32).
_BUDGET = 1 << 24

__all__ = ["GuardHooks", "STATE_KEY", "MASS_TOLERANCE", "sample_rows", "exact_rows", "estimate", "guarded_call",
           "head_fails", "summarise", "guard_report", "act_on_heads", "guard_levels_of"]


def row_count(seq, fraction):
    """Rows sampled per head for a call of ``seq`` query tokens (see the module docstring)."""
    return int(min(seq, max(math.ceil(fraction * seq), math.ceil(seq / STRATUM), MIN_ROWS)))


def sample_rows(seq, fraction, key, device):
    """Stratified query rows: ``row_count(seq, fraction)`` strata of equal length over ``0..seq-1``
    and one row drawn uniformly in each, from a generator seeded by ``key`` (a tuple of ints).
    Returns a long tensor on ``device`` (sorted, distinct)."""
    n = row_count(seq, fraction)
    generator = torch.Generator().manual_seed(hash(tuple(int(x) for x in key)) % (2 ** 62))
    bounds = torch.div(torch.arange(n + 1, dtype=torch.float64) * seq, n, rounding_mode="floor").long()
    width = (bounds[1:] - bounds[:-1]).clamp_min(1)
    offsets = (torch.rand(n, generator=generator, dtype=torch.float64) * width).long().clamp_max(width - 1)
    return (bounds[:-1] + offsets).to(device)


def exact_rows(q, k, v, rows, key_mask=None, scale=None, engine=None):
    """Dense attention of the query ``rows`` only: ``(out (B, H, n, D), lse (B, H, n))`` in float32
    (float64 for float64 inputs); keys with ``key_mask`` False left out; rows with no valid key
    give out 0 and lse -inf. Chunked over heads and rows so that at most ~16M scores are held at once.

    ``engine`` (default: on CUDA for float16 / bfloat16 inputs): the rows go through fastdit's
    attention engine instead, every key block of every row (tensor cores, float32 accumulation and
    log-sum-exp; the output rounded once to the input's type, a relative 2^-8 at most): a float32
    matmul on a GPU runs at a fifteenth of the tensor cores' rate, which would make the check cost
    a quarter of dense attention instead of its sampled share."""
    if engine is None:
        engine = q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
    if engine:
        from fastdit.plan import dense_plan, run_plan

        rows_q = q.index_select(2, rows)
        out, lse = run_plan(rows_q, k, v, dense_plan(rows.numel(), k.shape[2], q.device), key_mask=key_mask,
                            scale=scale, return_lse=True)
        return out.float(), lse.float()
    if q.device.type == "cpu" and _CPU_FLASH is not None:
        try:
            return _cpu_flash_rows(q, k, v, rows, key_mask, scale)
        except RuntimeError:  # a torch without this fused kernel's signature: the plain path below
            pass
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    batch, heads, _, dim = q.shape
    n, keys = rows.numel(), k.shape[2]
    out = torch.empty(batch, heads, n, v.shape[-1], dtype=dtype, device=q.device)
    lse = torch.empty(batch, heads, n, dtype=dtype, device=q.device)
    bias = None
    if key_mask is not None:
        bias = torch.zeros(batch, 1, 1, keys, dtype=dtype, device=q.device).masked_fill(
            ~key_mask.to(device=q.device, dtype=torch.bool)[:, None, None, :], float("-inf"))
    heads_step = max(1, _BUDGET // max(1, batch * n * keys))
    rows_step = max(1, _BUDGET // max(1, batch * keys)) if heads_step == 1 else n
    for h in range(0, heads, heads_step):
        keys_h = k[:, h:h + heads_step].to(dtype).transpose(-1, -2)
        values_h = v[:, h:h + heads_step].to(dtype)
        for r in range(0, n, rows_step):
            qs = q[:, h:h + heads_step].index_select(2, rows[r:r + rows_step]).to(dtype)
            scores = (qs @ keys_h) * scale
            if bias is not None:
                scores = scores + bias
            row_lse = torch.logsumexp(scores, dim=-1)
            live = torch.isfinite(row_lse)
            probs = torch.exp(scores - torch.where(live, row_lse, torch.zeros_like(row_lse))[..., None])
            probs = torch.where(live[..., None], probs, torch.zeros_like(probs))
            out[:, h:h + heads_step, r:r + rows_step] = probs @ values_h
            lse[:, h:h + heads_step, r:r + rows_step] = row_lse
    return out, lse


#: One-sided normal quantile of the error's upper confidence bound (95%): a head fails when the
#: bound exceeds ``guard``, so a head whose true error is above ``guard`` passes in at most about 5%
#: of calls (sampling error of the estimate; measured by ``eval.bench.guard``).
CONFIDENCE_Z = 1.645


#: torch's fused CPU attention that also returns the log-sum-exp (float32 accumulation): 4x
#: faster than scores, softmax and P V written out, for the same exact rows.
_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _cpu_flash_rows(q, k, v, rows, key_mask, scale):
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    qs, kf, vf = q.index_select(2, rows).to(dtype), k.to(dtype), v.to(dtype)
    bias = None
    if key_mask is not None:
        valid = key_mask.to(device=q.device, dtype=torch.bool)
        bias = torch.zeros(valid.shape[0], 1, 1, valid.shape[1], dtype=dtype, device=q.device)
        bias = bias.masked_fill(~valid[:, None, None, :], float("-inf"))
    out, lse = _CPU_FLASH(qs, kf, vf, 0.0, False, attn_mask=bias, scale=scale)
    lse = lse.to(dtype)
    if key_mask is not None:  # rows with no valid key: the kernel gives 0 and lse 0; ours is -inf
        empty = ~key_mask.to(torch.bool).any(-1)
        lse = lse.masked_fill(empty[:, None, None], float("-inf"))
        out = out.masked_fill(empty[:, None, None, None], 0.0)
    return out, lse


def estimate(out_rows, ref_out, ref_lse, lse_rows=None, query_valid=None):
    """Per (batch, head): ``(error, error_bound, kept_mass, live)`` float tensors ``(B, H)`` from the
    method's output rows (and their lse, when the method has one) against the exact rows.

    ``error = sqrt(R)``, ``R = sum_i e_i / sum_i r_i`` over the live sampled rows (``e_i`` the row's
    squared error, ``r_i`` its squared dense output): the relative L2 error of the sampled rows.
    ``error_bound = sqrt(R + z * se(R))`` with the ratio estimator's standard error
    ``se(R) = sd_i(e_i - R r_i) / (sqrt(n) * mean_i r_i)`` and ``z = CONFIDENCE_Z``: an upper 95%
    confidence bound of the head's error over all its rows (stratified rows make it conservative).
    ``kept_mass`` is 1 where the method reports no lse; ``live`` is 1 where a sampled row has a key."""
    live = torch.isfinite(ref_lse)
    if query_valid is not None:
        live = live & query_valid[:, None, :]
    weight = live.to(ref_out.dtype)
    row_err = ((out_rows.to(ref_out.dtype) - ref_out).pow(2).sum(-1) * weight).nan_to_num(float("inf"))
    row_ref = ref_out.pow(2).sum(-1) * weight
    rows = weight.sum(-1)
    n = rows.clamp_min(1)
    ratio = row_err.sum(-1) / row_ref.sum(-1).clamp_min(1e-30)
    resid = (row_err - ratio[..., None] * row_ref) * weight
    var = (resid.pow(2).sum(-1) - resid.sum(-1).pow(2) / n) / (n - 1).clamp_min(1)
    se = var.clamp_min(0).sqrt() / (n.sqrt() * (row_ref.sum(-1) / n).clamp_min(1e-30))
    error = ratio.sqrt()
    bound = (ratio + CONFIDENCE_Z * se.nan_to_num(0.0)).sqrt()
    if lse_rows is None:
        mass = torch.ones_like(error)
    else:
        fraction = torch.exp(lse_rows.to(ref_lse.dtype) - torch.where(live, ref_lse, torch.zeros_like(ref_lse)))
        fraction = torch.where(live, fraction.nan_to_num(0.0), torch.zeros_like(fraction))
        mass = torch.where(rows > 0, fraction.sum(-1) / n, torch.ones_like(error))
    return error, bound, mass, (rows > 0).to(error.dtype)


def all_finite(*tensors):
    """A device bool: every element of every tensor is finite. One float32-accumulated sum per tensor
    (a NaN or inf anywhere makes it non-finite; one read, no boolean copy of the tensor); a sum that
    overflows float32 (|values| near 1e38) would report non-finite input too."""
    flag = None
    for t in tensors:
        ok = torch.isfinite(t.sum(dtype=torch.float64 if t.dtype == torch.float64 else torch.float32))
        flag = ok if flag is None else flag & ok
    return flag


def head_context(ctx, head, dense_fn):
    """The context of one head of the call (fresh state: a re-run never touches the layer's)."""
    total = ctx.total_heads or ctx.num_heads
    return dataclasses.replace(ctx, head_offset=ctx.head_offset + head, num_heads=1, total_heads=total, state={},
                               info={}, dense_fn=dense_fn)


def _dense_head(q, k, v, ctx):
    """Dense attention of one head's ``(B, 1, S, D)`` call, exact in float32: ``(out, lse)``."""
    out, lse = exact_rows(q, k, v, torch.arange(q.shape[2], device=q.device), ctx.key_mask, ctx.scale)
    if ctx.query_mask is not None:
        valid = ctx.query_mask.to(device=out.device, dtype=torch.bool)[:, None, :]
        out = out * valid[..., None].to(out.dtype)
        lse = lse.masked_fill(~valid, float("-inf"))
    return out.to(q.dtype), lse.float()


def head_run_density(info):
    """Share of one head's dense work a re-run computed (1 for dense), from its ``ctx.info``."""
    if info.get("dense"):
        return 1.0
    if "performed" in info:
        return float(info["performed"]) / max(float(info["total"]), 1.0)
    plan = info.get("plan")
    return float(plan.block_density_tensor().double().mean()) if plan is not None else 1.0


def remembered_levels(ctx, heads, refresh):
    """The remembered level of each head of this call (refreshed every ``refresh`` steps)."""
    memory = ctx.state.get(STATE_KEY)
    if memory is None or ctx.step - memory["since"] >= refresh or ctx.step < memory["since"]:
        memory = {"since": ctx.step, "levels": {}}
        ctx.state[STATE_KEY] = memory
    return memory, [memory["levels"].get(ctx.head_offset + h, 0) for h in range(heads)]


def head_fails(upper, mass, live, bound, promise):
    """The guard's rule per (batch, head): the error's upper bound above ``bound`` (or NaN), or the
    kept mass below ``promise - MASS_TOLERANCE``; only heads with a live sampled row fail."""
    failed = (upper > bound) | torch.isnan(upper)
    if promise is not None:
        failed = failed | (mass < promise - MASS_TOLERANCE)
    return failed & (live > 0)


def guard_levels_of(method):
    """``(scored, top)``: 1 when the method's first wider level is its plan widened by scores
    (``guard/widen.py``), else 0; ``top``: the dense level (after the method's wider settings)."""
    scored = 1 if method.guard_scores_widen else 0
    return scored, method.guard_levels() + scored + 1


def summarise(error, upper, mass, failed, finite):
    """The call's one host synchronisation: per head the worst error, least mass, any failure and
    worst bound of the first check. ``(errors, masses, fails, first, finite)``, Python values."""
    summary = torch.stack([error.double().amax(0), mass.double().amin(0), failed.any(0).double(),
                           upper.double().amax(0)])
    summary, finite = summary.cpu(), bool(finite)
    errors, masses, fails = summary[0].tolist(), summary[1].tolist(), summary[2].tolist()
    # the method's own, before any action
    first = dict(first_error=list(errors), first_error_bound=summary[3].tolist(), first_kept_mass=list(masses))
    return errors, masses, fails, first, finite


def guard_report(errors, masses, first, rows, actions, levels, head_density, bound, promise, extra, started,
                 nonfinite=False):
    """``ctx.info["guard"]`` (see ``Method.guard_report``)."""
    return dict(error=errors, kept_mass=masses, **first, rows=rows, action=actions, nonfinite=nonfinite,
                levels=levels, head_density=head_density, bound=bound, promise=promise, extra_density=extra,
                seconds=time.perf_counter() - started)


def act_on_heads(method, reruns, memory, head_offset, levels, fails, errors, masses, bound, seq, extra):
    """Step 4 and 5 of the module docstring for one call's heads, however they are computed.

    ``reruns`` computes for head ``h``: ``scored(h)`` (its plan widened by scores: ``(out, lse,
    density)`` or None), ``wider(method, h)`` (the same at a wider setting), ``dense(h)`` (``(out,
    lse)``) and ``check(h, out, lse, round)`` (``(error, bound, mass, live, rows)`` on fresh rows):
    in one process (``guarded_call``) or over a ring of ranks (``parallel/ring_guard.py``), so both
    take the same decisions. ``levels`` / ``errors`` / ``masses`` are updated in place and the
    levels remembered in ``memory``. Returns ``(replaced {h: (out, lse)}, head_density, actions,
    extra)``."""
    heads = len(levels)
    scored, top = guard_levels_of(method)
    actions = ["remembered" if level else "pass" for level in levels]
    todo = {h: (levels[h] if levels[h] else (1 if fails[h] else 0)) for h in range(heads)}
    todo = {h: level for h, level in todo.items() if level}
    replaced = {}
    final_density = [None] * heads  # per head: what a re-run computed (None: the method's own call)
    round_index = 1
    while todo:
        next_todo = {}
        for h, level in sorted(todo.items()):
            if scored and level == 1:  # key blocks added by the rows' exact scores
                rerun = reruns.scored(h)
                if rerun is None:  # nothing to add, or no plan to add to: the next level
                    next_todo[h] = level + 1
                    continue
                promise = method.guard_promise()
            else:
                wider = method.guard_widened(level - scored) if level < top else None
                if wider is None:
                    replaced[h] = reruns.dense(h)
                    errors[h], masses[h], levels[h] = 0.0, 1.0, top
                    actions[h] = "dense"
                    final_density[h] = 1.0
                    extra += 1.0 / heads
                    continue
                rerun = reruns.wider(wider, h)
                promise = wider.guard_promise()
            result, head_lse, run_density = rerun
            extra += run_density / heads
            e, e_upper, m, alive, checked = reruns.check(h, result, head_lse, round_index)
            extra += checked / seq / heads
            if bool(head_fails(e_upper, m, alive, bound, promise).any()):
                next_todo[h] = level + 1
                continue
            replaced[h] = (result, head_lse)
            final_density[h] = run_density
            errors[h], masses[h], levels[h] = float(e.amax()), float(m.amin()), level
            actions[h] = "widened" if actions[h] == "pass" else actions[h]
        todo = next_todo
        round_index += 1
    for h in range(heads):
        if levels[h]:
            memory["levels"][head_offset + h] = levels[h]
        if actions[h] == "remembered":
            actions[h] = "dense" if levels[h] >= top else "widened"
    return replaced, final_density, actions, extra


class _LocalReruns:
    """``act_on_heads``' re-runs and checks of one process's call."""

    def __init__(self, method, ctx, q, k, v, bound, fraction, key):
        self.method, self.ctx, self.q, self.k, self.v = method, ctx, q, k, v
        self.bound, self.fraction, self.key = bound, fraction, key

    def _head(self, h):
        return self.q[:, h:h + 1], self.k[:, h:h + 1], self.v[:, h:h + 1]

    def scored(self, h):
        method, ctx = self.method, self.ctx
        return widen_head(method, ctx, self.q, self.k, self.v, h, self.bound) if widenable(method, ctx) else None

    def wider(self, wider, h):
        qh, kh, vh = self._head(h)
        head_ctx = head_context(self.ctx, h, lambda: _dense_head(qh, kh, vh, self.ctx)[0])
        result = wider.attend(head_ctx, qh, kh, vh)
        return result, head_ctx.info.get("lse"), head_run_density(head_ctx.info)

    def dense(self, h):
        return _dense_head(*self._head(h), self.ctx)

    def check(self, h, result, head_lse, round_index):
        ctx, (qh, kh, vh) = self.ctx, self._head(h)
        seq = qh.shape[2]
        # keyed to the global head: Ulysses ranks agree
        rows = sample_rows(seq, self.fraction, self.key + (round_index, ctx.head_offset + h), qh.device)
        ref_o, ref_l = exact_rows(qh, kh, vh, rows, ctx.key_mask, ctx.scale)
        valid = None if ctx.query_mask is None else ctx.query_mask.to(torch.bool).index_select(1, rows)
        e, e_upper, m, alive = estimate(result.index_select(2, rows), ref_o, ref_l,
                                        None if head_lse is None else head_lse.index_select(2, rows), valid)
        return e, e_upper, m, alive, rows.numel()


def guarded_call(method, ctx, q, k, v, run):
    """``run(ctx, q, k, v)`` (the method's call) under the guard of ``method.config``; writes
    ``ctx.info["guard"]`` (see ``Method.guard_report``) and returns the checked output."""
    config = method.config
    bound, fraction, refresh = float(config.guard), float(config.guard_rows), int(config.guard_refresh)
    batch, heads, seq, _ = q.shape
    memory, levels = remembered_levels(ctx, heads, refresh)
    out = run(ctx, q, k, v)
    if ctx.info.get("dense"):  # the method ran dense (a layout it computes densely, a refresh step)
        return out
    started = time.perf_counter()
    promise = method.guard_promise()
    key = (ctx.layer, ctx.step, ctx.branch)
    rows = sample_rows(seq, fraction, key + (0,), q.device)
    ref_out, ref_lse = exact_rows(q, k, v, rows, ctx.key_mask, ctx.scale)
    lse = ctx.info.get("lse")
    query_valid = None if ctx.query_mask is None else ctx.query_mask.to(torch.bool).index_select(1, rows)
    error, upper, mass, live = estimate(out.index_select(2, rows), ref_out, ref_lse,
                                        None if lse is None else lse.index_select(2, rows), query_valid)
    failed = head_fails(upper, mass, live, bound, promise)
    errors, masses, fails, first, finite = summarise(error, upper, mass, failed, all_finite(q, k, v))
    n = rows.numel()
    extra = n / seq  # the check's share of dense work, every head
    if not finite:
        ctx.info["guard"] = guard_report(errors, masses, first, n, ["nonfinite"] * heads, levels, [None] * heads,
                                         bound, promise, extra, started, nonfinite=True)
        return out
    reruns = _LocalReruns(method, ctx, q, k, v, bound, fraction, key)
    replaced, final_density, actions, extra = act_on_heads(method, reruns, memory, ctx.head_offset, levels, fails,
                                                           errors, masses, bound, seq, extra)
    if replaced:
        out = out.clone()
        lse = None if lse is None else lse.clone()
        for h, (result, head_lse) in replaced.items():
            out[:, h:h + 1] = result.to(out.dtype)
            if lse is not None and head_lse is not None:
                lse[:, h:h + 1] = head_lse.to(lse.dtype)
        if lse is not None:
            ctx.info["lse"] = lse  # of what the call computed in the end
    ctx.info["guard"] = guard_report(errors, masses, first, n, actions, levels, final_density, bound, promise, extra,
                                     started)
    return out


class GuardHooks:
    """The guard's part of the method protocol (see the module docstring)."""

    def guard_promise(self):
        """The kept attention mass this method's options promise (``cdf``, ``top_p``), or None."""
        return None

    #: Whether a failed head is first widened by the sampled rows' exact scores (``guard/widen.py``):
    #: methods whose output is their plan's engine call (the block-sparse methods).
    guard_scores_widen = False

    def guard_levels(self):
        """How many wider settings the guard may try on a failed head before dense (0: dense at once)."""
        return 0

    def guard_widened(self, level):
        """This method at its ``level``-th wider setting (1-based; ``guard_widen_options``), or None."""
        options = self.guard_widen_options(level)
        if options is None:
            return None
        cache = self.__dict__.setdefault("_guard_wider", {})
        if level not in cache:
            config = dataclasses.replace(self.config, layer_settings=None, guard=False, dense_steps=0, dense_layers=0,
                                         **options)
            cache[level] = type(self)(type(self).make_config(config))
        return cache[level]

    def guard_widen_options(self, level):
        """Options of the ``level``-th wider setting (e.g. ``{"cdf": 0.99}``), or None."""
        return None

    def guarded(self, ctx):
        """Whether this call runs under the guard (a number in ``config.guard``)."""
        guard = getattr(self.config, "guard", None)
        return guard is not None and guard is not False

    def run_checked(self, ctx, q, k, v):
        """``attend`` under the guard when it is on (see ``guard.guarded_call``)."""
        if not self.guarded(ctx):
            return self.attend(ctx, q, k, v)
        return guarded_call(self, ctx, q, k, v, self.attend)
