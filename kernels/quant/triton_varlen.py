"""Triton kernel of quantised variable-size block-sparse attention.

The work split, row-tile schedule and key walk of ``block_sparse_varlen_triton.py`` (one program
per (row tile slot, batch*head); key blocks from ``k_offsets`` in chunks of ``BLOCK_N``), with the
quantised tile update of ``triton_fixed.py`` (INT8 Q.K^T with INT32 accumulation, P.V in the half
type or FP8) and the shared epilogue of ``triton_attention_inner.py``. Q and K are quantised by the
shared ``_quantize_kernel`` with one scale per variable-size block (``VARLEN``: block bounds read
from the offsets). Formulas: ``emulation.py``.
"""
from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from ..block_sparse_varlen_triton import row_tile_schedule
from ..triton_attention_inner import normalise_rows, row_lse, softmax_state, store_lse, store_out
from ..triton_tuning import next_pow2
from .triton_fixed import LOG2E, _interpreted, _quant_tile, kv_valid_args, plan_strides, prepare_quant


@triton.jit
def _quant_varlen_kernel(
    Q8, K8, V, QS, KS, VS, Out, Lse, QOff, KOff, KVIdx, KVCnt, KVValid, SchedBlock, SchedTile,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_on, stride_od,
    stride_qob, stride_qoh, stride_qom, stride_kob, stride_koh, stride_kom,
    stride_ib, stride_ih, stride_im, stride_is,
    stride_cb, stride_ch, stride_cm,
    stride_vvb, stride_vvn,
    stride_sb, stride_sh, stride_ss,
    H, N, Nk, head_dim, n_qblocks, n_kblocks, qk_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HAS_KV_VALID: tl.constexpr,
    FP8: tl.constexpr, UPCAST: tl.constexpr,
):
    pid_s = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    bh64 = bh.to(tl.int64)
    sched = b * stride_sb + h * stride_sh + pid_s * stride_ss
    m = tl.load(SchedBlock + sched)
    tile = tl.load(SchedTile + sched)
    live = m < n_qblocks
    m_c = tl.where(live, m, 0).to(tl.int64)  # a dead slot reads block 0's entries, then ignores them
    qo_base = QOff + b * stride_qob + h * stride_qoh
    q_start = tl.load(qo_base + m_c * stride_qom).to(tl.int32)
    q_end = tl.where(live, tl.load(qo_base + (m_c + 1) * stride_qom).to(tl.int32), q_start)
    count = tl.where(live, tl.load(KVCnt + b * stride_cb + h * stride_ch + m_c * stride_cm).to(tl.int32), 0)

    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < head_dim
    rows = q_start + tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < q_end
    q8 = tl.load(Q8 + bh64 * N * head_dim + rows[:, None].to(tl.int64) * head_dim + offs_d[None, :],
                 mask=row_ok[:, None] & d_ok[None, :], other=0)
    q_scale = tl.load(QS + bh64 * n_qblocks + m_c)
    k_base = K8 + bh64 * Nk * head_dim
    v_base = V + b * stride_vb + h * stride_vh
    ko_base = KOff + b * stride_kob + h * stride_koh
    idx_base = KVIdx + b * stride_ib + h * stride_ih + m_c * stride_im

    m_i, l_i, acc = softmax_state(BLOCK_M, BLOCK_D)
    for slot in range(0, count):
        j = tl.load(idx_base + slot * stride_is).to(tl.int64)
        k_start = tl.load(ko_base + j * stride_kom).to(tl.int32)
        k_end = tl.load(ko_base + (j + 1) * stride_kom).to(tl.int32)
        k_scale = tl.load(KS + bh64 * n_kblocks + j)
        for c0 in range(k_start, k_end, BLOCK_N):
            cols = c0 + offs_n
            col_ok = cols < k_end
            if HAS_KV_VALID:
                col_ok = col_ok & (tl.load(KVValid + b * stride_vvb + cols.to(tl.int64) * stride_vvn, mask=col_ok,
                                           other=0) != 0)
            k_ptrs = k_base + cols[None, :].to(tl.int64) * head_dim + offs_d[:, None]
            v_ptrs = v_base + cols[:, None].to(tl.int64) * stride_vn + offs_d[None, :] * stride_vd
            acc, l_i, m_i = _quant_tile(acc, l_i, m_i, q8, q_scale, k_ptrs, v_ptrs, col_ok, d_ok, k_scale, qk_scale,
                                        FP8, UPCAST)
    out = normalise_rows(acc, l_i)
    if FP8:  # undo V's per-channel FP8 scale and P's 448
        out = out * (tl.load(VS + bh64 * head_dim + offs_d, mask=d_ok, other=1.0) / 448.0)[None, :]
    lse = row_lse(m_i, l_i)
    o_ptrs = Out + b * stride_ob + h * stride_oh + rows[:, None].to(tl.int64) * stride_on + offs_d[None, :] * stride_od
    store_out(o_ptrs, out, row_ok, d_ok, False, False)
    store_lse(Lse + bh64 * N + rows, lse, row_ok, False)


