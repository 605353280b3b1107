"""Triton kernel of variable-size block-sparse attention (FlashAttention-2 forward over offsets).

Work split. Query block ``m`` of (batch, head) ``(b, h)`` holds ``size_m = q_offsets[m + 1] -
q_offsets[m]`` rows, cut into ``ceil(size_m / BLOCK_M)`` row tiles. The launcher builds a *schedule*
on the device, with torch ops and no host sync: per (batch, head) the tiles of all blocks are
numbered in order (``first_tile = cumsum(tiles) - tiles``) and slot ``s`` belongs to the block
``m = searchsorted(cumsum(tiles), s, right=True)``, as tile ``s - first_tile[m]``. The number of
slots is bounded without reading the sizes:

    sum_m ceil(size_m / BLOCK_M) <= sum_m (size_m + BLOCK_M - 1) / BLOCK_M < N / BLOCK_M + Mq,

so the grid is ``(Mq + ceil(N / BLOCK_M), B * H)``; a slot past a pair's total gets ``m = Mq``
and its program does nothing (no row, no key block). Empty blocks get no tile.

Inside a program: the row tile's rows are masked at the block end; the key blocks
``kv_indices[b, h, m, :kv_counts[b, h, m]]`` are walked in plan order, each block's keys
``[k_offsets[j], k_offsets[j + 1])`` in chunks of ``BLOCK_N`` masked at the block end (and by
``kv_valid``). Online softmax and epilogue: the shared helpers of ``triton_attention_inner.py``
(float32 scores, running max and sum, ``exp2`` with ``log2(e)`` folded into the scale, a fully
masked chunk subtracts 0 so no NaN appears); a row with no valid key ends with output 0 and
``lse = -inf``. Head dims that are
not powers of two are padded to ``BLOCK_D`` and masked (``EVEN_D``). ``UPCAST`` (interpreter
only) computes bfloat16 dots in float32, as in the fixed kernel.

Tiles are fixed per call (no autotuning: the schedule depends on ``BLOCK_M``), chosen from the
mean block sizes (``launch_config``); ``FASTDIT_TRITON_CONFIG="BLOCK_M,BLOCK_N,warps,stages"``
pins one.
Only long-standing ``tl`` features (loops with run-time bounds, masked loads, ``tl.dot``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .block_sparse_triton import LOG2E, _forced_config, _interpreter_enabled
from .triton_attention_inner import (
    attention_epilogue,
    load_rows,
    online_softmax_step,
    softmax_state,
    store_lse,
    store_out,
)
from .triton_tuning import next_pow2, dtype_name, table_verdict


@triton.jit
def _varlen_fwd_kernel(
    Q, K, V, Out, Lse, QOff, KOff, KVIdx, KVCnt, KVValid, SchedBlock, SchedTile,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_on, stride_od,
    stride_lb, stride_lh, stride_ln,
    stride_qob, stride_qoh, stride_kob, stride_koh,
    stride_ib, stride_ih, stride_im, stride_is,
    stride_cb, stride_ch, stride_cm,
    stride_vvb, stride_vvn,
    stride_sb, stride_sh,
    H, head_dim, n_qblocks, qk_scale,
    BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, HAS_KV_VALID: tl.constexpr,
    IS_FP32: tl.constexpr, BIG_OFFSETS: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_s = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b64 = (pid_bh // H).to(tl.int64)
    h64 = (pid_bh % H).to(tl.int64)

    # this slot's query block and row tile (m == n_qblocks: past the pair's last tile, no work)
    sched = b64 * stride_sb + h64 * stride_sh + pid_s
    m = tl.load(SchedBlock + sched)
    tile = tl.load(SchedTile + sched)
    live = m < n_qblocks
    m_c = tl.where(live, m, 0).to(tl.int64)  # a dead slot reads block 0's entries, then ignores them
    qo_base = QOff + b64 * stride_qob + h64 * stride_qoh
    q_start = tl.load(qo_base + m_c)
    q_end = tl.where(live, tl.load(qo_base + m_c + 1), q_start)
    count = tl.load(KVCnt + b64 * stride_cb + h64 * stride_ch + m_c * stride_cm).to(tl.int32)
    count = tl.where(live, count, 0)

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < head_dim
    rows = q_start + tile * BLOCK_M + offs_m
    row_ok = rows < q_end
    if BIG_OFFSETS:
        rows_off = rows.to(tl.int64)
    else:
        rows_off = rows

    q_ptrs = Q + b64 * stride_qb + h64 * stride_qh + rows_off[:, None] * stride_qn + offs_d[None, :] * stride_qd
    q = load_rows(q_ptrs, row_ok, d_ok, False, EVEN_D)
    if UPCAST:
        q = q.to(tl.float32)

    k_base = K + b64 * stride_kb + h64 * stride_kh
    v_base = V + b64 * stride_vb + h64 * stride_vh
    vv_base = KVValid + b64 * stride_vvb
    ko_base = KOff + b64 * stride_kob + h64 * stride_koh
    idx_base = KVIdx + b64 * stride_ib + h64 * stride_ih + m_c * stride_im

    m_i, l_i, acc = softmax_state(BLOCK_M, BLOCK_D)
    for slot in range(0, count):
        j = tl.load(idx_base + slot * stride_is).to(tl.int64)
        k_start = tl.load(ko_base + j)
        k_end = tl.load(ko_base + j + 1)
        for c0 in range(k_start, k_end, BLOCK_N):
            cols = c0 + offs_n
            col_ok = cols < k_end
            if BIG_OFFSETS:
                cols_off = cols.to(tl.int64)
            else:
                cols_off = cols
            if HAS_KV_VALID:
                col_ok = col_ok & (tl.load(vv_base + cols_off * stride_vvn, mask=col_ok, other=0) != 0)
            k_ptrs = k_base + cols_off[None, :] * stride_kn + offs_d[:, None] * stride_kd
            v_ptrs = v_base + cols_off[:, None] * stride_vn + offs_d[None, :] * stride_vd
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
            s = tl.where(col_ok[None, :], s * qk_scale, float("-inf"))  # log2 domain
            acc, l_i, m_i = online_softmax_step(acc, l_i, m_i, s, v, True, IS_FP32, UPCAST, False, False)

    out, lse = attention_epilogue(acc, l_i, m_i)
    o_ptrs = Out + b64 * stride_ob + h64 * stride_oh + rows_off[:, None] * stride_on + offs_d[None, :] * stride_od
    store_out(o_ptrs, out, row_ok, d_ok, False, EVEN_D)
    store_lse(Lse + b64 * stride_lb + h64 * stride_lh + rows_off * stride_ln, lse, row_ok, False)


def _leading_strides(t, batch, heads):
    """Strides of the two leading dims of a ``(B|1, H|1, ...)`` tensor, 0 where it broadcasts."""
    return (t.stride(0) if t.shape[0] == batch and batch > 1 else 0,
            t.stride(1) if t.shape[1] == heads and heads > 1 else 0)


def row_tile_schedule(q_offsets, block_m, n_slots):
    """``(block, tile)`` int32 ``(B|1, H|1, n_slots)``: the query block and row tile of each slot
    (block ``Mq`` past the pair's last tile). Device-side torch ops, no host sync."""
    q_off = q_offsets.long()
    n_qblocks = q_off.shape[-1] - 1
    tiles = (q_off[..., 1:] - q_off[..., :-1] + block_m - 1) // block_m
    ends = torch.cumsum(tiles, dim=-1)
    slots = torch.arange(n_slots, device=q_off.device).expand(*q_off.shape[:2], n_slots).contiguous()
    block = torch.searchsorted(ends.contiguous(), slots, right=True)
    first = (ends - tiles).gather(-1, block.clamp(max=n_qblocks - 1))
    return block.to(torch.int32).contiguous(), (slots - first).to(torch.int32).contiguous()


def launch_config(n_q, n_qblocks, n_k, n_kblocks, block_d, capability=None, dtype=None):
    """``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` for a GPU launch, from the mean block sizes
    (shapes only, no sync). A row tile or key chunk is cut at its block's end, so tiles much larger
    than the blocks compute mostly masked entries: 128-row tiles (8 warps) only for mean query
    blocks of 128 rows or more, key chunks of 64 / 32 / 16 for mean key blocks of >= 96 / >= 40 /
    fewer keys (at most 32 for head dims over 128). Not tuned on a GPU yet.

    With ``capability`` (int, e.g. 80) and ``dtype`` (``bf16`` / ``fp16`` / ``fp32``), a choice that
    the offline compile table records as spilling or over the shared memory on that architecture is
    replaced by the nearest clean one: the other key chunks of the same row tile (closest first),
    then those of the other row tile (``_fallback_order``)."""
    forced = _forced_config()
    if forced is not None:
        return forced.kwargs["BLOCK_M"], forced.kwargs["BLOCK_N"], forced.num_warps, forced.num_stages
    mean_k = n_k / max(n_kblocks, 1)
    block_n = 64 if mean_k >= 96 else 32 if mean_k >= 40 else 16
    if block_d > 128:
        block_n = min(block_n, 32)
    if n_q >= 128 * max(n_qblocks, 1) and block_d <= 128:
        choice = (128, block_n, 8, 2)
    else:
        choice = (64, block_n, 4, 2)
    if capability is None or dtype is None:
        return choice
    for cfg in _fallback_order(choice):
        verdict = table_verdict("varlen", capability, dtype, block_d, cfg)
        if verdict is None and cfg == choice:
            return choice  # not tabled for this architecture: no per-arch pruning
        if verdict:
            return cfg
    return choice


def _fallback_order(choice):
    """The configs tried, in order, when ``choice`` is not clean on the device."""
    bm, bn, _, _ = choice
    chunks = sorted((64, 32, 16), key=lambda c: (abs(c - bn), c))  # nearest key chunk first, smaller on ties
    rows = [bm] + [r for r in (128, 64) if r != bm]
    return [(r, c, 8 if r == 128 else 4, 2) for r in rows for c in chunks]


def varlen_kernel_args(q, k, v, out, lse, q_off, k_off, kv_indices, kv_counts, kv_valid, sched_block, sched_tile,
                       scale, interpreted):
    """``(args, flags)`` of ``_varlen_fwd_kernel`` for one call: the positional arguments and the
    compile-time flags but the tile sizes. Shared by the launcher and the offline compile check
    (``offline.py``), so both compile the same specialisation."""
    batch, heads, n_q, dim = q.shape
    n_k = k.shape[2]
    n_qblocks = q_off.shape[-1] - 1
    block_d = max(16, next_pow2(dim))
    has_kv_valid = kv_valid is not None
    if has_kv_valid:
        kvv = kv_valid.view(torch.uint8)
        svb, svn = (kvv.stride(0) if kvv.shape[0] == batch and batch > 1 else 0), kvv.stride(1)
    else:
        kvv, svb, svn = kv_counts, 0, 0  # never read
    max_off = max(n_q * abs(q.stride(2)), n_k * abs(k.stride(2)), n_k * abs(v.stride(2)), n_q * dim, n_k * max(svn, 1))
    args = (
        q, k, v, out, lse, q_off, k_off, kv_indices, kv_counts, kvv, sched_block, sched_tile,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(), *lse.stride(),
        *_leading_strides(q_off, batch, heads), *_leading_strides(k_off, batch, heads),
        *_leading_strides(kv_indices, batch, heads), kv_indices.stride(2), kv_indices.stride(3),
        *_leading_strides(kv_counts, batch, heads), kv_counts.stride(2),
        svb, svn,
        *_leading_strides(sched_block, batch, heads),
        heads, dim, n_qblocks, float(scale) * LOG2E,
    )
    flags = dict(BLOCK_D=block_d, EVEN_D=dim == block_d, HAS_KV_VALID=has_kv_valid,
                 IS_FP32=q.dtype == torch.float32, BIG_OFFSETS=max_off >= 2**31 - 1,
                 UPCAST=interpreted and q.dtype == torch.bfloat16)
    return args, flags


def block_sparse_attention_varlen_triton(q, k, v, q_offsets, k_offsets, kv_indices, kv_counts, scale, kv_valid):
    """Launch the kernel on validated inputs (any strides). Returns ``(out, lse)``: ``out``
    contiguous ``(B, H, N, D)`` in q's dtype, ``lse`` float32 ``(B, H, N)``."""
    batch, heads, n_q, dim = q.shape
    n_k = k.shape[2]
    n_qblocks = q_offsets.shape[-1] - 1
    out = torch.empty((batch, heads, n_q, dim), dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, heads, n_q), dtype=torch.float32, device=q.device)
    if out.numel() == 0 or n_k == 0 or kv_indices.shape[-1] == 0:  # no key can be attended
        out.zero_()
        lse.fill_(float("-inf"))
        return out, lse

    block_d = max(16, next_pow2(dim))
    interpreted = _interpreter_enabled() or q.device.type != "cuda"
    if interpreted:
        block_m, block_n, warps, stages = 16, 16, 4, 1
    else:
        major, minor = torch.cuda.get_device_capability(q.device)
        block_m, block_n, warps, stages = launch_config(n_q, n_qblocks, n_k, k_offsets.shape[-1] - 1, block_d,
                                                        10 * major + minor, dtype_name(q.dtype))
    n_slots = n_qblocks + -(-n_q // block_m)
    sched_block, sched_tile = row_tile_schedule(q_offsets, block_m, n_slots)
    q_off = q_offsets.to(torch.int32).contiguous()
    k_off = k_offsets.to(torch.int32).contiguous()

    args, flags = varlen_kernel_args(q, k, v, out, lse, q_off, k_off, kv_indices, kv_counts, kv_valid,
                                     sched_block, sched_tile, scale, interpreted)
    grid = (n_slots, batch * heads)
    flags.update(BLOCK_M=block_m, BLOCK_N=block_n)
    if interpreted:
        _varlen_fwd_kernel[grid](*args, **flags, num_warps=warps, num_stages=stages)
    else:
        with torch.cuda.device(q.device):
            _varlen_fwd_kernel[grid](*args, **flags, num_warps=warps, num_stages=stages)
    return out, lse
