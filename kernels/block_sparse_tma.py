"""Hopper / Blackwell variant of the fixed-size block-sparse forward: K / V tiles through the tensor
memory accelerator (TMA), warp-specialised where the installed Triton supports it.

The math is the one of ``block_sparse_triton.py``, from the same shared helpers
(``triton_attention_inner.py``: FlashAttention-2 online softmax, Dao 2023,
arXiv:2307.08691): for a query row tile and the kept key sub-tiles ``t`` of its plan row,
``s_t = (q k_t^T) * scale * log2(e)``, ``m <- max(m, rowmax s_t)``, ``l <- l * 2^(m_old - m) +
rowsum 2^(s_t - m)``, ``acc <- acc * 2^(m_old - m) + 2^(s_t - m) v_t``; at the end ``out = acc / l``
and ``lse = (m + log2 l) * ln 2`` (natural log), a row without a valid key gives ``out = 0`` and
``lse = -inf``. Same arguments as ``_block_sparse_fwd_kernel`` (built by its ``kernel_args``), the
same plans (any plan block size: plan blocks are split into power-of-two sub-tiles, never merged),
the same ``kv_valid`` masking and the same skip rule (``SKIP``; off by default).

What differs is how tiles reach shared memory (the FlashAttention-3 recipe, Shah et al. 2024,
arXiv:2407.08608; Triton's Hopper / Blackwell attention tutorial): per (batch, head) program the
kernel builds device-side tensor descriptors ``tl.make_tensor_descriptor`` over the head's ``Q``,
``K`` and ``V`` (2-D: ``[tokens, head_dim]``, unit last stride) and loads each tile with
``desc.load([row, 0])``; the row offset of a K / V tile is ``kv_indices[slot] * block_n +
t * BLOCK_N`` (the plan's block index drives the descriptor offset). On sm_90 / sm_100 these become
bulk tensor copies (``cp.async.bulk.tensor``, UTMALDG in the machine code) instead of per-thread
``cp.async`` (LDGSTS). Out-of-bounds rows / columns (keys ``>= Nk``, a head dim below ``BLOCK_D``)
come back as zeros from the TMA unit; keys of a sub-tile that lie past the plan block are real keys
of the next block, masked to ``-inf`` in the scores exactly as in the classic kernel. With
``WARP_SPEC`` the key loop is ``tl.range(..., warp_specialize=True)``: Triton splits producer
(TMA) and consumer (MMA / softmax) warps where its backend supports it (Blackwell; on other targets
the flag is left off). Output and lse stores stay masked pointer stores (a row tile may cover rows
of the next plan block, which belong to another program).

Requirements (checked by the launcher, ``tma_layout_error``): unit stride on the head dim, 16-byte
aligned base pointers and token strides (TMA descriptor rules), a Triton with
``tl.make_tensor_descriptor`` (3.4 and later; 3.6 and 3.9 both compile it) and a GPU of compute
capability 9.0 or later. Device-side descriptors need a global scratch buffer a launch: the
launcher installs a torch allocator (``triton.set_allocator``) when none is set.

Which variant runs (``forward_variant``): ``FASTDIT_TRITON_VARIANT`` = ``auto`` (default), ``tma``
or ``cp_async``. ``auto`` runs this variant on a GPU whose architecture the offline table records
it as compiled clean for (sm_90, sm_100, sm_120: ``offline_table.json``, kernel ``fixed_tma``), for the
call's dtype and head dim, never below sm_90, never for the skip rule (whose launches keep the
classic kernel) and never when the layout does not meet the TMA rules. ``tma`` forces it: on a GPU
below sm_90 or a layout it cannot take, a ``ValueError`` naming the GPU / the layout and the
variant before any launch. Under the Triton interpreter ``auto`` is the classic kernel and ``tma``
runs this kernel (the interpreter emulates tensor descriptors, zero fill included).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from . import triton_tuning as tuning
from . import block_sparse_triton as bst
from .block_sparse_triton import _HEURISTICS
from .triton_attention_inner import attention_epilogue, online_softmax_step, softmax_state, store_lse, store_out

VARIANTS = ("auto", "tma", "cp_async")
VARIANT_ENV = "FASTDIT_TRITON_VARIANT"
HAS_TENSOR_DESCRIPTORS = hasattr(tl, "make_tensor_descriptor")
#: the lowest compute capability with a TMA unit (Hopper)
MIN_CAPABILITY = 90


@triton.jit
def _tma_fwd_kernel(
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
    WARP_SPEC: tl.constexpr,
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
    row0 = m * block_m + sub * BLOCK_M
    rows = row0 + offs_m
    row_ok = (row_in_block < block_m) & (rows < N)
    if BIG_OFFSETS:
        rows_off = rows.to(tl.int64)
    else:
        rows_off = rows

    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    # one 2-D descriptor per tensor over this (batch, head): [tokens, head_dim], unit last stride;
    # rows past the end and columns past head_dim load as zeros
    q_desc = tl.make_tensor_descriptor(Q + b64 * stride_qb + h64 * stride_qh, shape=[N, head_dim],
                                       strides=[stride_qn, 1], block_shape=[BLOCK_M, BLOCK_D])
    k_desc = tl.make_tensor_descriptor(K + b64 * stride_kb + h64 * stride_kh, shape=[Nk, head_dim],
                                       strides=[stride_kn, 1], block_shape=[BLOCK_N, BLOCK_D])
    v_desc = tl.make_tensor_descriptor(V + b64 * stride_vb + h64 * stride_vh, shape=[Nk, head_dim],
                                       strides=[stride_vn, 1], block_shape=[BLOCK_N, BLOCK_D])
    vv_base = KVValid + b64 * stride_vvb
    idx_base = KVIdx + b64 * stride_ib + h64 * stride_ih + m.to(tl.int64) * stride_im
    count = tl.load(KVCnt + b64 * stride_cb + h64 * stride_ch + m.to(tl.int64) * stride_cm).to(tl.int32)

    q = q_desc.load([row0, 0])
    if UPCAST:
        q = q.to(tl.float32)

    m_i, l_i, acc = softmax_state(BLOCK_M, BLOCK_D)
    n_skipped = count * 0
    if SKIP:
        n_live = tl.max(row_ok.to(tl.int32), 0)
    for it in tl.range(0, count * SUB_N, warp_specialize=WARP_SPEC):
        if SUB_N == 1:
            slot = it
            t = 0
        else:
            slot = it // SUB_N
            t = it % SUB_N
        j = tl.load(idx_base + slot * stride_is).to(tl.int32)
        key0 = j * block_n + t * BLOCK_N
        k = k_desc.load([key0, 0])
        v = v_desc.load([key0, 0])
        if MASKED:
            in_block = t * BLOCK_N + offs_n
            cols = key0 + offs_n
            if BIG_OFFSETS:
                cols_off = cols.to(tl.int64)
            else:
                cols_off = cols
            if EVEN_N:
                col_ok = tl.load(vv_base + cols_off * stride_vvn) != 0
            else:
                col_ok = (in_block < block_n) & (cols < Nk)
                if HAS_KV_VALID:
                    col_ok = col_ok & (tl.load(vv_base + cols_off * stride_vvn, mask=col_ok, other=0) != 0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        if IS_FP32 or UPCAST:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
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
    if SKIP:
        tl.atomic_add(Skipped + pid_bh, n_skipped)

    out, lse = attention_epilogue(acc, l_i, m_i)
    o_ptrs = Out + b64 * stride_ob + h64 * stride_oh + rows_off[:, None] * stride_on + offs_d[None, :] * stride_od
    l_ptrs = Lse + b64 * stride_lb + h64 * stride_lh + rows_off * stride_ln
    store_out(o_ptrs, out, row_ok, d_ok, EVEN_M, EVEN_D)
    store_lse(l_ptrs, lse, row_ok, EVEN_M)


_tma_fixed = triton.heuristics(_HEURISTICS)(_tma_fwd_kernel)


# --------------------------------------------------------------------------------------------------
# Which variant runs
# --------------------------------------------------------------------------------------------------

def requested_variant():
    """``FASTDIT_TRITON_VARIANT`` (``auto`` when unset); a ValueError naming the variable otherwise."""
    value = os.environ.get(VARIANT_ENV, "auto").strip().lower() or "auto"
    if value not in VARIANTS:
        raise ValueError(f"{VARIANT_ENV}={value!r} is not a forward variant; supported: {', '.join(VARIANTS)} "
                         "(auto: the offline table's choice for the GPU; tma: the Hopper / Blackwell TMA kernel; "
                         "cp_async: the classic kernel)")
    return value


def warp_spec_for(capability):
    """Warp specialisation is asked for on Blackwell (sm_100) only: the targets where the installed
    Triton lowers ``tl.range(..., warp_specialize=True)`` to producer / consumer warp groups (see
    docs/gpu_readiness.md for the compile evidence)."""
    return capability is not None and capability // 10 == 10


def tma_layout_error(q, k, v):
    """None when q / k / v meet the TMA descriptor rules, else the reason: unit stride on the head
    dim, 16-byte aligned (batch, head) base pointers and token strides."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        elt = t.element_size()
        if t.stride(3) != 1 and t.shape[3] > 1:
            return f"{name} has stride {t.stride(3)} on the head dim (the TMA variant needs 1)"
        if t.data_ptr() % 16:
            return f"{name}'s data pointer is not 16-byte aligned"
        for dim, label in ((0, "batch"), (1, "head"), (2, "token")):
            if t.shape[dim] > 1 and (t.stride(dim) * elt) % 16:
                return f"{name}'s {label} stride ({t.stride(dim)} elements) is not a multiple of 16 bytes"
    return None


