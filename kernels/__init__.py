"""fastdit.kernels: the block-sparse attention engine (Triton kernel, PyTorch fallback, references).

Imports only torch (and triton, lazily, for the Triton backend).
"""
from .block_sparse import BACKENDS, SUPPORTED_DTYPES, block_sparse_attention, triton_interpreter_enabled
from .op import block_sparse_attention_op, check_block_plan
from .reference import dense_reference, plan_to_token_mask, validate_plan

__all__ = [
    "BACKENDS",
    "SUPPORTED_DTYPES",
    "block_sparse_attention",
    "block_sparse_attention_op",
    "check_block_plan",
    "dense_reference",
    "plan_to_token_mask",
    "triton_interpreter_enabled",
    "validate_plan",
]
