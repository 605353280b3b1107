"""Similarity-based token pruning with randomised base tokens (``"optiprune"``).

After "OptiPrune: Boosting Prompt-Image Consistency with Attention-Guided Noise and Dynamic Token
Selection" (2025): representative *base* tokens are chosen by patch-wise similarity, the choice is
perturbed by randomness, attention runs on the base tokens only, and every pruned token recovers
the output of its most similar base token (max-similarity copy). The formulas are the paper's; the
code is this project's.

Base choice (per batch element and head, video tokens only, **on the attention keys** of the call:
they are what the attention compares, and they exist in every family's attention call, whereas the
block input would need a hook in each model): the ``(T, H, W)`` grid is cut into windows of
``st x sy x sx`` tokens (partial windows at the far edges). With cosine similarity of keys
``c(i, j) = k_i . k_j / (|k_i| |k_j|)``, token ``i`` of window ``W`` scores its representativeness

    rep(i) = mean_{j in W, j valid} c(i, j)

perturbed by ``randomness`` ``rho`` in [0, 1] with ``u_i ~ U(-1, 1)`` (seeded)::

    score(i) = (1 - rho) * rep(i) + rho * u_i

``rho = 0`` is deterministic (the most representative tokens), ``rho = 1`` a uniform random choice.
Each window of ``w`` tokens keeps its ``w - floor(ratio * w)`` highest-scoring tokens as bases (at
least one), the rest are pruned. Recovery assignment: every pruned token ``i`` is assigned to the
most similar base of its own window, ``a(i) = argmax_{b in W, b base} c(i, b)`` (the window's
similarities are already computed for the choice: no N x N matching as in ``tome``, whose global
nearest-destination rule cost as much as the attention itself at 12k tokens on the CPU).

Attention: base queries attend ``[base keys | text keys]`` with the score bias ``log n_b``, ``n_b``
the number of valid tokens assigned to base ``b`` (itself included). Why the bias: a pruned key is
approximated by its most similar base key, so base ``b`` stands for ``n_b`` keys in the softmax's
sum; without the bias the pruned keys would simply vanish and the text keys would weigh more than
in dense attention. On tokens duplicated within each window this is exact (``n`` identical keys
contribute ``n exp(s)``). Recovery: every pruned token gets the output row of ``a(i)`` (a gather).

The random draw: a generator seeded from ``(seed, step, CFG branch)``, so a run reproduces
whatever order the calls happen in. ``refresh_every``: the base choice and assignment of a step
are reused for the next ``refresh_every - 1`` steps of the same layer and CFG branch.

Text / conditioning tokens are never pruned: their keys are attended unchanged and their query
rows attend every key densely. ``ratio=0`` (or windows of one token) runs the model's own attention.

Cost: ``N_b = N - pruned`` queries against ``N_b + L`` keys, plus ``w x w`` key similarities per window
(choice and assignment) and gathers of ``(B, H, N, D)``.
"""
from __future__ import annotations

import functools
import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..base import GUARD_DEFAULT, Method, MethodConfig, check_int, check_number, option, register_method
from .token_attention import (TokenSplit, accumulation_dtype, biased_attention, grid_groups, log_size_bias,
                              record_token_call)


@dataclass
class OptiPruneConfig(MethodConfig):
    """Options of OptiPrune's token pruning.

    Attributes:
        ratio: fraction of each window's video tokens pruned, in [0, 1) (``floor(ratio * w)`` of a
            window of ``w`` tokens; at least one base per window).
        sx, sy, st: window size in columns, rows and frames.
        randomness: weight of the random perturbation of the base choice, in [0, 1] (0: deterministic).
        refresh_every: recompute the base choice every N denoising steps of a layer (1: every step).
        seed: seed of the random draw (with the step and CFG branch).
        dense_steps, dense_layers: see ``MethodConfig`` (default 0: prunes at every step).
    """

    ratio: float = option(0.5, "fraction of each window's video tokens pruned, in [0, 1)", range=(0.0, 1.0),
                          widget="slider")
    sx: int = option(2, "window width in tokens", range=(1, None), widget="number")
    sy: int = option(2, "window height in tokens", range=(1, None), widget="number")
    st: int = option(1, "window length in frames", range=(1, None), widget="number")
    randomness: float = option(0.1, "random perturbation of the base choice, in [0, 1] (0: deterministic)",
                               range=(0.0, 1.0), widget="slider")
    refresh_every: int = option(1, "recompute the base choice every N denoising steps of a layer", range=(1, None),
                                widget="number")
    seed: int = option(0, "seed of the random draw of the base choice", advanced=True)

    def validate(self):
        super().validate()
        self.ratio = check_number("ratio", self.ratio, 0, 1, high_open=True)
        for name in ("sx", "sy", "st", "refresh_every"):
            check_int(name, getattr(self, name))
        self.randomness = check_number("randomness", self.randomness, 0, 1)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int, got {self.seed!r}")


