"""The work a static plan gives each rank under ring attention, and a token order that balances it.

Work of rank ``r`` in one layer: the block pairs its ring steps compute, summed over the key shards
(``shard_part(plan, ..., r, s).pairs``). Diffusers gives rank ``r`` the ``r``-th contiguous chunk of
each stream (``contiguous``); with a local mask (sliding tile, radial's band) the ranks holding the
first and last frames have fewer neighbours and less work than the middle ones (xDiT #688). A
zigzag order (``zigzag``) cuts the video stream into ``2N`` chunks and gives rank ``r``
chunks ``r`` and ``2N - 1 - r``: each rank holds one piece near an end and one near the middle.
A block of the plan whose tokens fall on two ranks is computed (in part) by both: sharding in the
plan's kernel order (``kernel``, ``kernel_zigzag``: sliding tile's whole tiles) avoids that.

Only the arithmetic of that order is here: fastdit does not apply it at run time. Diffusers'
context-parallel hooks cut every input the model's ``_cp_plan`` names (hidden states after patch
embedding, RoPE tables, masks) into contiguous chunks (``EquipartitionSharder``) and join the output
chunks in rank order; a balancing order would have to permute all of them the same way before those
hooks and undo it after the output gather, inside the model's forward, for each model's plan.
"""
from __future__ import annotations

import torch

from .ring import ring_shards, shard_part

ORDERS = ("contiguous", "zigzag", "kernel", "kernel_zigzag")


def zigzag_shards(layout, ranks):
    """Rank of each model-order token under the zigzag order of the video stream (text, if any, as
    diffusers: contiguous chunks); None unless each stream splits into ``ranks`` equal shares.

    The video is cut into ``2 * ranks`` chunks, the first ``ranks`` of ``a = (V / N) // 2`` tokens and
    the last ``ranks`` of ``V / N - a``; rank ``r`` holds chunks ``r`` and ``2N - 1 - r`` (``V / N``
    tokens, as every rank under diffusers' equal split)."""
    video, text = layout.video_len, layout.text_len
    if video % ranks or text % ranks:
        return None
    owner = torch.empty(layout.seq_len, dtype=torch.long)
    owner[layout.video_positions()] = _shares(video, ranks, True)
    if text:
        owner[layout.text_positions()] = torch.arange(text) // (text // ranks)
    return owner


def _shares(length, ranks, zigzag):
    """Rank of each of ``length`` positions: ``ranks`` equal contiguous shares, or zigzag chunks."""
    share = length // ranks
    if not zigzag:
        return torch.arange(length) // share
    first = share // 2
    chunk = torch.repeat_interleave(torch.arange(2 * ranks), torch.tensor([first] * ranks + [share - first] * ranks))
    return torch.where(chunk < ranks, chunk, 2 * ranks - 1 - chunk)


def kernel_shards(plan, layout, ranks, zigzag=False):
    """Rank of each model-order token when the video is sharded in the plan's kernel order (sliding
    tile: whole tiles), in equal contiguous shares or zigzag; None unless it splits evenly (video only)."""
    if layout.text_len or layout.video_len % ranks or getattr(plan, "head_orders", None) is not None:
        return None
    tokens = plan.perm[plan.perm >= 0] if plan.perm is not None else torch.arange(layout.seq_len)
    owner = torch.empty(layout.seq_len, dtype=torch.long)
    owner[tokens.cpu()] = _shares(layout.video_len, ranks, zigzag)
    return owner


def rank_block_pairs(plan, layout, ranks, order="contiguous"):
    """Block pairs each rank's ring steps compute for ``plan`` (a list of ``ranks`` ints, all heads),
    under ``order``: ``"contiguous"`` (diffusers' chunks of the model order), ``"zigzag"``,
    ``"kernel"`` / ``"kernel_zigzag"`` (the same in the plan's kernel order); None when the layout
    does not split so."""
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    if order == "contiguous":
        shards = ring_shards(layout, ranks)
        owner = None if shards is None else shards[0]
    elif order == "zigzag":
        owner = zigzag_shards(layout, ranks)
    else:
        owner = kernel_shards(plan, layout, ranks, zigzag=order == "kernel_zigzag")
    if owner is None:
        return None
    local = torch.zeros_like(owner)  # positions within a shard do not change the count
    work = []
    for rank in range(ranks):
        parts = (shard_part(plan, owner, local, rank, shard) for shard in range(ranks))
        work.append(sum(part.pairs for part in parts if part is not None))
    return work


def imbalance(work):
    """``max / mean`` of per-rank work (1.0: balanced)."""
    return max(work) / (sum(work) / len(work))
