"""Video Sparse Attention (VSA): a coarse stage over 3-D cubes picks the key cubes of a fine stage.

After "VSA: Faster Video Diffusion with Trainable Sparse Attention" (Zhang, Huang, ... Zhang, 2025)
as FastVideo ships it (``video_sparse_attn``; ModelOpt's ``vsa`` method names the options
``block_size_3d`` and ``top_k_ratio``, FastVideo's command line ``VSA_sparsity``).

Kernel order: video tokens are cut into cubes of ``block_size_3d = (bt, bh, bw)`` tokens (each
entry clamped to the grid: an image, ``T = 1``, gets ``1 x bh x bw`` squares, the 2-D form), one cube
per kernel block of ``C = bt * bh * bw`` slots; cubes at the grid's far edges are partial and padded
(padding slots are never keys, their rows are dropped), never refused. Text / conditioning tokens
follow in blocks of ``C`` slots of their own. Per call, batch and head, with ``n`` blocks (cubes,
then text blocks) and ``N_m`` the valid tokens of block ``m`` (real tokens; for keys and values also
``key_mask``, for queries ``query_mask``):

* coarse stage: ``qc_m = mean_{i in m} q_i``, ``kc_m``, ``vc_m`` likewise (FastVideo's mean over a
  block's ``variable_block_sizes`` real tokens); ``A = softmax_j(scale qc_m . kc_j)`` over the key
  blocks with a valid key; the coarse output of block ``m`` is ``oc_m = sum_j A_mj vc_j`` and every
  query token of block ``m`` gets it (broadcast);
* selection: video query cube ``m`` keeps the ``K = max(1, int(top_k_ratio * n_cubes))`` video key
  cubes of largest ``A_mj`` (ModelOpt's count; ``sparsity``: FastVideo's ``VSA_sparsity`` =
  ``1 - top_k_ratio``) plus every text block; text query blocks keep every block (text rows and
  columns stay dense, as in every fastdit method);
* fine stage: exact attention of each query over the valid keys of its kept blocks, ``of_i``, on the
  block-sparse engine (the selection is a constant: no gradient through the top-k);
* combination (FastVideo: ``out = out_select + gate_compress * out_compress``):
  ``o_i = of_i + g_i * oc_{m(i)}`` with the gate ``g``, per ``gate``:

  - ``"learned"`` (default): ``g_i = W_h q_i + b_h``, one ``D x D`` projection and bias per head and
    layer, zero-initialised as FastVideo's ``to_gate_compress``: trainable parameters the patch adds
    (``Method.layer_module``; ``python -m fastdit.train --method vsa`` trains them with the LoRA,
    ``fastdit.patch(..., method_params=folder)`` loads them). Training-free (nothing loaded, or
    ``fastdit.attention``), ``g = 0``: the fine stage alone, the published initial state;
  - ``"sum"``: ``g = 1`` (``video_sparse_attn`` without ``compress_attn_weight``).

  FastVideo projects the block's input hidden states (``dim x dim``, across heads); a fastdit call
  sees only ``q, k, v``, so the gate projects each head's query. A FastVideo checkpoint's
  ``to_gate_compress`` therefore does not load into this form (it would need the attention module's
  input, which diffusers' processors do not pass to the attention call); its other weights load
  into diffusers as usual, and the gate is then retrained here (docs/methods.md).

Query rows that ``query_mask`` drops are 0. Density (statistics): the fine stage's block pairs; the
coarse stage (``n^2 D`` score work on pooled tokens, ``1 / C^2`` of dense) is overhead, not counted.
Not under ring attention (the coarse stage needs every key cube's mean of the whole sequence): use
Ulysses. ``correction`` is refused: the coarse branch is VSA's own estimate of the dropped cubes.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch


from . import base as _base
from .base import OptionError, check_number, option, register_method
from .block_sparse import BlockSparseConfig, BlockSparseMethod
from .selection.tiles import tile_order_plan

GATES = ("learned", "sum")
DEFAULT_CUBE = (4, 4, 4)


@dataclass
class VSAConfig(BlockSparseConfig):
    """Options of ``vsa`` (see the module docstring).

    Attributes:
        block_size_3d: ``(bt, bh, bw)`` tokens per cube (each clamped to the grid).
        top_k_ratio: share of the video key cubes each video query cube keeps, in (0, 1].
        sparsity: FastVideo's ``VSA_sparsity``, in [0, 1); when set it sets ``top_k_ratio = 1 -
            sparsity`` (a ``top_k_ratio`` other than its default 0.5 that disagrees is refused);
            None: ``top_k_ratio`` applies.
        gate: ``"learned"`` or ``"sum"``.
    """

    block_size_3d: tuple = option(DEFAULT_CUBE, "tokens per cube (t, h, w) of the coarse stage, clamped to the grid",
                                  widget="triple")
    top_k_ratio: float = option(0.5, "share of key cubes each query cube attends finely (ModelOpt's top_k_ratio)",
                                range=(0.0, 1.0), widget="slider")
    sparsity: float | None = option(None, "FastVideo's VSA_sparsity = 1 - top_k_ratio; empty: use top_k_ratio",
                                    range=(0.0, 1.0), widget="number", advanced=True)
    gate: str = option("learned", "coarse-branch gate: learned (per-head projection of q, zero until trained: "
                       "fine stage alone) or sum (gate 1)", choices=GATES, widget="dropdown")

    def validate(self):
        super().validate()
        cube = self.block_size_3d
        if not isinstance(cube, (tuple, list)) or len(cube) != 3 or not all(
                isinstance(c, int) and not isinstance(c, bool) and c > 0 for c in cube):
            raise OptionError(f"block_size_3d must be three positive ints (bt, bh, bw), got {cube!r}")
        self.block_size_3d = tuple(cube)
        self.top_k_ratio = check_number("top_k_ratio", self.top_k_ratio, 0, 1, low_open=True,
                                        note="the share of key cubes kept")
        if self.sparsity is not None:
            self.sparsity = check_number("sparsity", self.sparsity, 0, 1, high_open=True,
                                         note="FastVideo's VSA_sparsity, 1 - top_k_ratio")
            if self.top_k_ratio != 0.5 and abs(self.top_k_ratio - (1 - self.sparsity)) > 1e-9:
                raise OptionError(f"sparsity={self.sparsity} and top_k_ratio={self.top_k_ratio} disagree "
                                  "(sparsity = 1 - top_k_ratio); set one of them")
            self.top_k_ratio = 1.0 - self.sparsity
        if self.gate not in GATES:
            raise OptionError(f"gate must be one of {GATES}, got {self.gate!r}")
        if self.correction != "none":
            raise OptionError(f"vsa takes no correction (got correction={self.correction!r}): its coarse branch is "
                              "its own estimate of the cubes the fine stage drops; leave correction='none'")


class VSAGate(torch.nn.Module):
    """The per-layer gate of ``gate="learned"``: ``g = q W_h + b_h`` per head, zero-initialised."""

    def __init__(self, heads, head_dim):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(heads, head_dim, head_dim))
        self.bias = torch.nn.Parameter(torch.zeros(heads, head_dim))

    def forward(self, q, head_offset=0):
        """``(B, H, S, D)`` gate of ``q`` for heads ``head_offset ..`` of the layer."""
        heads = q.shape[1]
        weight = self.weight[head_offset:head_offset + heads].to(device=q.device, dtype=q.dtype)
        bias = self.bias[head_offset:head_offset + heads].to(device=q.device, dtype=q.dtype)
        return torch.einsum("bhsd,hde->bhse", q, weight) + bias[None, :, None, :]


def cube_means(x, valid, block):
    """Mean over each block's valid tokens: ``x`` ``(B, H, n * block, D)`` kernel order, ``valid``
    ``(B|1, n * block)`` bool; returns ``(means (B, H, n, D), counts (B|1, 1, n))`` in ``x``'s dtype
    accumulated in float32 (float64 for float64). A block without a valid token has mean 0."""
    batch, heads, length, dim = x.shape
    n = length // block
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    w = valid.view(valid.shape[0], 1, n, 1, block).to(acc)
    total = (w @ x.view(batch, heads, n, block, dim).to(acc)).squeeze(-2)
    count = w.sum(-1).squeeze(-1)  # (B|1, 1, n)
    return total / count.clamp_min(1.0)[..., None], count


@register_method
class VideoSparse(BlockSparseMethod):
    guard_scores_widen = False  # the output is more than the plan's engine call (see guard/widen.py)
    name = "vsa"
    config_cls = VSAConfig
    default_options = {"dense_steps": 0, "dense_layers": 0}
    #: tiny-shapes' 9 x 32 x 32 grid in 3 x 8 x 8 cubes (48, no padding), a quarter of them kept.
    tiny_options = {"block_size_3d": (3, 8, 8), "top_k_ratio": 0.25}
    rank, engine_geometry, cost_model = 45, "grid", "density"
    reports_lse = False  # the combined output is not one softmax: its lse would mislead
    ring = False
    ring_reason = ("its coarse stage attends the mean of every key cube of the whole sequence, which one ring shard "
                   "does not hold")

    @classmethod
    def candidates(cls, layout):
        return [{"top_k_ratio": r} for r in (0.5, 0.3, 0.2, 0.1)]

    @classmethod
    def outside_work(cls, options, batch, tokens, head_dim, elt):
        """The coarse stage and the gate per head: cube means ``3 N D``, cube scores and their product
        with the mean values ``4 n^2 D`` (``n = N / C``), the gate ``2 N D^2`` and the combination;
        bytes: q, k, v read once more, the coarse output and the gate written and read back."""
        cube = options.get("block_size_3d") or DEFAULT_CUBE
        n = max(1, tokens // math.prod(cube))
        gate = options.get("gate", "learned") == "learned"
        gate_flops = 2.0 * tokens * head_dim ** 2 if gate else 0.0
        flops = batch * (3.0 * tokens * head_dim + 4.0 * n * n * head_dim + gate_flops + 2.0 * tokens * head_dim)
        nbytes = batch * (3.0 + 4.0) * tokens * head_dim * elt
        return flops, nbytes

    def layer_module(self, heads, head_dim):
        return VSAGate(heads, head_dim) if self.config.gate == "learned" else None

    def layer_module_key(self):
        return {"block_size_3d": list(self.config.block_size_3d), "gate": self.config.gate}

    def cube_for(self, layout):
        return tuple(min(c, g) for c, g in zip(self.config.block_size_3d, layout.grid))

    def top_k(self, n_cubes):
        """Key cubes each video query cube keeps (ModelOpt's ``max(1, int(ratio * cubes))``)."""
        return min(n_cubes, max(1, int(self.config.top_k_ratio * n_cubes)))

    def prepare(self, layout, heads, device):
        """The static part: cube-order permutation and padding validity (``select`` fills the lists)."""
        cube = self.cube_for(layout)
        return tile_order_plan(layout, cube, device, f"vsa_c{'x'.join(map(str, cube))}", {"cube": cube})

    def coarse(self, static, q, k, v, key_mask=None, query_mask=None, scale=None):
        """The coarse stage: ``(oc (B, H, n, D) in q's dtype, A (B, H, n, n) float32/64)``."""
        block, index = static.block_m, static.gather_index
        key_ok = static.kernel_kv_valid(key_mask)
        query_ok = static.kv_valid
        if query_mask is not None:
            query_ok = query_mask.to(torch.bool)[:, index] & static.kv_valid
        q_c, _ = cube_means(q.index_select(2, index), query_ok, block)
        k_c, k_count = cube_means(k.index_select(2, index), key_ok, block)
        v_c, _ = cube_means(v.index_select(2, index), key_ok, block)
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        scores = (q_c @ k_c.transpose(-1, -2)) * scale
        scores = scores.masked_fill((k_count == 0)[..., None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # no valid key at all: 0
        return (probs @ v_c).to(q.dtype), probs

    def selection(self, static, probs):
        """``(kv_indices, kv_counts)`` int32 of the top-k rule (module docstring), on the device."""
        n_video, n_text = static.info["n_video"], static.info["n_text"]
        n_blocks = n_video + n_text
        batch, heads = probs.shape[:2]
        keep = self.top_k(n_video)
        device = probs.device
        top = probs[..., :n_video, :n_video].detach().topk(keep, dim=-1).indices.to(torch.int32)
        width = n_blocks if n_text else keep
        indices = torch.zeros(batch, heads, n_blocks, width, dtype=torch.int32, device=device)
        indices[..., :n_video, :keep] = top
        counts = torch.full((batch, heads, n_blocks), keep + n_text, dtype=torch.int32, device=device)
        if n_text:
            text = torch.arange(n_video, n_blocks, dtype=torch.int32, device=device)
            indices[..., :n_video, keep:keep + n_text] = text
            indices[..., n_video:, :] = torch.arange(n_blocks, dtype=torch.int32, device=device)
            counts[..., n_video:] = n_blocks
        return indices, counts

    def select(self, ctx, q, k):  # the plan alone (calibration, pictures); attend computes both stages
        static = self.prepared(ctx.layout, 1, q.device)
        _, probs = self.coarse(static, q, k, k, ctx.key_mask, ctx.query_mask, ctx.scale)
        return self._plan(static, probs)

    def _plan(self, static, probs):
        plan = copy.copy(static)  # keeps the static permutation and its inverse (no rebuild, no sync)
        plan.__dict__.pop("density", None)
        plan.kv_indices, plan.kv_counts = self.selection(static, probs)
        plan.dynamic = True
        plan.info = {"cube": static.info["cube"], "top_k": self.top_k(static.info["n_video"])}
        return plan

    def attend(self, ctx, q, k, v):
        static = self.prepared(ctx.layout, 1, q.device)
        config = self.config
        if config.quant is not None:
            from fastdit.kernels.quant import check_quant

            try:
                check_quant(config.quant, q.dtype, q.device)
            except ValueError as error:
                raise OptionError(f"method {self.name!r}: {error}") from None
        coarse, probs = self.coarse(static, q, k, v, ctx.key_mask, ctx.query_mask, ctx.scale)
        plan = self._plan(static, probs)
        ctx.record(plan=plan)
        skip = config.skip_threshold is not None
        fine, _, *skipped = _base.run_plan(q, k, v, plan, key_mask=ctx.key_mask, query_mask=ctx.query_mask,
                                           scale=ctx.scale, backend=ctx.backend, return_lse=True,
                                           skip_threshold=config.skip_threshold, return_skipped=skip,
                                           quant=config.quant)
        if skip:
            ctx.info["skipped_subtiles"] = skipped[0]
        if config.gate == "learned" and ctx.params is None:
            return fine  # the zero gate: the fine stage alone (training-free form)
        block_of = (plan.inverse // plan.block_m).to(q.device)  # model token -> its block
        coarse = coarse.index_select(2, block_of)
        gate = ctx.params(q, ctx.head_offset) if config.gate == "learned" else 1.0
        out = fine + gate * coarse
        if ctx.query_mask is not None:
            out = out * ctx.query_mask.to(device=out.device, dtype=out.dtype)[:, None, :, None]
        return out