@functools.lru_cache(maxsize=16)
def window_index(grid, window, device):
    """``(G, w)`` long: the frame-major token index of each slot of each (padded) window, -1 for
    slots beyond the grid (partial windows at the far edges)."""
    t, h, w = grid
    st, sy, sx = window
    gt, gy, gx = grid_groups(grid, window)
    index = torch.full((gt * st, gy * sy, gx * sx), -1, dtype=torch.long)
    index[:t, :h, :w] = torch.arange(t * h * w).reshape(t, h, w)
    index = index.reshape(gt, st, gy, sy, gx, sx).permute(0, 2, 4, 1, 3, 5).reshape(gt * gy * gx, st * sy * sx)
    return index.to(device)


def base_scores(keys, index, key_valid=None):
    """Per window: the cosine similarities ``sim`` ``(B, H, G, w, w)`` of the slots' keys, the
    representativeness ``rep(i)`` (mean cosine to the window's valid tokens) ``(B, H, G, w)`` (-inf
    for padding slots) and the validity of each slot ``(B, 1, G, w)``; float32 (float64 for float64 keys)."""
    present = index >= 0
    metric = F.normalize(keys.to(accumulation_dtype(keys.dtype)), dim=-1)
    windows = metric[:, :, index.clamp(min=0)]  # (B, H, G, w, D)
    sim = windows @ windows.transpose(-1, -2)  # (B, H, G, w, w)
    valid = present.expand(keys.shape[0], -1, -1)
    if key_valid is not None:
        valid = valid & key_valid[:, index.clamp(min=0)]
    weight = valid[:, None, :, None, :].to(sim.dtype)  # (B, 1, G, 1, w): over the window's valid j
    rep = (sim * weight).sum(-1) / weight.sum(-1).clamp(min=1)
    return sim, rep.masked_fill(~present, float("-inf")), valid[:, None]


#: Score of a token whose key is masked out: below every valid score (cosines and their
#: perturbation lie in [-1, 1]), above padding (-inf), so every batch element keeps as many bases.
INVALID_SCORE = -3.0


def choose_bases(keys, index, keep, randomness, generator, key_valid=None, head_offset=0, total_heads=None):
    """Base tokens and the slot of every token: ``(base, slot)``, ``base`` long ``(B, H, G * keep)``
    token indices (-1 where a partial window has fewer than ``keep`` tokens), ``slot`` long
    ``(B, H, N)``: the position in ``base`` of the base each token copies (its own for a base; for
    a pruned token the base of its window with the highest key cosine). The draw covers all
    ``total_heads`` of the layer and this call takes its heads' part (``head_offset``), so a rank
    of Ulysses context parallelism draws what one process draws for the same heads."""
    batch, heads, n_tokens, _ = keys.shape
    n_windows, size = index.shape
    sim, rep, valid = base_scores(keys, index, key_valid)
    score = rep
    if randomness > 0:
        shape = (rep.shape[0], total_heads or heads, *rep.shape[2:])
        u = torch.rand(shape, generator=generator, dtype=rep.dtype)[:, head_offset:head_offset + heads]
        u = u.to(rep.device) * 2 - 1
        score = (1 - randomness) * rep + randomness * u
    score = score.masked_fill(~valid, INVALID_SCORE).masked_fill(index < 0, float("-inf"))
    # stable order: ties (randomness 0, duplicated tokens) keep the window's first slots
    top = score.argsort(dim=-1, descending=True, stable=True)[..., :keep]  # (B, H, G, keep)
    windows = torch.arange(n_windows, device=keys.device)[:, None]
    base = index[windows, top]  # (B, H, G, keep)
    # Max-similarity copy inside the window: each slot's most similar base (padding and masked
    # bases last); a base copies itself.
    to_base = sim.gather(-1, top[..., None, :].expand(-1, -1, -1, size, -1))  # (B, H, G, w, keep)
    base_valid = valid.expand(-1, heads, -1, -1).gather(-1, top) & (base >= 0)
    to_base = to_base.masked_fill(~base_valid[..., None, :], -2.0).masked_fill((base < 0)[..., None, :], -3.0)
    choice = to_base.argmax(dim=-1)  # (B, H, G, w)
    own = torch.arange(keep, device=keys.device).expand(batch, heads, n_windows, -1)
    choice = choice.scatter(-1, top, own)
    slot_of = choice + windows * keep  # position in the flattened base list
    target = index.masked_fill(index < 0, n_tokens).reshape(-1).expand(batch, heads, -1)
    slot = torch.empty(batch, heads, n_tokens + 1, dtype=torch.long, device=keys.device)
    slot.scatter_(-1, target, slot_of.reshape(batch, heads, -1))
    return base.reshape(batch, heads, -1), slot[..., :n_tokens]


