"""Selection reuse across denoising steps for the dynamic methods (sparge, svg, svg2).

A dynamic method pays its selection (pooling and mass estimates, sampled exact rows, k-means and
scoring) at every step and layer. Between neighbouring denoising steps a head's queries and keys
change little, and so does what the selection would choose. After HASTE's temporal mask reuse
("HASTE: Training-Free Video Diffusion Acceleration via Head-Wise Adaptive Sparse Attention",
Zheng et al., 2026: skip mask prediction while the query-key drift is small) and LiteAttention
(skip decisions carried across steps), a head keeps the selection made at an earlier step while a
cheap similarity test against that step passes.

The test, per (layer, CFG branch) and head. Model-order tokens are cut into ``C = ceil(S / 128)``
consecutive chunks of ``CHUNK = 128`` (the last one shorter) and each chunk's mean is taken, in
float32: the signatures ``Qbar, Kbar`` ``(C, D)`` of the call, and from them the row-centred pooled
score map ``P = Qbar Kbar^T - rowmean`` ``(C, C)`` (a row's mean drops out of its softmax, so a
shift shared by all keys changes nothing). With ``P0`` the map of the step that selected the head's
current selection (its signatures kept in ``ctx.state``), per batch element::

    sim = 1 - ||P - P0||_F / ||P0||_F

(1 for an unchanged map, 0 for a change as large as the map, negative beyond), and the head's
similarity is the smallest over the batch. Unlike a cosine, it sees a change of scale (queries
twice as large: attention twice as sharp). The head **reuses** its selection when
``sim >= reuse_threshold`` (up to float32 rounding, ``ROUNDING``) and the selection was made fewer
than ``reuse_max_steps`` steps ago; otherwise it is **re-selected** (and its signatures and step are
stored anew). A head is also re-selected when its own output failed the quality guard's check on
the call before (a new failure: not a head the guard already runs at a wider setting), when its
similarity is not a number (non-finite input), and every head is when the call's shape, layout,
heads, dtype or device differ from the stored selection's (or nothing is stored: the first sparse
call of a layer in a pipeline call).

What it assumes: a selection depends on the queries and keys through what the block means of
model order show. A change confined inside chunks that leaves their means in place (tokens
swapping places within 128 tokens) is not seen, nor one that changes the scores only at a finer
scale than 128-token chunks (what a sharp head's selection depends on). ``reuse_max_steps`` bounds
how long any miss can last, and the quality guard (on by default for these methods) still checks
every call, reused or not, on exact sampled rows.

Only the heads to re-select are selected: the method's ``fresh_select`` runs on those heads alone
(``q[:, heads]``), and the per-head fields of the stored plan (``reuse_fields``: block lists,
permutations, cluster offsets) and of its ``info`` (``reuse_info``) are replaced at those heads.
So a call where every head reuses does no selection work at all, only the test (one pass over
``q`` and ``k``, about ``2 / S`` of a dense call's score work per head), and deciding which heads
to select reads one ``(H,)`` tensor on the host (one synchronisation per call on a GPU).

Options (``ReuseOptions``, shared by the three methods): ``reuse_threshold`` (None: off, the
default; else in [0, 1]; 1 reuses only on identical signatures) and ``reuse_max_steps`` (>= 1, 4 by
default: a selection serves at most that many consecutive steps; 1 re-selects every step). The
state lives in the layer's ``ctx.state`` and so is reset at every pipeline call and by
``remove()``; ``layer_settings`` clear it when a layer's setting changes. Statistics: every call
reports ``ctx.info["reuse"]`` (``heads``, ``reused``: how many kept their selection, ``selected``:
the heads selected, ``similarity`` per head), summed by ``PatchStats`` as
``reuse`` (``reused_heads`` / ``head_calls``).

Not offered where a call has no layer identity (the vllm-omni plugins refuse ``reuse_threshold``)
nor with ``trainable=True`` (the selection of an earlier forward). ``auto`` chooses among these
methods by their one-call error, measured with fresh selections (reuse off, the default); reuse
set on ``auto``'s members (``--set svg2.reuse_threshold=...``) runs without the guard there
unless the candidate sets one, so check such runs end to end.
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import torch

from ..config import check_int, check_number, option
from ..guard import MASS_TOLERANCE
from ..guard import STATE_KEY as GUARD_KEY

#: ``ctx.state`` key of a layer's stored selection.
STATE_KEY = "fastdit.reuse"
#: Model-order tokens per chunk of the signatures.
CHUNK = 128
#: float32 rounding of the similarity: identical signatures may give 1 - 6e-8, so the test is
#: ``sim >= reuse_threshold - ROUNDING`` (``reuse_threshold = 1`` reuses identical signatures)
ROUNDING = 1e-6


@dataclass
class ReuseOptions:
    """The reuse options (a config mixin: ``class SVG2Config(ReuseOptions, BlockSparseConfig)``).

    Attributes:
        reuse_threshold: a head keeps its earlier selection while the similarity of its pooled
            score map to the selecting step's is at least this; None: off (every call selects);
            in [0, 1].
        reuse_max_steps: a selection serves at most this many consecutive steps before the head is
            re-selected (>= 1; 1: every step).
    """

    reuse_threshold: float | None = option(
        None, "reuse a head's selection from an earlier step while its pooled score map (128-token means of q and "
        "k) stays this similar to that step's: 1 - relative change (HASTE); empty: off", range=(0.0, 1.0),
        widget="number", advanced=True)
    reuse_max_steps: int = option(4, "reuse_threshold: a selection serves at most this many consecutive steps, then "
                                  "the head is selected again", range=(1, None), widget="number", advanced=True)

    def validate(self):
        super().validate()
        if self.reuse_threshold is not None:
            self.reuse_threshold = check_number("reuse_threshold", self.reuse_threshold, 0, 1,
                                                note="1 - relative change of the pooled score map; empty: off")
        check_int("reuse_max_steps", self.reuse_max_steps, note="steps a selection serves at most")


def signatures(x):
    """Chunk means of model-order ``x`` ``(B, H, S, D)``: float32 ``(B, H, ceil(S / CHUNK), D)``."""
    batch, heads, seq, dim = x.shape
    full = seq // CHUNK
    parts = []
    if full:
        parts.append(x[:, :, :full * CHUNK].reshape(batch, heads, full, CHUNK, dim).mean(3, dtype=torch.float32))
    if seq > full * CHUNK:
        parts.append(x[:, :, full * CHUNK:].mean(2, keepdim=True, dtype=torch.float32))
    return torch.cat(parts, 2) if len(parts) > 1 else parts[0]


def score_map(qs, ks):
    """Row-centred pooled scores ``Qbar Kbar^T - rowmean``: float32 ``(B, H, C, C)``."""
    scores = qs @ ks.transpose(-1, -2)
    return scores - scores.mean(-1, keepdim=True)


def head_similarity(q, k, entry):
    """Per head, float32 ``(H,)``: ``1 - ||P - P0||_F / ||P0||_F`` of the row-centred pooled score
    maps now and at the selecting step, smallest over the batch (NaN stays NaN)."""
    now = score_map(signatures(q.detach()), signatures(k.detach()))
    before = score_map(entry["q"], entry["k"])
    change = torch.linalg.vector_norm(now - before, dim=(-1, -2))
    scale = torch.linalg.vector_norm(before, dim=(-1, -2)).clamp_min(torch.finfo(torch.float32).tiny)
    return (1.0 - change / scale).amin(0)


def _set_heads(target, source, index):
    """``target`` (a tensor with heads at dim 1) with ``source``'s heads put at ``index``."""
    out = target.clone()
    out.index_copy_(1, index, source.to(out.dtype))
    return out


