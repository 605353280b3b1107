"""Triton kernels of quantised block-sparse attention: the quantiser and the fixed-size engine.

``_quantize_kernel`` (one program per (block, batch*head)): reads the rows of one plan block twice
(the block's absolute maximum, then the rounded values; the second read mostly hits L2),
subtracting the key mean first for K, and writes the INT8 rows, the block's scale and, for Q, the
row's smoothing term ``scale * q_i . mu``. Division is ``div_rn`` (IEEE, as torch's) and rounding
to nearest even uses the float32 ``1.5 * 2^23`` trick, so the INT8 values equal the emulation's
bit for bit. The key mean itself is one torch reduction on the device (no host sync).

``_quant_attn_kernel`` (one program per (query sub-tile, batch*head), the work split of
``block_sparse_triton.py``): ``tl.dot`` of INT8 tiles with INT32 accumulation, scores
``dot * (sq * sk) * scale`` in the log2 domain, FlashAttention-2 online softmax in float32 (the
shared helpers of ``triton_attention_inner.py``: the online-softmax update, epilogue and stores), and
P.V in the input's half type (``"int8"``) or in float8 e4m3 with P scaled by 448 and V pre-scaled
per channel (``"int8-fp8"``), float32 accumulation. Formulas: ``emulation.py``.

Under the interpreter bfloat16 dots are computed in float32 after rounding P to bfloat16 (the
Triton 3.x interpreter multiplies bfloat16 storage as integers in ``tl.dot``; see
``block_sparse_triton.py``); INT8 dots run as they are (checked there: exact).
"""
from __future__ import annotations

import contextlib
import os

import torch
import triton
import triton.language as tl

from ..triton_attention_inner import normalise_rows, online_softmax_step, row_lse, softmax_state, store_lse, \
    store_out
from ..triton_tuning import next_pow2
from .emulation import fixed_blocks, fp8_value_scale, key_mean, nonfinite_keys, poison_scales, varlen_blocks

LOG2E = 1.4426950408889634
# 1.5 * 2**23: (y + RNE) - RNE rounds a float32 |y| < 2**22 to the nearest integer, ties to even
RNE = tl.constexpr(12582912.0)


@triton.jit
def _quantize_kernel(
    X, Mean, X8, Scale, Shift, Offsets,
    stride_xb, stride_xh, stride_xn, stride_xd,
    stride_ob, stride_oh, stride_om,
    H, L, D, block, n_blocks, shift_scale,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, SMOOTH: tl.constexpr, SHIFT: tl.constexpr,
    VARLEN: tl.constexpr,
):
    m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    if VARLEN:
        off_base = Offsets + b * stride_ob + h * stride_oh
        start = tl.load(off_base + m * stride_om).to(tl.int32)
        end = tl.load(off_base + (m + 1) * stride_om).to(tl.int32)
    else:
        start = m * block
        end = tl.minimum(start + block, L)
    offs_r = tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    x_base = X + b * stride_xb + h * stride_xh
    if SMOOTH or SHIFT:
        mu = tl.load(Mean + bh.to(tl.int64) * D + offs_d, mask=d_ok, other=0.0)
    amax = tl.zeros([BLOCK_R], dtype=tl.float32)
    for r0 in range(start, end, BLOCK_R):
        rows = r0 + offs_r
        ok = (rows < end)[:, None] & d_ok[None, :]
        x = tl.load(x_base + rows[:, None].to(tl.int64) * stride_xn + offs_d[None, :] * stride_xd, mask=ok,
                    other=0.0).to(tl.float32)
        if SMOOTH:
            x = tl.where(ok, x - mu[None, :], 0.0)
        amax = tl.maximum(amax, tl.max(tl.abs(x), 1))
    scale = tl.math.div_rn(tl.max(amax, 0), 127.0)
    scale = tl.where(scale > 0, scale, 1.0)
    tl.store(Scale + bh.to(tl.int64) * n_blocks + m, scale)
    out_base = X8 + bh.to(tl.int64) * L * D
    for r0 in range(start, end, BLOCK_R):
        rows = r0 + offs_r
        row_ok = rows < end
        ok = row_ok[:, None] & d_ok[None, :]
        x = tl.load(x_base + rows[:, None].to(tl.int64) * stride_xn + offs_d[None, :] * stride_xd, mask=ok,
                    other=0.0).to(tl.float32)
        if SHIFT:
            tl.store(Shift + bh.to(tl.int64) * L + rows, tl.sum(x * mu[None, :], 1) * shift_scale, mask=row_ok)
        if SMOOTH:
            x = x - mu[None, :]
        y = tl.math.div_rn(x, scale)
        y = (y + RNE) - RNE
        y = tl.minimum(tl.maximum(y, -127.0), 127.0)
        tl.store(out_base + rows[:, None].to(tl.int64) * D + offs_d[None, :], y.to(tl.int8), mask=ok)


