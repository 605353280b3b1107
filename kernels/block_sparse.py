"""Block-sparse attention: the one operation every fastdit method reduces to.

Each query block ``m`` (rows ``[m * block_m, (m + 1) * block_m)``) attends to exactly the key
blocks ``kv_indices[b, h, m, :kv_counts[b, h, m]]`` (keys ``[j * block_n, (j + 1) * block_n)``),
minus keys at positions ``>= Nk`` and keys whose ``kv_valid`` is False. Softmax is taken over that
set only (FlashAttention-2 online softmax on the GPU); a query block with no valid key gets output
0 and ``lse = -inf``.

Backends: ``"triton"`` (``block_sparse_triton.py``; the GPU, or the Triton interpreter on the CPU
with ``TRITON_INTERPRET=1``), ``"torch"`` (``block_sparse_torch.py``; any device) and ``"auto"``
(Triton on CUDA when it imports, torch otherwise).

Skip rule (``skip_threshold=``; after SpargeAttn's second stage and skip-softmax kernels). With
``skip_tile = (TM, TN)`` (powers of two, 16..256; default 64 x 64), the rows of every query block
are cut into *row tiles* of ``TM`` consecutive rows (the last cut by the block and by ``N``), and
each listed key block into *key sub-tiles* of ``TN`` consecutive keys (``ceil(block_n / TN)`` per
block, the last cut by the block; keys ``>= Nk`` or with ``kv_valid`` False count as score
``-inf``). For a row tile, the key sub-tiles are walked in plan order (listed blocks in slot
order, sub-tiles of a block in key order). With ``s_ij`` the scaled score (natural-log units) and
``m_i`` the running maximum of row ``i`` over the sub-tiles *computed* so far (``-inf`` at the
start), sub-tile ``t`` is *skipped* (no exp, no P.V: its keys are left out of that row tile's
softmax) iff

    for every row i of the row tile:   max_{j in t} s_ij  <  m_i - skip_threshold

otherwise it is computed and updates ``m_i``. A row with ``m_i = -inf`` therefore never lets a
sub-tile be skipped. Because a skipped sub-tile cannot raise ``m_i``, ``m_i`` before sub-tile ``t``
equals the maximum over *all* earlier sub-tiles (what the PyTorch fallback vectorises with a
cummax). ``skip_threshold = inf`` skips nothing. The Triton kernel, the PyTorch fallback
(``block_sparse_skip_torch.py``) and the float64 reference (``reference.skip_reference``) apply
this one rule; decisions agree exactly except for scores within float32 rounding of the
threshold. ``return_skipped=True`` also returns the number of skipped (row tile, key sub-tile)
pairs per (batch, head).

``block_sparse_attention`` checks its arguments, validates the plan (``reference.validate_plan``,
unless ``validate=False``) and runs the custom op ``fastdit::block_sparse_attention`` (``op.py``),
so that eager and ``torch.compile`` calls run the same code and a compiled graph holds one opaque
call.
"""
from __future__ import annotations

import math
import os

import torch

from .op import _triton_available, block_sparse_attention_op, block_sparse_attention_skip_op, check_block_plan
from .quant import block_sparse_attention_quant_op, check_quant

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
BACKENDS = ("auto", "triton", "torch")