def merge_plans(stored, fresh, index, fields, info_keys):
    """A copy of the ``stored`` plan with the per-head ``fields`` (and ``info`` entries
    ``info_keys``) of the ``fresh`` plan of heads ``index`` (long, on the plan's device) put in."""
    merged = copy.copy(stored)
    merged.__dict__.pop("density", None)  # a cached density of the stored plan no longer holds
    for name in fields:
        setattr(merged, name, _set_heads(getattr(stored, name), getattr(fresh, name), index))
    merged.info = dict(stored.info)
    for name in info_keys:
        if name in stored.info and name in fresh.info:
            merged.info[name] = _set_heads(stored.info[name], fresh.info[name], index)
    return merged


class ReuseSelection:
    """Method mixin (before the method's base: ``class SparseVideoGen2(ReuseSelection,
    BlockSparseMethod)``): ``select`` reuses a head's stored selection as the module docstring says,
    and runs the method's own ``fresh_select(ctx, q, k, v=None)`` on the heads to select."""

    #: plan attributes with (batch, head) leading dims, replaced per head when heads are re-selected
    reuse_fields = ("kv_indices", "kv_counts")
    #: ``plan.info`` entries with (batch, head) leading dims, likewise
    reuse_info = ("predicted_mass",)

    def fresh_select(self, ctx, q, k, v=None):
        raise NotImplementedError

    def trainable_refusal(self):
        if getattr(self.config, "reuse_threshold", None) is not None:
            return "reuse_threshold keeps a selection made at an earlier step (set it empty to train)"
        return super().trainable_refusal()

    # -- the state a subset of heads selects with (svg2's warm-start centroids) -----------------
    def reuse_substate(self, state, index, batch, heads):
        """The method state a selection of heads ``index`` (of ``heads``) starts from (default: none)."""
        return {}

    def reuse_store_substate(self, state, substate, index, batch, heads):
        """Put back what a selection of heads ``index`` left in ``substate`` (default: nothing)."""

    def select(self, ctx, q, k, v=None):
        """The call's plan: reused per head while the test passes, else ``fresh_select`` (see the
        module docstring). Reports ``ctx.info["reuse"]``."""
        config = self.config
        if config.reuse_threshold is None:
            return self.fresh_select(ctx, q, k, v)
        v = ctx.info.get("values") if v is None else v  # svg's values, left there by its attend
        batch, heads = q.shape[:2]
        key = (ctx.layout, tuple(q.shape), tuple(k.shape), ctx.head_offset, q.dtype, str(q.device))
        entry = ctx.state.get(STATE_KEY)
        if entry is None or entry["key"] != key or entry["plan"] is None:
            plan = self.fresh_select(ctx, q, k, v)
            ctx.state[STATE_KEY] = {"key": key, "plan": plan, "q": signatures(q.detach()), "k": signatures(k.detach()),
                                    "since": [ctx.step] * heads, "stale": [False] * heads}
            ctx.info["reuse"] = {"heads": heads, "reused": 0, "selected": list(range(heads))}
            return plan
        sim = head_similarity(q, k, entry).cpu().tolist()  # the call's one host synchronisation
        again = [not (s >= config.reuse_threshold - ROUNDING) or entry["stale"][h] or ctx.step < entry["since"][h]
                 or ctx.step - entry["since"][h] >= config.reuse_max_steps for h, s in enumerate(sim)]
        chosen = [h for h in range(heads) if again[h]]
        ctx.info["reuse"] = {"heads": heads, "reused": heads - len(chosen), "similarity": sim, "selected": chosen}
        if not chosen:
            return entry["plan"]
        if len(chosen) == heads:
            plan = self.fresh_select(ctx, q, k, v)
            index = torch.arange(heads, device=q.device)
        else:
            index = torch.tensor(chosen, device=q.device)
            plan = merge_plans(entry["plan"], self._select_heads(ctx, q, k, v, index), index, self.reuse_fields,
                               self.reuse_info)
        entry["plan"] = plan
        entry["q"] = _set_heads(entry["q"], signatures(q.detach().index_select(1, index)), index)
        entry["k"] = _set_heads(entry["k"], signatures(k.detach().index_select(1, index)), index)
        for h in chosen:
            entry["since"][h], entry["stale"][h] = ctx.step, False
        return plan

    def _select_heads(self, ctx, q, k, v, index):
        """``fresh_select`` of heads ``index`` alone (a context of those heads, their own state)."""
        batch, heads = q.shape[:2]
        substate = self.reuse_substate(ctx.state, index, batch, heads)
        sub = dataclasses.replace(ctx, num_heads=index.numel(), total_heads=ctx.total_heads or ctx.num_heads,
                                  state=substate, info={})
        pick = [None if t is None else t.index_select(1, index) for t in (q, k, v)]
        plan = self.fresh_select(sub, *pick)
        self.reuse_store_substate(ctx.state, substate, index, batch, heads)
        return plan

    def run_checked(self, ctx, q, k, v):
        """The call (under the guard when it is on); a head whose own output failed the guard's
        check (or whose input was not finite) is re-selected at the next call."""
        memory = ctx.state.get(GUARD_KEY)
        before = dict(memory["levels"]) if memory is not None else {}
        out = super().run_checked(ctx, q, k, v)
        report, entry = ctx.info.get("guard"), ctx.state.get(STATE_KEY)
        if report is not None and entry is not None and self.config.reuse_threshold is not None:
            promise = report["promise"]
            for h, action in enumerate(report["action"]):
                failed = (action == "nonfinite" or not report["first_error_bound"][h] <= report["bound"]
                          or (promise is not None and report["first_kept_mass"][h] < promise - MASS_TOLERANCE))
                if failed and not before.get(ctx.head_offset + h) and h < len(entry["stale"]):
                    entry["stale"][h] = True
        return out
