"""The engine as ``torch.library`` custom ops: ``torch.compile`` sees each as one opaque call.

* ``fastdit::block_sparse_attention`` (``block_sparse_attention_op``): the attention itself, run by
  the backend named in its last argument (``"torch"``, ``"triton"`` or ``"auto"``). It checks
  nothing: ``fastdit.kernels.block_sparse_attention`` checks shapes and validates the plan first,
  then calls it, so eager and compiled calls run the same code. Call the op directly only with
  inputs that wrapper would accept; a bad plan here is undefined behaviour (wrong values, or a
  crash on the Triton backend). Returns ``(out, lse)``: ``out`` contiguous ``(B, H, N, D)`` in q's
  dtype, ``lse`` contiguous float32 ``(B, H, N)`` (the fake implementation says the same, so
  compiled graphs get the real strides). Differentiable in q, k, v: ``autograd.py`` registers the
  backward (``fastdit::block_sparse_attention_backward``).
* ``fastdit::block_sparse_attention_skip`` (``block_sparse_attention_skip_op``): the same with the
  skip rule (``skip_threshold`` in natural-log units, the rule's sub-tile sizes ``skip_m`` x
  ``skip_n``); returns ``(out, lse, skipped)``, ``skipped`` int32 ``(B, H)``. A separate op, so
  the plain op's schema and compiled graphs stay as they were.
* ``fastdit::block_sparse_attention_varlen`` (``block_sparse_attention_varlen_op``): the same
  with variable-size blocks given by offsets (``block_sparse_varlen.py``); returns ``(out, lse)``.
  ``fastdit::check_varlen_plan`` (``check_varlen_plan``) is its plan check, built like the next one.
  Differentiable like the fixed-size op (``autograd.py``); the skip op is not.
* ``fastdit::check_block_plan`` (``check_block_plan``): ``validate_plan`` as an op; raises
  ``ValueError`` naming the first bad entry, else returns a copy of ``kv_counts`` that the wrapper
  feeds to the attention op. The data dependency keeps the check in compiled graphs (an op whose
  result nobody uses would be dropped) without a graph break for its host sync.

Schemas are written out (not inferred from annotations) so that they read the same on every torch
version from 2.4 on.
"""
import torch

from .block_sparse_skip_torch import block_sparse_attention_skip_torch
from .block_sparse_torch import block_sparse_attention_torch
from .block_sparse_varlen_torch import block_sparse_attention_varlen_torch
from .reference import validate_plan, validate_varlen_plan

_BACKENDS = ("auto", "triton", "torch")


def _triton_available():
    try:
        import triton  # a plain import statement: torch.compile traces it (importlib.import_module it refuses)
    except Exception:
        return False
    return triton is not None


@torch.library.custom_op(
    "fastdit::block_sparse_attention",
    mutates_args=(),
    schema="(Tensor q, Tensor k, Tensor v, Tensor kv_indices, Tensor kv_counts, int block_m, int block_n, "
    "float scale, Tensor? kv_valid, str backend) -> (Tensor, Tensor)",
)
def block_sparse_attention_op(q, k, v, kv_indices, kv_counts, block_m, block_n, scale, kv_valid, backend):
    """``(out, lse)`` of block-sparse attention on already-validated inputs (see the module doc)."""
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if backend == "auto":
        backend = "triton" if q.device.type == "cuda" and _triton_available() else "torch"
    # both backends return empty rows (0, -inf) without reading the plan when Nk = 0
    if backend == "triton":
        from .block_sparse_triton import block_sparse_attention_triton

        out, lse = block_sparse_attention_triton(q, k, v, kv_indices, kv_counts, block_m, block_n, scale, kv_valid)
    else:
        shape = tuple(q.shape[:2]) + tuple(kv_indices.shape[2:])
        out, lse = block_sparse_attention_torch(
            q, k, v, kv_indices.long().expand(shape), kv_counts.long().expand(shape[:3]),
            block_m, block_n, scale, kv_valid,
        )
    return out.contiguous(), lse.contiguous()


@block_sparse_attention_op.register_fake
def _block_sparse_attention_fake(q, k, v, kv_indices, kv_counts, block_m, block_n, scale, kv_valid, backend):
    batch, heads, n_q, dim = q.shape
    out = q.new_empty((batch, heads, n_q, dim))  # contiguous, q's dtype and device
    lse = q.new_empty((batch, heads, n_q), dtype=torch.float32)
    return out, lse


