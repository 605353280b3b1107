"""Autotune configs of the block-sparse Triton kernel and their pruning filter.

Split out of ``block_sparse_triton.py`` (which re-exports every name here); imports triton only
for ``triton.Config``.

Per-architecture limits come from the offline compile table ``offline_table.json`` (written by
``python -m fastdit.kernels.offline --update``, checked by ``tests/kernels/test_offline_compile.py``): a
config whose machine code spills registers or exceeds the shared memory of a target is pruned on
that target, and the config used without autotuning (``default_config``) is the first of
``DEFAULT_PREFERENCE`` that compiled clean there.
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
from pathlib import Path

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

# Used when the environment asks not to autotune (FASTDIT_TRITON_AUTOTUNE=0): the first config of
# DEFAULT_PREFERENCE that the offline table records as clean (no spills, shared memory within the
# limit) on the device's architecture, for its head dim and dtype. 128-row tiles with 8 warps first
# (Hopper and Ampere for D <= 128 and 128-token plan blocks), then shallower pipelines and narrower
# K/V tiles, which need fewer registers (BLOCK_M=128, BLOCK_N=64, 8 warps, 3 stages spills on
# sm_80 / sm_89 at D=128: see BENCHMARKS.md, "GPU readiness").
_DEFAULT_GPU_CONFIG = {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}
DEFAULT_PREFERENCE = ((128, 64, 8, 3), (128, 64, 8, 2), (128, 32, 8, 3), (64, 64, 4, 3), (64, 32, 4, 2))
TABLE_PATH = Path(__file__).with_name("offline_table.json")

# The TMA variant's launch candidates (``block_sparse_tma.py``; Hopper / Blackwell only): the first
# one the offline table records as clean for kernel ``fixed_tma`` on the device's architecture runs
# (no autotuning of this variant yet); an architecture without a clean one runs the classic kernel.
TMA_PREFERENCE = ((128, 64, 8, 3), (128, 64, 8, 2), (128, 128, 8, 2), (64, 64, 4, 3))

_SMEM_CACHE = {}


def next_pow2(x):
    return 1 << max(0, int(x) - 1).bit_length()


def dtype_name(dtype):
    """``bf16`` / ``fp16`` / ``fp32``: the offline table's name of a torch dtype."""
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]


def config_tuple(config):
    """``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` of a ``triton.Config``."""
    return (int(config.kwargs["BLOCK_M"]), int(config.kwargs["BLOCK_N"]), int(config.num_warps),
            int(config.num_stages))


@functools.lru_cache(maxsize=None)
def _table_verdicts():
    """``{(kernel, capability, dtype, head_dim, config): clean}`` from the offline table.

    Per key, the entry of the installed Triton version when the table has one, else the entries of
    every other version, the config counting as clean only if it was clean under each (the
    conservative choice for a Triton the table was not made with). An unreadable or missing table
    gives ``{}`` (no per-arch pruning: every config is allowed, as before the table existed)."""
    try:
        entries = json.loads(Path(TABLE_PATH).read_text())["entries"]
    except (OSError, ValueError, KeyError):
        return {}
    mine, others = {}, {}
    for e in entries:
        if e.get("registers") is None and e.get("error") is None:
            continue  # not compiled (skipped target)
        key = (e["kernel"], int(e["capability"]), e["dtype"], int(e["head_dim"]), tuple(e["config"]))
        if e.get("triton") == triton.__version__:
            mine[key] = bool(e["clean"])
        else:
            others[key] = others.get(key, True) and bool(e["clean"])
    return {**others, **mine}