@register_method
class OptiPrune(Method):
    name = "optiprune"
    #: the quality guard's bound (relative L2 error per head) when ``guard`` is left empty
    guard_default = GUARD_DEFAULT

    def guard_levels(self):
        return 1

    def guard_widen_options(self, level):
        """One wider setting: half the pruning ratio."""
        return {"ratio": self.config.ratio / 2}
    config_cls = OptiPruneConfig
    default_options = {"dense_steps": 0, "dense_layers": 0}
    rank = 80

    def window(self, grid):
        config = self.config
        return tuple(min(s, g) for s, g in zip((config.st, config.sy, config.sx), grid))

    def kept_per_window(self, grid):
        size = 1
        for s in self.window(grid):
            size *= s
        return max(1, size - int(self.config.ratio * size)), size

    def generator(self, ctx):
        # keyed to what the call carries: the seed option and the timestep value (the step index
        # where no timestep is known: fastdit.attention), never to how many calls came before, so
        # two calls with the same inputs draw the same bases (issue 46). Every layer and both CFG
        # branches of a step share the draw (a layer's result depends on its inputs and options).
        timestep = ctx.timestep_value() if self.config.randomness > 0 else None
        key = f"{self.config.seed}/" + (f"t{timestep!r}" if timestep is not None else f"s{ctx.step}")
        return torch.Generator().manual_seed(zlib.crc32(key.encode()))

    def selection(self, ctx, split):
        """``(base, slot)`` of this call, or the ones this layer kept from an earlier step."""
        grid = ctx.layout.grid
        keys = split.video_k
        signature = (grid, tuple(keys.shape), str(keys.device))
        kept = ctx.state.get("optiprune")
        every = self.config.refresh_every
        if every > 1 and kept is not None and kept["signature"] == signature and ctx.step - kept["step"] < every:
            return kept["base"], kept["slot"]
        window = self.window(grid)
        index = window_index(grid, window, str(keys.device))
        keep, _ = self.kept_per_window(grid)
        base, slot = choose_bases(keys, index, keep, float(self.config.randomness), self.generator(ctx),
                                  split.video_key_valid, ctx.head_offset, ctx.total_heads)
        if every > 1:
            ctx.state["optiprune"] = {"signature": signature, "step": ctx.step, "base": base, "slot": slot}
        return base, slot

    def attend(self, ctx, q, k, v):
        keep, size = self.kept_per_window(ctx.layout.grid)
        if keep >= size:  # nothing to prune (ratio 0, or windows of one token): the model's own attention
            ctx.info["dense"] = True
            return ctx.dense()
        split = TokenSplit(ctx, q, k, v)
        base, slot = self.selection(ctx, split)
        real = base >= 0
        gather = base.clamp(min=0)[..., None].expand(-1, -1, -1, q.shape[-1])
        q_b, k_b, v_b = (x.gather(2, gather) for x in (split.video_q, split.video_k, split.video_v))
        # n_b: valid tokens that copy base b (itself included); padding bases and invalid keys weigh 0
        weight = real.new_ones(slot.shape, dtype=accumulation_dtype(q.dtype))
        if split.video_key_valid is not None:
            weight = weight * split.video_key_valid[:, None].to(weight.dtype)
        sizes = weight.new_zeros(base.shape).scatter_add_(-1, slot, weight).masked_fill(~real, 0)
        if split.video_key_valid is not None:  # a masked key is never attended, whatever it stands for
            base_key_valid = split.video_key_valid[:, None].expand(-1, q.shape[1], -1).gather(-1, base.clamp(min=0))
            sizes = sizes.masked_fill(~base_key_valid, 0)
        keys = torch.cat([k_b, split.text_k], dim=2)
        values = torch.cat([v_b, split.text_v], dim=2)
        text_bias = split.text_bias(weight.dtype).expand(-1, q.shape[1], -1)
        bias = torch.cat([log_size_bias(sizes), text_bias], dim=-1)[:, :, None, :]
        # -inf bias on padding bases and masked keys: rows with no finite key give 0, not NaN
        masked = True
        out_b = biased_attention(q_b, keys, values, bias, ctx.scale, masked=masked)
        video_out = out_b.gather(2, slot[..., None].expand(-1, -1, -1, out_b.shape[-1]))
        n_base = int(real[0, 0].sum())
        record_token_call(ctx, split, n_base, n_base + split.text_k.shape[2])
        return split.assemble(video_out, ctx.scale)