def quant_attention_varlen_triton(q, k, v, q_offsets, k_offsets, kv_indices, kv_counts, scale, kv_valid, quant):
    """``(out, lse)`` of quantised variable-size block-sparse attention on the Triton backend
    (inputs validated by ``block_sparse_attention_varlen``; any strides)."""
    batch, heads, n_q, dim = q.shape
    n_k = k.shape[2]
    n_qblocks, n_kblocks = q_offsets.shape[-1] - 1, k_offsets.shape[-1] - 1
    out = torch.empty((batch, heads, n_q, dim), dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, heads, n_q), dtype=torch.float32, device=q.device)
    if out.numel() == 0 or n_k == 0 or kv_indices.shape[-1] == 0:
        return out.zero_(), lse.fill_(float("-inf"))
    q8, q_scales, shift, k8, k_scales, v_used, v_scale = prepare_quant(q, k, v, scale, quant, None, None,
                                                                       q_offsets, k_offsets)
    interpreted = _interpreted(q.device)
    block_m = varlen_tiles(interpreted)[0]
    n_slots = n_qblocks + -(-n_q // block_m)
    sched_block, sched_tile = row_tile_schedule(q_offsets, block_m, n_slots)
    args, flags = quant_varlen_kernel_args(q8, k8, v_used, q_scales, k_scales, v_scale, out, lse, q_offsets,
                                           k_offsets, kv_indices, kv_counts, kv_valid, sched_block, sched_tile, scale,
                                           quant, interpreted)
    with torch.cuda.device(q.device) if q.device.type == "cuda" else contextlib.nullcontext():
        _quant_varlen_kernel[(n_slots, batch * heads)](*args, **flags)
    return out, lse + shift


def varlen_tiles(interpreted):
    """``(BLOCK_M, BLOCK_N)`` of the quantised variable-size kernel."""
    return (16, 32) if interpreted else (64, 64)


def quant_varlen_kernel_args(q8, k8, v_used, q_scales, k_scales, v_scale, out, lse, q_offsets, k_offsets, kv_indices,
                             kv_counts, kv_valid, sched_block, sched_tile, scale, quant, interpreted):
    """``(args, flags)`` of ``_quant_varlen_kernel`` (shared by the launcher and the offline check)."""
    batch, heads, n_q, dim = q8.shape
    block_m, block_n = varlen_tiles(interpreted)
    kvv, svb, svn = kv_valid_args(kv_valid, batch, kv_counts)
    args = (q8, k8, v_used, q_scales, k_scales, v_scale, out, lse, q_offsets, k_offsets, kv_indices, kv_counts, kvv,
            sched_block, sched_tile,
            *v_used.stride(), *out.stride(), *plan_strides(q_offsets, batch, heads),
            *plan_strides(k_offsets, batch, heads), *plan_strides(kv_indices, batch, heads),
            *plan_strides(kv_counts, batch, heads), svb, svn, *plan_strides(sched_block, batch, heads),
            heads, n_q, k8.shape[2], dim, q_offsets.shape[-1] - 1, k_offsets.shape[-1] - 1, float(scale) * LOG2E)
    flags = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=max(32, next_pow2(dim)),
                 HAS_KV_VALID=kv_valid is not None, FP8=quant == "int8-fp8",
                 UPCAST=interpreted and out.dtype == torch.bfloat16, num_warps=4 if interpreted else 8,
                 num_stages=1 if interpreted else 2)  # 4 warps spill at 64 x 64 (offline check, sm_89)
    return args, flags