def table_capability(capability, kernel="fixed"):
    """The tabled capability that stands for a device of ``capability`` (an int, 86 for sm_86):
    the device's own, else the largest tabled one below it of the same major (sm_87 -> sm_86),
    else None (not covered: no per-arch pruning)."""
    caps = {k[1] for k in _table_verdicts() if k[0] == kernel}
    if capability in caps:
        return capability
    lower = [c for c in caps if c < capability and c // 10 == capability // 10]
    return max(lower) if lower else None


def table_verdict(kernel, capability, dtype, head_dim, config):
    """True (compiled clean), False (spills or exceeds shared memory) or None (not in the table)
    for ``config`` = ``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` on ``capability``."""
    cap = table_capability(capability, kernel)
    if cap is None:
        return None
    return _table_verdicts().get((kernel, cap, dtype, int(head_dim), tuple(config)))


def default_config(capability, head_dim, dtype):
    """The config used without autotuning on a device of ``capability`` (int, e.g. 80), for a
    padded head dim ``head_dim`` (``BLOCK_D``) and ``dtype`` (``bf16`` / ``fp16`` / ``fp32``): the
    first of ``DEFAULT_PREFERENCE`` recorded clean in the offline table; ``_DEFAULT_GPU_CONFIG``
    when the table does not cover the device."""
    for cfg in DEFAULT_PREFERENCE:
        if table_verdict("fixed", capability, dtype, head_dim, cfg):
            return cfg
    d = _DEFAULT_GPU_CONFIG
    return (d["BLOCK_M"], d["BLOCK_N"], d["num_warps"], d["num_stages"])


def _device_capability(device_index):
    try:
        major, minor = torch.cuda.get_device_capability(device_index)
        return 10 * major + minor
    except Exception:
        return None


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
    q = nargs["Q"]
    on_cuda = q.device.type == "cuda"
    index = q.device.index if on_cuda else 0
    return prune_for_target(configs, int(nargs["block_m"]), int(nargs["block_n"]), int(nargs["BLOCK_D"]),
                            q.element_size(), _shared_mem_bytes(index),
                            capability=_device_capability(index) if on_cuda else None,
                            dtype=dtype_name(q.dtype) if q.dtype in (torch.bfloat16, torch.float16, torch.float32)
                            else None)


def prune_for_target(configs, block_m, block_n, block_d, elt, smem, capability=None, dtype=None):
    """``_prune_configs`` for explicit resources: plan blocks ``block_m`` x ``block_n``, padded head
    dim ``block_d``, element size ``elt`` bytes, ``smem`` bytes of shared memory a block, and, when
    ``capability`` and ``dtype`` are given, the offline table's verdicts for that architecture
    (configs recorded as spilling or over the shared memory there are dropped, and the
    architecture's ``default_config`` joins the short list). The offline check calls this with
    each target's numbers, without ``capability``, to list the configs a target can select."""
    cap_m, cap_n = max(16, next_pow2(block_m)), max(16, next_pow2(block_n))
    full = os.environ.get("FASTDIT_TRITON_AUTOTUNE", "1").lower() == "full"
    preferred = _PREFERRED
    if capability is not None and dtype is not None:  # the architecture's clean default is a candidate too
        preferred = preferred | {default_config(capability, block_d, dtype)}
    cands = [
        c for c in configs
        if c.kwargs["BLOCK_M"] <= cap_m and c.kwargs["BLOCK_N"] <= cap_n
        and (full or len(configs) == 1
             or (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) in preferred)
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
        if capability is not None and dtype is not None and \
                table_verdict("fixed", capability, dtype, block_d, (bm, bn, w, s)) is False:
            continue  # spills or exceeds shared memory on this architecture (offline table)
        kept.append(c)
    if not kept:  # nothing passed the resource filters: smallest sane tile
        bm, bn = min(64, cap_m), min(32, cap_n)
        kept = [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=4, num_stages=2)]
    return kept


# --------------------------------------------------------------------------------------------------
# The backward kernels' launch tiles (block_sparse_bwd_triton.py)
# --------------------------------------------------------------------------------------------------

# (offline compiles, Triton 3.9: 64 x 64 tiles spill on sm_80 / sm_89 in some (kernel, head dim)
# pairs, the variable-size kernels with their run-time loop bounds more than the fixed ones; the
# table then picks the next.)
BWD_PREFERENCE = {
    "bwd_dq": ((64, 64, 8, 2), (64, 32, 4, 2), (32, 32, 4, 1)),
    "bwd_dkdv": ((64, 64, 8, 2), (64, 32, 8, 2), (32, 32, 4, 1)),
    "varlen_bwd_dq": ((64, 32, 4, 2), (32, 32, 4, 1), (16, 32, 4, 1)),
    "varlen_bwd_dkdv": ((64, 32, 8, 1), (32, 32, 4, 1), (16, 16, 4, 1)),
}


def bwd_config(kernel, head_dim, capability=None, dtype=None):
    """``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` of ``kernel`` (``bwd_dq`` / ``bwd_dkdv``): the
    first of ``BWD_PREFERENCE`` the offline table does not record as spilling (or over the shared
    memory) on ``capability`` for ``dtype`` and the padded head dim; head dims over 128 take the
    smallest tile."""
    prefs = BWD_PREFERENCE[kernel]
    if head_dim > 128:
        prefs = prefs[-1:]
    if capability is None or dtype is None:
        return prefs[0]
    for cfg in prefs:
        if table_verdict(kernel, capability, dtype, head_dim, cfg) is not False:
            return cfg
    return prefs[-1]


@contextlib.contextmanager
def env_var(name, value):
    """``os.environ[name] = value`` (``None``: unset) for the block, restored after: how checks and
    benchmarks pin ``FASTDIT_TRITON_CONFIG`` / ``FASTDIT_TRITON_AUTOTUNE`` for one call."""
    old = os.environ.get(name)
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old
