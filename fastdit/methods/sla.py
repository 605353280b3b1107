"""SLA: sparse-linear attention (critical blocks sparse, marginal blocks linear, negligible skipped).

After "SLA: Beyond Sparsity in Diffusion Transformers via Fine-Tunable Sparse-Linear Attention"
(Zhang, Wang, Jiang et al., 2025, arXiv 2509.24006; code thu-ml/SLA, served as sglang's
``sla_attn`` and ComfyUI's ``sla``). Written from the paper's formulas; names of the options follow
sglang (``topk_ratio``, ``feature_map``) and the paper (the negligible share ``k_l``).

Kernel order: as sparge, video tokens are permuted into 3-D tiles of ``tile = (tt, th, tw)``
tokens (fitted to each grid by ``sta.choose_tile``), one tile per block of ``b = tt * th * tw``
slots; text follows in its own blocks of ``b`` slots. Image models (one latent frame) use the 2-D
form: ``1 x th x tw`` tiles (default 1x8x16). Query and key blocks have the same size (the published
kernel uses 128-row query and 64-row key blocks). Per call, batch and head, with ``n`` blocks,
``valid`` keys the call's key mask minus padding slots:

1. **compressed scores**: ``qbar_m``, ``kbar_j`` the means of block ``m``'s valid queries and block
   ``j``'s valid keys; ``P_c[m, j] = softmax_j(scale * qbar_m . kbar_j)`` (key blocks without a
   valid key get 0). The published code ranks ``qbar_m . (kbar_j - mean(k))`` (SageAttention's
   smoothing); the subtracted term is constant along a row, so the ranking is the same.
2. **classification** of each (query block, key block) pair by row ``m``'s ranking of ``P_c``:
   the ``max(1, ceil(topk_ratio * n))`` highest are **critical** (the paper's ``k_h``), those among
   the ``floor(negligible_ratio * n)`` lowest that are not critical **negligible** (the paper's
   ``k_l``), the others **marginal**. Text key blocks are always critical and text query blocks keep
   every key block critical (as in every fastdit block-sparse method). A key block without a valid
   key (masked text padding) ranks last and is never attended.
3. **sparse branch** on the block-sparse engine over the critical pairs only:
   ``O_s[i] = sum_{j in C_m} exp(s_ij) v_j / sum_{j in C_m} exp(s_ij)``, ``s_ij = scale q_i . k_j``.
4. **linear branch** over the marginal pairs, blockwise (the published kernel's form): with the
   feature map ``phi`` (``"softmax"``: softmax over the head dimension, published default;
   ``"elu"``: ``elu(x) + 1``; ``"relu"``), per key block ``h_j = sum_{i in j, valid} phi(k_i)^T v_i``
   (``D x D``) and ``z_j = sum_{i in j, valid} phi(k_i)`` (``D``); per query block
   ``H_m = sum_{j marginal} h_j``, ``Z_m = sum_{j marginal} z_j``; and per query row
   ``O_l[i] = phi(q_i) H_m / (phi(q_i) . Z_m)`` (0 where the denominator is 0: a row without a
   marginal block, as the published kernel gives when every block is critical).
5. **output** ``O = O_s + proj(O_l)``, ``proj(x) = x W^T + c`` a learned ``D x D`` linear map with
   bias, one per attention layer and shared by its heads; the paper initialises it at zero, so an
   untrained SLA is its sparse branch alone (``sparse only`` is the training-free use). It is trained
   by ``python -m fastdit.train --method sla`` (a parameter of the patch) and loaded with the adapter.
   Masked query rows are 0.

Cost per head: the sparse branch is ``topk_ratio`` of dense attention's work (plus the text blocks);
the linear branch is about ``4 N D^2`` FLOPs for the block sums and the feature products, ``2 N
D^2`` for the projection, and ``2 n^2 D^2 = 2 N^2 D^2 / b^2`` to mix the block sums per query block
(1/256 of dense's ``4 N^2 D`` at ``b = D = 128``); its memory is two ``n x D x D`` float32 tensors
per head (the published kernel keeps the same per-query-block sums). What is fused: nothing across
branches. The published kernel adds the linear branch's block sums inside the sparse kernel's loop
over a query block's key blocks; fastdit's engine is shared with every block-sparse method, so here
the sparse branch is one engine call and the linear branch three batched matmuls beside it (block
sums, their per-row mix by the marginal mask, the feature products), never an ``N x N`` matrix.
``fastdit.eval.predict`` counts both (``outside_work``). A zero projection (the training-free form)
skips the linear branch; telling it from a trained one reads the projection once per call (one host
synchronisation on a GPU).

Not under ring attention (the linear branch needs every key block's sums; ring cuts the plan only).
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


from . import base as _base
from .base import OptionError, check_number, option, register_method
from .block_sparse import BlockSparseConfig, BlockSparseMethod
from .selection.tiles import tile_order_plan
from .sta import choose_tile

VIDEO_TILE = (2, 8, 8)
IMAGE_TILE = (1, 8, 16)
FEATURE_MAPS = ("softmax", "elu", "relu")


@dataclass
class SLAConfig(BlockSparseConfig):
    """Options of sla (see the module docstring).

    Attributes:
        topk_ratio: share of key blocks per query block that are critical (sparse softmax attention);
            sglang's ``topk_ratio``, thu-ml's ``topk``, the paper's ``k_h``; ComfyUI's ``keep_percent``
            is ``100 * topk_ratio``. In (0, 1] (1: dense, no linear branch).
        negligible_ratio: share of key blocks per query block, the lowest-scoring, that are skipped
            (the paper's ``k_l``; the published code and sglang run with none). In [0, 1).
        feature_map: the linear branch's feature map: ``"softmax"`` (published default), ``"elu"``
            or ``"relu"``.
        tile: target ``(tt, th, tw)`` tokens per block, fitted to each grid; None: 2x8x8 for video,
            1x8x16 for images (128 tokens).
        dense_steps, dense_layers, skip_threshold, quant: see ``BlockSparseConfig``; ``correction``
            must stay ``"none"`` (the linear branch is SLA's own compensation).
    """

    topk_ratio: float = option(0.1, "share of key blocks per query block attended exactly (critical; sglang's "
                               "topk_ratio, the paper's k_h, ComfyUI keep_percent / 100)", range=(0.0, 1.0),
                               widget="slider")
    negligible_ratio: float = option(0.0, "share of key blocks per query block skipped (lowest scores; the "
                                     "paper's k_l); the rest get the linear branch", range=(0.0, 1.0), widget="slider")
    feature_map: str = option("softmax", "feature map of the linear branch: softmax (over the head dim), elu "
                              "(elu + 1) or relu", choices=FEATURE_MAPS, widget="dropdown", advanced=True)
    tile: tuple | None = option(None, "target tokens per block (tt, th, tw), fitted to each grid; empty: 2x8x8 "
                                "(1x8x16 for images)", widget="triple")

    def validate(self):
        super().validate()
        check_number("topk_ratio", self.topk_ratio, 0, 1, low_open=True,
                     note="share of key blocks attended exactly per query block")
        check_number("negligible_ratio", self.negligible_ratio, 0, 1, high_open=True,
                     note="share of key blocks skipped per query block")
        if self.topk_ratio + self.negligible_ratio > 1:
            raise OptionError(f"topk_ratio + negligible_ratio must be at most 1 (critical and negligible shares of "
                              f"the same key blocks), got {self.topk_ratio} + {self.negligible_ratio}")
        if self.feature_map not in FEATURE_MAPS:
            raise OptionError(f"feature_map must be one of {FEATURE_MAPS}, got {self.feature_map!r}")
        if self.correction != "none":
            raise OptionError(f"sla takes correction='none' only, got {self.correction!r}: its linear branch is "
                              "its compensation for the blocks it does not attend exactly")
        if self.tile is not None:
            if not isinstance(self.tile, (tuple, list)) or len(self.tile) != 3 or not all(
                isinstance(t, int) and not isinstance(t, bool) and t > 0 for t in self.tile
            ):
                raise OptionError(f"tile must be three positive ints (tt, th, tw), got {self.tile!r}")
            self.tile = tuple(self.tile)


def feature(x, name):
    """The linear branch's feature map ``phi`` over the last (head) dimension."""
    if name == "softmax":
        return torch.softmax(x, dim=-1)
    if name == "elu":
        return F.elu(x) + 1.0
    return torch.relu(x)


def block_means(x, weight, block):
    """Mean of each block's valid tokens: ``(B, H, n, D)`` float32 (float64 for float64 ``x``) and
    the valid count ``(B|1, 1, n)``; ``weight`` ``(B|1, L)`` bool. A block without one has mean 0."""
    batch, heads, length, dim = x.shape
    n = length // block
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    w = weight.view(weight.shape[0], 1, n, 1, block).to(acc)
    total = (w @ x.view(batch, heads, n, block, dim).to(acc)).squeeze(-2)  # (B, H, n, D)
    count = w.sum(-1).squeeze(-1)
    return total / count.clamp_min(1.0)[..., None], count


def classify(scores, count, forced_keys, full_rows, config):
    """``(critical, marginal, order)`` from block scores ``(B, H, n, n)``: bool masks of the pairs
    and each row's key blocks in descending score. ``count`` ``(B|1, 1, n)``: valid keys per key
    block; ``forced_keys`` / ``full_rows`` bool ``(n,)``: text key blocks, text query blocks."""
    n = scores.shape[-1]
    scores = scores.masked_fill((count == 0)[..., None, :], float("-inf"))
    order = scores.sort(dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(n, device=scores.device).expand_as(order))
    n_critical = min(n, max(1, math.ceil(config.topk_ratio * n)))
    n_negligible = math.floor(config.negligible_ratio * n)
    critical = (rank < n_critical) | forced_keys[None, None, None, :] | full_rows[None, None, :, None]
    negligible = (rank >= n - n_negligible) & ~critical
    marginal = ~critical & ~negligible & (count > 0)[..., None, :]
    return critical, marginal, order


def plan_lists(critical, order):
    """``(kv_indices, kv_counts)`` int32 of the critical pairs, each row in descending score."""
    keep = critical.gather(-1, order)
    position = (~keep).to(torch.uint8).sort(dim=-1, stable=True).indices
    return order.gather(-1, position).to(torch.int32), keep.sum(-1, dtype=torch.int32)


def linear_branch(q, k, v, key_ok, marginal, block, feature_map):
    """The linear branch in kernel order (module docstring, step 4): ``(B, H, L, D)`` in float32
    (float64 for float64 inputs) from kernel-order ``q, k, v``, valid keys ``key_ok`` ``(B|1, L)``
    and the marginal pairs ``(B, H, n, n)``."""
    batch, heads, length, dim = q.shape
    n = length // block
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    phi_q = feature(q.to(acc), feature_map).view(batch, heads, n, block, dim)
    phi_k = feature(k.to(acc), feature_map) * key_ok.view(key_ok.shape[0], 1, length, 1).to(acc)
    phi_k = phi_k.view(batch, heads, n, block, dim)
    h = phi_k.transpose(-1, -2) @ v.to(acc).view(batch, heads, n, block, dim)  # (B, H, n, D, D): h_j
    z = phi_k.sum(3)  # (B, H, n, D): z_j
    mix = marginal.to(acc)
    h_rows = (mix @ h.reshape(batch, heads, n, dim * dim)).view(batch, heads, n, dim, dim)  # H_m
    z_rows = mix @ z  # Z_m
    numerator = phi_q @ h_rows  # (B, H, n, b, D)
    denominator = (phi_q * z_rows[:, :, :, None, :]).sum(-1, keepdim=True)
    positive = denominator > 0
    out = torch.where(positive, numerator / torch.where(positive, denominator, torch.ones_like(denominator)), 0.0)
    return out.view(batch, heads, length, dim)


@register_method
class SLA(BlockSparseMethod):
    guard_scores_widen = False  # the output is more than the plan's engine call (see guard/widen.py)
    name = "sla"
    config_cls = SLAConfig
    default_options = {"dense_steps": 0, "dense_layers": 0}
    #: tiny-shapes' 9 x 32 x 32 grid in 3 x 8 x 8 tiles (48 blocks): the sparse branch at a quarter of them.
    tiny_options = {"tile": (3, 8, 8), "topk_ratio": 0.25}
    rank, engine_geometry, cost_model = 36, "grid", "density"  # in an engine: training-free (no layer identity)
    ring = False
    ring_reason = ("its linear branch sums phi(K)^T V over every marginal key block of the whole sequence, which one "
                   "ring shard does not hold")
    reports_lse = False  # the output is not a softmax over the computed keys (the linear branch adds to it)

    #: off by default, as published and as vsa: the guard compares each head with the model's dense
    #: attention, which a fine-tuned model (LoRA + projection) has moved away from, so it would re-run
    #: the trained heads dense. ``guard=0.1`` (``GUARD_DEFAULT``) turns it on for the training-free form.
    guard_default = False

    @classmethod
    def candidates(cls, layout):
        return [{"topk_ratio": r} for r in (0.5, 0.3, 0.2, 0.1, 0.05)]

    def guard_levels(self):
        return 1

    def guard_widen_options(self, level):
        """One wider setting: twice the critical share (and no negligible blocks)."""
        return {"topk_ratio": min(1.0, 2 * self.config.topk_ratio), "negligible_ratio": 0.0}

    def tile_for(self, layout):
        target = self.config.tile or (VIDEO_TILE if layout.frames > 1 else IMAGE_TILE)
        return choose_tile(layout.grid, target)

    def prepare(self, layout, heads, device):
        """The static part: tile-order permutation, padding validity and the text blocks; the plan's
        own lists are dense (``select`` replaces them every call)."""
        tile = self.tile_for(layout)
        return tile_order_plan(layout, tile, device, f"sla_t{'x'.join(map(str, tile))}", {"tile": tile})

    def classify(self, static, q_kernel, k_kernel, key_ok, query_ok, scale):
        """``(critical, marginal, order, P_c)`` of one call (module docstring, steps 1 and 2)."""
        block = static.block_m
        q_mean, _ = block_means(q_kernel, query_ok, block)
        k_mean, k_count = block_means(k_kernel, key_ok, block)
        scores = (q_mean @ k_mean.transpose(-1, -2)) * scale
        text = static.info["text_blocks"]
        critical, marginal, order = classify(scores, k_count, text, text, self.config)
        probs = torch.softmax(scores.masked_fill((k_count == 0)[..., None, :], float("-inf")), -1).nan_to_num(0.0)
        return critical, marginal, order, probs

    def select(self, ctx, q, k):
        plan, _ = self.predict(self.prepared(ctx.layout, 1, q.device), q, k, ctx.key_mask, ctx.query_mask,
                               ctx.scale)
        return plan

    def predict(self, static, q, k, key_mask=None, query_mask=None, scale=None):
        """The sparse branch's plan of one call and the pieces it came from (a dict: ``critical``,
        ``marginal``, ``probs`` and the kernel-order ``q``, ``k``, ``key_ok``)."""
        index = static.gather_index
        q_kernel, k_kernel = q.index_select(2, index), k.index_select(2, index)
        key_ok = static.kernel_kv_valid(key_mask)
        query_ok = static.kv_valid
        if query_mask is not None:
            query_ok = query_mask.to(torch.bool)[:, index] & static.kv_valid
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        critical, marginal, order, probs = self.classify(static, q_kernel, k_kernel, key_ok, query_ok, scale)
        kv_indices, kv_counts = plan_lists(critical, order)
        plan = copy.copy(static)  # keeps the static permutation and its inverse
        plan.__dict__.pop("density", None)
        plan.kv_indices, plan.kv_counts, plan.dynamic = kv_indices, kv_counts, True
        plan.info = {"tile": static.info["tile"], "marginal_density": marginal.float().mean((-1, -2))}
        return plan, {"critical": critical, "marginal": marginal, "probs": probs, "q": q_kernel, "k": k_kernel,
                      "key_ok": key_ok}

    def layer_module(self, heads, head_dim):
        """The learned projection of one layer: ``torch.nn.Linear(D, D)`` with bias, shared by the
        layer's heads, initialised at zero as published (the training-free form: sparse only)."""
        proj = torch.nn.Linear(head_dim, head_dim)
        with torch.no_grad():
            proj.weight.zero_()
            proj.bias.zero_()
        return proj

    def layer_module_key(self):
        """The projection maps the linear branch's output, whose meaning is set by the feature map."""
        return {"feature_map": self.config.feature_map}

    @staticmethod
    def projection(ctx):
        """``(weight, bias)`` of this call's learned projection (``ctx.params``), or None where it is
        zero and takes no gradient (the linear branch would add nothing: it is not computed).
        Reading whether it is zero synchronises once per call on a GPU."""
        proj = ctx.params
        if proj is None:
            return None
        weight, bias = proj.weight, proj.bias
        live = torch.is_grad_enabled() and (weight.requires_grad or (bias is not None and bias.requires_grad))
        if not live and not bool(weight.count_nonzero()) and (bias is None or not bool(bias.count_nonzero())):
            return None
        return weight, bias

    def attend(self, ctx, q, k, v):
        config = self.config
        static = self.prepared(ctx.layout, 1, q.device)
        plan, parts = self.predict(static, q, k, ctx.key_mask, ctx.query_mask, ctx.scale)
        ctx.record(plan=plan)
        skip = config.skip_threshold is not None
        out, lse, *skipped = _base.run_plan(q, k, v, plan, key_mask=ctx.key_mask, query_mask=ctx.query_mask,
                                            scale=ctx.scale, backend=ctx.backend, return_lse=True, quant=config.quant,
                                            skip_threshold=config.skip_threshold, return_skipped=skip)
        ctx.info["sparse_lse"] = lse
        ctx.info["marginal_density"] = plan.info["marginal_density"]
        proj = self.projection(ctx)
        if proj is None:  # zero projection: the sparse branch alone (the linear branch is not computed)
            return out
        v_kernel = v.index_select(2, static.gather_index)
        linear = linear_branch(parts["q"], parts["k"], v_kernel, parts["key_ok"], parts["marginal"], static.block_m,
                               config.feature_map).index_select(2, static.inverse)
        weight, bias = proj
        linear = linear @ weight.to(linear.dtype).t()
        if bias is not None:
            linear = linear + bias.to(linear.dtype)
        out = out + linear.to(out.dtype)
        if ctx.query_mask is not None:
            out = out * ctx.query_mask.to(device=out.device, dtype=out.dtype)[:, None, :, None]
        return out

    @classmethod
    def outside_work(cls, options, batch, tokens, head_dim, elt):
        """The linear branch and the block scores per head: features and block sums ``~ 6 N D^2``,
        the per-row mix of block sums ``2 n^2 D^2``, compressed scores ``2 n^2 D`` (``n = N / 128``);
        bytes: q, k, v read once more and the output written, plus the ``n D^2`` block sums."""
        n = max(1, tokens // 128)
        flops = batch * (6.0 * tokens * head_dim ** 2 + 2.0 * n * n * head_dim ** 2 + 2.0 * n * n * head_dim)
        nbytes = batch * (4.0 * tokens * head_dim * elt + 2.0 * n * head_dim ** 2 * 4)
        return flops, nbytes
