"""Triton kernel of block-sparse attention (FlashAttention-2 style forward, any plan block size).

Reading order: autotune configs and their pruning filter, compile-time flags, the inner loop, the
kernel, the launcher ``block_sparse_attention_triton`` (called by ``block_sparse.py`` with
validated inputs).

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

Flags that are compile-time constants (``EVEN_N``, ``EVEN_M``, ``EVEN_D``, ``HAS_KV_VALID``) drop
the masks that a plan does not need, so a power-of-two plan over a whole number of blocks runs the
unmasked fast path. ``UPCAST`` (interpreter only) computes bfloat16 dots in float32: the
interpreter of Triton 3.x multiplies the raw uint16 storage of bfloat16 operands in ``tl.dot``
(garbage results), while bf16 loads, stores and casts are right. Under the Triton interpreter (``TRITON_INTERPRET=1``, CPU) the kernel runs
with one small fixed configuration instead of autotuning (the autotuner times configs on a GPU).

Only Triton features present from 3.0 on are used (``tl.dot(input_precision=...)``, autotune,
heuristics); no TMA descriptors, no warp specialisation.
"""
from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453

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
    Nk, block_n, qk_scale,
    offs_n, offs_d, d_ok,
    BLOCK_N: tl.constexpr, SUB_N: tl.constexpr,
    EVEN_N: tl.constexpr, EVEN_D: tl.constexpr, HAS_KV_VALID: tl.constexpr,
    IS_FP32: tl.constexpr, BIG_OFFSETS: tl.constexpr, UPCAST: tl.constexpr, MASKED: tl.constexpr,
):
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
        m_new = tl.maximum(m_i, tl.max(s, 1))
        if MASKED:
            # all keys so far masked: subtract 0, not -inf (exp2(-inf - -inf) would be NaN)
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_sub = m_new
        p = tl.math.exp2(s - m_sub[:, None])
        alpha = tl.math.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if IS_FP32 or UPCAST:
            acc += tl.dot(p, v, input_precision="ieee")
        else:
            acc += tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return acc, l_i, m_i


# --------------------------------------------------------------------------------------------------
# The kernel
# --------------------------------------------------------------------------------------------------

@triton.jit
def _block_sparse_fwd_kernel(
    Q, K, V, Out, Lse, KVIdx, KVCnt, KVValid,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_on, stride_od,
    stride_lb, stride_lh, stride_ln,
    stride_ib, stride_ih, stride_im, stride_is,
    stride_cb, stride_ch, stride_cm,
    stride_vvb, stride_vvn,
    H, N, Nk, head_dim, block_m, block_n, qk_scale, TUNE_N,
    BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, HAS_KV_VALID: tl.constexpr,
    IS_FP32: tl.constexpr, BIG_OFFSETS: tl.constexpr, UPCAST: tl.constexpr,
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
    if EVEN_M:
        if EVEN_D:
            q = tl.load(q_ptrs)
        else:
            q = tl.load(q_ptrs, mask=d_ok[None, :], other=0.0)
    else:
        if EVEN_D:
            q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
        else:
            q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    acc, l_i, m_i = _attn_inner(
        acc, l_i, m_i, q,
        k_base, v_base, vv_base, idx_base, count,
        stride_kn, stride_kd, stride_vn, stride_vd, stride_vvn, stride_is,
        Nk, block_n, qk_scale,
        offs_n, offs_d, d_ok,
        BLOCK_N, SUB_N, EVEN_N, EVEN_D, HAS_KV_VALID, IS_FP32, BIG_OFFSETS, UPCAST, MASKED,
    )

    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)

    o_ptrs = Out + b64 * stride_ob + h64 * stride_oh + rows_off[:, None] * stride_on + offs_d[None, :] * stride_od
    l_ptrs = Lse + b64 * stride_lb + h64 * stride_lh + rows_off * stride_ln
    out = out.to(Out.dtype.element_ty)
    if EVEN_M:
        if EVEN_D:
            tl.store(o_ptrs, out)
        else:
            tl.store(o_ptrs, out, mask=d_ok[None, :])
        tl.store(l_ptrs, lse)
    else:
        if EVEN_D:
            tl.store(o_ptrs, out, mask=row_ok[:, None])
        else:
            tl.store(o_ptrs, out, mask=row_ok[:, None] & d_ok[None, :])
        tl.store(l_ptrs, lse, mask=row_ok)


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
    return max(16, min(32, _next_pow2(plan_block)))


