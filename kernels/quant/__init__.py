"""Quantised block-sparse attention (option ``quant`` of the engines), after SageAttention.

Modes (``QUANT_MODES``):

* ``None``: the plain engine (Q.K^T and P.V in the input's half type, float32 accumulation).
* ``"int8"`` (SageAttention V1): K smoothed by subtracting its mean over the sequence (per batch,
  head and channel; softmax is unchanged), Q and K quantised to INT8 with one scale per query
  block / key block of the plan, Q.K^T in INT8 with INT32 accumulation, P.V in the input's half
  type with float32 accumulation.
* ``"int8-fp8"`` (SageAttention 2): as ``"int8"``, with P and V in float8 e4m3 (V scaled per
  channel). Needs FP8 tensor cores: CUDA devices of compute capability 8.9 or later.

The exact formulas are in ``emulation.py`` (the PyTorch backend, which emulates them). The
log-sum-exp is that of the quantised scores of the unsmoothed keys, so results merge exactly.
Inputs must be float16 or bfloat16. The quantised ops have no backward (inference only).
"""
from __future__ import annotations

import torch

from .emulation import (allowed_blocks, fixed_blocks, quant_attention_emulated, quantize_blocks, smooth_keys,
                        varlen_blocks)

QUANT_MODES = (None, "int8", "int8-fp8")
HALF_DTYPES = (torch.float16, torch.bfloat16)
#: Engines with a Triton quantised kernel; the others run the emulation on the Triton backend too.
TRITON_KERNELS = ("fixed", "varlen")


def fp8_supported(device):
    """Whether ``device`` has FP8 tensor cores (a CUDA device of compute capability 8.9 or later)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def check_quant_mode(quant):
    """Raise ValueError unless ``quant`` is one of ``QUANT_MODES``."""
    if quant not in QUANT_MODES or isinstance(quant, bool):
        raise ValueError(f"quant={quant!r} is not a quantisation mode; supported: None (off), 'int8' "
                         f"(INT8 Q.K^T, half P.V) or 'int8-fp8' (INT8 Q.K^T, FP8 P.V on sm_89 and later)")


def check_quant(quant, dtype, device):
    """Raise ValueError naming the option, the mode and what is supported when ``quant`` cannot run on
    inputs of ``dtype`` on ``device`` (checked at the first call, when these are known)."""
    check_quant_mode(quant)
    if quant is None:
        return
    if dtype not in HALF_DTYPES:
        raise ValueError(f"quant={quant!r} needs float16 or bfloat16 inputs (P.V runs in the input's half type), "
                         f"got {dtype}; cast the inputs or use quant=None")
    if quant == "int8-fp8" and not fp8_supported(device):
        where = (f"CUDA device of compute capability {torch.cuda.get_device_capability(device)}"
                 if torch.device(device).type == "cuda" and torch.cuda.is_available() else f"{torch.device(device)}")
        raise ValueError(f"quant='int8-fp8' needs FP8 tensor cores (CUDA compute capability 8.9 or later: Ada, "
                         f"Hopper, Blackwell), got {where}; use quant='int8' there")


@torch.library.custom_op(
    "fastdit::block_sparse_attention_quant",
    mutates_args=(),
    schema="(Tensor q, Tensor k, Tensor v, Tensor kv_indices, Tensor kv_counts, int block_m, int block_n, "
    "float scale, Tensor? kv_valid, str backend, str quant) -> (Tensor, Tensor)",
)
def block_sparse_attention_quant_op(q, k, v, kv_indices, kv_counts, block_m, block_n, scale, kv_valid, backend,
                                    quant):
    """``(out, lse)`` of quantised fixed-size block-sparse attention (validated inputs)."""
    if backend == "triton" and "fixed" in TRITON_KERNELS:
        from .triton_fixed import quant_attention_triton

        return quant_attention_triton(q, k, v, kv_indices, kv_counts, block_m, block_n, scale, kv_valid, quant)
    batch, heads, n_q, _ = q.shape
    n_k = k.shape[2]
    allowed = allowed_blocks(kv_indices, kv_counts, batch, heads, -(-n_k // block_n))
    out, lse = quant_attention_emulated(q, k, v, fixed_blocks(n_q, block_m, q.device),
                                        fixed_blocks(n_k, block_n, q.device), allowed, scale, kv_valid, quant)
    return out.contiguous(), lse.contiguous()


@block_sparse_attention_quant_op.register_fake
def _quant_fake(q, k, v, kv_indices, kv_counts, block_m, block_n, scale, kv_valid, backend, quant):
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op(
    "fastdit::block_sparse_attention_varlen_quant",
    mutates_args=(),
    schema="(Tensor q, Tensor k, Tensor v, Tensor q_offsets, Tensor k_offsets, Tensor kv_indices, "
    "Tensor kv_counts, float scale, Tensor? kv_valid, str backend, str quant) -> (Tensor, Tensor)",
)
def block_sparse_attention_varlen_quant_op(q, k, v, q_offsets, k_offsets, kv_indices, kv_counts, scale, kv_valid,
                                           backend, quant):
    """``(out, lse)`` of quantised variable-size block-sparse attention (validated inputs)."""
    if backend == "triton" and "varlen" in TRITON_KERNELS:
        from .triton_varlen import quant_attention_varlen_triton

        return quant_attention_varlen_triton(q, k, v, q_offsets, k_offsets, kv_indices, kv_counts, scale, kv_valid,
                                             quant)
    batch, heads, n_q, _ = q.shape
    allowed = allowed_blocks(kv_indices, kv_counts, batch, heads, k_offsets.shape[-1] - 1)
    out, lse = quant_attention_emulated(q, k, v, varlen_blocks(q_offsets, n_q), varlen_blocks(k_offsets, k.shape[2]),
                                        allowed, scale, kv_valid, quant)
    return out.contiguous(), lse.contiguous()


@block_sparse_attention_varlen_quant_op.register_fake
def _varlen_quant_fake(q, k, v, q_offsets, k_offsets, kv_indices, kv_counts, scale, kv_valid, backend, quant):
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)


__all__ = ["HALF_DTYPES", "QUANT_MODES", "allowed_blocks", "block_sparse_attention_quant_op",
           "block_sparse_attention_varlen_quant_op", "check_quant", "check_quant_mode", "fixed_blocks",
           "fp8_supported", "quant_attention_emulated", "quantize_blocks", "smooth_keys", "varlen_blocks"]
