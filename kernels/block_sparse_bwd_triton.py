"""Triton backward of block-sparse attention (FlashAttention-2 style, fixed-size plan blocks).

The formulas are those of ``block_sparse_bwd_torch.py`` (``delta_i = dout_i . out_i - dlse_i``,
``P = exp(s - lse)``, ``dS = P (dP - delta)``). Two kernels, neither writes a location another
program writes (no atomics, deterministic):

* ``_bwd_dq_kernel``: one program per (query sub-tile, batch*head), the forward's walk over the
  key blocks its query block lists: recompute ``P`` from the saved log-sum-exp, ``dP = dout V^T``,
  ``dq += dS K``.
* ``_bwd_dkdv_kernel``: one program per (key sub-tile, batch*head), walking the query blocks that
  list its key block (the *transposed plan*, ``transpose_plan``, built on the device once
  per call): ``dv += P^T dout``, ``dk += dS^T Q``. Keys no query block lists get 0.

Scores are float32 in the log2 domain (``log2(e)`` folded into the scale) as in the forward; a
row without a key (``lse = -inf``) uses ``+inf`` as its shift, so its ``P`` is exactly 0 and no
NaN appears; masked keys (past ``Nk``, outside the plan block, ``kv_valid`` False) get ``P = 0``.
``UPCAST`` (interpreter only) computes bfloat16 dots in float32, as in the forward.

Launch tiles: ``triton_tuning.bwd_config`` (the offline compile table: a tile that spills on the target is not
used); the interpreter runs 16 x 16 tiles.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .block_sparse_triton import LOG2E, _broadcast_strides, _interpreter_enabled
from .triton_tuning import BWD_PREFERENCE, next_pow2, bwd_config, dtype_name  # noqa: F401  (offline check)


@triton.jit
def _bwd_tile(q, do, k, v, lse2, delta, row_ok, col_ok, qk_scale,
              IS_FP32: tl.constexpr, UPCAST: tl.constexpr):
    """``(p, ds)`` of one (query tile, key tile): ``q``, ``do`` ``(M, D)``, ``k``, ``v`` ``(N, D)``."""
    if IS_FP32 or UPCAST:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
        dp = tl.dot(do, tl.trans(v), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
        dp = tl.dot(do, tl.trans(v))
    p = tl.math.exp2(s * qk_scale - lse2[:, None])
    p = tl.where(row_ok[:, None] & col_ok[None, :], p, 0.0)
    ds = p * (dp - delta[:, None])
    return p, ds


@triton.jit
def _load_rows(base, rows, ok, offs_d, d_ok, stride_n, stride_d, EVEN_D: tl.constexpr, BIG_OFFSETS: tl.constexpr):
    # int32 in-head offsets (fewer registers) unless an offset could pass 2**31 elements
    if BIG_OFFSETS:
        ptrs = base + rows.to(tl.int64)[:, None] * stride_n + offs_d[None, :] * stride_d
    else:
        ptrs = base + rows[:, None] * stride_n + offs_d[None, :] * stride_d
    if EVEN_D:
        return tl.load(ptrs, mask=ok[:, None], other=0.0)
    return tl.load(ptrs, mask=ok[:, None] & d_ok[None, :], other=0.0)


@triton.jit
def _bwd_dq_kernel(
    Q, K, V, DO, Lse, Delta, DQ, KVIdx, KVCnt, KVValid,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_lb, stride_lh, stride_ib, stride_ih, stride_im, stride_is,
    stride_cb, stride_ch, stride_cm, stride_vvb,
    H, N, Nk, head_dim, block_m, block_n, qk_scale, scale,
    BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, HAS_KV_VALID: tl.constexpr,
    IS_FP32: tl.constexpr, UPCAST: tl.constexpr, BIG_OFFSETS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # q, k, v, do, dq are contiguous-like with the same strides (the launcher makes them so)
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b64 = (pid_bh // H).to(tl.int64)
    h64 = (pid_bh % H).to(tl.int64)
    n_sub_m = tl.cdiv(block_m, BLOCK_M)
    sub_n = tl.cdiv(block_n, BLOCK_N)
    m = pid_m // n_sub_m
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < head_dim
    in_block = (pid_m % n_sub_m) * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = m * block_m + in_block
    row_ok = (in_block < block_m) & (rows < N)

    q_off = b64 * stride_qb + h64 * stride_qh
    k_off = b64 * stride_kb + h64 * stride_kh
    q = _load_rows(Q + q_off, rows, row_ok, offs_d, d_ok, stride_qn, stride_qd, EVEN_D, BIG_OFFSETS)
    do = _load_rows(DO + q_off, rows, row_ok, offs_d, d_ok, stride_qn, stride_qd, EVEN_D, BIG_OFFSETS)
    l_ptr = b64 * stride_lb + h64 * stride_lh + rows
    lse = tl.load(Lse + l_ptr, mask=row_ok, other=float("-inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    delta = tl.load(Delta + l_ptr, mask=row_ok, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)

    idx_base = KVIdx + b64 * stride_ib + h64 * stride_ih + m.to(tl.int64) * stride_im
    count = tl.load(KVCnt + b64 * stride_cb + h64 * stride_ch + m.to(tl.int64) * stride_cm).to(tl.int32)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    for it in range(0, count * sub_n):
        j = tl.load(idx_base + (it // sub_n) * stride_is).to(tl.int32)
        key_in_block = (it % sub_n) * BLOCK_N + offs_n
        cols = j * block_n + key_in_block
        col_ok = (key_in_block < block_n) & (cols < Nk)
        if HAS_KV_VALID:
            col_ok = col_ok & (tl.load(KVValid + b64 * stride_vvb + cols, mask=col_ok, other=0) != 0)
        k = _load_rows(K + k_off, cols, col_ok, offs_d, d_ok, stride_kn, stride_kd, EVEN_D, BIG_OFFSETS)
        v = _load_rows(V + k_off, cols, col_ok, offs_d, d_ok, stride_kn, stride_kd, EVEN_D, BIG_OFFSETS)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        p, ds = _bwd_tile(q, do, k, v, lse2, delta, row_ok, col_ok, qk_scale, IS_FP32, UPCAST)
        if IS_FP32 or UPCAST:
            dq += tl.dot(ds, k, input_precision="ieee")
        else:
            dq += tl.dot(ds.to(k.dtype), k)
    dq = dq * scale
    dq_ptrs = DQ + q_off + rows[:, None].to(tl.int64) * stride_qn + offs_d[None, :] * stride_qd
    tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _bwd_dkdv_kernel(
    Q, K, V, DO, Lse, Delta, DK, DV, QIdx, QCnt, KVValid,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_lb, stride_lh, stride_ib, stride_ih, stride_im, stride_is,
    stride_cb, stride_ch, stride_cm, stride_vvb,
    H, N, Nk, head_dim, block_m, block_n, qk_scale, scale,
    BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, HAS_KV_VALID: tl.constexpr,
    IS_FP32: tl.constexpr, UPCAST: tl.constexpr, BIG_OFFSETS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b64 = (pid_bh // H).to(tl.int64)
    h64 = (pid_bh % H).to(tl.int64)
    n_sub_n = tl.cdiv(block_n, BLOCK_N)
    sub_m = tl.cdiv(block_m, BLOCK_M)
    j = pid_n // n_sub_n
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < head_dim
    key_in_block = (pid_n % n_sub_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = j * block_n + key_in_block
    in_range = (key_in_block < block_n) & (cols < Nk)
    col_ok = in_range
    if HAS_KV_VALID:
        col_ok = col_ok & (tl.load(KVValid + b64 * stride_vvb + cols, mask=in_range, other=0) != 0)

    q_off = b64 * stride_qb + h64 * stride_qh
    k_off = b64 * stride_kb + h64 * stride_kh
    k = _load_rows(K + k_off, cols, col_ok, offs_d, d_ok, stride_kn, stride_kd, EVEN_D, BIG_OFFSETS)
    v = _load_rows(V + k_off, cols, col_ok, offs_d, d_ok, stride_kn, stride_kd, EVEN_D, BIG_OFFSETS)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)

    idx_base = QIdx + b64 * stride_ib + h64 * stride_ih + j.to(tl.int64) * stride_im
    count = tl.load(QCnt + b64 * stride_cb + h64 * stride_ch + j.to(tl.int64) * stride_cm).to(tl.int32)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    offs_m = tl.arange(0, BLOCK_M)
    for it in range(0, count * sub_m):
        m = tl.load(idx_base + (it // sub_m) * stride_is).to(tl.int32)
        row_in_block = (it % sub_m) * BLOCK_M + offs_m
        rows = m * block_m + row_in_block
        row_ok = (row_in_block < block_m) & (rows < N)
        q = _load_rows(Q + q_off, rows, row_ok, offs_d, d_ok, stride_qn, stride_qd, EVEN_D, BIG_OFFSETS)
        do = _load_rows(DO + q_off, rows, row_ok, offs_d, d_ok, stride_qn, stride_qd, EVEN_D, BIG_OFFSETS)
        l_ptr = b64 * stride_lb + h64 * stride_lh + rows
        lse = tl.load(Lse + l_ptr, mask=row_ok, other=float("-inf"))
        lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
        delta = tl.load(Delta + l_ptr, mask=row_ok, other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
            do = do.to(tl.float32)
        p, ds = _bwd_tile(q, do, k, v, lse2, delta, row_ok, col_ok, qk_scale, IS_FP32, UPCAST)
        if IS_FP32 or UPCAST:
            dv += tl.dot(tl.trans(p), do, input_precision="ieee")
            dk += tl.dot(tl.trans(ds), q, input_precision="ieee")
        else:
            dv += tl.dot(tl.trans(p.to(do.dtype)), do)
            dk += tl.dot(tl.trans(ds.to(q.dtype)), q)
    dk = dk * scale
    out_ptrs = k_off + cols[:, None].to(tl.int64) * stride_kn + offs_d[None, :] * stride_kd
    store_ok = in_range[:, None] & d_ok[None, :]
    tl.store(DK + out_ptrs, dk.to(DK.dtype.element_ty), mask=store_ok)
    tl.store(DV + out_ptrs, dv.to(DV.dtype.element_ty), mask=store_ok)


# Launch tiles per kernel, best first; the first the offline table does not mark unclean is used.
def bwd_kernel_args(q, k, v, dout, lse, delta, grad, plan_idx, plan_cnt, kv_valid, block_m, block_n, scale):
    """``(args, flags)`` shared by both kernels (``grad``: ``(dq,)`` or ``(dk, dv)``; the plan is
    the forward plan for dQ, the transposed one for dK / dV). The offline check builds its launch
    from this too."""
    batch, heads, n_q, dim = q.shape
    block_d = max(16, next_pow2(dim))
    sib, sih = _broadcast_strides(plan_idx, batch, heads)
    scb, sch = _broadcast_strides(plan_cnt, batch, heads)
    has_kv_valid = kv_valid is not None
    if has_kv_valid:
        kvv = kv_valid.contiguous()
        kvv = kvv.view(torch.uint8) if kvv.dtype == torch.bool else kvv
        svb = kvv.stride(0) if kvv.shape[0] == batch and batch > 1 else 0
    else:
        kvv, svb = plan_cnt, 0  # never read
    args = (
        q, k, v, dout, lse, delta, *grad, plan_idx, plan_cnt, kvv,
        *q.stride(), *k.stride(), lse.stride(0), lse.stride(1),
        sib, sih, plan_idx.stride(2), plan_idx.stride(3), scb, sch, plan_cnt.stride(2), svb,
        heads, n_q, k.shape[2], dim, block_m, block_n, float(scale) * LOG2E, float(scale),
    )
    n_k = k.shape[2]
    flags = dict(BLOCK_D=block_d, EVEN_D=dim == block_d, HAS_KV_VALID=has_kv_valid,
                 IS_FP32=q.dtype == torch.float32, UPCAST=False,
                 BIG_OFFSETS=max(n_q * q.stride(2), n_k * k.stride(2), n_q * dim) >= 2**31 - 1)
    return args, flags


def block_sparse_attention_backward_triton(dout, dlse, q, k, v, out, lse, kv_indices, kv_counts, block_m, block_n,
                                           scale, kv_valid):
    """``(dq, dk, dv)`` (contiguous, the inputs' dtype) by the two kernels; inputs as the forward
    got them (validated plan)."""
    from .block_sparse_bwd_torch import transpose_plan

    batch, heads, n_q, dim = q.shape
    n_k = k.shape[2]
    if batch * heads * n_q == 0 or n_k == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    q, k, v, dout = (t.contiguous() for t in (q, k, v, dout))
    lse = lse.contiguous()
    delta = (dout.float() * out.float()).sum(-1)
    if dlse is not None:
        delta = delta - dlse.float()
    delta = delta.contiguous()
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    n_qblocks, n_kblocks = -(-n_q // block_m), -(-n_k // block_n)
    q_indices, q_counts = transpose_plan(kv_indices, kv_counts, n_kblocks)

    interpreted = _interpreter_enabled() or q.device.type != "cuda"
    block_d = max(16, next_pow2(dim))
    for kernel, fn, grad, idx, cnt, n_blocks, plan_block in (
            ("bwd_dq", _bwd_dq_kernel, (dq,), kv_indices, kv_counts, n_qblocks, block_m),
            ("bwd_dkdv", _bwd_dkdv_kernel, (dk, dv), q_indices, q_counts, n_kblocks, block_n)):
        args, flags = bwd_kernel_args(q, k, v, dout, lse, delta, grad, idx, cnt, kv_valid, block_m, block_n, scale)
        if interpreted:
            bm, bn, warps, stages = 16, 16, 4, 1
            flags["UPCAST"] = q.dtype == torch.bfloat16
        else:
            major, minor = torch.cuda.get_device_capability(q.device)
            bm, bn, warps, stages = bwd_config(kernel, block_d, 10 * major + minor, dtype_name(q.dtype))
        tile = bm if kernel == "bwd_dq" else bn
        grid = (n_blocks * -(-plan_block // tile), batch * heads)
        if interpreted:
            fn[grid](*args, **flags, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages)
        else:
            with torch.cuda.device(q.device):
                fn[grid](*args, **flags, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages)
    return dq, dk, dv


# --------------------------------------------------------------------------------------------------
# Variable-size blocks (``block_sparse_varlen_triton.py``'s forward): the same two kernels over
# offsets; the programs are slots of a device-side schedule of row tiles (dQ) / key tiles (dK, dV).
# --------------------------------------------------------------------------------------------------

@triton.jit
def _varlen_bwd_dq_kernel(
    Q, K, V, DO, Lse, Delta, DQ, QOff, KOff, KVIdx, KVCnt, KVValid, SchedBlock, SchedTile,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_lb, stride_lh, stride_qob, stride_qoh, stride_kob, stride_koh,
    stride_ib, stride_ih, stride_im, stride_is, stride_cb, stride_ch, stride_cm,
    stride_vvb, stride_sb, stride_sh,
    H, head_dim, n_qblocks, qk_scale, scale,
    BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, HAS_KV_VALID: tl.constexpr,
    IS_FP32: tl.constexpr, UPCAST: tl.constexpr, BIG_OFFSETS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_bh = tl.program_id(1)
    b64 = (pid_bh // H).to(tl.int64)
    h64 = (pid_bh % H).to(tl.int64)
    sched = b64 * stride_sb + h64 * stride_sh + tl.program_id(0)
    m = tl.load(SchedBlock + sched)
    live = m < n_qblocks
    m_c = tl.where(live, m, 0).to(tl.int64)  # a slot past the last tile does nothing
    qo_base = QOff + b64 * stride_qob + h64 * stride_qoh
    q_start = tl.load(qo_base + m_c)
    q_end = tl.where(live, tl.load(qo_base + m_c + 1), q_start)
    count = tl.where(live, tl.load(KVCnt + b64 * stride_cb + h64 * stride_ch + m_c * stride_cm).to(tl.int32), 0)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < head_dim
    rows = q_start + tl.load(SchedTile + sched) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < q_end

    q_off = b64 * stride_qb + h64 * stride_qh
    k_off = b64 * stride_kb + h64 * stride_kh
    q = _load_rows(Q + q_off, rows, row_ok, offs_d, d_ok, stride_qn, stride_qd, EVEN_D, BIG_OFFSETS)
    do = _load_rows(DO + q_off, rows, row_ok, offs_d, d_ok, stride_qn, stride_qd, EVEN_D, BIG_OFFSETS)
    l_ptr = b64 * stride_lb + h64 * stride_lh + rows
    lse = tl.load(Lse + l_ptr, mask=row_ok, other=float("-inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    delta = tl.load(Delta + l_ptr, mask=row_ok, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    ko_base = KOff + b64 * stride_kob + h64 * stride_koh
    idx_base = KVIdx + b64 * stride_ib + h64 * stride_ih + m_c * stride_im
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for slot in range(0, count):
        j = tl.load(idx_base + slot * stride_is).to(tl.int64)
        k_end = tl.load(ko_base + j + 1)
        for c0 in range(tl.load(ko_base + j), k_end, BLOCK_N):
            cols = c0 + tl.arange(0, BLOCK_N)
            col_ok = cols < k_end
            if HAS_KV_VALID:
                col_ok = col_ok & (tl.load(KVValid + b64 * stride_vvb + cols, mask=col_ok, other=0) != 0)
            k = _load_rows(K + k_off, cols, col_ok, offs_d, d_ok, stride_kn, stride_kd, EVEN_D, BIG_OFFSETS)
            v = _load_rows(V + k_off, cols, col_ok, offs_d, d_ok, stride_kn, stride_kd, EVEN_D, BIG_OFFSETS)
            if UPCAST:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            p, ds = _bwd_tile(q, do, k, v, lse2, delta, row_ok, col_ok, qk_scale, IS_FP32, UPCAST)
            if IS_FP32 or UPCAST:
                dq += tl.dot(ds, k, input_precision="ieee")
            else:
                dq += tl.dot(ds.to(k.dtype), k)
    dq = dq * scale
    dq_ptrs = DQ + q_off + rows[:, None].to(tl.int64) * stride_qn + offs_d[None, :] * stride_qd
    tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _varlen_bwd_dkdv_kernel(
    Q, K, V, DO, Lse, Delta, DK, DV, QOff, KOff, QIdx, QCnt, KVValid, SchedBlock, SchedTile,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_lb, stride_lh, stride_qob, stride_qoh, stride_kob, stride_koh,
    stride_ib, stride_ih, stride_im, stride_is, stride_cb, stride_ch, stride_cm,
    stride_vvb, stride_sb, stride_sh,
    H, head_dim, n_kblocks, qk_scale, scale,
    BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, HAS_KV_VALID: tl.constexpr,
    IS_FP32: tl.constexpr, UPCAST: tl.constexpr, BIG_OFFSETS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_bh = tl.program_id(1)
    b64 = (pid_bh // H).to(tl.int64)
    h64 = (pid_bh % H).to(tl.int64)
    sched = b64 * stride_sb + h64 * stride_sh + tl.program_id(0)
    j = tl.load(SchedBlock + sched)
    live = j < n_kblocks
    j_c = tl.where(live, j, 0).to(tl.int64)
    ko_base = KOff + b64 * stride_kob + h64 * stride_koh
    k_start = tl.load(ko_base + j_c)
    k_end = tl.where(live, tl.load(ko_base + j_c + 1), k_start)
    count = tl.where(live, tl.load(QCnt + b64 * stride_cb + h64 * stride_ch + j_c * stride_cm).to(tl.int32), 0)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < head_dim
    cols = k_start + tl.load(SchedTile + sched) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_range = cols < k_end
    col_ok = in_range
    if HAS_KV_VALID:
        col_ok = col_ok & (tl.load(KVValid + b64 * stride_vvb + cols, mask=in_range, other=0) != 0)

    q_off = b64 * stride_qb + h64 * stride_qh
    k_off = b64 * stride_kb + h64 * stride_kh
    k = _load_rows(K + k_off, cols, col_ok, offs_d, d_ok, stride_kn, stride_kd, EVEN_D, BIG_OFFSETS)
    v = _load_rows(V + k_off, cols, col_ok, offs_d, d_ok, stride_kn, stride_kd, EVEN_D, BIG_OFFSETS)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    qo_base = QOff + b64 * stride_qob + h64 * stride_qoh
    idx_base = QIdx + b64 * stride_ib + h64 * stride_ih + j_c * stride_im
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    for slot in range(0, count):
        m = tl.load(idx_base + slot * stride_is).to(tl.int64)
        q_end = tl.load(qo_base + m + 1)
        for r0 in range(tl.load(qo_base + m), q_end, BLOCK_M):
            rows = r0 + tl.arange(0, BLOCK_M)
            row_ok = rows < q_end
            q = _load_rows(Q + q_off, rows, row_ok, offs_d, d_ok, stride_qn, stride_qd, EVEN_D, BIG_OFFSETS)
            do = _load_rows(DO + q_off, rows, row_ok, offs_d, d_ok, stride_qn, stride_qd, EVEN_D, BIG_OFFSETS)
            l_ptr = b64 * stride_lb + h64 * stride_lh + rows
            lse = tl.load(Lse + l_ptr, mask=row_ok, other=float("-inf"))
            lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
            delta = tl.load(Delta + l_ptr, mask=row_ok, other=0.0)
            if UPCAST:
                q = q.to(tl.float32)
                do = do.to(tl.float32)
            p, ds = _bwd_tile(q, do, k, v, lse2, delta, row_ok, col_ok, qk_scale, IS_FP32, UPCAST)
            if IS_FP32 or UPCAST:
                dv += tl.dot(tl.trans(p), do, input_precision="ieee")
                dk += tl.dot(tl.trans(ds), q, input_precision="ieee")
            else:
                dv += tl.dot(tl.trans(p.to(do.dtype)), do)
                dk += tl.dot(tl.trans(ds.to(q.dtype)), q)
    dk = dk * scale
    out_ptrs = k_off + cols[:, None].to(tl.int64) * stride_kn + offs_d[None, :] * stride_kd
    store_ok = in_range[:, None] & d_ok[None, :]
    tl.store(DK + out_ptrs, dk.to(DK.dtype.element_ty), mask=store_ok)
    tl.store(DV + out_ptrs, dv.to(DV.dtype.element_ty), mask=store_ok)


def varlen_bwd_kernel_args(q, k, v, dout, lse, delta, grad, q_off, k_off, plan_idx, plan_cnt, kv_valid, sched,
                           scale):
    """``(args, flags)`` of either varlen backward kernel (``sched``: the ``(block, tile)`` schedule)."""
    from .block_sparse_varlen_triton import _leading_strides

    batch, heads, n_q, dim = q.shape
    block_d = max(16, next_pow2(dim))
    has_kv_valid = kv_valid is not None
    if has_kv_valid:
        kvv = kv_valid.contiguous().view(torch.uint8)
        svb = kvv.stride(0) if kvv.shape[0] == batch and batch > 1 else 0
    else:
        kvv, svb = plan_cnt, 0  # never read
    args = (
        q, k, v, dout, lse, delta, *grad, q_off, k_off, plan_idx, plan_cnt, kvv, *sched,
        *q.stride(), *k.stride(), lse.stride(0), lse.stride(1),
        *_leading_strides(q_off, batch, heads), *_leading_strides(k_off, batch, heads),
        *_leading_strides(plan_idx, batch, heads), plan_idx.stride(2), plan_idx.stride(3),
        *_leading_strides(plan_cnt, batch, heads), plan_cnt.stride(2), svb,
        *_leading_strides(sched[0], batch, heads),
        heads, dim, plan_cnt.shape[2], float(scale) * LOG2E, float(scale),
    )
    n_k = k.shape[2]
    flags = dict(BLOCK_D=block_d, EVEN_D=dim == block_d, HAS_KV_VALID=has_kv_valid,
                 IS_FP32=q.dtype == torch.float32, UPCAST=False,
                 BIG_OFFSETS=max(n_q * q.stride(2), n_k * k.stride(2), n_q * dim) >= 2**31 - 1)
    return args, flags


def block_sparse_attention_varlen_backward_triton(dout, dlse, q, k, v, out, lse, q_offsets, k_offsets, kv_indices,
                                                  kv_counts, scale, kv_valid):
    """``(dq, dk, dv)`` of the variable-size engine by the two varlen kernels."""
    from .block_sparse_bwd_torch import transpose_plan
    from .block_sparse_varlen_triton import row_tile_schedule

    batch, heads, n_q, dim = q.shape
    n_k = k.shape[2]
    if batch * heads * n_q == 0 or n_k == 0 or kv_indices.shape[-1] == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    q, k, v, dout, lse = (t.contiguous() for t in (q, k, v, dout, lse))
    delta = (dout.float() * out.float()).sum(-1)
    if dlse is not None:
        delta = delta - dlse.float()
    delta = delta.contiguous()
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    q_off = q_offsets.to(torch.int32).contiguous()
    k_off = k_offsets.to(torch.int32).contiguous()
    n_qblocks, n_kblocks = q_off.shape[-1] - 1, k_off.shape[-1] - 1
    q_indices, q_counts = transpose_plan(kv_indices, kv_counts, n_kblocks)

    interpreted = _interpreter_enabled() or q.device.type != "cuda"
    block_d = max(16, next_pow2(dim))
    for kernel, fn, grad, idx, cnt, offsets, n_blocks, n_tokens in (
            ("varlen_bwd_dq", _varlen_bwd_dq_kernel, (dq,), kv_indices, kv_counts, q_off, n_qblocks, n_q),
            ("varlen_bwd_dkdv", _varlen_bwd_dkdv_kernel, (dk, dv), q_indices, q_counts, k_off, n_kblocks, n_k)):
        if interpreted:
            bm, bn, warps, stages = 16, 16, 4, 1
        else:
            major, minor = torch.cuda.get_device_capability(q.device)
            bm, bn, warps, stages = bwd_config(kernel, block_d, 10 * major + minor, dtype_name(q.dtype))
        tile = bm if kernel == "varlen_bwd_dq" else bn
        n_slots = n_blocks + -(-n_tokens // tile)
        sched = row_tile_schedule(offsets, tile, n_slots)
        args, flags = varlen_bwd_kernel_args(q, k, v, dout, lse, delta, grad, q_off, k_off, idx, cnt, kv_valid,
                                             sched, scale)
        flags["UPCAST"] = interpreted and q.dtype == torch.bfloat16
        grid = (n_slots, batch * heads)
        if interpreted:
            fn[grid](*args, **flags, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages)
        else:
            with torch.cuda.device(q.device):
                fn[grid](*args, **flags, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages)
    return dq, dk, dv
