"""Token downsampling (``"todo"``).

After "ToDo: Token Downsampling for Efficient Generation of High-Resolution Images" (Smith et al.,
2024): keys and values are downsampled over spatial neighbourhoods while every query stays, so
nothing needs unmerging. Here, for DiT video and image models, the video tokens of each frame are
cut into pools of ``factor x factor`` tokens (rows x columns of the latent grid) and, with
``t_factor > 1``, also ``t_factor`` frames. For a pool ``P`` with valid tokens ``V(P)`` (the model's
key mask)::

    k_P = mean_{j in V(P)} k_j,   v_P = mean_{j in V(P)} v_j          (mode="mean")
    k_P = k_{first(P)},           v_P = v_{first(P)}                  (mode="nearest")

and every video query attends the pooled keys plus all text keys, with the score bias
``log |V(P)|`` (``proportional=True``: a pool weighs as many tokens as it stands for, as in
ToMe's proportional attention; an extension over the paper, which weighs pools equally, that makes
pools of identical tokens exact and keeps partial edge pools from weighing as much as full ones).
A pool with no valid token (or, for ``"nearest"``, whose first token is invalid) is never attended.

Grids that the factors do not divide are handled with partial pools at the far edges (the last
row, column or frame of pools holds fewer tokens), never rejected. Text / conditioning tokens are
never pooled: text keys are attended as they are and text queries attend every key densely.

Cost: video queries ``N`` against ``ceil(T/ft) ceil(H/f) ceil(W/f) + L`` keys instead of ``N + L``
(a quarter of the video-video scores at ``factor=2``); pooling is one reshape and sum. The paper
uses factor 2 at the highest resolution and no dense steps; ``factor=1, t_factor=1`` runs the
model's own attention.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..base import GUARD_DEFAULT, Method, MethodConfig, check_int, option, register_method
from .token_attention import (TokenSplit, accumulation_dtype, biased_attention, grid_groups, log_size_bias,
                              record_token_call)

MODES = ("mean", "nearest")


@dataclass
class ToDoConfig(MethodConfig):
    """Options of token downsampling.

    Attributes:
        factor: pool ``factor x factor`` neighbouring tokens of a frame into one key and value (>= 1).
        t_factor: also pool this many consecutive frames (>= 1; images have one frame).
        mode: ``"mean"`` (average of the pool's valid tokens) or ``"nearest"`` (the pool's first token).
        proportional: weigh each pooled key by the number of tokens it stands for (+ log(size)
            on its scores).
        dense_steps, dense_layers: see ``MethodConfig`` (default 0: ToDo pools at every step).
    """

    factor: int = option(2, "pool factor x factor neighbouring tokens of each frame into one key/value",
                         range=(1, None), widget="number")
    t_factor: int = option(1, "also pool this many consecutive frames", range=(1, None), widget="number")
    mode: str = option("mean", "pooling: mean of the pool, or nearest (its first token)", choices=MODES,
                       widget="dropdown")
    proportional: bool = option(True, "weigh pooled keys by the tokens they stand for (+ log(size) on scores)",
                                widget="checkbox")

    def validate(self):
        super().validate()
        check_int("factor", self.factor)
        check_int("t_factor", self.t_factor)
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if not isinstance(self.proportional, bool):
            raise ValueError(f"proportional must be True or False, got {self.proportional!r}")


def pool_video(x, grid, pool, weight=None):
    """Mean over pools of ``pool = (pt, ph, pw)`` grid tokens, partial at the far edges.

    ``x``: ``(B, H, N, D)`` in frame-major grid order; ``weight``: float ``(B, N)`` (1 valid,
    0 invalid) or None. Returns the pooled ``(B, H, P, D)`` and the valid tokens per pool
    ``(B, 1, P)``, in float32 (float64 for float64 inputs).
    """
    batch, heads, _, dim = x.shape
    t, h, w = grid
    groups = grid_groups(grid, pool)
    padded = [g * p for g, p in zip(groups, pool)]
    x = x.to(accumulation_dtype(x.dtype)).reshape(batch, heads, t, h, w, dim)
    ones = x.new_ones(batch, 1, t, h, w) if weight is None else weight.to(x.dtype).reshape(batch, 1, t, h, w)
    if weight is not None:
        x = x * ones[..., None]
    if padded != [t, h, w]:  # partial edge pools: zero slots that add nothing to sums or counts
        x = F.pad(x, (0, 0, 0, padded[2] - w, 0, padded[1] - h, 0, padded[0] - t))
        ones = F.pad(ones, (0, padded[2] - w, 0, padded[1] - h, 0, padded[0] - t))
    shape = (groups[0], pool[0], groups[1], pool[1], groups[2], pool[2])
    sums = x.reshape(batch, heads, *shape, dim).sum(dim=(3, 5, 7))
    counts = ones.reshape(batch, 1, *shape).sum(dim=(3, 5, 7))
    pooled = sums / counts.clamp(min=1)[..., None]
    n_pools = groups[0] * groups[1] * groups[2]
    return pooled.reshape(batch, heads, n_pools, dim), counts.reshape(batch, 1, n_pools)


def first_of_pools(x, grid, pool, weight=None):
    """The first token (lowest frame, row, column) of every pool: ``(B, H, P, D)``, and float
    ``(B, 1, P)``: the pool's valid tokens when that first token is valid, else 0."""
    batch, heads, _, dim = x.shape
    t, h, w = grid
    frames = x.reshape(batch, heads, t, h, w, dim)
    picked = frames[:, :, :: pool[0], :: pool[1], :: pool[2]]
    n_pools = picked.shape[2] * picked.shape[3] * picked.shape[4]
    _, counts = pool_video(x[:, :1, :, :1], grid, pool, weight)
    if weight is not None:
        first_valid = weight.to(counts.dtype).reshape(batch, 1, t, h, w)[:, :, :: pool[0], :: pool[1], :: pool[2]]
        counts = counts * first_valid.reshape(batch, 1, n_pools)
    return picked.reshape(batch, heads, n_pools, dim), counts


