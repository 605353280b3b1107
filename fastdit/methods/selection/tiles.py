"""The static plan of a method that chooses its blocks per call in sliding-tile order (sparge, sla,
vsa): sta's tile permutation of the layout, padding validity, and block lists that hold every block
(the method's ``select`` replaces them each call)."""
from __future__ import annotations

import math

import torch

from fastdit.plan import BlockPlan

from ..sta import padding_fraction, tile_permutation


def tile_order_plan(layout, tile, device, name, info=None):
    """The ``BlockPlan`` of ``layout`` cut into ``tile``-shaped blocks (video blocks, then text
    blocks), every block listed for every query block. ``plan.info``: ``text_blocks`` (bool per
    block), ``n_video``, ``n_text`` and the caller's ``info``."""
    block = math.prod(tile)
    perm, n_video, n_text = tile_permutation(layout, tile, block)
    n_blocks = n_video + n_text
    indices = torch.arange(n_blocks, dtype=torch.int32).expand(1, 1, n_blocks, n_blocks).contiguous()
    counts = torch.full((1, 1, n_blocks), n_blocks, dtype=torch.int32)
    text_blocks = torch.arange(n_blocks) >= n_video
    return BlockPlan(
        kv_indices=indices.to(device), kv_counts=counts.to(device), block_m=block, block_n=block,
        seq_len=layout.seq_len, perm=perm.to(device), kv_valid=(perm >= 0)[None].to(device),
        padding_fraction=padding_fraction(layout.grid, tile), name=name,
        info={"text_blocks": text_blocks.to(device), "n_video": n_video, "n_text": n_text, **(info or {})},
    )
