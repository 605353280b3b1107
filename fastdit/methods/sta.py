"""Sliding-tile attention (STA).

After "Fast Video Generation with Sliding Tile Attention" (Zhang et al., 2025). Video tokens form a
``(T, H, W)`` grid cut into tiles of ``tile = (tt, th, tw)`` tokens; the tile grid is
``(nT, nH, nW) = ceil(T / tt), ceil(H / th), ceil(W / tw)``. ``window = (wt, wh, ww)`` counts tiles
(odd entries). For the query tile ``(a, b, c)`` the window centre is clamped per dimension::

    ca = min(max(a, wt // 2), nT - 1 - wt // 2)      (the whole axis when nT <= wt)

and key tile ``(x, y, z)`` is attended iff ``|ca - x| <= wt // 2``, ``|cb - y| <= wh // 2`` and
``|cc - z| <= ww // 2``. Every query attends the same number of key tiles, so the work is balanced.
Video queries also attend every valid text key; text queries attend every valid key.

Tokens are permuted into tile order, so a tile is exactly one kernel block of ``tt * th * tw``
tokens; tiles that overhang the grid hold padding slots (keys masked, query rows dropped). The
default tile is chosen per resolution (``choose_tile``) so that padding stays under 10%.
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Integral

import torch

from fastdit.plan import BlockPlan

from .base import option, register_method
from .block_sparse import BlockSparseConfig, BlockSparseMethod

#: Published tile (tokens) of STA for HunyuanVideo / Wan: 6x8x8 = 384 tokens.
DEFAULT_TILE = (6, 8, 8)
DEFAULT_WINDOW = (3, 3, 3)
MAX_PADDING = 0.10


@dataclass
class STAConfig(BlockSparseConfig):
    """Options of sliding-tile attention.

    Attributes:
        tile: ``(tt, th, tw)`` tokens per tile. None: chosen per resolution by ``choose_tile``
            around the published 6x8x8, keeping padding under 10%. A tile dimension larger than
            the grid is clamped to it (the tile then spans that axis).
        window: ``(wt, wh, ww)`` tiles, odd entries; or a list of such triples, one per head.
        fit_tile: treat ``tile`` as a target fitted to each call's grid (``choose_tile`` around
            it, padding under 10%) instead of using it exactly; the tiny models' preset does, so
            every entry point (compare, eval, the app) fits it the same way, where the plan is built.
        dense_steps: see ``MethodConfig``; default 0.25 (the first quarter of steps dense).
        dense_layers: see ``MethodConfig``; default 0.
        skip_threshold, correction, refresh_every: see ``BlockSparseConfig``.
    """

    tile: tuple | None = option(None, "tokens per tile (tt, th, tw); empty: chosen per resolution around 6x8x8",
                                widget="triple")
    window: tuple | list = option(DEFAULT_WINDOW, "tiles attended around each query tile (wt, wh, ww), odd; "
                                  "or one triple per head", widget="triple")
    fit_tile: bool = option(False, "fit the tile to each grid (padding under 10%) instead of using it exactly",
                            widget="checkbox")

    def validate(self):
        super().validate()
        if not isinstance(self.fit_tile, bool):
            raise ValueError(f"fit_tile must be True or False, got {self.fit_tile!r}")
        if self.tile is not None:
            if not isinstance(self.tile, (tuple, list)) or len(self.tile) != 3 or not all(
                isinstance(t, int) and not isinstance(t, bool) and t > 0 for t in self.tile
            ):
                raise ValueError(f"tile must be three positive ints (tt, th, tw), got {self.tile!r}")
            self.tile = tuple(self.tile)
        for window in _windows(self.window):
            if len(window) != 3 or not all(isinstance(w, int) and not isinstance(w, bool) for w in window):
                raise ValueError(f"window must be three odd positive ints (wt, wh, ww) or a list of them, got {self.window!r}")
            if any(w <= 0 or w % 2 == 0 for w in window):
                raise ValueError(f"window entries must be odd and positive (a window is centred on its tile), got {window}")
        windows = _windows(self.window)
        # one window as a tuple (any sequence of three ints is accepted), per-head windows as a list
        self.window = windows if _is_per_head(self.window) else windows[0]


def _is_per_head(window):
    return isinstance(window, Sequence) and len(window) > 0 and all(isinstance(w, Sequence) for w in window)


def _windows(window):
    """The list of window triples: one shared window, or one per head (any sequences of ints)."""
    if _is_per_head(window):
        return [tuple(int(x) if isinstance(x, Integral) and not isinstance(x, bool) else x for x in w) for w in window]
    if isinstance(window, Sequence) and not isinstance(window, str):
        return [tuple(int(x) if isinstance(x, Integral) and not isinstance(x, bool) else x for x in window)]
    raise ValueError(f"window must be three odd ints (wt, wh, ww) or a list of such triples, one per head; "
                     f"got {window!r}")


def padding_fraction(grid, tile):
    """Padding slots / real tokens when ``grid`` is cut into tiles of ``tile`` tokens."""
    padded = math.prod(-(-g // t) * t for g, t in zip(grid, tile))
    return padded / math.prod(grid) - 1.0


def choose_tile(grid, target=DEFAULT_TILE, max_padding=MAX_PADDING):
    """Pick a tile for ``grid`` near ``target`` with padding under ``max_padding``.

    The published tile is kept when it pads little. Otherwise tiles with about the target's token
    count (0.5x to 1.5x) are searched and the one that wastes least is taken, counting the kernel's
    32-row sub-tile granularity, with a small penalty for straying from the target's shape. A
    target dimension longer than the grid is clamped to it.
    """
    target = tuple(min(t, g) for t, g in zip(target, grid))
    if padding_fraction(grid, target) <= max_padding:
        return target
    target_tokens = math.prod(target)
    ranges = [range(1, min(g, 2 * t) + 1) for g, t in zip(grid, target)]
    best, best_cost = None, None
    for tile in itertools.product(*ranges):
        tokens = math.prod(tile)
        if not 0.5 * target_tokens <= tokens <= 1.5 * target_tokens:
            continue
        pad = padding_fraction(grid, tile)
        if pad > max_padding:
            continue
        n_tiles = math.prod(-(-g // t) for g, t in zip(grid, tile))
        kernel_waste = n_tiles * (-(-tokens // 32) * 32) / math.prod(grid) - 1.0
        shape_cost = sum(abs(math.log(t / s)) for t, s in zip(tile, target))
        cost = kernel_waste + 0.1 * shape_cost
        if best_cost is None or cost < best_cost:
            best, best_cost = tile, cost
    return best if best is not None else target


def _axis_windows(n_tiles, width):
    """Key-tile coordinates attended by each query tile along one axis: ``(n_tiles, w)``."""
    width = min(width, n_tiles)
    start = (torch.arange(n_tiles) - width // 2).clamp(0, n_tiles - width)
    return start[:, None] + torch.arange(width)


def tile_permutation(layout, tile, text_block):
    """Kernel order: video tiles in tile-grid order (each ``prod(tile)`` slots, padded), then text
    padded to whole blocks of ``text_block`` slots. Returns ``(perm, n_video_blocks, n_text_blocks)``
    with ``perm[i]`` the model token at kernel position ``i`` (-1 for padding)."""
    t_, h_, w_ = layout.grid
    tt, th, tw = tile
    n_t, n_h, n_w = -(-t_ // tt), -(-h_ // th), -(-w_ // tw)
    # Grid coordinates of every slot, as (n_t, n_h, n_w, tt, th, tw) -> flattened tile-major.
    t = (torch.arange(n_t)[:, None] * tt + torch.arange(tt)).view(n_t, 1, 1, tt, 1, 1)
    h = (torch.arange(n_h)[:, None] * th + torch.arange(th)).view(1, n_h, 1, 1, th, 1)
    w = (torch.arange(n_w)[:, None] * tw + torch.arange(tw)).view(1, 1, n_w, 1, 1, tw)
    inside = (t < t_) & (h < h_) & (w < w_)
    video = torch.where(inside, layout.video_start + (t * h_ + h) * w_ + w, torch.tensor(-1)).reshape(-1)
    n_text_blocks = -(-layout.text_len // text_block)
    text = torch.full((n_text_blocks * text_block,), -1, dtype=torch.long)
    text[: layout.text_len] = layout.text_positions()
    return torch.cat([video, text]), n_t * n_h * n_w, n_text_blocks


@register_method
class SlidingTile(BlockSparseMethod):
    name = "sta"
    config_cls = STAConfig
    default_options = {"dense_steps": 0.25, "dense_layers": 0}
    #: The tiny models' grids are small: a 4x4x8 tile target, fitted per grid.
    tiny_options = {"tile": (4, 4, 8), "window": (3, 3, 3), "fit_tile": True}

    def tile_for(self, layout):
        if self.config.tile is None:
            return choose_tile(layout.grid, DEFAULT_TILE)
        if self.config.fit_tile:
            return choose_tile(layout.grid, self.config.tile)
        return tuple(min(t, g) for t, g in zip(self.config.tile, layout.grid))

    def check_heads(self, num_heads):
        windows = _windows(self.config.window)
        if len(windows) not in (1, num_heads):
            raise ValueError(f"window lists {len(windows)} triples but the model's attention layers have {num_heads} "
                             f"heads; give one window or {num_heads}")

    def prepare(self, layout, heads, device):
        self.check_heads(heads)
        windows = _windows(self.config.window)
        tile = self.tile_for(layout)
        block = math.prod(tile)
        perm, n_video, n_text = tile_permutation(layout, tile, block)
        n_tiles = [-(-g // t) for g, t in zip(layout.grid, tile)]
        n_blocks = n_video + n_text
        text_blocks = torch.arange(n_video, n_blocks)

        rows_per_head = []
        for window in windows:
            axes = [_axis_windows(n, w) for n, w in zip(n_tiles, window)]
            kt, kh, kw = (a.shape[1] for a in axes)
            # Key tile index (x * nH + y) * nW + z for every query tile (a, b, c) and window slot.
            keys = ((axes[0].view(-1, 1, 1, kt, 1, 1) * n_tiles[1] + axes[1].view(1, -1, 1, 1, kh, 1)) * n_tiles[2]
                    + axes[2].view(1, 1, -1, 1, 1, kw)).reshape(n_video, kt * kh * kw)
            video_rows = torch.cat([keys, text_blocks.expand(n_video, n_text)], dim=1)
            indices = torch.zeros(n_blocks, n_blocks, dtype=torch.int32)
            counts = torch.full((n_blocks,), n_blocks, dtype=torch.int32)
            indices[:n_video, : video_rows.shape[1]] = video_rows.to(torch.int32)
            counts[:n_video] = video_rows.shape[1]
            indices[n_video:] = torch.arange(n_blocks, dtype=torch.int32)
            rows_per_head.append((indices, counts))
        # Trim the index width to the widest row actually used.
        width = max(int(c.max()) for _, c in rows_per_head)
        kv_indices = torch.stack([i[:, :width] for i, _ in rows_per_head])[None]
        kv_counts = torch.stack([c for _, c in rows_per_head])[None]
        window_name = "_".join("x".join(map(str, w)) for w in windows[:1]) + ("_perhead" if len(windows) > 1 else "")
        return BlockPlan(
            kv_indices=kv_indices.to(device),
            kv_counts=kv_counts.to(device),
            block_m=block,
            block_n=block,
            seq_len=layout.seq_len,
            perm=perm.to(device),
            kv_valid=(perm >= 0)[None].to(device),
            padding_fraction=padding_fraction(layout.grid, tile),
            name=f"sta_t{'x'.join(map(str, tile))}_w{window_name}",
            info={"tile": tile, "tile_grid": tuple(n_tiles), "window": windows if len(windows) > 1 else windows[0]},
        )
