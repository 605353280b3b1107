"""fastdit.kernels: the block-sparse attention engine (Triton kernel, PyTorch fallback, references).

Imports only torch (and triton, lazily, for the Triton backend).
"""
if __name__ != "fastdit.kernels":  # pragma: no cover - only when imported under the wrong name
    # This folder installs as ``fastdit.kernels``. Run from the repository root, transformers' probe
    # for Hugging Face's package named ``kernels`` imports this folder as ``kernels``; loading the
    # engine a second time would register its torch.library ops twice. Stay an empty module (no
    # version: transformers then reports its ``kernels`` as unavailable).
    __all__ = []
else:
    from .block_sparse import (
        BACKENDS,
        SUPPORTED_DTYPES,
        available_backends,
        block_sparse_attention,
        check_skip_options,
        skip_subtiles_walked,
        triton_interpreter_enabled,
    )
    from .block_sparse_varlen import block_sparse_attention_varlen
    from . import autograd  # noqa: F401  (registers the backward of the custom ops)
    from . import block_sparse_tma  # noqa: F401  (registers the Hopper / Blackwell forward variant)
    from .block_sparse_bwd_torch import transpose_plan
    from .op import (
        block_sparse_attention_op,
        block_sparse_attention_skip_op,
        block_sparse_attention_varlen_op,
        check_block_plan,
        check_varlen_plan,
    )
    from .reference import (
        dense_reference,
        plan_to_token_mask,
        skip_reference,
        validate_plan,
        validate_varlen_plan,
        varlen_reference,
        varlen_to_token_mask,
    )

    __all__ = [
        "BACKENDS",
        "SUPPORTED_DTYPES",
        "available_backends",
        "block_sparse_attention",
        "block_sparse_attention_op",
        "block_sparse_attention_skip_op",
        "block_sparse_attention_varlen",
        "block_sparse_attention_varlen_op",
        "check_skip_options",
        "check_block_plan",
        "check_varlen_plan",
        "dense_reference",
        "transpose_plan",
        "plan_to_token_mask",
        "skip_reference",
        "skip_subtiles_walked",
        "triton_interpreter_enabled",
        "validate_plan",
        "validate_varlen_plan",
        "varlen_reference",
        "varlen_to_token_mask",
    ]