@register_method
class TokenDownsampling(Method):
    name = "todo"
    #: the quality guard's bound (relative L2 error per head) when ``guard`` is left empty
    guard_default = GUARD_DEFAULT
    config_cls = ToDoConfig
    default_options = {"dense_steps": 0, "dense_layers": 0}
    rank, auto_candidate, engine_geometry = 60, True, "grid"

    @classmethod
    def candidates(cls, layout):
        return [{"factor": f} for f in (2, 3, 4)]

    @classmethod
    def outside_work(cls, options, batch, tokens, head_dim, elt):
        """The pooling: read K, V and write the pooled ones (``4 B N D e`` bytes)."""
        return 0.0, 4.0 * batch * tokens * head_dim * elt

    def pool(self, grid):
        """Pool size ``(pt, ph, pw)``, clamped to the grid (a factor above an axis pools all of it)."""
        config = self.config
        return tuple(min(p, g) for p, g in zip((config.t_factor, config.factor, config.factor), grid))

    def attend(self, ctx, q, k, v):
        pool = self.pool(ctx.layout.grid)
        if pool == (1, 1, 1):  # nothing to pool: the model's own attention
            ctx.info["dense"] = True
            return ctx.dense()
        split = TokenSplit(ctx, q, k, v)
        grid = ctx.layout.grid
        weight = None if split.video_key_valid is None else split.video_key_valid.float()
        if self.config.mode == "mean":
            # Keys and values pooled together: one reshape and sum over (B, H, N, 2D).
            pooled, counts = pool_video(torch.cat([split.video_k, split.video_v], dim=-1), grid, pool, weight)
            pooled_k, pooled_v = pooled.to(q.dtype).chunk(2, dim=-1)
        else:
            pooled_k, counts = first_of_pools(split.video_k, grid, pool, weight)
            pooled_v, _ = first_of_pools(split.video_v, grid, pool, None)
        keys = torch.cat([pooled_k, split.text_k], dim=2)
        values = torch.cat([pooled_v, split.text_v], dim=2)
        bias = torch.cat([log_size_bias(counts, self.config.proportional), split.text_bias(torch.float32)], dim=-1)
        video_out = biased_attention(split.video_q, keys, values, bias[:, :, None, :], ctx.scale,
                                     masked=split.key_mask is not None)
        record_token_call(ctx, split, split.video_q.shape[2], keys.shape[2])
        return split.assemble(video_out, ctx.scale)