def forward_variant(requested, capability, gpu_name, dtype, head_dim, layout_error=None, skip=False):
    """``"tma"`` or ``"cp_async"`` for a call on a GPU of ``capability`` (int, 90 for sm_90; None: no
    GPU, the interpreter) named ``gpu_name``, with ``dtype`` (``bf16`` / ``fp16`` / ``fp32``) and
    padded head dim ``head_dim``. ``requested``: ``auto`` / ``tma`` / ``cp_async``. A forced ``tma``
    that cannot run raises a ValueError naming the GPU (or the layout) and the variant."""
    if requested == "cp_async":
        return "cp_async"
    if requested == "tma":
        where = f"{gpu_name} (sm_{capability})" if capability is not None else "this device"
        if not HAS_TENSOR_DESCRIPTORS:
            raise ValueError(f"{VARIANT_ENV}=tma: Triton {triton.__version__} has no tl.make_tensor_descriptor; "
                             "the TMA variant needs Triton 3.4 or later (use auto or cp_async)")
        if capability is not None and capability < MIN_CAPABILITY:
            raise ValueError(f"{VARIANT_ENV}=tma: the TMA forward variant needs a GPU of compute capability 9.0 "
                             f"or later (Hopper, Blackwell); {where} has none (use auto or cp_async)")
        if layout_error is not None:
            raise ValueError(f"{VARIANT_ENV}=tma: the TMA forward variant cannot take these inputs on {where}: "
                             f"{layout_error} (use auto or cp_async)")
        return "tma"
    if capability is None or capability < MIN_CAPABILITY or not HAS_TENSOR_DESCRIPTORS or skip \
            or layout_error is not None:
        return "cp_async"
    return "tma" if tma_config(capability, head_dim, dtype) is not None else "cp_async"