def _broadcast_strides(t, batch, heads):
    """Strides of a (B|1, H|1, ...) plan tensor with stride 0 on broadcast leading dims."""
    sb = t.stride(0) if t.shape[0] == batch and batch > 1 else 0
    sh = t.stride(1) if t.shape[1] == heads and heads > 1 else 0
    return sb, sh


def block_sparse_attention_triton(q, k, v, kv_indices, kv_counts, block_m, block_n, scale, kv_valid):
    """Launch the kernel. Inputs are validated by ``block_sparse_attention``; any strides.

    Returns ``(out, lse)``: ``out`` contiguous ``(B, H, N, D)`` in q's dtype, ``lse`` float32
    ``(B, H, N)`` (natural log; ``-inf`` for rows without a valid key)."""
    batch, heads, n_q, dim = q.shape
    n_k = k.shape[2]
    out = torch.empty((batch, heads, n_q, dim), dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, heads, n_q), dtype=torch.float32, device=q.device)
    if out.numel() == 0 or n_k == 0:  # nothing to compute, or no key: every row is empty
        out.zero_()
        lse.fill_(float("-inf"))
        return out, lse
    n_qblocks = -(-n_q // block_m)

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

    block_d = max(16, _next_pow2(dim))
    # int64 in-head offsets only when a row/key offset could pass 2**31 elements
    max_off = max(n_q * abs(q.stride(2)), n_k * abs(k.stride(2)), n_k * abs(v.stride(2)), n_q * dim,
                  n_k * max(svn, 1))
    big_offsets = max_off >= 2**31 - 1
    tune_n = _next_pow2(max(n_q, n_k))
    interpreted = _interpreter_enabled() or q.device.type != "cuda"

    args = (
        q, k, v, out, lse, kv_indices, kv_counts, kvv,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        *lse.stride(),
        sib, sih, kv_indices.stride(2), kv_indices.stride(3),
        scb, sch, kv_counts.stride(2),
        svb, svn,
        heads, n_q, n_k, dim, block_m, block_n, float(scale) * LOG2E, tune_n,
        block_d, dim == block_d, has_kv_valid, q.dtype == torch.float32, big_offsets,
        interpreted and q.dtype == torch.bfloat16,
    )

    if interpreted:
        bm, bn = _interpreter_block(block_m), _interpreter_block(block_n)
        grid = (n_qblocks * -(-block_m // bm), batch * heads)
        _kernel_fixed[grid](*args, BLOCK_M=bm, BLOCK_N=bn, num_warps=4, num_stages=1)
        return out, lse

    def grid(meta):
        return (n_qblocks * -(-block_m // meta["BLOCK_M"]), batch * heads)

    with torch.cuda.device(q.device):
        forced = _forced_config()
        if forced is None and _autotune_enabled():
            _kernel_tuned[grid](*args)
        else:
            cfg = forced or triton.Config(
                {"BLOCK_M": _DEFAULT_GPU_CONFIG["BLOCK_M"], "BLOCK_N": _DEFAULT_GPU_CONFIG["BLOCK_N"]},
                num_warps=_DEFAULT_GPU_CONFIG["num_warps"], num_stages=_DEFAULT_GPU_CONFIG["num_stages"],
            )
            # the same sanity filter as autotuning (falls back to a small tile if cfg does not fit)
            c = _prune_configs([cfg], {"block_m": block_m, "block_n": block_n, "BLOCK_D": block_d, "Q": q})[0]
            _kernel_fixed[grid](*args, **c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages)
    return out, lse


def best_config():
    """The autotuner's last choice (for benchmarks / logs), or None."""
    cfg = getattr(_kernel_tuned, "best_config", None)
    return None if cfg is None else str(cfg)
