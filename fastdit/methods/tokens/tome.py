"""Token merging (``"tome"``).

After "Token Merging for Fast Stable Diffusion" (Bolya and Hoffman, 2023), itself after "Token
Merging: Your ViT but Faster" (Bolya et al., 2023), adapted to DiT attention calls (per batch
element and head, on the call's ``q, k, v``, with proportional attention).

Matching (bipartite, per batch element and head, video tokens only): the ``(T, H, W)`` grid is cut
into windows of ``st x sy x sx`` tokens (frames x rows x columns; partial windows at the far
edges); the first token of each window (lowest frame, row, column: a fixed, deterministic choice
where ToMe for SD draws one at random) is a destination, every other token a source. With
cosine similarity of keys ``c(i, j) = k_i . k_j / (|k_i| |k_j|)``, each source ``i`` finds its most
similar destination ``d(i) = argmax_j c(i, j)`` over all destinations, and the ``r = floor(ratio * N)``
sources with the highest ``c(i, d(i))`` (at most all sources) are merged into their destination.

Merge: each group ``G`` (a destination and the sources merged into it, or an unmerged source)
becomes one token whose query is the mean of its valid queries and whose key and value are the
means of its valid keys and values. Attention runs on the merged tokens: merged queries against
``[merged keys | text keys]`` with the score bias ``log |G|`` (valid tokens in the group), so a
group of ``n`` identical tokens contributes ``n exp(s)`` exactly as the unmerged keys would, and
a group with no valid key is never attended. Unmerge: every token of a group gets the group's
output (a gather).

``match_every`` (per-layer state kept across denoising steps, reset at every pipeline call): the
matching of a step is reused for the next ``match_every - 1`` steps of the same layer and CFG
branch; 1 recomputes it every step, as the paper does.

Text / conditioning tokens are never merged: their keys are attended as they are and their query
rows attend every key densely. ``ratio=0`` runs the model's own attention.

Cost: ``M = N - r`` merged queries against ``M + L`` keys (a quarter of the video-video scores at
``ratio=0.5``), plus the matching: ``(N - N/w) x N/w`` cosine scores per head for windows of ``w``
tokens (3/16 of ``N^2`` at 2x2, computed as one batched matmul), a sort, and two scatter-adds and a
gather of ``(B, H, N, D)``.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from ..base import GUARD_DEFAULT, Method, MethodConfig, check_int, check_number, option, register_method
from .token_attention import (TokenSplit, accumulation_dtype, biased_attention, grid_groups, log_size_bias,
                              nearest_destination, record_token_call)


@dataclass
class ToMeConfig(MethodConfig):
    """Options of token merging.

    Attributes:
        ratio: fraction of the video tokens merged away, in [0, 1) (capped at the number of
            sources: 3/4 of the tokens with 2x2 windows).
        sx, sy, st: window size in columns, rows and frames (one destination per window).
        match_every: recompute the matching every N denoising steps of a layer (1: every step).
        dense_steps, dense_layers: see ``MethodConfig`` (default 0: ToMe merges at every step).
    """

    ratio: float = option(0.5, "fraction of video tokens merged away, in [0, 1)", range=(0.0, 1.0),
                          widget="slider")
    sx: int = option(2, "window width in tokens (one destination per window)", range=(1, None), widget="number")
    sy: int = option(2, "window height in tokens", range=(1, None), widget="number")
    st: int = option(1, "window length in frames", range=(1, None), widget="number")
    match_every: int = option(1, "recompute the matching every N denoising steps of a layer", range=(1, None),
                              widget="number")

    def validate(self):
        super().validate()
        self.ratio = check_number("ratio", self.ratio, 0, 1, high_open=True)
        for name in ("sx", "sy", "st", "match_every"):
            check_int(name, getattr(self, name))


def window_roles(grid, window, device):
    """Destination and source token indices (frame-major grid order) for windows ``(st, sy, sx)``:
    the first token of each window is its destination. Returns ``(dst, src)`` long tensors."""
    t, h, w = grid
    first = torch.zeros(t, h, w, dtype=torch.bool)
    first[:: window[0], :: window[1], :: window[2]] = True
    first = first.reshape(-1)
    return first.nonzero().squeeze(1).to(device), (~first).nonzero().squeeze(1).to(device)


def match(keys, dst, src, merged, key_valid=None):
    """Bipartite matching: the slot of every video token in the merged sequence.

    ``keys``: ``(B, H, N, D)``; ``dst``/``src``: token indices; ``merged``: how many sources merge.
    Returns long ``(B, H, N)``: destinations take slots ``0 .. len(dst) - 1``, unmerged sources the
    slots after them, merged sources their destination's slot.
    """
    batch, heads, n_tokens, _ = keys.shape
    n_dst, n_src = dst.numel(), src.numel()
    # Valid sources prefer valid destinations; invalid sources merge last (they add nothing).
    dst_valid = None if key_valid is None else key_valid[:, None, dst]
    best, best_dst = nearest_destination(keys, dst, src, dst_valid)  # (B, H, Ns)
    if key_valid is not None:
        best = best.masked_fill(~key_valid[:, None, src], float("-inf"))
    # stable: ties (e.g. invalid sources, all -inf) merge in token order, deterministically
    order = best.argsort(dim=-1, descending=True, stable=True)
    merged_pos, kept_pos = order[..., :merged], order[..., merged:]
    src_slot = torch.empty(batch, heads, n_src, dtype=torch.long, device=keys.device)
    kept_slots = torch.arange(n_dst, n_dst + n_src - merged, device=keys.device).expand(batch, heads, -1)
    src_slot.scatter_(-1, kept_pos, kept_slots)
    src_slot.scatter_(-1, merged_pos, best_dst.gather(-1, merged_pos))
    slot = torch.empty(batch, heads, n_tokens, dtype=torch.long, device=keys.device)
    slot[..., dst] = torch.arange(n_dst, device=keys.device).expand(batch, heads, -1)
    slot[..., src] = src_slot
    return slot


def merge(split, slot, n_slots):
    """Group means of queries (over valid queries) and keys / values (over valid keys), and the
    valid keys per group: ``(B, H, M, D)`` x3 in float32 and float32 ``(B, H, M)``."""
    q, k, v = split.video_q, split.video_k, split.video_v
    batch, heads, _, dim = q.shape
    parts = torch.cat([q, k, v], dim=-1).to(accumulation_dtype(q.dtype))
    weights = parts.new_ones(batch, 1, q.shape[2], 2)
    if split.video_query_valid is not None:
        weights[..., 0] = split.video_query_valid[:, None].to(parts.dtype)
    if split.video_key_valid is not None:
        weights[..., 1] = split.video_key_valid[:, None].to(parts.dtype)
    if split.video_query_valid is not None or split.video_key_valid is not None:
        parts = parts * torch.cat([weights[..., :1].expand(-1, -1, -1, dim),
                                   weights[..., 1:].expand(-1, -1, -1, 2 * dim)], dim=-1)
    sums = parts.new_zeros(batch, heads, n_slots, 3 * dim).scatter_add_(2, slot[..., None].expand(-1, -1, -1, 3 * dim),
                                                                        parts)
    sizes = parts.new_zeros(batch, heads, n_slots, 2).scatter_add_(
        2, slot[..., None].expand(-1, -1, -1, 2), weights.expand(batch, heads, -1, -1).contiguous())
    q_m = sums[..., :dim] / sizes[..., :1].clamp(min=1)
    kv_m = sums[..., dim:] / sizes[..., 1:].clamp(min=1)
    return q_m, kv_m[..., :dim], kv_m[..., dim:], sizes[..., 1]


@register_method
class TokenMerging(Method):
    name = "tome"
    #: the quality guard's bound (relative L2 error per head) when ``guard`` is left empty
    guard_default = GUARD_DEFAULT

    def guard_levels(self):
        return 1

    def guard_widen_options(self, level):
        """One wider setting: half the pruning ratio."""
        return {"ratio": self.config.ratio / 2}
    config_cls = ToMeConfig
    default_options = {"dense_steps": 0, "dense_layers": 0}
    rank, auto_candidate, engine_geometry = 70, True, "grid"

    @classmethod
    def candidates(cls, layout):
        return [{"ratio": r} for r in (0.25, 0.5, 0.75)]

    @classmethod
    def outside_work(cls, options, batch, tokens, head_dim, elt):
        """The matching (``(N - N/w) x N/w`` cosine scores, ``w = sx sy st`` tokens a window:
        ``2 B (N - N/w)(N/w) D`` FLOPs) and the merge / unmerge (two scatter-adds and a gather:
        ``8 B N D e`` bytes)."""
        options = options or {}
        w = max(1, int(options.get("sx", 2)) * int(options.get("sy", 2)) * int(options.get("st", 1)))
        n = tokens
        return 2.0 * batch * (n - n / w) * (n / w) * head_dim, 8.0 * batch * n * head_dim * elt

    def __init__(self, config=None, **options):
        super().__init__(config, **options)
        self._roles = {}
        self._roles_lock = threading.Lock()

    def roles(self, grid, device):
        """Cached ``(dst, src)`` indices for a grid and device (one small host-to-device copy per grid)."""
        config = self.config
        window = tuple(min(s, g) for s, g in zip((config.st, config.sy, config.sx), grid))
        key = (grid, window, str(device))
        with self._roles_lock:
            roles = self._roles.get(key)
        if roles is None:
            roles = window_roles(grid, window, device)
            with self._roles_lock:
                if len(self._roles) >= self.cache_size:
                    self._roles.pop(next(iter(self._roles)))
                self._roles[key] = roles
        return roles

    def merged_count(self, grid):
        """Sources merged for a grid: ``floor(ratio * N)``, at most all sources."""
        config = self.config
        window = tuple(min(s, g) for s, g in zip((config.st, config.sy, config.sx), grid))
        n_tokens = grid[0] * grid[1] * grid[2]
        n_dst = 1
        for groups in grid_groups(grid, window):
            n_dst *= groups
        return min(int(self.config.ratio * n_tokens), n_tokens - n_dst)

    def slots(self, ctx, split):
        """The matching of this call, or the one this layer kept from an earlier step."""
        grid = ctx.layout.grid
        keys = split.video_k
        signature = (grid, tuple(keys.shape), str(keys.device))
        kept = ctx.state.get("tome")
        if (self.config.match_every > 1 and kept is not None and kept["signature"] == signature
                and ctx.step - kept["step"] < self.config.match_every):
            return kept["slot"]
        dst, src = self.roles(grid, keys.device)
        slot = match(keys, dst, src, self.merged_count(grid), split.video_key_valid)
        if self.config.match_every > 1:
            ctx.state["tome"] = {"signature": signature, "step": ctx.step, "slot": slot}
        return slot

    def attend(self, ctx, q, k, v):
        grid = ctx.layout.grid
        merged = self.merged_count(grid)
        if merged <= 0:  # nothing to merge (ratio 0, or windows of one token): the model's own attention
            ctx.info["dense"] = True
            return ctx.dense()
        split = TokenSplit(ctx, q, k, v)
        n_slots = ctx.layout.video_len - merged
        slot = self.slots(ctx, split)
        q_m, k_m, v_m, sizes = merge(split, slot, n_slots)
        keys = torch.cat([k_m.to(q.dtype), split.text_k], dim=2)
        values = torch.cat([v_m.to(q.dtype), split.text_v], dim=2)
        text_bias = split.text_bias(torch.float32).expand(-1, q.shape[1], -1)
        bias = torch.cat([log_size_bias(sizes), text_bias], dim=-1)[:, :, None, :]
        masked = split.key_mask is not None
        out_m = biased_attention(q_m.to(q.dtype), keys, values, bias, ctx.scale, masked=masked)
        video_out = out_m.gather(2, slot[..., None].expand(-1, -1, -1, out_m.shape[-1]))
        record_token_call(ctx, split, n_slots, keys.shape[2])
        return split.assemble(video_out, ctx.scale)
