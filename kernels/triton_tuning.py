"""Autotune configs of the block-sparse Triton kernel and their pruning filter.

Split out of ``block_sparse_triton.py`` (which re-exports every name here); imports triton only
for ``triton.Config``.
"""
from __future__ import annotations

import os

import torch
import triton

# --------------------------------------------------------------------------------------------------
# Autotune configs and pruning
# --------------------------------------------------------------------------------------------------

_BLOCK_M_CHOICES = (64, 128)
_BLOCK_N_CHOICES = (32, 64, 128)
_WARPS_CHOICES = (4, 8)
_STAGES_CHOICES = (2, 3, 4)

AUTOTUNE_CONFIGS = [
    triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)
    for bm in _BLOCK_M_CHOICES
    for bn in _BLOCK_N_CHOICES
    for w in _WARPS_CHOICES
    for s in _STAGES_CHOICES
]

# The default search: a short list inside the grid above that covers Hopper and Ampere (128-row
# query tiles with 8 warps, 64-row tiles for small / odd plan blocks, deeper pipelines for narrow
# K/V tiles). FASTDIT_TRITON_AUTOTUNE=full searches the whole grid (after pruning), =0 skips tuning.
_PREFERRED = {
    (128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3),
    (128, 32, 4, 4), (64, 64, 4, 3), (64, 32, 4, 4), (64, 128, 4, 2),
}

# Used when the environment asks not to autotune (FASTDIT_TRITON_AUTOTUNE=0): a config that is
# good on both Hopper and Ampere for D <= 128 and 128-token plan blocks.
_DEFAULT_GPU_CONFIG = {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}

_SMEM_CACHE = {}


def _next_pow2(x):
    return 1 << max(0, int(x) - 1).bit_length()


def _shared_mem_bytes(device_index):
    """Opt-in shared memory per block of a CUDA device (227 KiB on H100/H200, 163 KiB on A100)."""
    if device_index not in _SMEM_CACHE:
        size = 0
        try:
            props = torch.cuda.get_device_properties(device_index)
            size = int(getattr(props, "shared_memory_per_block_optin", 0) or 0)
        except Exception:
            size = 0
        if size <= 0:
            try:
                size = int(triton.runtime.driver.active.utils.get_device_properties(device_index)["max_shared_mem"])
            except Exception:
                size = 99 * 1024  # the smallest of recent GPUs (consumer Ampere / Ada)
        _SMEM_CACHE[device_index] = size
    return _SMEM_CACHE[device_index]


def _tile_waste(plan, tile):
    """Computed / useful ratio when a plan block of ``plan`` rows is cut into tiles of ``tile``."""
    return (-(-plan // tile) * tile) / plan


def _prune_configs(configs, nargs, **kwargs):
    """Keep the configs that make sense for this call (the autotuner then times the survivors).

    * BLOCK_M / BLOCK_N never exceed the plan block rounded up to a power of two;
    * tiles that waste much more compute on masked rows / keys than the best choice are dropped
      (e.g. plan blocks of 192 rows: 64-row tiles waste nothing, 128-row tiles a third);
    * the shared memory of the pipelined K/V buffers plus the Q tile fits the device;
    * the float32 accumulator stays within ~128 registers a thread (4 warps for BLOCK_M=64, no
      8 warps on 64-row tiles, which only starves each warp of rows);
    * 4 stages only where the tiles are small enough to profit from them;
    * unless FASTDIT_TRITON_AUTOTUNE=full, only the short ``_PREFERRED`` list (tuning cost:
      every config is compiled and timed once per autotune key).
    """
    block_m, block_n = int(nargs["block_m"]), int(nargs["block_n"])
    block_d = int(nargs["BLOCK_D"])
    q = nargs["Q"]
    elt = q.element_size()
    smem = _shared_mem_bytes(q.device.index if q.device.type == "cuda" else 0)
    cap_m, cap_n = max(16, _next_pow2(block_m)), max(16, _next_pow2(block_n))
    full = os.environ.get("FASTDIT_TRITON_AUTOTUNE", "1").lower() == "full"
    cands = [
        c for c in configs
        if c.kwargs["BLOCK_M"] <= cap_m and c.kwargs["BLOCK_N"] <= cap_n
        and (full or len(configs) == 1
             or (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) in _PREFERRED)
    ]
    if not cands:
        bm, bn = min(64, cap_m), min(32, cap_n)
        return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=4, num_stages=2)]
    best_wm = min(_tile_waste(block_m, c.kwargs["BLOCK_M"]) for c in cands)
    best_wn = min(_tile_waste(block_n, c.kwargs["BLOCK_N"]) for c in cands)
    kept = []
    for c in cands:
        bm, bn, w, s = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages
        if _tile_waste(block_m, bm) > 1.1 * best_wm or _tile_waste(block_n, bn) > 1.1 * best_wn:
            continue
        # pipelined K/V buffers (stages - 1 in flight) + the Q tile; compiled kernels stay at or below
        # this for half types (measured on sm_80 / sm_90), the autotuner skips any that do not fit
        if (max(1, s - 1) * 2 * bn * block_d + bm * block_d) * elt > smem:
            continue
        if bm * block_d // (32 * w) > 128:  # accumulator registers a thread
            continue
        if bm == 64 and w == 8:
            continue
        if s == 4 and bn * block_d * elt > 128 * 64 * 2:  # deep pipelines only for small K/V tiles
            continue
        kept.append(c)
    if not kept:  # nothing passed the resource filters: smallest sane tile
        bm, bn = min(64, cap_m), min(32, cap_n)
        kept = [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=4, num_stages=2)]
    return kept
