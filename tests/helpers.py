"""Test helpers that several test files share (independent references and seeded inputs)."""
import math

import torch


def seeded_qkv(batch, heads, seq, dim, seed=0):
    """``(q, k, v)``: standard normal ``(batch, heads, seq, dim)`` tensors from one seeded generator."""
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(batch, heads, seq, dim, generator=g) for _ in range(3))


def randn_qkv(layout, batch=2, heads=3, dim=16, seed=0):
    """``seeded_qkv`` for every token of ``layout`` (text included)."""
    return seeded_qkv(batch, heads, layout.seq_len, dim, seed)


def sta_mask(grid, tile, window):
    """Independent sliding-tile rule in model order (no text): per axis a window of w tiles (0: all)
    whose start is the query tile minus w // 2, clamped into the axis. ``(tokens, tokens)`` bool."""
    n_tiles = [math.ceil(g / t) for g, t in zip(grid, tile)]
    pos = torch.stack(torch.meshgrid(*(torch.arange(g) for g in grid), indexing="ij"), -1).reshape(-1, 3)
    tiles = pos // torch.tensor(tile)
    ok = torch.ones(len(pos), len(pos), dtype=torch.bool)
    for axis in range(3):
        w = n_tiles[axis] if window[axis] == 0 else min(window[axis], n_tiles[axis])
        start = (tiles[:, axis] - w // 2).clamp(0, n_tiles[axis] - w)
        ok &= (tiles[None, :, axis] >= start[:, None]) & (tiles[None, :, axis] < start[:, None] + w)
    return ok