def triton_interpreter_enabled():
    """True when Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def available_backends(device=None):
    """The concrete backends of ``block_sparse_attention`` that can run here, in ``BACKENDS`` order.

    ``"torch"`` always (the PyTorch fallback runs on every device). ``"triton"`` when the triton
    package imports and, given a ``device`` (``torch.device`` or its name), when tensors on it can run
    Triton kernels: a CUDA device, or any device with ``TRITON_INTERPRET=1`` (the CPU interpreter).
    ``backend="auto"`` picks Triton on CUDA when it is listed, else torch.

        >>> available_backends("cpu")   # without TRITON_INTERPRET=1
        ('torch',)
    """
    triton_ok = _triton_available()
    if triton_ok and device is not None:
        triton_ok = torch.device(device).type == "cuda" or triton_interpreter_enabled()
    return tuple(b for b in BACKENDS if b == "torch" or (b == "triton" and triton_ok))


def debug_enabled():
    """``FASTDIT_DEBUG=1``: validate every plan, even in calls made with ``validate=False``."""
    return os.environ.get("FASTDIT_DEBUG", "0").lower() in ("1", "true", "yes", "on")


def check_qkv(q, k, v, kv_valid=None):
    """The engine's rules for ``q``, ``k``, ``v`` and ``kv_valid`` (shared by the fixed-size and the
    variable-size API): ValueError naming the argument."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have rank 4 (B, H, N, D), got shape {tuple(t.shape)}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"{name} has unsupported dtype {t.dtype}; supported: float16, bfloat16, float32")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}; all inputs must share one device")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    batch, heads, _, dim = q.shape
    if k.shape[0] != batch or k.shape[1] != heads or k.shape[3] != dim:
        raise ValueError(f"k shape {tuple(k.shape)} does not match q shape {tuple(q.shape)} in (B, H, _, D)")
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"v shape {tuple(v.shape)} must equal k shape {tuple(k.shape)}")
    if dim > MAX_HEAD_DIM or dim < 1:
        raise ValueError(f"head dim {dim} is not supported; any head dim from 1 to {MAX_HEAD_DIM} works")
    if kv_valid is not None:
        if not isinstance(kv_valid, torch.Tensor) or kv_valid.dtype != torch.bool:
            raise ValueError("kv_valid must be a bool tensor of shape (B|1, Nk)")
        if kv_valid.dim() != 2 or kv_valid.shape[0] not in (1, batch) or kv_valid.shape[1] != k.shape[2]:
            raise ValueError(f"kv_valid shape {tuple(kv_valid.shape)} must be ({batch} or 1, {k.shape[2]})")
        if kv_valid.device != q.device:
            raise ValueError(f"kv_valid is on {kv_valid.device} but q is on {q.device}")


