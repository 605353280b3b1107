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

Per (step, layer, head) windows (``strategy``, after STA's mask search, which picks a window per
head, layer and step and ships it as a JSON "mask strategy"): a mapping ``"s_l_h" -> (wt, wh, ww)``
where ``s`` is the first denoising step of a step bucket, ``l`` the patched layer (model order,
over all patched transformers) and ``h`` the head (global: under context parallelism a rank's
heads are ``head_offset ..``). A window entry 0 means the whole axis. Step ``i`` uses the bucket
with the largest start ``s <= i`` (so the last bucket also covers every later step); steps before
the first bucket, and (layer, head) pairs the strategy does not name, use ``window``. Heads of one
call run in one engine call on a per-head plan; a call whose heads all cover the whole grid runs
the model's own (dense) attention. ``load_strategy`` imports FastVideo's ``mask_strategy_*.json``.
"""
from __future__ import annotations

import itertools
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Integral

import torch

from fastdit.plan import BlockPlan

from .base import bucket_start, option, register_method
from .block_sparse import BlockSparseConfig, BlockSparseMethod

#: Published tile (tokens) of STA for HunyuanVideo / Wan: 6x8x8 = 384 tokens.
DEFAULT_TILE = (6, 8, 8)
DEFAULT_WINDOW = (3, 3, 3)
MAX_PADDING = 0.10


@dataclass
class TileWindowOptions:
    """The 3-D tile window shared by sliding tile (``STAConfig``) and window attention
    (``WindowConfig``): declared and checked once here.

    Attributes:
        tile: ``(tt, th, tw)`` tokens per tile. None: chosen per resolution by ``choose_tile``
            around the published 6x8x8, keeping padding under 10%. A tile dimension larger than
            the grid is clamped to it (the tile then spans that axis).
        window: ``(wt, wh, ww)`` tiles, odd entries; or a list of such triples, one per head.
        fit_tile: treat ``tile`` as a target fitted to each call's grid (``choose_tile`` around
            it, padding under 10%) instead of using it exactly; the tiny models' preset does, so
            every entry point (compare, eval, the app) fits it the same way, where the plan is built.
    """

    tile: tuple | None = option(None, "tokens per tile (tt, th, tw); empty: chosen per resolution around 6x8x8",
                                widget="triple")
    window: tuple | list = option(DEFAULT_WINDOW, "tiles attended around each query tile (wt, wh, ww), odd; "
                                  "or one triple per head", widget="triple")
    fit_tile: bool = option(False, "fit the tile to each grid (padding under 10%) instead of using it exactly",
                            widget="checkbox")

    def check_tile_window(self):
        """Check ``tile``, ``window`` and ``fit_tile`` and put them in canonical form (a tuple tile;
        one window as a tuple, per-head windows as a list); ValueError names the option."""
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
                raise ValueError("window must be three odd positive ints (wt, wh, ww) or a list of them, "
                                 f"got {self.window!r}")
            if any(w <= 0 or w % 2 == 0 for w in window):
                raise ValueError("window entries must be odd and positive (a window is centred on its tile), "
                                 f"got {window}")
        windows = _windows(self.window)
        # one window as a tuple (any sequence of three ints is accepted), per-head windows as a list
        self.window = windows if _is_per_head(self.window) else windows[0]


@dataclass
class STAConfig(BlockSparseConfig, TileWindowOptions):
    """Options of sliding-tile attention.

    Attributes:
        tile, window, fit_tile: see ``TileWindowOptions``.
        strategy: per (step bucket, layer, head) windows (see the module docstring).
        dense_steps: see ``MethodConfig``; default 0.25 (the first quarter of steps dense).
        dense_layers: see ``MethodConfig``; default 0.
        skip_threshold, correction, refresh_every: see ``BlockSparseConfig``.
    """

    strategy: dict | None = option(None, "per (step bucket, layer, head) windows: {'s_l_h': (wt, wh, ww)}, "
                                   "0 = whole axis; step i uses the bucket with the largest start <= i; "
                                   "unnamed heads and earlier steps use window", widget="text", advanced=True)

    def validate(self):
        super().validate()
        self.check_tile_window()
        if self.strategy is not None:
            self.strategy = normalize_strategy(self.strategy)


def _parse_strategy_key(key):
    """``"s_l_h"`` or ``(s, l, h)`` -> ``(s, l, h)`` non-negative ints; ValueError otherwise."""
    parts = key.split("_") if isinstance(key, str) else key
    try:
        if isinstance(parts, (str, bytes)) or len(parts) != 3:
            raise ValueError
        values = tuple(int(p) if isinstance(p, str) else p for p in parts)
    except (TypeError, ValueError):
        raise ValueError(f"strategy entry {key!r}: keys are 'step_layer_head' (three ints >= 0, e.g. '12_3_0') "
                         f"or (step, layer, head) tuples") from None
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ValueError(f"strategy entry {key!r}: step, layer and head must be ints >= 0")
    return values


def normalize_strategy(strategy):
    """A strategy checked and in canonical form: ``{"s_l_h": (wt, wh, ww)}`` sorted by (s, l, h).
    Window entries are odd positive ints (tiles) or 0 (the whole axis). ValueError names the entry."""
    if not isinstance(strategy, dict):
        raise ValueError(f"strategy must be a dict {{'step_layer_head': (wt, wh, ww)}}, got {type(strategy).__name__}")
    entries = {}
    for key, window in strategy.items():
        step_layer_head = _parse_strategy_key(key)
        if (not isinstance(window, Sequence) or isinstance(window, str) or len(window) != 3
                or not all(isinstance(w, Integral) and not isinstance(w, bool) for w in window)):
            raise ValueError(f"strategy entry {key!r}: a window is three ints (wt, wh, ww), got {window!r}")
        window = tuple(int(w) for w in window)
        if any(w < 0 or (w > 0 and w % 2 == 0) for w in window):
            raise ValueError(f"strategy entry {key!r}: window entries must be odd positive tiles or 0 (the whole "
                             f"axis), got {window}")
        if step_layer_head in entries and entries[step_layer_head] != window:
            raise ValueError(f"strategy entry {key!r}: (step, layer, head) {step_layer_head} is given twice")
        entries[step_layer_head] = window
    return {"_".join(map(str, k)): entries[k] for k in sorted(entries)}


class _StrategyIndex:
    """Window lookup of a normalized strategy: bucket starts and ``(start, layer) -> {head: window}``."""

    def __init__(self, strategy):
        self.table = {}
        for key, window in (strategy or {}).items():
            step, layer, head = map(int, key.split("_"))
            self.table.setdefault((step, layer), {})[head] = window
        self.starts = sorted({step for step, _ in self.table})
        self.max_head = max((h for heads in self.table.values() for h in heads), default=-1)

    def bucket(self, step):
        """The start of the bucket step ``step`` belongs to (None: before the first bucket)."""
        return bucket_start(self.starts, step)

    def windows(self, step, layer, defaults):
        """Per-head windows of (step, layer): the strategy's, else ``defaults`` (one per head)."""
        start = self.bucket(step)
        heads = self.table.get((start, layer)) if start is not None else None
        if not heads:
            return defaults
        return tuple(heads.get(h, default) for h, default in enumerate(defaults))


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
    width = n_tiles if width == 0 else min(width, n_tiles)  # 0: the whole axis
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
    rank, auto_candidate, engine_geometry, cost_model = 10, True, "grid", "plan"

    @classmethod
    def candidates(cls, layout, tile=(6, 8, 8)):
        """Windows from 1 tile up to the whole axis: per axis the odd widths 1, 3, 5 below the axis'
        tile count, and 0 (the whole axis); 1, 3 and 0 without a layout."""
        if layout is None:
            per_axis = [[1, 3, 0]] * 3
        else:
            n_tiles = [-(-g // t) for g, t in zip(layout.grid, tile)]
            per_axis = [[w for w in (1, 3, 5) if w < n] + [0] for n in n_tiles]
        return [{"window": w} for w in itertools.product(*per_axis)]

    @classmethod
    def auto_candidates(cls, layout, base):
        """A compact set of windows: per axis 1 and 3 tiles (those below the axis' tile count) and the
        whole axis (the smallest odd width >= its tile count), the whole volume (dense) left out;
        none without a layout (windows count tiles of its grid)."""
        if layout is None:
            return []
        tiles = [-(-g // t) for g, t in zip(layout.grid, cls(**base).tile_for(layout))]
        per_axis = [[w for w in (1, 3) if w < n] + [n | 1] for n in tiles]  # n | 1: odd, >= n: the whole axis
        return [{"window": w} for w in itertools.product(*per_axis) if w != tuple(n | 1 for n in tiles)]

    def tile_for(self, layout):
        if self.config.tile is None:
            return choose_tile(layout.grid, DEFAULT_TILE)
        if self.config.fit_tile:
            return choose_tile(layout.grid, self.config.tile)
        return tuple(min(t, g) for t, g in zip(self.config.tile, layout.grid))

    def __init__(self, config=None, **options):
        super().__init__(config, **options)
        self._strategy = _StrategyIndex(self.config.strategy)
        if self.config.strategy:
            # one plan per distinct (layout, window list): room for every (bucket, layer) setting
            self.cache_size = max(self.cache_size, 4 * len(self._strategy.table) + 16)
        self._window_lists = {}

    def check_heads(self, num_heads):
        windows = _windows(self.config.window)
        if len(windows) not in (1, num_heads):
            raise ValueError(f"window lists {len(windows)} triples but the model's attention layers have {num_heads} "
                             f"heads; give one window or {num_heads}")
        if self._strategy.max_head >= num_heads:
            entry = next(f"{s}_{layer}_{h}" for (s, layer), heads in self._strategy.table.items() for h in heads
                         if h >= num_heads)
            raise ValueError(f"strategy entry {entry!r} names head {self._strategy.max_head} but the model's attention "
                             f"layers have {num_heads} heads")

    def check_layers(self, num_layers):
        super().check_layers(num_layers)
        outside = sorted((layer, s) for s, layer in self._strategy.table if layer >= num_layers)
        if outside:
            layer, step = outside[0]
            head = min(self._strategy.table[step, layer])
            raise ValueError(f"strategy entry '{step}_{layer}_{head}' names layer {layer} but the model has "
                             f"{num_layers} patched attention layers (0 to {num_layers - 1})")

    def window_list(self, step, layer, heads):
        """The per-head windows (one triple per global head) of a call at ``step`` in ``layer``."""
        key = (self._strategy.bucket(step), layer, heads)
        found = self._window_lists.get(key)
        if found is None:
            defaults = _windows(self.config.window)
            defaults = tuple(defaults) if len(defaults) == heads else tuple(defaults) * heads
            found = self._window_lists[key] = self._strategy.windows(step, layer, defaults)
        return found

    def select(self, ctx, q, k):
        """The plan of this call's (step, layer) (the strategy's windows), sliced to the call's heads."""
        if not self.config.strategy:
            return super().select(ctx, q, k)
        total = ctx.total_heads or ctx.num_heads
        windows = self.window_list(ctx.step, ctx.layer, total)
        mine = windows[ctx.head_offset:ctx.head_offset + ctx.num_heads]
        shared = len(set(mine)) == 1
        # heads sharing one window get a one-head plan (broadcast); otherwise a per-head plan of all heads
        plan = self.windows_plan(ctx.layout, mine[:1] if shared else windows, q.device)
        if plan is not None and not shared and (ctx.head_offset or ctx.num_heads != total):
            plan = plan.select_heads(ctx.head_offset, ctx.num_heads)
        return plan

    def windows_plan(self, layout, windows, device):
        """The plan of per-head ``windows`` on ``layout`` (cached), or None when every head covers the
        whole grid (the call then runs the model's own attention)."""
        def build():
            n_tiles = [-(-g // t) for g, t in zip(layout.grid, self.tile_for(layout))]
            covers = all(all(w == 0 or w >= n for w, n in zip(window, n_tiles)) for window in windows)
            return None if covers else self.build_plan(layout, list(windows), device)

        return self.cached_plan(("windows", layout, tuple(windows), str(device)), build)

    def prepare(self, layout, heads, device):
        self.check_heads(heads)
        return self.build_plan(layout, _windows(self.config.window), device)

    def build_plan(self, layout, windows, device):
        """The block plan of ``windows`` (one triple, or one per head; entry 0 = the whole axis)."""
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


#: FastVideo's STA tile (tokens): its mask strategies count windows in tiles of this size.
FASTVIDEO_TILE = (6, 8, 8)
#: Calibration files' format tag and version 2 (method "auto": per-head ``choices`` among
#: ``candidates``); version 1 files and the old tag ``"fastdit-plan"`` (files written before the
#: rename) still load.
CALIBRATION_FORMAT, CALIBRATION_VERSION = "fastdit-calibration", 2
READABLE_FORMATS = (CALIBRATION_FORMAT, "fastdit-plan")


def _fastvideo_window(entry, n_tiles):
    """FastVideo's window entry ``e`` as a fastdit window entry along an axis of ``n_tiles`` tiles.

    FastVideo's rule (its flex-attention reference mask): the centre ``clamp(q, e//2, n-1-e//2)``
    and key tiles within ``e//2`` of it. So ``e >= n`` covers the whole axis (0 here), an odd ``e``
    is ``e`` tiles, and an even ``e < n`` is ``e + 1`` tiles. Without the grid (``n_tiles`` None)
    an even entry means the whole axis, as in FastVideo's published files (whose even entries are
    the axis lengths, e.g. ``[5, 6, 10]`` on HunyuanVideo's 5x6x10 tile grid).
    """
    if n_tiles is None:
        return 0 if entry % 2 == 0 else entry
    if entry >= n_tiles:
        return 0
    return entry + 1 if entry % 2 == 0 else entry


def load_strategy(path, *, grid=None, tile=FASTVIDEO_TILE, out=None):
    """Import a FastVideo STA mask strategy (``mask_strategy_*.json``) as a fastdit calibration (a dict).

    The file maps ``"step_layer_head"`` (FastVideo's denoising step index, layer, head) to a window
    ``[wt, wh, ww]`` in tiles of ``tile`` tokens (FastVideo's 6x8x8). Entries become the ``sta``
    option ``strategy`` (consecutive steps with the same settings share one step bucket), with
    ``tile`` fixed and ``dense_steps=0`` (FastVideo's dense first steps are full windows in the
    file). ``grid`` ``(T, H, W)`` latent tokens: with it, even entries smaller than the axis follow
    FastVideo's rule exactly (``e + 1`` tiles) and the calibration records the grid; without it an even
    entry means the whole axis. ``out``: also write the calibration there (JSON).

    Apply it with ``fastdit.patch(pipe, "sta", calibration=path_of_the_written_file)``, or with the options
    ``fastdit.calibration.calibration_file.calibration_options`` gives. ValueError names the file and the
    entry for a file that is not JSON, not an object, or has keys / windows that do not parse.
    """
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as handle:
            raw = json.load(handle)
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not a valid JSON mask strategy (truncated or malformed): {error}") from None
    except OSError as error:
        raise ValueError(f"{path}: cannot read the mask strategy: {error.strerror or error}") from None
    if not isinstance(raw, dict) or not raw:
        raise ValueError(f"{path}: a mask strategy is a non-empty JSON object {{'step_layer_head': [wt, wh, ww]}}")
    if grid is not None:
        grid = tuple(int(g) for g in grid)
        if len(grid) != 3 or min(grid) < 1:
            raise ValueError(f"grid must be three positive ints (T, H, W), got {grid!r}")
    n_tiles = [None] * 3 if grid is None else [-(-g // t) for g, t in zip(grid, tile)]
    per_step = {}
    for key, window in raw.items():
        try:
            step, layer, head = _parse_strategy_key(key)
        except ValueError as error:
            raise ValueError(f"{path}: {error}") from None
        if (not isinstance(window, list) or len(window) != 3
                or not all(isinstance(w, int) and not isinstance(w, bool) and w >= 1 for w in window)):
            raise ValueError(f"{path}: strategy entry {key!r}: a window is three ints >= 1 (tiles), got {window!r}")
        per_step.setdefault(step, {})[(layer, head)] = tuple(_fastvideo_window(w, n) for w, n in zip(window, n_tiles))
    strategy, previous = {}, None
    for step in sorted(per_step):
        if per_step[step] == previous:
            continue  # same settings as the bucket before: that bucket continues
        previous = per_step[step]
        for (layer, head), window in sorted(previous.items()):
            strategy[f"{step}_{layer}_{head}"] = window
    strategy = normalize_strategy(strategy)
    layers = 1 + max(layer for settings in per_step.values() for layer, _ in settings)
    heads = 1 + max(head for settings in per_step.values() for _, head in settings)
    calibration = {
        "format": CALIBRATION_FORMAT, "version": CALIBRATION_VERSION, "method": "sta",
        "model": {"family": None, "transformer": None, "layers": layers, "heads": heads,
                  "grids": [list(grid)] if grid is not None else []},
        "options": {"tile": list(tile), "fit_tile": False, "dense_steps": 0, "dense_layers": 0},
        "step_buckets": sorted({int(k.split("_")[0]) for k in strategy}),
        "strategy": {k: list(w) for k, w in strategy.items()},
        "source": {"kind": "fastvideo-mask-strategy", "file": os.path.basename(path), "steps": len(per_step)},
        "budget": None, "prompts": [], "measured": {},
    }
    if out is not None:
        with open(out, "w", encoding="utf-8") as handle:
            json.dump(calibration, handle, indent=1)
    return calibration
