"""Triton kernel of block-sparse attention (FlashAttention-2 style forward, any plan block size).

Reading order: compile-time flags (autotune configs and their pruning filter: ``triton_tuning.py``), the inner loop, the
kernel, the launcher ``block_sparse_attention_triton`` (called by ``block_sparse.py`` with
validated inputs). The online-softmax update of a key tile, the Q load, the running state and the
epilogue (normalise, log-sum-exp, stores) are the shared helpers of ``triton_attention_inner.py``,
which every forward kernel calls; this file keeps the key walk (K / V loads, scores) and the skip
rule.

Work split: one program per (query sub-tile, batch*head). A plan query block of ``block_m`` rows
is cut into ``ceil(block_m / BLOCK_M)`` power-of-two sub-tiles (rows outside the plan block or
``>= N`` are masked); a listed key block of ``block_n`` keys into ``ceil(block_n / BLOCK_N)``
sub-tiles (keys outside the plan block, ``>= Nk`` or with ``kv_valid`` False are masked). The
kernel only ever splits plan blocks, never merges them, so any plan block size is exact.

Inside a program: the key-block list of the query block (its length loaded from ``kv_counts``) is
walked with the key sub-tiles of each listed block; the two loops are written as one flat loop of
``count * SUB_N`` steps so that the software pipeliner (``num_stages``) overlaps the loads of the
next tile with the math of this one even when a key block holds a single sub-tile. Scores, the
running max / sum and the output accumulator are float32; exponentials are ``exp2`` with
``log2(e)`` folded into the score scale. A fully masked tile (running max still ``-inf``) is made
safe by subtracting 0 instead of ``-inf``, so no NaN ever appears; a row with no valid key ends
with output 0 and ``lse = -inf``.

Skip rule (``SKIP``, compile-time, off by default; see ``block_sparse.py`` for the rule): the
program of a query row tile checks each key sub-tile's scores against the running row maxima
before its exp and P.V, and skips both when every valid row is more than the threshold below;
each program adds its skipped count to a per-(batch, head) counter with one atomic add. With
``SKIP`` off the loop compiles exactly as before (the branch is a compile-time ``if``).

Flags that are compile-time constants (``EVEN_N``, ``EVEN_M``, ``EVEN_D``, ``HAS_KV_VALID``) drop
the masks that a plan does not need, so a power-of-two plan over a whole number of blocks runs the
unmasked fast path. ``UPCAST`` (interpreter only) computes bfloat16 dots in float32: the
interpreter of Triton 3.x multiplies the raw uint16 storage of bfloat16 operands in ``tl.dot``
(garbage results), while bf16 loads, stores and casts are right. Under the Triton interpreter
(``TRITON_INTERPRET=1``, CPU) the kernel runs with one small fixed configuration instead of
autotuning (the autotuner times configs on a GPU).

Only Triton features present from 3.0 on are used (``tl.dot(input_precision=...)``, autotune,
heuristics); no TMA descriptors, no warp specialisation: those are in the Hopper / Blackwell variant
``block_sparse_tma.py``, which the launcher runs instead where ``FASTDIT_TRITON_VARIANT`` and the
offline table choose it.
"""
from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

#: Launchers of other forward variants, asked in order before the classic kernel runs: each takes the
#: classic kernel's arguments and returns True when it launched (``block_sparse_tma`` registers its own).
FORWARD_VARIANTS = []

#: What the last forward launch of this process ran (``last_launch``): (variant, how its tile was chosen, tile).
_LAST_LAUNCH = None

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453

from .triton_tuning import (  # noqa: F401  (re-exported: tests and benchmarks read them here)
    _DEFAULT_GPU_CONFIG,
    _PREFERRED,
    _SMEM_CACHE,
    AUTOTUNE_CONFIGS,
    next_pow2,
    _prune_configs,
    _shared_mem_bytes,
    _tile_waste,
    default_config,
    dtype_name,
    prune_for_target,
    table_verdict,
)
from .triton_attention_inner import (
    attention_epilogue,
    load_rows,
    online_softmax_step,
    softmax_state,
    store_lse,
    store_out,
)

