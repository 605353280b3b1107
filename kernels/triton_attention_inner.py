"""Shared ``@triton.jit`` pieces of the forward attention kernels: the key-tile step and the epilogue.

Every forward kernel of ``kernels/`` (fixed-size blocks ``block_sparse_triton.py``, its TMA variant
``block_sparse_tma.py``, variable-size blocks ``block_sparse_varlen_triton.py`` and the quantised
ones in ``quant/``) walks a list of key tiles for one tile of query rows and keeps the
FlashAttention-2 running state (Dao 2023, arXiv:2307.08691) in float32 registers. The pattern is the
one of Triton's fused-attention tutorial (``06-fused-attention.py``: a kernel that calls one jitted
``_attn_fwd_inner`` per key range): the kernels own the walk (which tiles, how they are addressed
and loaded, the Q.K^T dot, what is masked or skipped) and call the helpers below for the update and
the epilogue, which Triton inlines, so the compiled code is the one of the hand-inlined loop (same
operations in the same order; the Triton IR of every tabled launch is unchanged bar the order of
its constants).

Why the K / V loads and the scores stay in the kernels: every inlined call inside the key loop adds
debug-scope labels (``$L__tmp``) to the PTX, and ``ptxas`` (line info is on by default) schedules
around them. With the loads, the dot and the update as four helpers the instructions were the same
but the fixed kernel took up to 3 more registers (sm_86 / sm_89, d=64) and one already spilling
config spilled 8 B more; one flat helper call per tile (the update) keeps the loop's machine code
as it was. The loads also differ per kernel (pointers, TMA descriptors, INT8 K with its scales).

Scores are in the log2 domain: ``s = (q . k) * scale * log2(e)`` (``log2(e)`` folded into the
launcher's ``qk_scale``), so the exponentials are ``exp2``. For one key tile with scores ``s``
(``BLOCK_M x BLOCK_N``, masked keys ``-inf``) and values ``v`` (``BLOCK_N x BLOCK_D``):

    m_new = max(m, rowmax(s))                   running maximum (log2 units)
    p     = 2^(s - m_new)                       this tile's unnormalised probabilities
    alpha = 2^(m - m_new)                       rescales what was accumulated before
    l     = alpha * l + rowsum(p)               running sum
    acc   = alpha * acc + p @ V                 running numerator

A row whose keys so far are all masked has ``m_new = -inf``; ``2^(-inf - -inf)`` would be NaN, so
with ``MASKED`` the step subtracts 0 instead (``p = 0``, ``alpha = 2^(-inf) = 0``: the state stays
``l = 0, acc = 0``). Without ``MASKED`` (no key of any tile can be masked) that guard is not
compiled. After the walk (the epilogue): ``out = acc / l`` and the natural-log log-sum-exp
``lse = (m + log2 l) * ln 2``; a row with no valid key (``l = 0``) gets ``out = 0`` and
``lse = -inf``.

Flags: ``IS_FP32`` (float32 inputs: ``ieee`` dots) and ``UPCAST`` (interpreter only: bfloat16 dots
computed in float32, since the Triton 3.x interpreter multiplies bfloat16 storage as integers in
``tl.dot``). Only ``tl`` features present in Triton 3.0 and later are used.
"""
from __future__ import annotations

import triton
import triton.language as tl


# --------------------------------------------------------------------------------------------------
# Query tile and running state
# --------------------------------------------------------------------------------------------------

