"""Gradients of the engine: backward custom ops and ``register_autograd`` on the forward ops.

* ``fastdit::block_sparse_attention_backward`` (``block_sparse_attention_backward_op``) and
  ``fastdit::block_sparse_attention_varlen_backward``: ``(dq, dk, dv)`` from ``dout``, ``dlse``
  (may be None) and what the forward saved (``q, k, v, out, lse`` and the plan), run by the
  backend the forward ran (``block_sparse_bwd_torch.py`` / ``block_sparse_bwd_triton.py``).
  Opaque custom ops with fake implementations, like the forward: ``torch.compile`` (AOT autograd)
  puts one call of each in the backward graph.
* ``register_autograd`` on ``fastdit::block_sparse_attention`` and
  ``fastdit::block_sparse_attention_varlen``: ``out`` and ``lse`` are differentiable in ``q``,
  ``k``, ``v`` (the plan, ``kv_valid`` and the offsets are constants: which keys a query sees is
  not differentiated). The skip-rule op (``fastdit::block_sparse_attention_skip``) has no
  gradient: which sub-tiles it skipped is not saved, so its backward would not be exact.

The formulas are in ``block_sparse_bwd_torch.py``; the Triton kernels recompute the scores from
the saved log-sum-exp (FlashAttention-2 style) and need the transposed plan (key block -> the
query blocks that list it), built on the device (``transpose_plan`` of ``block_sparse_bwd_torch.py``;
no host sync).
"""
from __future__ import annotations

import torch

from .block_sparse_bwd_torch import (block_sparse_attention_backward_torch,
                                     block_sparse_attention_varlen_backward_torch, transpose_plan)
from .op import _BACKENDS, _triton_available, block_sparse_attention_op, block_sparse_attention_varlen_op


def _resolve(backend, device):
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if device.type == "cuda" and _triton_available() else "torch"
    return backend


@torch.library.custom_op(
    "fastdit::block_sparse_attention_backward",
    mutates_args=(),
    schema="(Tensor dout, Tensor? dlse, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor kv_indices, "
    "Tensor kv_counts, int block_m, int block_n, float scale, Tensor? kv_valid, str backend) "
    "-> (Tensor, Tensor, Tensor)",
)
def block_sparse_attention_backward_op(dout, dlse, q, k, v, out, lse, kv_indices, kv_counts, block_m, block_n, scale,
                                       kv_valid, backend):
    """``(dq, dk, dv)`` (contiguous, dtypes of q, k, v) of ``fastdit::block_sparse_attention``."""
    if _resolve(backend, q.device) == "triton":
        from .block_sparse_bwd_triton import block_sparse_attention_backward_triton

        grads = block_sparse_attention_backward_triton(dout, dlse, q, k, v, out, lse, kv_indices, kv_counts,
                                                       block_m, block_n, scale, kv_valid)
    else:
        grads = block_sparse_attention_backward_torch(dout, dlse, q, k, v, out, lse, kv_indices, kv_counts,
                                                      block_m, block_n, scale, kv_valid)
    return tuple(g.contiguous() for g in grads)


@block_sparse_attention_backward_op.register_fake
def _backward_fake(dout, dlse, q, k, v, out, lse, kv_indices, kv_counts, block_m, block_n, scale, kv_valid, backend):
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape))


@torch.library.custom_op(
    "fastdit::block_sparse_attention_varlen_backward",
    mutates_args=(),
    schema="(Tensor dout, Tensor? dlse, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor q_offsets, "
    "Tensor k_offsets, Tensor kv_indices, Tensor kv_counts, float scale, Tensor? kv_valid, str backend) "
    "-> (Tensor, Tensor, Tensor)",
)
def block_sparse_attention_varlen_backward_op(dout, dlse, q, k, v, out, lse, q_offsets, k_offsets, kv_indices,
                                              kv_counts, scale, kv_valid, backend):
    """``(dq, dk, dv)`` of ``fastdit::block_sparse_attention_varlen``."""
    if _resolve(backend, q.device) == "triton":
        from .block_sparse_bwd_triton import block_sparse_attention_varlen_backward_triton

        grads = block_sparse_attention_varlen_backward_triton(dout, dlse, q, k, v, out, lse, q_offsets, k_offsets,
                                                              kv_indices, kv_counts, scale, kv_valid)
    else:
        grads = block_sparse_attention_varlen_backward_torch(dout, dlse, q, k, v, out, lse, q_offsets, k_offsets,
                                                             kv_indices, kv_counts, scale, kv_valid)
    return tuple(g.contiguous() for g in grads)


@block_sparse_attention_varlen_backward_op.register_fake
def _varlen_backward_fake(dout, dlse, q, k, v, out, lse, q_offsets, k_offsets, kv_indices, kv_counts, scale, kv_valid,
                          backend):
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape))


def _save(ctx, tensors, params):
    # kv_valid may be None: saved as None and given back as None
    ctx.save_for_backward(*tensors)
    ctx.params = params


def _fixed_setup(ctx, inputs, output):
    q, k, v, kv_indices, kv_counts, block_m, block_n, scale, kv_valid, backend = inputs
    _save(ctx, (q, k, v, output[0], output[1], kv_indices, kv_counts, kv_valid), (block_m, block_n, scale, backend))


def _fixed_backward(ctx, dout, dlse):
    q, k, v, out, lse, kv_indices, kv_counts, kv_valid = ctx.saved_tensors
    block_m, block_n, scale, backend = ctx.params
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = torch.ops.fastdit.block_sparse_attention_backward(
        dout, dlse, q, k, v, out, lse, kv_indices, kv_counts, block_m, block_n, scale, kv_valid, backend)
    return dq, dk, dv, None, None, None, None, None, None, None


def _varlen_setup(ctx, inputs, output):
    q, k, v, q_offsets, k_offsets, kv_indices, kv_counts, scale, kv_valid, backend = inputs
    _save(ctx, (q, k, v, output[0], output[1], q_offsets, k_offsets, kv_indices, kv_counts, kv_valid),
          (scale, backend))


def _varlen_backward(ctx, dout, dlse):
    q, k, v, out, lse, q_offsets, k_offsets, kv_indices, kv_counts, kv_valid = ctx.saved_tensors
    scale, backend = ctx.params
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = torch.ops.fastdit.block_sparse_attention_varlen_backward(
        dout, dlse, q, k, v, out, lse, q_offsets, k_offsets, kv_indices, kv_counts, scale, kv_valid, backend)
    return dq, dk, dv, None, None, None, None, None, None, None


block_sparse_attention_op.register_autograd(_fixed_backward, setup_context=_fixed_setup)
block_sparse_attention_varlen_op.register_autograd(_varlen_backward, setup_context=_varlen_setup)