# --------------------------------------------------------------------------------------------------
# Compile-time flags derived from the call and the chosen tile sizes
# --------------------------------------------------------------------------------------------------

def _sub_n(args):
    return -(-int(args["block_n"]) // int(args["BLOCK_N"]))


def _even_n(args):
    """Every key sub-tile is full: no column mask (bar kv_valid)."""
    return int(args["block_n"]) % int(args["BLOCK_N"]) == 0 and int(args["Nk"]) % int(args["block_n"]) == 0


def _even_m(args):
    """Every query sub-tile is full: no row mask on the Q load and the stores."""
    return int(args["block_m"]) % int(args["BLOCK_M"]) == 0 and int(args["N"]) % int(args["block_m"]) == 0


def _masked(args):
    """Scores need a column mask: partial key sub-tiles or kv_valid."""
    return (not _even_n(args)) or bool(args["HAS_KV_VALID"])


_HEURISTICS = {"SUB_N": _sub_n, "EVEN_N": _even_n, "EVEN_M": _even_m, "MASKED": _masked}


# --------------------------------------------------------------------------------------------------
# The inner loop
# --------------------------------------------------------------------------------------------------

@triton.jit
def _attn_inner(
    acc, l_i, m_i, q,
    k_base, v_base, vv_base, idx_base, count,
    stride_kn, stride_kd, stride_vn, stride_vd, stride_vvn, stride_is,
    Nk, block_n, qk_scale, skip_log2, row_ok,
    offs_n, offs_d, d_ok,
    BLOCK_N: tl.constexpr, SUB_N: tl.constexpr,
    EVEN_N: tl.constexpr, EVEN_D: tl.constexpr, HAS_KV_VALID: tl.constexpr,
    IS_FP32: tl.constexpr, BIG_OFFSETS: tl.constexpr, UPCAST: tl.constexpr, MASKED: tl.constexpr,
    SKIP: tl.constexpr,
):
    # SKIP (compile-time; off: this loop compiles exactly as without the rule): a sub-tile whose
    # largest score is below (running max - skip_log2) for every valid row of the row tile is
    # skipped without exp and P.V. A skipped tile never raises the running max, so m_i is the max
    # over every earlier sub-tile in the walk, skipped or not (the rule the references reproduce).
    n_skipped = count * 0
    if SKIP:
        n_live = tl.max(row_ok.to(tl.int32), 0)  # 0: a sub-tile of rows past N (never skips, never counts)
    for it in range(0, count * SUB_N):
        # step `it` = sub-tile `t` of the `slot`-th listed key block
        if SUB_N == 1:
            slot = it
            t = 0
        else:
            slot = it // SUB_N
            t = it % SUB_N
        j = tl.load(idx_base + slot * stride_is).to(tl.int32)
        in_block = t * BLOCK_N + offs_n
        cols = j * block_n + in_block
        if BIG_OFFSETS:
            cols_off = cols.to(tl.int64)
        else:
            cols_off = cols
        k_ptrs = k_base + cols_off[None, :] * stride_kn + offs_d[:, None] * stride_kd
        v_ptrs = v_base + cols_off[:, None] * stride_vn + offs_d[None, :] * stride_vd
        if EVEN_N:
            if HAS_KV_VALID:
                col_ok = tl.load(vv_base + cols_off * stride_vvn) != 0
            if EVEN_D:
                k = tl.load(k_ptrs)
                v = tl.load(v_ptrs)
            else:
                k = tl.load(k_ptrs, mask=d_ok[:, None], other=0.0)
                v = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
        else:
            col_ok = (in_block < block_n) & (cols < Nk)
            if HAS_KV_VALID:
                col_ok = col_ok & (tl.load(vv_base + cols_off * stride_vvn, mask=col_ok, other=0) != 0)
            if EVEN_D:
                k = tl.load(k_ptrs, mask=col_ok[None, :], other=0.0)
                v = tl.load(v_ptrs, mask=col_ok[:, None], other=0.0)
            else:
                k = tl.load(k_ptrs, mask=col_ok[None, :] & d_ok[:, None], other=0.0)
                v = tl.load(v_ptrs, mask=col_ok[:, None] & d_ok[None, :], other=0.0)

        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        if IS_FP32 or UPCAST:
            s = tl.dot(q, k, input_precision="ieee")
        else:
            s = tl.dot(q, k)
        s = s * qk_scale  # log2 domain
        if MASKED:
            s = tl.where(col_ok[None, :], s, float("-inf"))
        if SKIP:
            below = tl.where(row_ok, tl.max(s, 1) < m_i - skip_log2, 1).to(tl.int32)
            keep = (tl.min(below, 0) == 0) | (n_live == 0)
            n_skipped += 1 - keep.to(tl.int32)
            if keep:
                acc, l_i, m_i = online_softmax_step(acc, l_i, m_i, s, v, MASKED, IS_FP32, UPCAST, False, False)
        else:
            acc, l_i, m_i = online_softmax_step(acc, l_i, m_i, s, v, MASKED, IS_FP32, UPCAST, False, False)
    return acc, l_i, m_i, n_skipped


# --------------------------------------------------------------------------------------------------
# The kernel
# --------------------------------------------------------------------------------------------------

@triton.jit
def _block_sparse_fwd_kernel(
    Q, K, V, Out, Lse, KVIdx, KVCnt, KVValid, Skipped,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_on, stride_od,
    stride_lb, stride_lh, stride_ln,
    stride_ib, stride_ih, stride_im, stride_is,
    stride_cb, stride_ch, stride_cm,
    stride_vvb, stride_vvn,
    H, N, Nk, head_dim, block_m, block_n, qk_scale, skip_log2, TUNE_N,
    BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, HAS_KV_VALID: tl.constexpr,
    IS_FP32: tl.constexpr, BIG_OFFSETS: tl.constexpr, UPCAST: tl.constexpr, SKIP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SUB_N: tl.constexpr, EVEN_N: tl.constexpr, EVEN_M: tl.constexpr, MASKED: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    n_sub_m = tl.cdiv(block_m, BLOCK_M)
    m = pid_m // n_sub_m
    sub = pid_m % n_sub_m

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < head_dim
    row_in_block = sub * BLOCK_M + offs_m
    rows = m * block_m + row_in_block
    row_ok = (row_in_block < block_m) & (rows < N)
    if BIG_OFFSETS:
        rows_off = rows.to(tl.int64)
    else:
        rows_off = rows

    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    q_base = Q + b64 * stride_qb + h64 * stride_qh
    k_base = K + b64 * stride_kb + h64 * stride_kh
    v_base = V + b64 * stride_vb + h64 * stride_vh
    vv_base = KVValid + b64 * stride_vvb
    idx_base = KVIdx + b64 * stride_ib + h64 * stride_ih + m.to(tl.int64) * stride_im
    count = tl.load(KVCnt + b64 * stride_cb + h64 * stride_ch + m.to(tl.int64) * stride_cm).to(tl.int32)

    q_ptrs = q_base + rows_off[:, None] * stride_qn + offs_d[None, :] * stride_qd
    q = load_rows(q_ptrs, row_ok, d_ok, EVEN_M, EVEN_D)
    if UPCAST:
        q = q.to(tl.float32)

    m_i, l_i, acc = softmax_state(BLOCK_M, BLOCK_D)
    acc, l_i, m_i, n_skipped = _attn_inner(
        acc, l_i, m_i, q,
        k_base, v_base, vv_base, idx_base, count,
        stride_kn, stride_kd, stride_vn, stride_vd, stride_vvn, stride_is,
        Nk, block_n, qk_scale, skip_log2, row_ok,
        offs_n, offs_d, d_ok,
        BLOCK_N, SUB_N, EVEN_N, EVEN_D, HAS_KV_VALID, IS_FP32, BIG_OFFSETS, UPCAST, MASKED, SKIP,
    )
    if SKIP:
        tl.atomic_add(Skipped + pid_bh, n_skipped)

    out, lse = attention_epilogue(acc, l_i, m_i)
    o_ptrs = Out + b64 * stride_ob + h64 * stride_oh + rows_off[:, None] * stride_on + offs_d[None, :] * stride_od
    l_ptrs = Lse + b64 * stride_lb + h64 * stride_lh + rows_off * stride_ln
    store_out(o_ptrs, out, row_ok, d_ok, EVEN_M, EVEN_D)
    store_lse(l_ptrs, lse, row_ok, EVEN_M)


# Both launch paths share the raw jitted kernel above:
#   * `_kernel_fixed`: heuristics only (flags from a fixed BLOCK_M / BLOCK_N): interpreter, or no autotune;
#   * `_kernel_tuned`: autotune over AUTOTUNE_CONFIGS (pruned per call), then the same heuristics.
_kernel_fixed = triton.heuristics(_HEURISTICS)(_block_sparse_fwd_kernel)
_kernel_tuned = triton.autotune(
    configs=AUTOTUNE_CONFIGS,
    key=["BLOCK_D", "TUNE_N", "block_m", "block_n", "HAS_KV_VALID", "EVEN_D"],
    prune_configs_by={"early_config_prune": _prune_configs},
)(_kernel_fixed)


# --------------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------------

def _interpreter_enabled():
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def _autotune_enabled():
    return os.environ.get("FASTDIT_TRITON_AUTOTUNE", "1").lower() not in ("0", "false", "no", "off")


def _forced_config():
    """FASTDIT_TRITON_CONFIG="BLOCK_M,BLOCK_N,num_warps,num_stages" pins one config (tests, debugging)."""
    spec = os.environ.get("FASTDIT_TRITON_CONFIG", "").strip()
    if not spec:
        return None
    try:
        bm, bn, w, st = (int(x) for x in spec.split(","))
    except ValueError as e:
        raise ValueError(f"FASTDIT_TRITON_CONFIG must be 'BLOCK_M,BLOCK_N,num_warps,num_stages', got {spec!r}") from e
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=st)


def _interpreter_block(plan_block):
    """Small power-of-two tiles for the interpreter (cheap numpy ops, still exercises splitting)."""
    return max(16, min(32, next_pow2(plan_block)))


def _broadcast_strides(t, batch, heads):
    """Strides of a (B|1, H|1, ...) plan tensor with stride 0 on broadcast leading dims."""
    sb = t.stride(0) if t.shape[0] == batch and batch > 1 else 0
    sh = t.stride(1) if t.shape[1] == heads and heads > 1 else 0
    return sb, sh


def skip_tile_sizes(block_m, block_n, skip_tile):
    """The kernel tile ``(BLOCK_M, BLOCK_N)`` that realises the skip rule's sub-tiles.

    The rule groups a plan block's rows (keys) into runs of ``skip_tile[0]`` (``skip_tile[1]``)
    consecutive entries, the last run cut by the plan block. A power-of-two kernel tile of that
    size does exactly this; a plan block smaller than the skip tile is one run, which a tile of
    ``next_pow2(plan block)`` (at least 16, ``tl.dot``'s minimum) covers the same way."""
    tile_m = min(int(skip_tile[0]), max(16, next_pow2(block_m)))
    tile_n = min(int(skip_tile[1]), max(16, next_pow2(block_n)))
    return tile_m, tile_n


def _skip_launch_config(tile_m, tile_n, block_d, elt, device_index, smem=None, capability=None, dtype=None):
    """Warps / stages for the fixed skip tiles: the deepest pipeline (3, 2, 1) whose K/V buffers and
    Q tile fit the device's shared memory (``smem`` bytes when given: the offline check passes each
    target's) and that the offline table does not record as spilling on ``capability`` (int, e.g.
    89) for ``dtype`` (``bf16`` / ``fp16`` / ``fp32``); the tile sizes themselves are the rule:
    never changed."""
    if smem is None:
        smem = _shared_mem_bytes(device_index)
    warps = 8 if tile_m >= 128 else 4
    fitting = [s for s in (3, 2, 1) if (max(1, s - 1) * 2 * tile_n * block_d + tile_m * block_d) * elt <= smem]
    fitting = fitting or [1]
    for stages in fitting:
        if capability is None or dtype is None or \
                table_verdict("skip", capability, dtype, block_d, (tile_m, tile_n, warps, stages)) is not False:
            return warps, stages
    return warps, fitting[-1]


def kernel_args(q, k, v, out, lse, skipped, kv_indices, kv_counts, kv_valid, block_m, block_n, scale,
                skip_threshold, interpreted):
    """The positional arguments of ``_block_sparse_fwd_kernel`` for one call (everything but the
    tile sizes and the flags the heuristics derive from them). The launcher and the offline compile
    check (``offline.py``) both build the launch from this, so the offline check compiles the
    specialisation a real launch gets."""
    batch, heads, n_q, dim = q.shape
    n_k = k.shape[2]
    skip = skip_threshold is not None
    sib, sih = _broadcast_strides(kv_indices, batch, heads)
    scb, sch = _broadcast_strides(kv_counts, batch, heads)
    has_kv_valid = kv_valid is not None
    if has_kv_valid:
        kvv = kv_valid.view(torch.uint8) if kv_valid.dtype == torch.bool else kv_valid
        svb = kvv.stride(0) if kvv.shape[0] == batch and batch > 1 else 0
        svn = kvv.stride(1)
    else:
        kvv = kv_counts  # never read (HAS_KV_VALID=False); any valid pointer
        svb, svn = 0, 0

    block_d = max(16, next_pow2(dim))
    # int64 in-head offsets only when a row/key offset could pass 2**31 elements
    max_off = max(n_q * abs(q.stride(2)), n_k * abs(k.stride(2)), n_k * abs(v.stride(2)), n_q * dim,
                  n_k * max(svn, 1))
    big_offsets = max_off >= 2**31 - 1
    tune_n = next_pow2(max(n_q, n_k))
    return (
        q, k, v, out, lse, kv_indices, kv_counts, kvv, skipped if skip else lse,  # Skipped: unread without SKIP
        *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        *lse.stride(),
        sib, sih, kv_indices.stride(2), kv_indices.stride(3),
        scb, sch, kv_counts.stride(2),
        svb, svn,
        heads, n_q, n_k, dim, block_m, block_n, float(scale) * LOG2E,
        float(skip_threshold) * LOG2E if skip else 0.0, tune_n,
        block_d, dim == block_d, has_kv_valid, q.dtype == torch.float32, big_offsets,
        interpreted and q.dtype == torch.bfloat16, skip,
    )


_ARG_INDEX = {name: i for i, name in enumerate(_block_sparse_fwd_kernel.arg_names)}


def block_sparse_attention_triton(q, k, v, kv_indices, kv_counts, block_m, block_n, scale, kv_valid,
                                  skip_threshold=None, skip_tile=(64, 64)):
    """Launch the kernel. Inputs are validated by ``block_sparse_attention``; any strides.

    Returns ``(out, lse)``: ``out`` contiguous ``(B, H, N, D)`` in q's dtype, ``lse`` float32
    ``(B, H, N)`` (natural log; ``-inf`` for rows without a valid key). With ``skip_threshold``
    (a float >= 0, natural-log units; may be ``inf``) the kernel applies the skip rule on the
    fixed sub-tiles ``skip_tile_sizes(block_m, block_n, skip_tile)`` (no autotuning: the tile
    sizes are part of the rule) and returns ``(out, lse, skipped)``, ``skipped`` int32 ``(B, H)``
    counting the skipped (row tile, key sub-tile) pairs."""
    batch, heads, n_q, dim = q.shape
    n_k = k.shape[2]
    skip = skip_threshold is not None
    out = torch.empty((batch, heads, n_q, dim), dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, heads, n_q), dtype=torch.float32, device=q.device)
    skipped = torch.zeros((batch, heads), dtype=torch.int32, device=q.device) if skip else None
    if out.numel() == 0 or n_k == 0:  # nothing to compute, or no key: every row is empty
        out.zero_()
        lse.fill_(float("-inf"))
        return (out, lse, skipped) if skip else (out, lse)
    n_qblocks = -(-n_q // block_m)
    interpreted = _interpreter_enabled() or q.device.type != "cuda"
    args = kernel_args(q, k, v, out, lse, skipped, kv_indices, kv_counts, kv_valid, block_m, block_n, scale,
                       skip_threshold, interpreted)
    block_d = args[_ARG_INDEX["BLOCK_D"]]
    # other variants first (block_sparse_tma: the Hopper / Blackwell TMA loads, FASTDIT_TRITON_VARIANT)
    if any(run(q, k, v, args, n_qblocks, block_m, block_n, block_d, skip, skip_tile, interpreted)
           for run in FORWARD_VARIANTS):
        return (out, lse, skipped) if skip else (out, lse)

    if skip:  # fixed tiles: they define which sub-tiles the rule looks at
        bm, bn = skip_tile_sizes(block_m, block_n, skip_tile)
        grid = (n_qblocks * -(-block_m // bm), batch * heads)
        if interpreted:
            _kernel_fixed[grid](*args, BLOCK_M=bm, BLOCK_N=bn, num_warps=4, num_stages=1)
            record_launch("cp_async", "interpreter", (bm, bn, 4, 1))
        else:
            major, minor = torch.cuda.get_device_capability(q.device)
            warps, stages = _skip_launch_config(bm, bn, block_d, q.element_size(), q.device.index,
                                                capability=10 * major + minor, dtype=dtype_name(q.dtype))
            with torch.cuda.device(q.device):
                _kernel_fixed[grid](*args, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages)
            record_launch("cp_async", "skip rule", (bm, bn, warps, stages))
        return out, lse, skipped

    if interpreted:
        bm, bn = _interpreter_block(block_m), _interpreter_block(block_n)
        grid = (n_qblocks * -(-block_m // bm), batch * heads)
        _kernel_fixed[grid](*args, BLOCK_M=bm, BLOCK_N=bn, num_warps=4, num_stages=1)
        record_launch("cp_async", "interpreter", (bm, bn, 4, 1))
        return out, lse

    def grid(meta):
        return (n_qblocks * -(-block_m // meta["BLOCK_M"]), batch * heads)

    with torch.cuda.device(q.device):
        forced = _forced_config()
        how = "default" if forced is None else "forced"
        if forced is None and _autotune_enabled():
            _kernel_tuned[grid](*args)
            best = getattr(_kernel_tuned, "best_config", None)
            record_launch("cp_async", "autotuned", None if best is None else
                          (best.kwargs["BLOCK_M"], best.kwargs["BLOCK_N"], best.num_warps, best.num_stages))
        else:
            if forced is None:  # the per-architecture default (offline table: no spills there)
                major, minor = torch.cuda.get_device_capability(q.device)
                bm, bn, w, st = default_config(10 * major + minor, block_d, dtype_name(q.dtype))
                forced = triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=st)
            # the same sanity filter as autotuning, bar the table (a pinned config is kept even where
            # the table says it spills); falls back to a small tile if it does not fit the device
            c = prune_for_target([forced], block_m, block_n, block_d, q.element_size(),
                                 _shared_mem_bytes(q.device.index))[0]
            _kernel_fixed[grid](*args, **c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages)
            record_launch("cp_async", how, (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages))
    return out, lse


def best_config():
    """The classic kernel's autotuner's last choice, or None. Not necessarily what ran last: the TMA
    variant and the fixed launches do not autotune (``last_launch`` says what ran)."""
    cfg = getattr(_kernel_tuned, "best_config", None)
    return None if cfg is None else str(cfg)


def record_launch(variant, how, tile):
    """Note what a forward launch ran (``last_launch``); ``tile`` = ``(BLOCK_M, BLOCK_N, warps, stages)``."""
    global _LAST_LAUNCH
    _LAST_LAUNCH = (variant, how, None if tile is None else tuple(tile))


def last_launch():
    """What the last forward launch of this process ran, for benchmarks and logs: ``{"variant": "tma" |
    "cp_async", "how": "autotuned" | "default" | "forced" | "table" | "skip rule" | "interpreter", "tile":
    (BLOCK_M, BLOCK_N, warps, stages)}``, or None before any launch. (The first H200 run recorded
    ``best_config`` instead, which named a classic tile for rows the TMA variant ran.)"""
    if _LAST_LAUNCH is None:
        return None
    variant, how, tile = _LAST_LAUNCH
    return {"variant": variant, "how": how, "tile": tile}
