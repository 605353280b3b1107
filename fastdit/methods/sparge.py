"""SpargeAttn-style dynamic block selection from mean-pooled queries and keys.

After "SpargeAttn: Accurate Sparse Attention Accelerating Any Model Inference" (Zhang, Xiang,
Zhang et al., ICML 2025), first stage (the second stage, skipping inside the kernel, is the shared
``skip_threshold`` option of ``BlockSparseConfig``).

Kernel order: video tokens are permuted into 3-D tiles of ``tile = (tt, th, tw)`` tokens (fitted
to each grid by ``sta.choose_tile``, padding under 10%; the paper orders video tokens along a
Hilbert curve for the same purpose: blocks of nearby, alike tokens), one tile per kernel block of
``b = tt * th * tw`` slots; text follows in its own blocks of ``b`` slots. Per call, batch and
head, with ``x_i`` the tokens of block ``m`` (valid ones only: padding slots and masked keys are
left out) and ``n_m`` their count:

* mean pooling: ``xbar_m = (1 / n_m) sum_i x_i`` for queries (and keys, ``estimator="pooled"``);
* self-similarity: ``sim_m = (1 / n_m) sum_i cos(x_i, xbar_m)``. A query block with ``sim_m <
  simthresh`` attends every key block (with ``estimator="pooled"`` also: a key block with
  ``sim_m < simthresh`` is attended by every query block);
* predicted block masses ``P[m, j]``, by ``estimator``:

  - ``"sampled"`` (default): ``mass_rows`` representative query rows of block ``m``
    (``mass.representative_rows``: farthest-point samples of its queries, the first nearest the
    block mean, each weighted by the number of the block's rows nearest to it) are scored exactly
    against every valid key; ``P[m, j]`` is the weighted mean of their softmax mass on key block
    ``j``. Exact on the key side (no assumption on how scores spread inside a key block); it
    assumes that rows with alike queries attend alike (each row stands for the rows nearest it);
  - ``"rowwise"``: every query row against each key block's mean and per-dim spread
    (``mass.rowwise_block_masses``: a second-order, log-normal estimate of each block's sum);
  - ``"pooled"`` (SpargeAttn's): ``softmax_j(scale * qbar_m . kbar_j)`` (key blocks without a
    valid key get 0). It estimates ``exp(mean score)`` over a block pair, far below the mean of
    ``exp(score)`` when a head is sharper than a block, so it overpromises on sharp heads;

* selection per query block: the fewest highest-scoring key blocks whose cumulative ``P``
  reaches ``cdf`` (``count = #{r : sum_{r' < r} P_sorted[r'] < cdf}``; with the measured
  estimators the forced key blocks rank first, so their mass counts toward ``cdf``), or with
  ``topk`` the ``ceil(topk * n_blocks)`` highest; at least ``min_blocks``; plus the forced blocks:
  every text key block, with ``estimator="pooled"`` the key blocks that are not self-similar, and
  with ``sink`` the first key block. Text query blocks and query blocks that are not self-similar
  keep every key block. ``plan.info["predicted_mass"]`` ``(B, H)``: the predicted kept mass,
  mean over query rows (1 for a row kept whole), to set beside ``return_info="mass"``.

Each row lists its key blocks in descending predicted score, so the kernel meets the largest
scores first (which helps the in-kernel skip rule). ``cdf = 1`` or ``topk = 1`` is dense
attention. Everything runs on the tensors' device with no host synchronisation (the counts stay
on the device; the plan's width is the number of key blocks).

Defaults: SpargeAttn publishes thresholds tuned per model; with none for a given model fastdit
uses ``cdf = 0.95``, ``estimator = "sampled"`` with ``mass_rows = 8`` (``8 / 128`` of dense's
scores), ``simthresh`` by estimator (0.6 for ``"pooled"``, SpargeAttn's; off for the measured
estimators), ``min_blocks = 1``, no sink, 128-token blocks (tile target 2x8x8 for video, 1x8x16
for images; the paper's query blocks are 128 tokens) and, as for sliding tile, the first quarter
of the denoising steps dense.

Why ``simthresh`` is off with the measured estimators (issue 23, 4x32x32 structured heads, two
per kind, ``cdf = 0.95``): the rule marks a tile dissimilar when its tokens' cosine to their mean
is low, which is what norm-preserving (rotary-style) position features do within a tile when q
and k carry no large shared mean. Without one, 100% of the query blocks of temporal and rotary
heads and 88% of smooth heads fall below 0.6, and sparge ran dense there (density 1.00 / 1.00 /
0.96); with the ``"sampled"`` estimator and the rule off, the same heads run at 0.06 / 0.86 / 0.75
with true kept mass 1.00 / 0.95 / 0.95, identical to the heads with a shared mean (which passes
every block: the rule changes nothing there). The guard protected the pooled estimate; measured
masses need none (BENCHMARKS.md, "Selection vs oracle").
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch


from .base import GUARD_DEFAULT, check_int, check_number, option, register_method
from .block_sparse import BlockSparseConfig, BlockSparseMethod
from .selection.tiles import tile_order_plan
from .selection.mass import representative_rows, row_block_masses, rowwise_block_masses
from .selection.reuse import ReuseOptions, ReuseSelection
from .sta import choose_tile

VIDEO_TILE = (2, 8, 8)
#: How block masses are predicted (``SpargeConfig.estimator``).
ESTIMATORS = ("sampled", "rowwise", "pooled")
#: ``simthresh`` when left None: SpargeAttn's 0.6 guards its pooled estimate; the other estimators
#: score every key (and represent every kind of query row), so they need no guard (-1: off).
SIMTHRESH = {"pooled": 0.6, "sampled": -1.0, "rowwise": -1.0}
IMAGE_TILE = (1, 8, 16)


@dataclass
class SpargeConfig(ReuseOptions, BlockSparseConfig):
    """Options of sparge (see the module docstring).

    Attributes:
        tile: target ``(tt, th, tw)`` tokens per block, fitted to each grid (padding under 10%).
            None: 2x8x8 for video, 1x8x16 for images (128 tokens).
        simthresh: blocks whose mean cosine similarity to their own mean is below this are never
            skipped; in [-1, 1] (-1: every block is trusted).
        cdf: per query block, keep the fewest top-scoring key blocks whose predicted mass reaches
            this; in (0, 1] (1: dense).
        topk: instead of ``cdf``, keep this fraction of the key blocks (rounded up); in (0, 1] or
            None.
        min_blocks: keep at least this many key blocks per query block (>= 1).
        sink: always keep the first key block.
        dense_steps, dense_layers: see ``MethodConfig``; default 0.25 and 0.
        skip_threshold, correction, refresh_every: see ``BlockSparseConfig``.
        reuse_threshold, reuse_max_steps: selection reuse across steps (``reuse.py``).
    """

    tile: tuple | None = option(None, "target tokens per block (tt, th, tw), fitted to each grid; empty: 2x8x8 "
                                "(1x8x16 for images)", widget="triple")
    simthresh: float | None = option(None, "blocks less self-similar than this (mean cosine to the block mean) are "
                                     "never skipped; empty: 0.6 with estimator='pooled', off (-1) otherwise",
                                     range=(-1.0, 1.0), widget="slider")
    cdf: float = option(0.95, "keep the fewest top-scoring key blocks whose predicted mass reaches this",
                        range=(0.0, 1.0), widget="slider")
    topk: float | None = option(None, "instead of cdf: keep this fraction of key blocks per query block; empty: "
                                "use cdf", range=(0.0, 1.0), widget="number")
    min_blocks: int = option(1, "at least this many key blocks per query block", range=(1, None), widget="number")
    sink: bool = option(False, "always keep the first key block (attention sink)", widget="checkbox")
    estimator: str = option("sampled", "how block masses are predicted: 'sampled' (exact masses of a few "
                            "representative rows per block), 'rowwise' (every query row against each key block's mean "
                            "and spread) or 'pooled' (softmax of mean-pooled scores, SpargeAttn's)",
                            choices=ESTIMATORS, widget="dropdown", advanced=True)
    mass_rows: int = option(8, "estimator='sampled': representative query rows per query block", range=(1, None),
                            widget="number", advanced=True)

    def validate(self):
        super().validate()
        if self.tile is not None:
            if not isinstance(self.tile, (tuple, list)) or len(self.tile) != 3 or not all(
                isinstance(t, int) and not isinstance(t, bool) and t > 0 for t in self.tile
            ):
                raise ValueError(f"tile must be three positive ints (tt, th, tw), got {self.tile!r}")
            self.tile = tuple(self.tile)
        if self.simthresh is not None:
            check_number("simthresh", self.simthresh, -1, 1, note="a cosine similarity; or None: by estimator")
        check_number("cdf", self.cdf, 0, 1, low_open=True, note="predicted attention mass kept")
        if self.topk is not None:
            check_number("topk", self.topk, 0, 1, low_open=True, note="a fraction of the key blocks; or None")
        check_int("min_blocks", self.min_blocks)
        if not isinstance(self.sink, bool):
            raise ValueError(f"sink must be True or False, got {self.sink!r}")
        if self.estimator not in ESTIMATORS:
            raise ValueError(f"estimator must be one of {ESTIMATORS}, got {self.estimator!r}")
        check_int("mass_rows", self.mass_rows, note="query rows sampled per block")


def pooled_blocks(x, weight, block):
    """Mean ``(B, H, n, D)`` float32 and self-similarity ``(B, H, n)`` of each block of ``block``
    tokens of kernel-order ``x`` ``(B, H, n * block, D)``; ``weight`` ``(B|1, n * block)`` is 1 for
    valid tokens, 0 otherwise. A block without a valid token has mean 0 and similarity 1."""
    batch, heads, length, dim = x.shape
    n = length // block
    xb = x.view(batch, heads, n, block, dim)
    w = weight.view(weight.shape[0], 1, n, 1, block).to(x.dtype)
    count = weight.view(weight.shape[0], 1, n, block).float().sum(-1)  # (B|1, 1, n)
    # Weighted sums as a matmul: accumulates in float32 without a float32 copy of x.
    total = (w @ xb).squeeze(-2).float()  # (B, H, n, D)
    mean = total / count.clamp_min(1.0)[..., None]
    norms = torch.linalg.vector_norm(xb, dim=-1, dtype=torch.float32).clamp_min(1e-12)  # (B, H, n, block)
    mean_norm = torch.linalg.vector_norm(mean, dim=-1).clamp_min(1e-12)  # (B, H, n)
    dots = (xb @ mean.to(x.dtype)[..., None]).squeeze(-1).float()  # (B, H, n, block)
    cosine = dots / (norms * mean_norm[..., None])
    similarity = (cosine * weight.view(weight.shape[0], 1, n, block).float()).sum(-1) / count.clamp_min(1.0)
    similarity = torch.where(count > 0, similarity, torch.ones_like(similarity))
    return mean, similarity, count


def select_blocks(probs, forced_keys, full_rows, config, n_blocks, forced_first=False):
    """``(kv_indices, kv_counts)`` int32 from predicted block scores ``probs`` ``(B, H, n, n)``,
    key blocks always kept ``forced_keys`` ``(B|1, H|1, n)`` and query blocks kept whole
    ``full_rows`` ``(B|1, H|1, n)``: the rule of the module docstring, kept blocks in score order.
    ``forced_first``: the forced key blocks rank first, so their mass counts toward ``cdf``.
    Also returns the predicted kept mass per query block ``(B, H, n)`` float32."""
    if forced_first:
        forced = forced_keys[..., None, :].expand_as(probs)
        order = torch.where(forced, probs + 2.0, probs).sort(dim=-1, descending=True).indices
        sorted_probs = probs.gather(-1, order)
    else:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(n_blocks, device=probs.device)
    if config.topk is not None:
        count = torch.full(probs.shape[:-1], min(n_blocks, math.ceil(config.topk * n_blocks)), device=probs.device)
    elif config.cdf >= 1.0:
        count = torch.full(probs.shape[:-1], n_blocks, device=probs.device)
    else:
        before = sorted_probs.cumsum(-1) - sorted_probs  # mass of the higher-ranked blocks
        count = (before < config.cdf).sum(-1)
    count = count.clamp(min=min(config.min_blocks, n_blocks))
    keep = rank < count[..., None]  # in score order
    keep = keep | forced_keys[..., None, :].expand_as(probs).gather(-1, order) | full_rows[..., None]
    kv_counts = keep.sum(-1, dtype=torch.int32)
    # predicted kept mass per query block (1 for a row kept whole)
    predicted = torch.where(full_rows.expand(probs.shape[:-1]), torch.ones_like(sorted_probs[..., 0]),
                            (sorted_probs * keep).sum(-1))
    # Kept blocks first, each group still in descending score (a stable sort of the keep flags).
    position = (~keep).to(torch.uint8).sort(dim=-1, stable=True).indices
    kv_indices = order.gather(-1, position).to(torch.int32)
    return kv_indices, kv_counts, predicted


@register_method
class Sparge(ReuseSelection, BlockSparseMethod):
    name = "sparge"
    config_cls = SpargeConfig
    default_options = {"dense_steps": 0.25, "dense_layers": 0}
    #: fastdit's tiny models have random weights: attention is near uniform there (a cdf keeps
    #: nearly every block) and their tokens are not self-similar, so a fixed eighth of the key
    #: blocks is kept, with 256-token blocks (4x8x8 tiles): the CPU fallback loops per query
    #: block and gathers per head, and smaller blocks were slower than dense there.
    tiny_options = {"tile": (4, 8, 8), "topk": 0.125, "simthresh": -1.0}
    rank, auto_candidate, engine_geometry, cost_model = 30, True, "grid", "density"

    @classmethod
    def candidates(cls, layout):
        return [{"cdf": c, "topk": None} for c in (0.99, 0.95, 0.9, 0.8)] + [{"topk": t} for t in (0.5, 0.3, 0.1)]
    #: the quality guard's bound (relative L2 error per head) when ``guard`` is left empty
    guard_default = GUARD_DEFAULT

    def guard_promise(self):
        return None if self.config.topk is not None else self.config.cdf

    def guard_levels(self):
        return 1

    def guard_widen_options(self, level):
        """One wider setting: a quarter of the dropped mass (``cdf`` 0.9 -> 0.975), or twice ``topk``."""
        if self.config.topk is not None:
            return {"topk": min(1.0, 2 * self.config.topk)}
        return {"cdf": 1 - (1 - self.config.cdf) / 4}

    def tile_for(self, layout):
        target = self.config.tile or (VIDEO_TILE if layout.frames > 1 else IMAGE_TILE)
        return choose_tile(layout.grid, target)

    def prepare(self, layout, heads, device):
        """The static part: tile-order permutation, padding validity and block roles; the plan's
        own lists are dense (``select`` replaces them every call)."""
        tile = self.tile_for(layout)
        plan = tile_order_plan(layout, tile, device, f"sparge_t{'x'.join(map(str, tile))}", {"tile": tile})
        sink = torch.zeros_like(plan.info["text_blocks"])
        sink[0] = self.config.sink
        plan.info["always_keys"] = plan.info["text_blocks"] | sink
        return plan

    @property
    def simthresh(self):
        """The self-similarity threshold in force (``SIMTHRESH`` by estimator when left None)."""
        value = self.config.simthresh
        return SIMTHRESH[self.config.estimator] if value is None else value

    def fresh_select(self, ctx, q, k, v=None):
        """This call's selection (``select`` adds reuse across steps, ``reuse.py``)."""
        static = self.prepared(ctx.layout, 1, q.device)
        plan, _ = self.predict(static, q, k, ctx.key_mask, ctx.query_mask, ctx.scale)
        return plan

    def predict(self, static, q, k, key_mask=None, query_mask=None, scale=None):
        """The dynamic plan of one call and the pieces it came from (a dict, for tests and reports)."""
        block, n_blocks = static.block_m, static.num_kv_blocks
        index = static.gather_index
        q_kernel, k_kernel = q.index_select(2, index), k.index_select(2, index)
        key_ok = static.kernel_kv_valid(key_mask)
        query_ok = static.kv_valid
        if query_mask is not None:
            query_ok = query_mask.to(torch.bool)[:, index] & static.kv_valid
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        q_mean, q_sim, _ = pooled_blocks(q_kernel, query_ok, block)
        text_blocks, always = static.info["text_blocks"], static.info["always_keys"]
        simthresh = self.simthresh
        full_rows = text_blocks | (q_sim < simthresh)
        rows = self.config.estimator != "pooled"
        if rows:  # every key is in its block's estimate (mean and spread), so key blocks need no guard
            k_sim = None
            if self.config.estimator == "sampled":
                probs = self.row_estimate(static, q_kernel, k_kernel, query_ok, key_ok, scale)
            else:
                probs = rowwise_block_masses(q_kernel, k_kernel, key_ok, block, n_blocks, block, n_blocks, scale,
                                             query_ok)
            forced_keys = always
        else:
            k_mean, k_sim, k_count = pooled_blocks(k_kernel, key_ok, block)
            scores = (q_mean @ k_mean.transpose(-1, -2)) * scale
            scores = scores.masked_fill((k_count == 0)[..., None, :], float("-inf"))
            probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row with no valid key: all 0
            forced_keys = always | (k_sim < simthresh)
        kv_indices, kv_counts, kept = select_blocks(probs, forced_keys, full_rows, self.config, n_blocks,
                                                    forced_first=rows and self.config.topk is None)
        rows_per_block = query_ok.view(query_ok.shape[0], 1, n_blocks, block).float().sum(-1)  # (B|1, 1, n)
        predicted = (kept * rows_per_block).sum(-1) / rows_per_block.sum(-1).clamp_min(1.0)
        # A shallow copy keeps the static permutation and its inverse (rebuilding the plan would
        # recompute them, with a host synchronisation).
        plan = copy.copy(static)
        plan.__dict__.pop("density", None)
        plan.kv_indices, plan.kv_counts, plan.dynamic = kv_indices, kv_counts, True
        plan.info = {"tile": static.info["tile"], "predicted_mass": predicted}
        return plan, {"probs": probs, "q_similarity": q_sim, "k_similarity": k_sim, "forced_keys": forced_keys,
                      "full_rows": full_rows}

    def row_estimate(self, static, q_kernel, k_kernel, query_ok, key_ok, scale):
        """``estimator="sampled"``: ``P[m, j]`` float32 ``(B, H, n, n)``: ``mass_rows`` representative
        rows of query block ``m`` (``mass.representative_rows``: farthest-point samples of its
        queries, each weighted by the rows nearest to it) scored exactly against every key; the
        weighted mean of their masses on key block ``j``."""
        block, n_blocks = static.block_m, static.num_kv_blocks
        batch, heads, length, dim = q_kernel.shape
        blocks = q_kernel.view(batch, heads, n_blocks, block, dim)
        rows, weight = representative_rows(blocks, query_ok.view(-1, n_blocks, block), self.config.mass_rows)
        flat = (rows + torch.arange(n_blocks, device=rows.device)[:, None] * block).view(batch, heads, -1)
        q_rows = q_kernel.gather(2, flat[..., None].expand(-1, -1, -1, dim))
        masses = row_block_masses(q_rows, k_kernel, key_ok, block, n_blocks, scale)
        masses = masses.view(batch, heads, n_blocks, rows.shape[-1], n_blocks)
        total = weight.sum(-1).clamp_min(1.0)
        return (masses * weight[..., None]).sum(3) / total[..., None]
