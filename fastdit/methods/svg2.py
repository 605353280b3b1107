"""Sparse VideoGen 2 ("svg2"): semantic-aware permutation by k-means clusters of queries and keys.

After "Sparse VideoGen2: Accelerate Video Generation with Sparse Attention via Semantic-Aware
Permutation" (Yang, Xi et al., 2025). Per call, batch element ``b`` and head ``h`` (all ``B*H`` at
once, on the device, no host synchronisation):

1. Clustering: the video queries are clustered into ``Cq = q_clusters`` and the video keys into
   ``Ck = k_clusters`` clusters by batched L2 k-means (``fastdit.methods.selection.kmeans``; SVG2 uses plain
   Euclidean k-means as well). Cold start: the centroids are ``Cq`` (``Ck``) distinct video tokens
   drawn once with a fixed seed (deterministic, spread over the video; evenly spaced tokens would
   alias with the frame length, see ``kmeans.spread_init``), then ``init_iters`` iterations. Warm
   start (``warm_start=True``, as the paper): the centroids of the previous call of the same layer
   and CFG branch (kept in ``ctx.state``, which fastdit resets at every pipeline call) are reused,
   with ``kmeans_iters`` iterations, while the layout, batch, heads, head dimension, cluster counts
   and device are unchanged; anything else is a cold start. Without warm start every call is a
   cold start (``init_iters`` iterations). Masked keys (``ctx.key_mask``) are placed but
   move no centroid and count in no size; so are query rows that ``ctx.query_mask`` drops.
2. Permutation: queries are sorted by query cluster, keys (and values) by key cluster (a stable
   sort: model order inside a cluster), so every cluster is a contiguous variable-size block; the
   text / conditioning tokens follow in one query block and one key block of their own.
3. Scoring: ``p[m, j]``, the mass query cluster ``m`` puts on key cluster ``j``, by ``estimator``:

   * ``"rowwise"`` (default): every video query row ``i`` of the cluster is scored against each
     key cluster's mean ``kbar_j`` and per-dim variance ``var_j`` over its ``n_j`` valid keys
     (and the text keys as one more block), ``p_i(j) = softmax_j(scale q_i . kbar_j + log n_j +
     (scale^2 / 2) sum_d q_id^2 var_jd)``, and ``p[m, j]`` is the mean of ``p_i(j)`` over the
     cluster's rows (``mass.rowwise_block_masses``). What it assumes: scores inside a key cluster
     spread about as a Gaussian. A query cluster whose rows attend to different key clusters gets
     all of them. ``refine_clusters = m`` (4): each row's ``m`` largest terms are then scored
     from (up to ``refine_keys`` of) the cluster's keys. Cost: ``2 Ck + m x refine_keys`` scores a row at most;
   * ``"sampled"``: ``mass_rows`` rows per query cluster (stratified over the cluster) scored
     exactly against every key, their masses averaged (``mass.row_block_masses``);
   * ``"centroids"`` (SVG2's)::

       p[m, j] = n_j exp(scale cq_m . ck_j) / sum_j' n_j' exp(scale cq_m . ck_j')

     (softmax of centroid scores, key clusters counted ``n_j`` times): ``exp(mean score)``, far
     below the mean of ``exp(score)`` on heads sharper than a cluster (issue 23: 0.53 true mass at
     ``top_p = 0.9`` on a temporal head).

   ``plan.info["predicted_mass"]`` ``(B, H)``: the predicted kept mass, mean over query rows.
4. Selection: per query cluster, the key clusters in descending ``p / n_j`` (``rank="per_token"``,
   default: predicted mass per key token, so ``top_p`` is reached with the fewest token pairs) or
   ``p`` (``rank="mass"``: the fewest clusters, SVG2's order), keeping the first ones whose
   cumulative ``p`` (plus, with the measured estimators, the text keys' mass, always kept) reaches
   ``top_p`` (``count = #{r : sum_{r' < r} p_sorted[r'] < top_p}``, at
   least 1, and at least ``ceil(min_kc_ratio * Ck)``: SVG2's floor, 0.10 in its scripts, default 0
   here); ``top_p = 1`` keeps every key cluster (dense attention, exactly). ``row_guard``
   (rowwise) also keeps every key cluster on which one row alone puts more than ``guard_margin x
   (1 - top_p)`` of its predicted mass: a cluster-mean rule lets a few rows that attend elsewhere
   lose everything (issue 23: 30 of 4096 temporal rows kept 0.05%). It needs each row's masses
   right: on sharp spatial heads the Gaussian term alone forces the wrong clusters (2.3x the
   own-cluster oracle's error at ``top_p = 0.95``; 0.94x with ``refine_clusters = 4``).
   Every video query cluster also keeps the text key block; the text query block keeps every key
   block: text rows and columns stay dense.
5. Attention on the kept (query cluster, key cluster) pairs: one call of the variable-size engine
   ``fastdit.kernels.block_sparse_attention_varlen`` for all heads (heads folded into the batch,
   since every head has its own two permutations and key validity), then un-permutation.

Cluster counts are clamped per call to the video tokens; counts < 1 are refused at configuration.
Defaults: ``q_clusters = 100``, ``k_clusters = 500`` (SVG2: 100 / 100 on Wan 720p, 400 / 1000 on
HunyuanVideo 720p), ``top_p = 0.9``, ``estimator = "rowwise"``, ``kmeans_iters = 2`` (SVG2's
``kmeans_iter_step``), ``init_iters = 20`` (SVG2: 50), ``dense_steps = 0.25``, ``dense_layers = 1``.

Corrections: ``"cached"`` works (its complement plan lists the key clusters not kept); ``"pooled"``
stands each dropped key cluster in as its size times its mean key and value, per query cluster
(``corrections.pooled_correction`` via ``ClusterPlan.token_blocks``): ``Ck / S`` of dense's scores.
``skip_threshold`` (a fixed-block engine rule) is refused. Statistics count token pairs (blocks
have variable sizes): computed pairs / ``S^2`` per (batch, head), text included; clustering and
scoring are overhead in the timings (``eval/bench/methods.py`` reports them separately).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fastdit.plan import ClusterPlan

from .base import GUARD_DEFAULT, check_int, check_number, option, register_method
from .block_sparse import BlockSparseConfig, BlockSparseMethod
from .selection.kmeans import cluster_permutation, inverse_order, kmeans, spread_init
from .selection.mass import row_block_masses, rowwise_block_masses, stratified_rows
from .selection.reuse import ReuseOptions, ReuseSelection

#: How cluster masses are predicted (``SVG2Config.estimator``).
ESTIMATORS = ("rowwise", "sampled", "centroids")
#: In what order key clusters are taken until ``top_p`` is reached (``SVG2Config.rank``).
RANKS = ("per_token", "mass")
#: ``ctx.state`` key of the warm-start centroids.
STATE_KEY = "svg2_centroids"


@dataclass
class SVG2Config(ReuseOptions, BlockSparseConfig):
    """Options of svg2 (see the module docstring).

    Attributes:
        q_clusters: query clusters per (batch, head), >= 1 (clamped to the video tokens per call).
        k_clusters: key clusters per (batch, head), >= 1 (clamped likewise).
        top_p: per query cluster, keep key clusters (in ``rank`` order) until their predicted mass
            reaches this; in (0, 1] (1: dense).
        kmeans_iters: k-means iterations of a warm-started call (>= 1).
        init_iters: k-means iterations of a cold start (>= 1).
        warm_start: start from the previous call's centroids while the layout is unchanged.
        min_kc_ratio: keep at least this fraction of the key clusters per query cluster, in [0, 1]
            (SVG2's ``min_kc_ratio``; its scripts use 0.10).
        estimator, mass_rows, row_guard, guard_margin, refine_clusters, refine_keys: how masses
            are predicted and rows guarded (module docstring, 3 and 4).
        rank: ``"per_token"`` (predicted mass per key token) or ``"mass"`` (SVG2's order).
        dense_steps, dense_layers: see ``MethodConfig``; default 0.25 and 1.
        correction: ``"none"``, ``"pooled"`` or ``"cached"``; ``skip_threshold`` must
            stay None (the variable-size engine has no skip rule).
    """

    q_clusters: int = option(100, "query clusters per head (k-means), clamped to the video tokens", range=(1, None),
                             widget="number")
    k_clusters: int = option(500, "key clusters per head (k-means), clamped to the video tokens", range=(1, None),
                             widget="number")
    top_p: float = option(0.9, "per query cluster, keep key clusters (see rank) until their predicted mass "
                          "reaches this", range=(0.0, 1.0), widget="slider")
    kmeans_iters: int = option(2, "k-means iterations of a warm-started call", range=(1, None), widget="number")
    init_iters: int = option(20, "k-means iterations of a cold start (first call, or a changed layout)",
                             range=(1, None), widget="number")
    warm_start: bool = option(True, "start k-means from the previous call's centroids while the layout is unchanged",
                              widget="checkbox")
    min_kc_ratio: float = option(0.0, "keep at least this fraction of the key clusters per query cluster (SVG2: 0.1)",
                                 range=(0.0, 1.0), widget="slider")
    estimator: str = option("rowwise", "how cluster masses are predicted: 'rowwise' (every query row against each "
                            "key cluster's mean and spread), 'sampled' (exact masses of a few sampled rows per query "
                            "cluster) or 'centroids' (softmax of centroid scores, SVG2's)",
                            choices=ESTIMATORS, widget="dropdown", advanced=True)
    mass_rows: int = option(4, "estimator='sampled': query rows sampled per query cluster", range=(1, None),
                            widget="number", advanced=True)
    row_guard: bool = option(True, "estimator='rowwise': also keep every key cluster on which a single query row "
                             "puts more than guard_margin x (1 - top_p) of its predicted mass", widget="checkbox",
                             advanced=True)
    guard_margin: float = option(1.0, "row_guard: a key cluster is kept for one query row when that row's predicted "
                                 "mass on it exceeds guard_margin x (1 - top_p)", range=(1.0, None), widget="number",
                                 advanced=True)
    refine_clusters: int = option(4, "estimator='rowwise': each row's N key clusters of largest estimate are scored "
                                  "again from their keys (0: off)", range=(0, None), widget="number", advanced=True)
    refine_keys: int = option(256, "refine_clusters: keys scored per refined cluster (all of a smaller cluster)",
                              range=(1, None), widget="number", advanced=True)
    rank: str = option("per_token", "order in which key clusters are kept until top_p is reached: 'per_token' "
                       "(predicted mass per key token: the fewest token pairs) or 'mass' (predicted mass: the fewest "
                       "clusters, SVG2's)", choices=RANKS, widget="dropdown", advanced=True)

    def validate(self):
        super().validate()
        for name in ("q_clusters", "k_clusters"):
            check_int(name, getattr(self, name), note="counts above the number of video tokens are clamped per call")
        for name in ("kmeans_iters", "init_iters", "mass_rows", "refine_keys"):
            check_int(name, getattr(self, name))
        check_int("refine_clusters", self.refine_clusters, low=0, note="0: off")
        self.top_p = check_number("top_p", self.top_p, 0, 1, low_open=True,
                                  note="predicted attention mass kept per query cluster")
        self.min_kc_ratio = check_number("min_kc_ratio", self.min_kc_ratio, 0, 1,
                                         note="fraction of the key clusters always kept")
        if self.estimator not in ESTIMATORS:
            raise ValueError(f"estimator must be one of {ESTIMATORS}, got {self.estimator!r}")
        if self.rank not in RANKS:
            raise ValueError(f"rank must be one of {RANKS}, got {self.rank!r}")
        self.guard_margin = check_number("guard_margin", self.guard_margin, 1, math.inf, high_open=True,
                                         note="a row guard at guard_margin x (1 - top_p) of one row's predicted mass")
        for name in ("warm_start", "row_guard"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.skip_threshold is not None:
            raise ValueError("skip_threshold is not supported by svg2 (its variable-size cluster blocks run on an "
                             "engine without the skip rule): leave it None")


# -- scoring and selection ----------------------------------------------------------------------

def cluster_scores(q_centroids, k_centroids, k_sizes, scale):
    """``p[m, j]`` of the module docstring: float32 ``(G, Cq, Ck)``, rows summing to 1 (0 when no
    key cluster has a valid key)."""
    logits = torch.bmm(q_centroids.float(), k_centroids.float().transpose(1, 2)).mul_(scale)
    sizes = k_sizes.float()[:, None, :]
    logits = logits + torch.where(sizes > 0, sizes.clamp(min=1.0).log(), torch.full_like(sizes, float("-inf")))
    return torch.softmax(logits, dim=-1).nan_to_num(0.0)


def select_clusters(probs, top_p, min_kc_ratio=0.0, kept_before=None, forced=None, sizes=None):
    """``(order, counts)``: key clusters of each query cluster in descending ``p`` (long
    ``(G, Cq, Ck)``), or with ``sizes`` (valid keys per key cluster, ``(G, Ck)``) in descending
    ``p / n_j`` (mass per key token: reaching ``top_p`` with the fewest token pairs, the greedy
    answer to "the least work that keeps ``top_p``"; by ``p`` alone a large cluster of mass 0.3
    ranks before ten small ones of 0.1 each, which keep more in fewer pairs), and how many of
    them are kept (long ``(G, Cq)``, >= 1 and >= ``ceil(min_kc_ratio * Ck)``). ``kept_before``
    ``(G, Cq)``: predicted mass already kept whatever the selection (the text keys, with
    ``estimator="rows"``), counted toward ``top_p``. ``forced`` bool ``(G, Cq, Ck)``: key
    clusters kept whatever their ``p`` (ranked first, their mass counted toward ``top_p``)."""
    clusters = probs.shape[-1]
    rank = probs if sizes is None else probs / sizes.to(probs.dtype).clamp(min=1.0)[:, None, :]
    rank = rank if forced is None else rank + 2.0 * forced  # rank <= 1: forced clusters rank first
    order = rank.argsort(dim=-1, descending=True)
    sorted_probs = probs.gather(-1, order)
    if top_p >= 1.0:  # every cluster, whatever the float rounding of the cumulative sum
        return order, torch.full(probs.shape[:-1], clusters, dtype=torch.long, device=probs.device)
    before = sorted_probs.cumsum(-1) - sorted_probs  # mass of the higher-ranked clusters
    if kept_before is not None:
        before = before + kept_before[..., None]
    counts = (before < top_p).sum(-1)
    if forced is not None:
        counts = torch.maximum(counts, forced.sum(-1))
    return order, counts.clamp(min=max(1, math.ceil(min_kc_ratio * clusters - 1e-9)))


def predicted_kept(probs, order, counts, kept_before=None):
    """Predicted kept mass per query cluster ``(G, Cq)``: the ``counts`` top clusters' ``p`` (plus
    ``kept_before``)."""
    used = torch.arange(probs.shape[-1], device=probs.device) < counts[..., None]
    kept = (probs.gather(-1, order) * used).sum(-1)
    return kept if kept_before is None else kept + kept_before


def block_lists(order, counts, has_text):
    """int32 ``(kv_indices (G, Mq, Mk), kv_counts (G, Mq))``: each video query cluster's kept key
    clusters (in descending score), then the text key block ``Ck`` when there is text; the text
    query block (last row) keeps every key block."""
    groups, q_clusters, k_clusters = order.shape
    if not has_text:
        return order.to(torch.int32), counts.to(torch.int32)
    device = order.device
    width = k_clusters + 1
    slot = torch.arange(width, device=device).expand(groups, q_clusters, width)
    count = counts[..., None]
    source = (slot - (slot > count).long()).clamp(max=k_clusters - 1)  # skip over the text slot
    video_rows = torch.where(slot == count, torch.full_like(slot, k_clusters), order.gather(-1, source))
    text_row = torch.arange(width, device=device).expand(groups, 1, width)
    indices = torch.cat([video_rows, text_row], 1).to(torch.int32)
    kv_counts = torch.cat([counts + 1, torch.full((groups, 1), width, dtype=torch.long, device=device)], 1)
    return indices.contiguous(), kv_counts.to(torch.int32)


# -- the per-call plan ----------------------------------------------------------------------------

# -- the method ---------------------------------------------------------------------------------

@dataclass
class Clusters:
    """One call's clustering: labels long ``(G, Nv)``, centroids ``(G, C, D)``, valid key sizes."""

    q_labels: torch.Tensor
    k_labels: torch.Tensor
    q_centroids: torch.Tensor
    k_centroids: torch.Tensor
    k_sizes: torch.Tensor
    warm: bool
    iters: int


@register_method
class SparseVideoGen2(ReuseSelection, BlockSparseMethod):
    name = "svg2"
    config_cls = SVG2Config
    default_options = {"dense_steps": 0.25, "dense_layers": 1}
    #: The embedded random-weight tiny models (8 x 32 x 48 = 12288 video tokens in compare) have
    #: nearly uniform attention, so ``p`` follows the key clusters' sizes and ``top_p`` is about the
    #: kept fraction of keys. 0.5 is the lowest of the calibration's candidates (``candidates``):
    #: half the mass, a threshold that still means what it says (an earlier 0.15 kept 15% of the
    #: mass and is gone, issue 40); the trained tiny-shapes model takes its calibration instead.
    #: Clusters of a few hundred tokens suit the CPU engine; a short cold start (6 iterations) keeps
    #: the first sparse step of each layer cheap there.
    # 48 key clusters of 256 keys: 64 refined keys keep the refinement's share of a row's keys (4 x 64
    # of 12k) near a real video's at the defaults (4 x 256 of 75k, 1.4%)
    tiny_options = {"q_clusters": 24, "k_clusters": 48, "top_p": 0.5, "init_iters": 6, "refine_keys": 64}
    rank, auto_candidate, engine_geometry = 50, True, "frames"

    @classmethod
    def candidates(cls, layout):
        """The predicted-mass threshold of its key clusters."""
        return [{"top_p": p} for p in (0.95, 0.9, 0.8, 0.7, 0.5)]
    #: the quality guard's bound (relative L2 error per head) when ``guard`` is left empty
    guard_default = GUARD_DEFAULT

    def guard_promise(self):
        return self.config.top_p

    def guard_levels(self):
        return 1

    def guard_widen_options(self, level):
        """One wider setting: a quarter of the dropped mass (``top_p`` 0.9 -> 0.975)."""
        return {"top_p": 1 - (1 - self.config.top_p) / 4}
    #: where the warm-start centroids live in ``ctx.state``
    state_key = STATE_KEY
    #: per-head parts of a ``ClusterPlan`` (what reuse replaces at re-selected heads, ``reuse.py``)
    reuse_fields = ("kv_indices", "kv_counts", "q_order", "q_inverse", "k_order", "q_offsets", "k_offsets",
                    "q_blocks", "k_blocks")
    reuse_info = ("scores", "predicted_mass")

    def reuse_substate(self, state, index, batch, heads):
        """Re-selected heads warm-start from their own stored centroids (``(B*H, C, D)`` rows)."""
        stored = state.get(STATE_KEY)
        if stored is None or stored["key"][1:3] != (batch, heads):
            return {}
        pick = {name: stored[name].view(batch, heads, *stored[name].shape[1:])[:, index].flatten(0, 1)
                for name in ("q", "k")}
        return {STATE_KEY: {"key": stored["key"][:2] + (index.numel(),) + stored["key"][3:], **pick}}

    def reuse_store_substate(self, state, substate, index, batch, heads):
        stored, fresh = state.get(STATE_KEY), substate.get(STATE_KEY)
        if stored is None or fresh is None or stored["key"][1:3] != (batch, heads):
            return
        for name in ("q", "k"):
            full = stored[name].view(batch, heads, *stored[name].shape[1:]).clone()
            full[:, index] = fresh[name].view(batch, index.numel(), *fresh[name].shape[1:])
            stored[name] = full.flatten(0, 1)

    def cluster(self, ctx, q, k):
        """k-means of the video queries and keys of every (batch, head), warm-started from
        ``ctx.state`` when allowed (see the module docstring); stores the new centroids there."""
        config, layout = self.config, ctx.layout
        batch, heads, _, dim = q.shape
        video = layout.video_positions(q.device)
        n_video = video.numel()
        cq, ck = min(config.q_clusters, n_video), min(config.k_clusters, n_video)
        xq = q.index_select(2, video).reshape(batch * heads, n_video, dim)
        xk = k.index_select(2, video).reshape(batch * heads, n_video, dim)

        def validity(mask):
            if mask is None:
                return None
            return mask.to(device=q.device, dtype=torch.bool)[:, video][:, None, :].expand(
                batch, heads, n_video).reshape(batch * heads, n_video)

        key = (layout, batch, heads, dim, cq, ck, str(q.device))
        stored = ctx.state.get(STATE_KEY) if config.warm_start else None
        warm = stored is not None and stored["key"] == key
        if warm:
            init_q, init_k, iters = stored["q"], stored["k"], config.kmeans_iters
        else:
            init_q, init_k, iters = spread_init(xq, cq), spread_init(xk, ck), config.init_iters
        q_centroids, q_labels, _ = kmeans(xq, init_q, iters, validity(ctx.query_mask))
        k_centroids, k_labels, k_sizes = kmeans(xk, init_k, iters, validity(ctx.key_mask))
        if config.warm_start:
            # selection only (no gradient): kept detached, so no autograd graph outlives the call
            ctx.state[STATE_KEY] = {"key": key, "q": q_centroids.detach(), "k": k_centroids.detach()}
        return Clusters(q_labels, k_labels, q_centroids, k_centroids, k_sizes, warm, iters)

    def plan_from_clusters(self, ctx, clusters, q, k=None):
        """Scoring, selection and the ``ClusterPlan`` of this call from its clustering (``k`` is
        needed by ``estimator="rows"``)."""
        layout = ctx.layout
        batch, heads, seq, dim = q.shape
        scale = 1.0 / math.sqrt(dim) if ctx.scale is None else ctx.scale
        video, text = layout.video_positions(q.device), layout.text_positions(q.device)
        cq, ck = clusters.q_centroids.shape[1], clusters.k_centroids.shape[1]
        q_order, q_offsets, q_blocks = cluster_permutation(clusters.q_labels, cq, video, text)
        k_order, k_offsets, k_blocks = cluster_permutation(clusters.k_labels, ck, video, text)

        def per_head(t):
            return t.view(batch, heads, *t.shape[1:])

        text_mass = forced = None
        if self.config.estimator != "centroids":
            if k is None:
                raise ValueError(f"svg2 with estimator={self.config.estimator!r} scores query rows against the keys: "
                                 f"pass k")
            if self.config.estimator == "sampled":
                probs, text_mass = self.row_estimate(ctx, q, k, q_order, q_offsets, k_blocks, cq, ck, scale)
            else:
                probs, most = rowwise_block_masses(q, k, ctx.key_mask, per_head(q_blocks), cq + 1, per_head(k_blocks),
                                                   ck + 1, scale, ctx.query_mask, row_max=True,
                                                   refine=self.config.refine_clusters,
                                                   refine_keys=self.config.refine_keys)
                probs = probs.view(-1, cq + 1, ck + 1)
                probs, text_mass = probs[:, :cq, :ck], probs[:, :cq, ck]
                if self.config.row_guard and self.config.top_p < 1.0:
                    margin = self.config.guard_margin * (1 - self.config.top_p)
                    forced = most.view(-1, cq + 1, ck + 1)[:, :cq, :ck] > margin
        else:
            probs = cluster_scores(clusters.q_centroids, clusters.k_centroids, clusters.k_sizes, scale)
        sizes = clusters.k_sizes if self.config.rank == "per_token" else None
        order, counts = select_clusters(probs, self.config.top_p, self.config.min_kc_ratio, text_mass, forced, sizes)
        q_sizes = q_offsets.diff(dim=-1)[:, :cq].double()
        predicted = (predicted_kept(probs, order, counts, text_mass).double() * q_sizes).sum(-1)
        predicted = (predicted + layout.text_len) / seq  # per (batch, head), over all rows (text rows keep all)
        has_text = layout.text_len > 0
        kv_indices, kv_counts = block_lists(order, counts, has_text)

        return ClusterPlan(
            kv_indices=per_head(kv_indices), kv_counts=per_head(kv_counts), block_m=1, block_n=1, seq_len=seq,
            name=f"svg2_q{cq}_k{ck}_p{self.config.top_p:g}", dynamic=True,
            info={"q_clusters": cq, "k_clusters": ck, "warm": clusters.warm, "iters": clusters.iters,
                  "scores": per_head(probs), "predicted_mass": predicted.view(batch, heads)},
            q_order=per_head(q_order), q_inverse=per_head(inverse_order(q_order)), k_order=per_head(k_order),
            q_offsets=per_head(q_offsets), k_offsets=per_head(k_offsets), q_blocks=per_head(q_blocks),
            k_blocks=per_head(k_blocks))

    def fresh_select(self, ctx, q, k, v=None):
        """The ``ClusterPlan`` of this call: clustering, then scoring and selection (``select`` adds
        reuse across steps, ``reuse.py``)."""
        return self.plan_from_clusters(ctx, self.cluster(ctx, q, k), q, k)

    def row_estimate(self, ctx, q, k, q_order, q_offsets, k_blocks, cq, ck, scale):
        """``estimator="sampled"``: ``(p (G, Cq, Ck), text mass (G, Cq))`` float32: per query cluster,
        the mean over ``mass_rows`` sampled member rows (stratified over the cluster, see
        ``fastdit.methods.selection.mass``) of their exact softmax mass on each key cluster and on the text."""
        batch, heads, seq, dim = q.shape
        groups = batch * heads
        starts = q_offsets[:, :cq].long()
        positions, weight = stratified_rows(starts, q_offsets.diff(dim=-1)[:, :cq].long(), self.config.mass_rows)
        rows = q_order.gather(1, positions.reshape(groups, -1))  # model tokens (G, Cq * s)
        if ctx.query_mask is not None:
            ok = ctx.query_mask.to(device=q.device, dtype=torch.bool)[:, None, :].expand(batch, heads, seq)
            weight = weight * ok.reshape(groups, seq).gather(1, rows).view_as(weight).float()
        q_rows = q.reshape(groups, seq, dim).gather(1, rows[..., None].expand(-1, -1, dim))
        key_valid = None if ctx.key_mask is None else ctx.key_mask.to(device=q.device, dtype=torch.bool)
        masses = row_block_masses(q_rows.view(batch, heads, -1, dim), k, key_valid, k_blocks.view(batch, heads, seq),
                                  ck + 1, scale).view(groups, cq, -1, ck + 1)
        probs = (masses * weight[..., None]).sum(2) / weight.sum(-1).clamp_min(1.0)[..., None]
        return probs[..., :ck], probs[..., ck]