def _check_inputs(q, k, v, kv_indices, kv_counts, block_m, block_n, kv_valid):
    for name, t in (("q", q), ("k", k), ("v", v), ("kv_indices", kv_indices), ("kv_counts", kv_counts)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    check_qkv(q, k, v, kv_valid)
    batch, heads, n_q, dim = q.shape
    for name, b in (("block_m", block_m), ("block_n", block_n)):
        if not isinstance(b, int) or isinstance(b, bool) or b <= 0:
            raise ValueError(f"{name} must be a positive int, got {b!r}")
    n_qblocks = -(-n_q // block_m)
    if kv_indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"kv_indices must be int32, got {kv_indices.dtype}")
    if kv_counts.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"kv_counts must be int32, got {kv_counts.dtype}")
    if kv_indices.dim() != 4:
        raise ValueError(f"kv_indices must have rank 4 (B|1, H|1, ceil(N/block_m), max_blocks), "
                         f"got {tuple(kv_indices.shape)}")
    if kv_counts.dim() != 3:
        raise ValueError(f"kv_counts must have rank 3 (B|1, H|1, ceil(N/block_m)), got {tuple(kv_counts.shape)}")
    pb, ph, pm, _ = kv_indices.shape
    if pb not in (1, batch) or ph not in (1, heads) or pm != n_qblocks:
        raise ValueError(
            f"kv_indices shape {tuple(kv_indices.shape)} does not match q: expected ({batch} or 1, {heads} or 1, "
            f"{n_qblocks} = ceil({n_q}/{block_m}), max_blocks)"
        )
    if tuple(kv_counts.shape) != (pb, ph, pm):
        raise ValueError(f"kv_counts shape {tuple(kv_counts.shape)} must equal kv_indices.shape[:3] = {(pb, ph, pm)}")
    for name, t in (("kv_indices", kv_indices), ("kv_counts", kv_counts)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")


def _pick_backend(backend, device):
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if device.type == "cuda" and _triton_available() else "torch"
    if backend == "triton":
        if not _triton_available():
            raise ValueError("backend='triton' needs the triton package (Linux); use backend='torch'")
        if device.type != "cuda" and not triton_interpreter_enabled():
            raise ValueError(
                f"backend='triton' got {device.type} tensors: Triton runs on CUDA GPUs, or on the CPU only with "
                "TRITON_INTERPRET=1 set before fastdit is imported; use backend='torch' for CPU tensors"
            )
    return backend


def block_sparse_attention(
    q,
    k,
    v,
    kv_indices,
    kv_counts,
    block_m=128,
    block_n=128,
    scale=None,
    kv_valid=None,
    return_lse=True,
    backend="auto",
    *,
    validate=True,
    skip_threshold=None,
    skip_tile=(64, 64),
    return_skipped=False,
    quant=None,
):
    """Attention in which each query block attends to a list of key/value blocks.

    Args:
        q: ``(B, H, N, D)``; k, v: ``(B, H, Nk, D)``. float16, bfloat16 or float32, one device.
            Any strides. D up to 256 (non-powers of two are padded inside the kernel). ``Nk = 0``
            is allowed (every count must then be 0: output 0, ``lse = -inf``).
        kv_indices: int32 ``(B|1, H|1, ceil(N / block_m), max_blocks)``: key-block indices per
            query block; the first ``kv_counts[b, h, m]`` entries are used, in any order, each in
            ``[0, ceil(Nk / block_n))``. Duplicates within a row are rejected (``ValueError``),
            not merged. Entries past the count are never read. Leading dims of size 1 broadcast
            over batch / heads.
        kv_counts: int32 ``(B|1, H|1, ceil(N / block_m))``, each in ``[0, max_blocks]``.
        block_m, block_n: query / key block sizes of the plan (any positive ints; N and Nk need
            not be multiples).
        scale: score scale, default ``1 / sqrt(D)``.
        kv_valid: optional bool ``(B|1, Nk)``; False keys are never attended.
        return_lse: when True return ``(out, lse)``, else ``out`` alone.
        backend: ``"auto"``, ``"triton"`` or ``"torch"``.
        validate: check the plan's values (counts in range, used indices in range, no
            duplicates; see ``validate_plan``) and raise ``ValueError`` naming the first bad
            entry. Vectorised, two host syncs on a GPU (so not inside CUDA-graph capture);
            under ``torch.compile`` the check is an op of the graph (no graph break). Pass
            ``validate=False`` only for plans validated when they were built (fastdit's own
            plans): an invalid plan is then undefined behaviour (wrong values, or a crash of the
            Triton kernel). ``FASTDIT_DEBUG=1`` validates every call regardless. Shapes, dtypes
            and devices are always checked.
        skip_threshold: None (default: off, the plain kernel) or a number ``>= 0`` (``inf``
            allowed): the skip rule of the module docstring, in natural-log units.
        skip_tile: ``(TM, TN)``, the rule's row-tile and key sub-tile sizes (powers of two from
            16 to 256); with the rule on, the Triton kernel runs exactly these tiles (clipped to
            the plan blocks) instead of autotuned ones.
        return_skipped: also return ``skipped``, int32 ``(B, H)``: skipped (row tile, key
            sub-tile) pairs (zeros when ``skip_threshold`` is None).
        quant: None, ``"int8"`` or ``"int8-fp8"``: quantised Q.K^T (and P.V) after SageAttention,
            with one scale per plan block (``fastdit.kernels.quant``); float16 / bfloat16 only,
            no skip rule, no backward.

    Returns:
        ``out`` ``(B, H, N, D)`` contiguous in q's dtype and, with ``return_lse``, ``lse``
        float32 ``(B, H, N)``: ``log(sum_j exp(scale * q . k_j))`` over attended keys, ``-inf``
        where none; then ``skipped`` with ``return_skipped``.

    Raises:
        ValueError: bad shapes, dtypes, devices, backend or (with validation) plan values.

    Example::

        n_blocks = -(-N // 128)
        idx = torch.arange(n_blocks, dtype=torch.int32).expand(1, 1, n_blocks, n_blocks).contiguous()
        cnt = torch.full((1, 1, n_blocks), n_blocks, dtype=torch.int32)
        out, lse = block_sparse_attention(q, k, v, idx, cnt)   # == dense attention

    The computation is the custom op ``torch.ops.fastdit.block_sparse_attention``, differentiable
    in q, k, v (``autograd.py``: FlashAttention-2-style backward on both backends; the plan is a
    constant). With ``skip_threshold`` set there is no gradient.
    """
    _check_inputs(q, k, v, kv_indices, kv_counts, block_m, block_n, kv_valid)
    skip_threshold, skip_tile = check_skip_options(skip_threshold, skip_tile)
    backend = _pick_backend(backend, q.device)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if validate or debug_enabled():
        n_k = k.shape[2]
        kv_counts = check_block_plan(kv_indices, kv_counts, -(-n_k // block_n), -(-q.shape[2] // block_m), n_k, block_n)
    if quant is not None:
        if skip_threshold is not None:
            raise ValueError("skip_threshold and quant cannot be combined (the quantised kernel has no skip rule)")
        check_quant(quant, q.dtype, q.device)
        out, lse = block_sparse_attention_quant_op(q, k, v, kv_indices, kv_counts, block_m, block_n, scale, kv_valid,
                                                   backend, quant)
        skipped = torch.zeros(q.shape[:2], dtype=torch.int32, device=q.device) if return_skipped else None
    elif skip_threshold is None:
        out, lse = block_sparse_attention_op(q, k, v, kv_indices, kv_counts, block_m, block_n, scale, kv_valid, backend)
        skipped = None
        if return_skipped:
            skipped = torch.zeros(q.shape[:2], dtype=torch.int32, device=q.device)
    else:
        out, lse, skipped = block_sparse_attention_skip_op(
            q, k, v, kv_indices, kv_counts, block_m, block_n, scale, kv_valid, backend,
            skip_threshold, skip_tile[0], skip_tile[1],
        )
    result = (out, lse) if return_lse else (out,)
    if return_skipped:
        result = result + (skipped,)
    return result if len(result) > 1 else out


def skip_subtiles_walked(kv_counts, n_q, block_m, block_n, skip_tile=(64, 64)):
    """(row tile, key sub-tile) pairs the skip rule looks at, per (batch, head): int64
    ``(B|1, H|1)`` on the plan's device (no host sync); ``skipped / walked`` is the skipped share."""
    tile_m, tile_n = skip_tile
    n_qblocks = kv_counts.shape[-1]
    rows = (n_q - torch.arange(n_qblocks, device=kv_counts.device) * block_m).clamp(min=0, max=block_m)
    row_tiles = torch.div(rows + tile_m - 1, tile_m, rounding_mode="floor")
    return (kv_counts.long() * row_tiles).sum(-1) * (-(-block_n // tile_n))


def check_skip_options(skip_threshold, skip_tile=(64, 64)):
    """``(skip_threshold as float or None, skip_tile as a tuple of two ints)``; ValueError naming
    the option for a threshold that is not a number >= 0 (NaN included; ``inf`` is fine) or a tile
    that is not two powers of two from 16 to 256."""
    if skip_threshold is not None:
        value = skip_threshold
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value < 0:
            raise ValueError(f"skip_threshold must be None or a number >= 0 (natural-log units below the running "
                             f"row maximum; inf skips nothing), got {value!r}")
        skip_threshold = float(value)
    if (not isinstance(skip_tile, (tuple, list)) or len(skip_tile) != 2
            or not all(isinstance(t, int) and not isinstance(t, bool) and 16 <= t <= 256 and t & (t - 1) == 0
                       for t in skip_tile)):
        raise ValueError(f"skip_tile must be two powers of two (rows, keys) from 16 to 256, got {skip_tile!r}")
    return skip_threshold, (int(skip_tile[0]), int(skip_tile[1]))