def tma_config(capability, head_dim, dtype):
    """The first of ``TMA_PREFERENCE`` the offline table records as clean for ``kernel=fixed_tma``
    on ``capability``, or None (not tabled there or nothing clean: the classic kernel runs)."""
    for cfg in tuning.TMA_PREFERENCE:
        if tuning.table_verdict("fixed_tma", capability, dtype, head_dim, cfg):
            return cfg
    return None


def _install_allocator():
    """Device-side descriptors need a global scratch buffer a launch: a torch allocation, installed
    only when no allocator is set (a caller's own allocator is kept)."""
    try:
        from triton.runtime import _allocation
        current = _allocation._allocator.get()
        if not isinstance(current, _allocation.NullAllocator):
            return
    except (ImportError, AttributeError):
        pass

    def alloc(size, alignment, stream):
        return torch.empty(size, dtype=torch.int8, device="cuda")

    triton.set_allocator(alloc)


def launch_tma(grid, args, config, capability):
    """Launch the TMA kernel with ``config`` = ``(BLOCK_M, BLOCK_N, num_warps, num_stages)``."""
    bm, bn, warps, stages = config
    if capability is not None:
        _install_allocator()
    _tma_fixed[grid](*args, BLOCK_M=bm, BLOCK_N=bn, WARP_SPEC=warp_spec_for(capability), num_warps=warps,
                     num_stages=stages)


def run_if_chosen(q, k, v, args, n_qblocks, block_m, block_n, block_d, skip, skip_tile, interpreted):
    """Called by ``block_sparse_attention_triton`` with the classic kernel's arguments ``args``:
    launch the TMA variant when ``forward_variant`` picks it (or raise for a forced variant that
    cannot run, before any launch) and return True; False: the classic kernel runs."""
    requested = requested_variant()
    if requested == "cp_async" or (interpreted and requested != "tma"):
        return False
    dtype = tuning.dtype_name(q.dtype)
    if interpreted:
        capability, gpu_name = None, "the Triton interpreter"
    else:
        major, minor = torch.cuda.get_device_capability(q.device)
        capability, gpu_name = 10 * major + minor, torch.cuda.get_device_name(q.device)
    variant = forward_variant(requested, capability, gpu_name, dtype, block_d, tma_layout_error(q, k, v), skip)
    if variant != "tma":
        return False
    elt = q.element_size()
    if skip:  # the rule's own tiles, as the classic launch
        bm, bn = bst.skip_tile_sizes(block_m, block_n, skip_tile)
        how = "interpreter" if interpreted else "skip rule"  # how the tile was chosen (last_launch)
        if interpreted:
            config = (bm, bn, 4, 1)
        else:
            config = (bm, bn, *bst._skip_launch_config(bm, bn, block_d, elt, q.device.index,
                                                       capability=capability, dtype=dtype))
    elif interpreted:
        config = (bst._interpreter_block(block_m), bst._interpreter_block(block_n), 4, 1)
        how = "interpreter"
    else:
        forced = bst._forced_config()
        how = "table" if forced is None else "forced"
        config = tuning.config_tuple(forced) if forced is not None else \
            (tma_config(capability, block_d, dtype) or tuning.TMA_PREFERENCE[0])
        bm, bn, w, s = config
        kept = tuning.prune_for_target([triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)],
                                       block_m, block_n, block_d, elt, tuning._shared_mem_bytes(q.device.index))
        config = tuning.config_tuple(kept[0])
    grid = (n_qblocks * -(-block_m // config[0]), q.shape[0] * q.shape[1])
    bst.record_launch("tma", how, config)
    if interpreted:
        launch_tma(grid, args, config, None)
    else:
        with torch.cuda.device(q.device):
            launch_tma(grid, args, config, capability)
    return True


# The classic launcher asks its registered variants first (it never imports this module: no circle).
bst.FORWARD_VARIANTS.append(run_if_chosen)