def quantize_triton(x, blocks, mean=None, q_for_shift=None, shift_scale=0.0, offsets=None):
    """``(x8, scales[, shift])``: INT8 ``(B, H, L, D)`` contiguous and float32 scales ``(B, H, M)``
    of ``x`` ``(B, H, L, D)`` (any strides), one scale per block of ``blocks`` rows (fixed size) or
    per block of ``offsets`` ``(B|1, H|1, M + 1)``. ``mean`` ``(B, H, 1, D)`` float32: subtracted
    first (keys). With ``q_for_shift`` (queries: ``mean`` is then the *key* mean, not subtracted)
    also the float32 smoothing term ``shift_scale * x_i . mean`` ``(B, H, L)``."""
    batch, heads, length, dim = x.shape
    n_blocks = offsets.shape[-1] - 1 if offsets is not None else -(-length // blocks)
    x8 = torch.empty((batch, heads, length, dim), dtype=torch.int8, device=x.device)
    scales = torch.empty((batch, heads, n_blocks), dtype=torch.float32, device=x.device)
    shift = torch.empty((batch, heads, length), dtype=torch.float32, device=x.device) if q_for_shift else scales
    if offsets is not None:
        osb = offsets.stride(0) if offsets.shape[0] > 1 else 0
        osh = offsets.stride(1) if offsets.shape[1] > 1 else 0
        off_args = (offsets, osb, osh, offsets.stride(2))
    else:
        off_args = (scales, 0, 0, 0)  # never read
    mean_arg = mean.reshape(batch * heads, dim) if mean is not None else scales
    if n_blocks and batch * heads:
        args, flags = quantize_kernel_args(x, mean_arg, x8, scales, shift, off_args, blocks, n_blocks, shift_scale,
                                           mean is not None and not q_for_shift, bool(q_for_shift), offsets is not None)
        _quantize_kernel[(n_blocks, batch * heads)](*args, **flags)
    return (x8, scales, shift) if q_for_shift else (x8, scales)


QUANTIZE_ROWS = 32  # rows a step of the quantiser (BLOCK_R)


def quantize_kernel_args(x, mean, x8, scales, shift, off_args, blocks, n_blocks, shift_scale, smooth, with_shift,
                         varlen):
    """``(args, flags)`` of ``_quantize_kernel`` (shared with the offline compile check)."""
    _, heads, length, dim = x.shape
    args = (x, mean, x8, scales, shift, off_args[0], *x.stride(), *off_args[1:], heads, length, dim, blocks or 1,
            n_blocks, float(shift_scale))
    flags = dict(BLOCK_R=QUANTIZE_ROWS, BLOCK_D=max(16, next_pow2(dim)), SMOOTH=smooth, SHIFT=with_shift,
                 VARLEN=varlen)
    return args, flags


@triton.jit
def _quant_tile(acc, l_i, m_i, q8, q_scale, k_ptrs, v_ptrs, col_ok, d_ok, k_scale, qk_scale,
                FP8: tl.constexpr, UPCAST: tl.constexpr):
    """One key tile: INT8 scores dequantised with the blocks' scales, then the shared online-softmax
    update with P.V in the half type or FP8 (see the module docstring)."""
    k8 = tl.load(k_ptrs, mask=col_ok[None, :] & d_ok[:, None], other=0)
    v = tl.load(v_ptrs, mask=col_ok[:, None] & d_ok[None, :], other=0.0)
    s = tl.dot(q8, k8).to(tl.float32) * (q_scale * k_scale) * qk_scale
    s = tl.where(col_ok[None, :], s, float("-inf"))
    # ROUND_P: under the interpreter P is rounded to V's half type before the float32 dot, as on a GPU
    return online_softmax_step(acc, l_i, m_i, s, v, True, False, UPCAST, FP8, True)


@triton.jit
def _quant_attn_kernel(
    Q8, K8, V, QS, KS, VS, Out, Lse, KVIdx, KVCnt, KVValid,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_on, stride_od,
    stride_ib, stride_ih, stride_im, stride_is,
    stride_cb, stride_ch, stride_cm,
    stride_vvb, stride_vvn,
    H, N, Nk, head_dim, block_m, block_n, n_qblocks, n_kblocks, qk_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HAS_KV_VALID: tl.constexpr,
    FP8: tl.constexpr, UPCAST: tl.constexpr,
):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    bh64 = bh.to(tl.int64)
    n_sub_m = tl.cdiv(block_m, BLOCK_M)
    m = pid_m // n_sub_m
    row_in_block = (pid_m % n_sub_m) * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = m * block_m + row_in_block
    row_ok = (row_in_block < block_m) & (rows < N)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < head_dim

    q8 = tl.load(Q8 + bh64 * N * head_dim + rows[:, None].to(tl.int64) * head_dim + offs_d[None, :],
                 mask=row_ok[:, None] & d_ok[None, :], other=0)
    q_scale = tl.load(QS + bh64 * n_qblocks + m)
    k_base = K8 + bh64 * Nk * head_dim
    v_base = V + b * stride_vb + h * stride_vh
    idx_base = KVIdx + b * stride_ib + h * stride_ih + m * stride_im
    count = tl.load(KVCnt + b * stride_cb + h * stride_ch + m * stride_cm).to(tl.int32)
    m_i, l_i, acc = softmax_state(BLOCK_M, BLOCK_D)
    sub_n = tl.cdiv(block_n, BLOCK_N)
    for it in range(0, count * sub_n):
        j = tl.load(idx_base + (it // sub_n) * stride_is).to(tl.int32)
        in_block = (it % sub_n) * BLOCK_N + offs_n
        cols = j * block_n + in_block
        col_ok = (in_block < block_n) & (cols < Nk)
        if HAS_KV_VALID:
            col_ok = col_ok & (tl.load(KVValid + b * stride_vvb + cols.to(tl.int64) * stride_vvn, mask=col_ok,
                                       other=0) != 0)
        k_ptrs = k_base + cols[None, :].to(tl.int64) * head_dim + offs_d[:, None]
        v_ptrs = v_base + cols[:, None].to(tl.int64) * stride_vn + offs_d[None, :] * stride_vd
        k_scale = tl.load(KS + bh64 * n_kblocks + j)
        acc, l_i, m_i = _quant_tile(acc, l_i, m_i, q8, q_scale, k_ptrs, v_ptrs, col_ok, d_ok, k_scale, qk_scale,
                                    FP8, UPCAST)
    out = normalise_rows(acc, l_i)
    if FP8:  # undo V's per-channel FP8 scale and P's 448
        out = out * (tl.load(VS + bh64 * head_dim + offs_d, mask=d_ok, other=1.0) / 448.0)[None, :]
    lse = row_lse(m_i, l_i)
    o_ptrs = Out + b * stride_ob + h * stride_oh + rows[:, None].to(tl.int64) * stride_on + offs_d[None, :] * stride_od
    store_out(o_ptrs, out, row_ok, d_ok, False, False)
    store_lse(Lse + bh64 * N + rows, lse, row_ok, False)


def _interpreted(device):
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on") or device.type != "cuda"


def tiles(block_m, block_n, interpreted):
    """``(BLOCK_M, BLOCK_N)`` of the attention kernel: powers of two that split plan blocks (never
    merge them); BLOCK_N at least 32 (the K dimension of an FP8 dot)."""
    if interpreted:
        return max(16, min(32, next_pow2(block_m))), 32
    return max(16, min(128, next_pow2(block_m))), max(32, min(64, next_pow2(block_n)))


def prepare_quant(q, k, v, scale, quant, q_blocks, k_blocks, q_offsets=None, k_offsets=None):
    """The device-side prologue both engines share: key mean, INT8 Q and K with their scales, the
    smoothing term of the lse and, for ``"int8-fp8"``, V in e4m3 with its per-channel scales."""
    mu = key_mean(k)  # finite where an inf / NaN key would make the plain mean (and every row) NaN
    q8, q_scales, shift = quantize_triton(q, q_blocks, mean=mu, q_for_shift=True, shift_scale=scale,
                                          offsets=q_offsets)
    k_clean, bad_k = nonfinite_keys(k)  # such a key: quantised as 0, its block's scale NaN (emulation.py)
    k8, k_scales = quantize_triton(k_clean, k_blocks, mean=mu, offsets=k_offsets)
    n_k = k.shape[2]
    key_blocks = (varlen_blocks(k_offsets, n_k) if k_offsets is not None else fixed_blocks(n_k, k_blocks, k.device))
    k_scales = poison_scales(k_scales, bad_k, key_blocks)
    if quant == "int8-fp8":
        v_scale = fp8_value_scale(v)
        v_used = (v.float() / v_scale).to(torch.float8_e4m3fn)
    else:
        v_scale, v_used = q_scales, v  # V's scales unread without FP8
    return q8, q_scales, shift, k8, k_scales, v_used, v_scale


def plan_strides(t, batch, heads):
    """Strides of a (B|1, H|1, ...) plan tensor, 0 on broadcast leading dims, then the rest."""
    sb = t.stride(0) if t.shape[0] == batch and batch > 1 else 0
    sh = t.stride(1) if t.shape[1] == heads and heads > 1 else 0
    return (sb, sh) + tuple(t.stride()[2:])


def kv_valid_args(kv_valid, batch, fallback):
    if kv_valid is None:
        return fallback, 0, 0
    kvv = kv_valid.view(torch.uint8)
    return kvv, kvv.stride(0) if kvv.shape[0] == batch and batch > 1 else 0, kvv.stride(1)


def quant_attention_triton(q, k, v, kv_indices, kv_counts, block_m, block_n, scale, kv_valid, quant):
    """``(out, lse)`` of quantised fixed-size block-sparse attention on the Triton backend (inputs
    validated by ``block_sparse_attention``; any strides)."""
    batch, heads, n_q, dim = q.shape
    n_k = k.shape[2]
    out = torch.empty((batch, heads, n_q, dim), dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, heads, n_q), dtype=torch.float32, device=q.device)
    if out.numel() == 0 or n_k == 0:
        return out.zero_(), lse.fill_(float("-inf"))
    q8, q_scales, shift, k8, k_scales, v_used, v_scale = prepare_quant(q, k, v, scale, quant, block_m, block_n)
    interpreted = _interpreted(q.device)
    args, flags = quant_kernel_args(q8, k8, v_used, q_scales, k_scales, v_scale, out, lse, kv_indices, kv_counts,
                                    kv_valid, block_m, block_n, scale, quant, interpreted)
    grid = (-(-n_q // block_m) * -(-block_m // flags["BLOCK_M"]), batch * heads)
    with torch.cuda.device(q.device) if q.device.type == "cuda" else contextlib.nullcontext():
        _quant_attn_kernel[grid](*args, **flags)
    return out, lse + shift


def quant_kernel_args(q8, k8, v_used, q_scales, k_scales, v_scale, out, lse, kv_indices, kv_counts, kv_valid,
                      block_m, block_n, scale, quant, interpreted):
    """``(args, flags)`` of ``_quant_attn_kernel``: positional arguments, tiles, flags, warps and
    stages (shared by the launcher and the offline compile check)."""
    batch, heads, n_q, dim = q8.shape
    n_k = k8.shape[2]
    bm, bn = tiles(block_m, block_n, interpreted)
    kvv, svb, svn = kv_valid_args(kv_valid, batch, kv_counts)
    args = (q8, k8, v_used, q_scales, k_scales, v_scale, out, lse, kv_indices, kv_counts, kvv,
            *v_used.stride(), *out.stride(), *plan_strides(kv_indices, batch, heads),
            *plan_strides(kv_counts, batch, heads), svb, svn,
            heads, n_q, n_k, dim, block_m, block_n, -(-n_q // block_m), -(-n_k // block_n), float(scale) * LOG2E)
    flags = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=max(32, next_pow2(dim)), HAS_KV_VALID=kv_valid is not None,
                 FP8=quant == "int8-fp8", UPCAST=interpreted and out.dtype == torch.bfloat16,
                 num_warps=4 if bm <= 64 else 8, num_stages=1 if interpreted else 2)
    return args, flags