@triton.jit
def load_rows(ptrs, row_ok, d_ok, EVEN_M: tl.constexpr, EVEN_D: tl.constexpr):
    """A ``BLOCK_M x BLOCK_D`` tile (the queries): masked on rows unless ``EVEN_M``, on the head dim
    unless ``EVEN_D``; masked entries are 0."""
    if EVEN_M:
        if EVEN_D:
            x = tl.load(ptrs)
        else:
            x = tl.load(ptrs, mask=d_ok[None, :], other=0.0)
    else:
        if EVEN_D:
            x = tl.load(ptrs, mask=row_ok[:, None], other=0.0)
        else:
            x = tl.load(ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    return x


@triton.jit
def softmax_state(BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """The empty running state ``(m, l, acc)``: ``m = -inf``, ``l = 0``, ``acc = 0`` (float32)."""
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    return m_i, l_i, acc


# --------------------------------------------------------------------------------------------------
# One key tile: the online-softmax update
# --------------------------------------------------------------------------------------------------

@triton.jit
def online_softmax_step(acc, l_i, m_i, s, v, MASKED: tl.constexpr, IS_FP32: tl.constexpr, UPCAST: tl.constexpr,
                        FP8: tl.constexpr, ROUND_P: tl.constexpr):
    """Fold one key tile (log2-domain scores ``s``, values ``v``) into the running ``(acc, l, m)``
    and return the updated ``(acc, l, m)``:

        m_new = max(m, rowmax s);  p = 2^(s - m_new);  alpha = 2^(m - m_new)
        l = alpha * l + rowsum p;  acc = alpha * acc + p @ v

    ``MASKED``: subtract 0 where ``m_new`` is still ``-inf`` (all keys so far masked), so that no
    NaN appears. P.V: P in V's type for half inputs (float32 accumulation); float32 ``ieee`` dots
    for float32 inputs and under ``UPCAST`` (``v`` already float32 there); ``FP8`` (quantised
    ``int8-fp8``): P scaled by 448 into float8 e4m3 against V in e4m3; ``ROUND_P`` with ``UPCAST``
    (quantised kernels under the interpreter): P rounded to V's type first, then a float32 dot.

    Written flat on purpose (no nested helper calls): each inlined call adds debug-scope labels to
    the PTX inside the key loop, and ``ptxas`` schedules around them (measured: up to 3 more
    registers on sm_86 / sm_89 with the update split in two helpers)."""
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
    if FP8:
        acc += tl.dot((p * 448.0).to(tl.float8e4nv), v)
    elif ROUND_P and UPCAST:
        acc += tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
    elif IS_FP32 or UPCAST:
        acc += tl.dot(p, v, input_precision="ieee")
    else:
        acc += tl.dot(p.to(v.dtype), v)
    return acc, l_i, m_new


# --------------------------------------------------------------------------------------------------
# Epilogue
# --------------------------------------------------------------------------------------------------

@triton.jit
def normalise_rows(acc, l_i):
    """``out = acc / l``; a row without a valid key (``l = 0``, ``acc = 0``) gives 0."""
    return acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]


@triton.jit
def row_lse(m_i, l_i):
    """Natural-log log-sum-exp of a row from its log2-domain state: ``(m + log2 l) * ln 2``;
    ``-inf`` for a row without a valid key (``l = 0``)."""
    empty = l_i == 0.0
    return tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)


@triton.jit
def attention_epilogue(acc, l_i, m_i):
    """``(out, lse)`` of a row tile: ``normalise_rows`` and ``row_lse``."""
    out = normalise_rows(acc, l_i)
    lse = row_lse(m_i, l_i)
    return out, lse


@triton.jit
def store_out(o_ptrs, out, row_ok, d_ok, EVEN_M: tl.constexpr, EVEN_D: tl.constexpr):
    """Write ``out`` cast to the output's type: masked on rows unless ``EVEN_M``, on the head dim
    unless ``EVEN_D``."""
    out = out.to(o_ptrs.dtype.element_ty)
    if EVEN_M:
        if EVEN_D:
            tl.store(o_ptrs, out)
        else:
            tl.store(o_ptrs, out, mask=d_ok[None, :])
    else:
        if EVEN_D:
            tl.store(o_ptrs, out, mask=row_ok[:, None])
        else:
            tl.store(o_ptrs, out, mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def store_lse(l_ptrs, lse, row_ok, EVEN_M: tl.constexpr):
    """Write the rows' log-sum-exp (masked on rows unless ``EVEN_M``)."""
    if EVEN_M:
        tl.store(l_ptrs, lse)
    else:
        tl.store(l_ptrs, lse, mask=row_ok)
