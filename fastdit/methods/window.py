"""Window attention with a cached residual, step sharing and CFG sharing ("window").

After DiTFastAttn ("DiTFastAttn: Attention Compression for Diffusion Transformer Models", Yuan et
al., NeurIPS 2024), its three techniques:

* **Window attention with residual caching** (WA-RS). Queries attend only a local window: the 3-D
  tile window of sliding tile (``tile``, ``window``, ``fit_tile``: the same options with the same
  meaning as ``"sta"``, see ``fastdit/methods/sta.py``), or, with ``band`` set, a 1-D band in model
  order: video query block ``m`` (blocks of ``BAND_BLOCK`` = 64 tokens) attends video key blocks
  ``m - r .. m + r``, ``r = ceil(band / 64)`` (truncated at the ends). In both, video queries
  attend every text key and text queries attend every key. On a **full step** (the first step
  the method runs, then every ``refresh_every``-th step) the layer computes full attention ``F``
  AND window attention ``W`` and caches the residual ``R = F - W``; the output is ``F``. On the
  steps in between the output is ``W + R`` (the window part is fresh, the long-range part is
  the cached one, which changes slowly across steps).
* **Attention sharing across timesteps** (AST, ``share_steps``). On a full step the relative
  change of the layer's output against the previous step's, ``||F - O_prev|| / ||O_prev||``, is
  measured; below ``share_threshold`` the layer reuses the previous step's output (no attention
  at all) on the following steps until the next full step. Reading the decision costs one host
  synchronisation per layer and full step (none on the other steps).
* **Attention sharing across CFG** (ASC, ``share_cfg``), on the steps between full steps (full
  steps compute both branches). Which branch is computed: the *conditional* one.

  - Two transformer calls per step (Wan: diffusers calls the conditional pass first): call 0
    computes and keeps its output; call 1 (unconditional) returns call 0's output of the same
    layer and step.
  - One batched call (LTX, ...: diffusers concatenates ``[uncond, cond]`` along the batch): the
    second half (conditional) is computed, and its video rows are copied to the first half; the
    unconditional half's text / conditioning query rows are still computed (against its own
    keys), since text is never shared. The batched case is recognised from step history: a layer
    that saw no second call in earlier steps, with an even batch.
  - No-op when the pipeline runs no CFG or does not say (``ctx.cfg`` False or None: fastdit reads
    the pipeline's ``do_classifier_free_guidance``, which e.g. CogVideoX, Flux and HunyuanVideo
    in diffusers 0.42 do not have), and for a bare transformer.

Memory, per patched layer and CFG branch, in the model dtype: the residual ``(B, H, S, D)``; with
``share_steps`` also the last output; with ``share_cfg`` a reference to call 0's output.
Cost: a full step is 1 + (window density) of dense attention, a window step its window density,
a shared step nothing.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from fastdit.plan import BlockPlan
from fastdit.plan import run_plan as run_window_plan

from .base import Method, MethodConfig, check_int, check_number, option, register_method
from .prune import compact_attention, full_attention, is_refresh_step
from .sta import STAConfig, SlidingTile, TileWindowOptions

BAND_BLOCK = 64


@dataclass
class WindowConfig(MethodConfig, TileWindowOptions):
    """Options of window attention with residual caching (see the module docstring).

    Attributes:
        tile, window, fit_tile: the 3-D tile window, as for ``"sta"`` (``TileWindowOptions``).
        band: tokens attended on each side in model order (rounded up to 64-token blocks)
            instead of the 3-D window; None: the 3-D window.
        refresh_every: a full step (full + window attention, residual refreshed) every N steps.
        share_steps: reuse the previous step's output in layers whose output changed by less than
            ``share_threshold`` (relative, measured on full steps).
        share_threshold: the relative change below which a layer shares across steps.
        share_cfg: compute the conditional branch and reuse it for the unconditional one.
    """

    band: int | None = option(None, "1-D band: tokens attended on each side in model order (64-token blocks) "
                              "instead of the 3-D window; empty: the 3-D window", range=(1, None), widget="number")
    refresh_every: int = option(4, "a full step (full + window attention, residual refreshed) every N steps",
                                range=(1, None), widget="number")
    share_steps: bool = option(False, "reuse the previous step's output in layers whose output barely changes",
                               widget="checkbox")
    share_threshold: float = option(0.05, "share_steps: relative change of a layer's output below which it is "
                                    "shared", range=(0.0, None), widget="number")
    share_cfg: bool = option(False, "compute attention for the conditional branch and reuse it for the "
                             "unconditional one", widget="checkbox")

    def validate(self):
        super().validate()
        self.check_tile_window()
        if self.band is not None:
            check_int("band", self.band)
        check_int("refresh_every", self.refresh_every)
        for name in ("share_steps", "share_cfg"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        self.share_threshold = check_number("share_threshold", self.share_threshold, 0)

    def tile_config(self):
        """The ``STAConfig`` of this window (the sliding-tile plans window attention runs on)."""
        config = STAConfig(tile=self.tile, window=self.window, fit_tile=self.fit_tile, dense_steps=0, dense_layers=0)
        config.validate()
        return config


def band_plan(layout, band, device="cpu"):
    """The 1-D band plan: video blocks of ``BAND_BLOCK`` tokens in model order, then text blocks."""
    size = BAND_BLOCK
    n_video, n_text = -(-layout.video_len // size), -(-layout.text_len // size)
    n_blocks = n_video + n_text
    perm = torch.full(((n_video + n_text) * size,), -1, dtype=torch.long)
    perm[: layout.video_len] = layout.video_positions()
    perm[n_video * size: n_video * size + layout.text_len] = layout.text_positions()
    reach = -(-band // size)
    block = torch.arange(n_video)
    start, end = (block - reach).clamp(min=0), (block + reach).clamp(max=n_video - 1)
    video_count = end - start + 1
    slot = torch.arange(n_blocks)
    video_rows = torch.where(slot < video_count[:, None], start[:, None] + slot,
                             n_video + slot - video_count[:, None]).clamp(0, n_blocks - 1)
    indices = torch.cat([video_rows, slot.expand(n_text, -1)]).to(torch.int32)
    counts = torch.cat([video_count + n_text, torch.full((n_text,), n_blocks)]).to(torch.int32)
    return BlockPlan(kv_indices=indices[None, None].contiguous().to(device), kv_counts=counts[None, None].to(device),
                     block_m=size, block_n=size, seq_len=layout.seq_len, perm=perm.to(device),
                     kv_valid=(perm >= 0)[None].to(device),
                     name=f"band{band}_b{size}", info={"band": band, "block": size})


@register_method
class Window(Method):
    """Window attention + cached residual, step and CFG sharing (DiTFastAttn); see the module docstring."""

    name = "window"
    config_cls = WindowConfig
    default_options = {"dense_steps": 0, "dense_layers": 0}
    rank = 90

    @classmethod
    def candidates(cls, layout):
        return [{"window": w} for w in ((1, 1, 1), (1, 3, 3), (3, 3, 3))]
    #: The tiny models' grids are small: sliding tile's 4x4x8 tile target, fitted per grid.
    tiny_options = {"tile": (4, 4, 8), "window": (3, 3, 3), "fit_tile": True, "refresh_every": 4}

    def __init__(self, config=None, **options):
        super().__init__(config, **options)
        self._tiles = SlidingTile(self.config.tile_config())

    def trainable_refusal(self):
        """share_steps / share_cfg return another call's output: no gradient to this call's inputs.
        (The residual of a full step is a constant of later steps, like a plan: it is kept detached.)"""
        for name in ("share_steps", "share_cfg"):
            if getattr(self.config, name):
                return f"{name}=True reuses the output of another step or CFG branch"
        return super().trainable_refusal()

    def check_heads(self, num_heads):
        if self.config.band is None:
            self._tiles.check_heads(num_heads)

    def prepare(self, layout, heads, device):
        if self.config.band is not None:
            plan = band_plan(layout, self.config.band, device)
        else:
            plan = self._tiles.prepare(layout, heads, device)
        # Query-key pairs per head, counted once per layout (no host sync per call).
        plan.info["pairs_per_head"] = [float(x) for x in plan.pair_counts().reshape(-1).tolist()]
        return plan

    # -- the call ---------------------------------------------------------------------------------
    def attend(self, ctx, q, k, v):
        config, state = self.config, ctx.state
        batch, heads, seq, _ = q.shape
        if k.shape[2] != seq:
            raise ValueError(f"window attention needs self-attention (as many keys as queries), got {seq} queries "
                             f"and {k.shape[2]} keys")
        plan = self.select(ctx, q, k)
        residual = state.get("residual")
        if (residual is None or residual.shape != q.shape or residual.dtype != q.dtype or residual.device != q.device
                or is_refresh_step(ctx, config)):
            full = full_attention(ctx, q, k, v)
            window = run_window_plan(q, k, v, plan, key_mask=ctx.key_mask, query_mask=ctx.query_mask,
                                     scale=ctx.scale, backend=ctx.backend)
            state["residual"] = (full - window).detach()  # a constant of the later steps (no graph kept)
            if config.share_steps:
                self.measure_change(state, full)
            self.remember(ctx, full)
            return self.record(ctx, full, batch * heads * seq * seq + self.window_pairs(ctx, plan, batch))
        if config.share_steps and state.get("shared"):
            return self.record(ctx, self.remember(ctx, state["last_out"]), 0)
        mode = self.cfg_mode(ctx, batch)
        if mode == "reuse":
            other = ctx.call.layer_state(ctx.layer, 0)
            shared = other.get("cfg_out")
            if other.get("cfg_step") == ctx.step and shared is not None and shared.shape == q.shape:
                return self.record(ctx, self.remember(ctx, shared), 0)
        if mode == "batched":
            out, performed = self.batched_cfg(ctx, q, k, v, plan, residual)
            return self.record(ctx, self.remember(ctx, out), performed)
        window = run_window_plan(q, k, v, plan, key_mask=ctx.key_mask, query_mask=ctx.query_mask, scale=ctx.scale,
                                 backend=ctx.backend)
        return self.record(ctx, self.remember(ctx, window + residual), self.window_pairs(ctx, plan, batch))

    def batched_cfg(self, ctx, q, k, v, plan, residual):
        """``[uncond, cond]`` in one batch: the conditional half computed, its video rows reused."""
        half, heads, seq = q.shape[0] // 2, q.shape[1], q.shape[2]
        cond = slice(half, None)
        key_mask = None if ctx.key_mask is None else ctx.key_mask[cond]
        query_mask = None if ctx.query_mask is None else ctx.query_mask[cond]
        out_cond = run_window_plan(q[cond], k[cond], v[cond], plan, key_mask=key_mask, query_mask=query_mask,
                                   scale=ctx.scale, backend=ctx.backend) + residual[cond]
        out_uncond = out_cond
        performed = self.window_pairs(ctx, plan, half)
        layout = ctx.layout
        if layout.text_len:  # the unconditional half's own text rows (text is never shared)
            rows = slice(layout.text_start, layout.text_start + layout.text_len)
            text = compact_attention(q[:half, :, rows], k[:half], v[:half],
                                     None if ctx.key_mask is None else ctx.key_mask[:half], ctx.scale, ctx.backend)
            if ctx.query_mask is not None:
                text = text * ctx.query_mask[:half, None, rows, None].to(text.dtype)
            out_uncond = out_cond.clone()
            out_uncond[:, :, rows] = text
            performed += half * heads * layout.text_len * seq
        return torch.cat([out_uncond, out_cond]), performed

    # -- helpers ----------------------------------------------------------------------------------
    def cfg_mode(self, ctx, batch):
        """``"reuse"`` (second call of a step), ``"batched"`` (one call holding both branches), or
        None (compute this call)."""
        if not self.config.share_cfg or ctx.cfg is not True:
            return None
        if ctx.branch >= 1:
            return "reuse"
        if (ctx.layer, 1) in ctx.call.store:  # two calls per step: this first (conditional) call computes
            return None
        return "batched" if batch % 2 == 0 else None

    def remember(self, ctx, out):
        """Keep what sharing reads later: the last output (steps), call 0's output (CFG)."""
        if self.config.share_steps:
            ctx.state["last_out"] = out
        if self.config.share_cfg and ctx.cfg is True and ctx.branch == 0:
            ctx.state["cfg_out"], ctx.state["cfg_step"] = out, ctx.step
        return out

    def measure_change(self, state, full):
        """On a full step: share the following steps iff the output moved less than the threshold
        since the previous step (one host sync per layer and full step)."""
        previous = state.get("last_out")
        if previous is None or previous.shape != full.shape:
            state["shared"], state["change"] = False, None
            return
        change = (full.float() - previous.float()).norm() / previous.float().norm().clamp_min(1e-12)
        state["change"] = float(change)
        state["shared"] = state["change"] < self.config.share_threshold

    def window_pairs(self, ctx, plan, batch):
        """Query-key pairs the window plan computes for ``batch`` rows of this call's heads."""
        per_head = plan.info["pairs_per_head"]
        if len(per_head) == 1:
            return batch * ctx.num_heads * per_head[0]
        return batch * sum(per_head[ctx.head_offset:ctx.head_offset + ctx.num_heads])

    def record(self, ctx, out, performed):
        batch, heads, seq = out.shape[:3]
        total = batch * heads * seq * seq
        ctx.record(performed=performed, total=total)
        ctx.info["attention_shape"] = (seq, round(performed / (batch * heads * seq)))  # dense work of equal size
        return out

    def attend_dense(self, ctx, q, k, v):
        """Dense steps: the model's own attention; with ``share_steps`` its output is kept so that
        the first full step can measure the change."""
        out = ctx.dense()
        if self.config.share_steps:
            ctx.state["last_out"] = out
        return out
