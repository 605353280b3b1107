"""Block-sparse attention with variable-size blocks: block boundaries given by offsets.

Methods that regroup tokens (Sparse VideoGen 2's k-means clusters, arXiv 2505.18875) produce
blocks of any size. Here query block ``m`` of (batch, head) ``(b, h)`` is the rows
``[q_offsets[b, h, m], q_offsets[b, h, m + 1])`` and key block ``j`` the keys
``[k_offsets[b, h, j], k_offsets[b, h, j + 1])``; blocks may be empty or hold one token. Query
block ``m`` attends exactly the keys of the blocks ``kv_indices[b, h, m, :kv_counts[b, h, m]]``
whose ``kv_valid`` is True:

    out_i = sum_{t in A(i)} softmax_t(scale * q_i . k_t) v_t,   lse_i = log sum_{t in A(i)} exp(scale * q_i . k_t)

with ``A(i)`` that attended set; a row with ``A(i)`` empty gets ``out = 0`` and ``lse = -inf``.

Backends: ``"triton"`` (``block_sparse_varlen_triton.py``: a device-side schedule of row tiles,
no host sync), ``"torch"`` (``block_sparse_varlen_torch.py``: the query blocks of all (batch,
head) pairs computed together in order of size, one fused CPU attention call per step) and
``"auto"`` (Triton on CUDA, torch otherwise). Fixed-size plans keep their own API and kernels
(``block_sparse.py``); this is a separate entry point and a separate custom op
(``fastdit::block_sparse_attention_varlen``, ``op.py``) so that ``torch.compile`` holds one
opaque call.
"""
from __future__ import annotations

import math

import torch

from .block_sparse import _pick_backend, check_qkv, debug_enabled
from .op import block_sparse_attention_varlen_op, check_varlen_plan
from .quant import block_sparse_attention_varlen_quant_op, check_quant


def _check_plan_shapes(q, k, q_offsets, k_offsets, kv_indices, kv_counts):
    """Shapes, dtypes and devices of the plan tensors (their values: ``validate_varlen_plan``)."""
    batch, heads, n_q, _ = q.shape
    n_k = k.shape[2]
    for name, t, rank in (("q_offsets", q_offsets, 3), ("k_offsets", k_offsets, 3),
                          ("kv_indices", kv_indices, 4), ("kv_counts", kv_counts, 3)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 (or int64), got {t.dtype}")
        if t.dim() != rank:
            raise ValueError(f"{name} must have rank {rank}, got shape {tuple(t.shape)}")
        if t.shape[0] not in (1, batch) or t.shape[1] not in (1, heads):
            raise ValueError(f"{name} shape {tuple(t.shape)}: leading dims must be ({batch} or 1, {heads} or 1) "
                             f"to match q {tuple(q.shape)}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    for name, t, total in (("q_offsets", q_offsets, n_q), ("k_offsets", k_offsets, n_k)):
        if t.shape[-1] < 1:
            raise ValueError(f"{name} needs at least one entry (blocks + 1 boundaries from 0 to {total}), "
                             f"got shape {tuple(t.shape)}")
    n_qblocks = q_offsets.shape[-1] - 1
    if kv_indices.shape[2] != n_qblocks:
        raise ValueError(f"kv_indices shape {tuple(kv_indices.shape)} lists {kv_indices.shape[2]} query blocks "
                         f"but q_offsets has {n_qblocks} (q_offsets.shape[-1] - 1)")
    if tuple(kv_counts.shape) != tuple(kv_indices.shape[:3]):
        raise ValueError(f"kv_counts shape {tuple(kv_counts.shape)} must equal kv_indices.shape[:3] = "
                         f"{tuple(kv_indices.shape[:3])}")


def block_sparse_attention_varlen(q, k, v, q_offsets, k_offsets, kv_indices, kv_counts, scale=None,
                                  kv_valid=None, return_lse=True, backend="auto", *, validate=True, quant=None):
    """Attention in which each variable-size query block attends to a list of variable-size key blocks.

    Args:
        q: ``(B, H, N, D)``; k, v: ``(B, H, Nk, D)``; the dtype / device / head-dim rules of
            ``block_sparse_attention`` (float16, bfloat16, float32; D up to 256; any strides).
        q_offsets: int32 / int64 ``(B|1, H|1, Mq + 1)``: query block boundaries, non-decreasing,
            from 0 to N. Blocks may be empty or hold a single row.
        k_offsets: int32 / int64 ``(B|1, H|1, Mk + 1)``: key block boundaries, from 0 to Nk.
        kv_indices: int32 ``(B|1, H|1, Mq, W)``: key-block indices per query block; the first
            ``kv_counts[b, h, m]`` are used, in any order, each in ``[0, Mk)``, no duplicates.
        kv_counts: int32 ``(B|1, H|1, Mq)``, each in ``[0, W]``.
            Leading dims of size 1 broadcast over batch / heads, independently for each tensor.
        scale: score scale, default ``1 / sqrt(D)``.
        kv_valid: optional bool ``(B|1, Nk)``; False keys are never attended.
        return_lse: return ``(out, lse)`` (default) or ``out`` alone.
        backend: ``"auto"``, ``"triton"`` or ``"torch"``.
        validate: check the plan's values (``validate_varlen_plan``: offsets first / last /
            monotone, counts and used indices in range, no duplicates) and raise ``ValueError``
            naming the first bad entry. Three host syncs on a GPU; pass False only for plans
            validated when they were built (an invalid plan is then undefined behaviour).
            ``FASTDIT_DEBUG=1`` validates regardless. Shapes, dtypes and devices are always checked.
        quant: None, ``"int8"`` or ``"int8-fp8"``: quantised attention with one scale per
            variable-size block (``fastdit.kernels.quant``); float16 / bfloat16 only, no backward.

    Returns:
        ``out`` ``(B, H, N, D)`` contiguous in q's dtype and, with ``return_lse``, ``lse`` float32
        ``(B, H, N)`` (natural log; ``-inf`` for rows with no attended key, whose output is 0).

    Example (two query blocks of 3 and 5 rows, three key blocks, one of them empty)::

        q_off = torch.tensor([[[0, 3, 8]]]); k_off = torch.tensor([[[0, 4, 4, 8]]])
        idx = torch.tensor([[[[0, 2], [2, 1]]]], dtype=torch.int32)
        cnt = torch.tensor([[[2, 1]]], dtype=torch.int32)     # block 1 attends keys 4..7 only
        out, lse = block_sparse_attention_varlen(q, k, v, q_off, k_off, idx, cnt)
    """
    check_qkv(q, k, v, kv_valid)
    _check_plan_shapes(q, k, q_offsets, k_offsets, kv_indices, kv_counts)
    backend = _pick_backend(backend, q.device)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if validate or debug_enabled():
        kv_counts = check_varlen_plan(q_offsets, k_offsets, kv_indices, kv_counts, q.shape[2], k.shape[2])
    if quant is not None:
        check_quant(quant, q.dtype, q.device)
        out, lse = block_sparse_attention_varlen_quant_op(q, k, v, q_offsets, k_offsets, kv_indices, kv_counts,
                                                          scale, kv_valid, backend, quant)
    else:
        out, lse = block_sparse_attention_varlen_op(q, k, v, q_offsets, k_offsets, kv_indices, kv_counts, scale,
                                                    kv_valid, backend)
    return (out, lse) if return_lse else out