@torch.library.custom_op(
    "fastdit::block_sparse_attention_skip",
    mutates_args=(),
    schema="(Tensor q, Tensor k, Tensor v, Tensor kv_indices, Tensor kv_counts, int block_m, int block_n, "
    "float scale, Tensor? kv_valid, str backend, float skip_threshold, int skip_m, int skip_n) "
    "-> (Tensor, Tensor, Tensor)",
)
def block_sparse_attention_skip_op(q, k, v, kv_indices, kv_counts, block_m, block_n, scale, kv_valid, backend,
                                   skip_threshold, skip_m, skip_n):
    """``(out, lse, skipped)`` of block-sparse attention under the skip rule (validated inputs)."""
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if backend == "auto":
        backend = "triton" if q.device.type == "cuda" and _triton_available() else "torch"
    if backend == "triton":
        from .block_sparse_triton import block_sparse_attention_triton

        out, lse, skipped = block_sparse_attention_triton(
            q, k, v, kv_indices, kv_counts, block_m, block_n, scale, kv_valid,
            skip_threshold=skip_threshold, skip_tile=(skip_m, skip_n),
        )
    else:
        shape = tuple(q.shape[:2]) + tuple(kv_indices.shape[2:])
        out, lse, skipped = block_sparse_attention_skip_torch(
            q, k, v, kv_indices.long().expand(shape), kv_counts.long().expand(shape[:3]),
            block_m, block_n, scale, kv_valid, skip_threshold, skip_m, skip_n,
        )
    return out.contiguous(), lse.contiguous(), skipped.contiguous()


@block_sparse_attention_skip_op.register_fake
def _block_sparse_attention_skip_fake(q, k, v, kv_indices, kv_counts, block_m, block_n, scale, kv_valid, backend,
                                      skip_threshold, skip_m, skip_n):
    batch, heads, n_q, dim = q.shape
    out = q.new_empty((batch, heads, n_q, dim))
    lse = q.new_empty((batch, heads, n_q), dtype=torch.float32)
    skipped = q.new_empty((batch, heads), dtype=torch.int32)
    return out, lse, skipped


@torch.library.custom_op(
    "fastdit::check_block_plan",
    mutates_args=(),
    schema="(Tensor kv_indices, Tensor kv_counts, int n_kv_blocks, int n_q_blocks, int n_k, int block_n) -> Tensor",
)
def check_block_plan(kv_indices, kv_counts, n_kv_blocks, n_q_blocks, n_k, block_n):
    """Raise ``ValueError("invalid block plan: ...")`` unless ``validate_plan`` finds nothing;
    return a copy of ``kv_counts``."""
    problems = validate_plan(kv_indices, kv_counts, n_kv_blocks, n_q_blocks, n_k=n_k, block_n=block_n)
    if problems:
        raise ValueError("invalid block plan: " + "; ".join(problems))
    return kv_counts.clone()


@check_block_plan.register_fake
def _check_block_plan_fake(kv_indices, kv_counts, n_kv_blocks, n_q_blocks, n_k, block_n):
    return torch.empty_like(kv_counts)


@torch.library.custom_op(
    "fastdit::block_sparse_attention_varlen",
    mutates_args=(),
    schema="(Tensor q, Tensor k, Tensor v, Tensor q_offsets, Tensor k_offsets, Tensor kv_indices, "
    "Tensor kv_counts, float scale, Tensor? kv_valid, str backend) -> (Tensor, Tensor)",
)
def block_sparse_attention_varlen_op(q, k, v, q_offsets, k_offsets, kv_indices, kv_counts, scale, kv_valid,
                                     backend):
    """``(out, lse)`` of variable-size block-sparse attention on already-validated inputs."""
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if backend == "auto":
        backend = "triton" if q.device.type == "cuda" and _triton_available() else "torch"
    if backend == "triton":
        from .block_sparse_varlen_triton import block_sparse_attention_varlen_triton

        out, lse = block_sparse_attention_varlen_triton(q, k, v, q_offsets, k_offsets, kv_indices, kv_counts,
                                                        scale, kv_valid)
    else:
        out, lse = block_sparse_attention_varlen_torch(q, k, v, q_offsets, k_offsets, kv_indices, kv_counts,
                                                       scale, kv_valid)
    return out.contiguous(), lse.contiguous()


@block_sparse_attention_varlen_op.register_fake
def _block_sparse_attention_varlen_fake(q, k, v, q_offsets, k_offsets, kv_indices, kv_counts, scale, kv_valid,
                                        backend):
    batch, heads, n_q, dim = q.shape
    return q.new_empty((batch, heads, n_q, dim)), q.new_empty((batch, heads, n_q), dtype=torch.float32)


@torch.library.custom_op(
    "fastdit::check_varlen_plan",
    mutates_args=(),
    schema="(Tensor q_offsets, Tensor k_offsets, Tensor kv_indices, Tensor kv_counts, int n_q, int n_k) -> Tensor",
)
def check_varlen_plan(q_offsets, k_offsets, kv_indices, kv_counts, n_q, n_k):
    """Raise ``ValueError("invalid variable-size block plan: ...")`` unless ``validate_varlen_plan``
    finds nothing; return a copy of ``kv_counts`` (the data dependency keeps it in compiled graphs)."""
    problems = validate_varlen_plan(q_offsets, k_offsets, kv_indices, kv_counts, n_q, n_k)
    if problems:
        raise ValueError("invalid variable-size block plan: " + "; ".join(problems))
    return kv_counts.clone()


@check_varlen_plan.register_fake
def _check_varlen_plan_fake(q_offsets, k_offsets, kv_indices, kv_counts, n_q, n_k):
    return torch.empty_like(kv_counts)
