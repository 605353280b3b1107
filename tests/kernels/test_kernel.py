"""Block-sparse attention engine: both backends against the float64 reference, and the plan
helpers (``plan_to_token_mask``, ``validate_plan``). Bad input and bad plans (every one a ValueError
naming the argument and entry, on both backends) are in test_kernel_validation.py; the custom-op /
torch.compile side is in test_kernel_op.py.

The Triton backend runs on CUDA, or on the CPU under the Triton interpreter: the interpreter must
be switched on before triton is first imported (``TRITON_INTERPRET=1 python -m pytest ...``);
without it and without a GPU the Triton cases are skipped. Interpreter cases are kept small.
"""
from __future__ import annotations

import zlib

import pytest
import torch
import torch.nn.functional as F

from fastdit.kernels import block_sparse_attention, dense_reference, plan_to_token_mask, validate_plan

from kernel_backends import BACKENDS, DEVICE, TRITON_OK, TRITON_SKIP_REASON, seeded, to_device

TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-2}
LSE_TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 1e-2}


def make_plan(gen, pb, ph, n_qblocks, n_kblocks, zero_rows=True, garbage=True):
    """Random plan: shuffled distinct indices, random counts (some 0), junk in unused slots."""
    max_blocks = n_kblocks + 1
    idx = torch.full((pb, ph, n_qblocks, max_blocks), -7 if garbage else 0, dtype=torch.int64)
    cnt = torch.randint(0, n_kblocks + 1, (pb, ph, n_qblocks), generator=gen)
    for b in range(pb):
        for h in range(ph):
            for m in range(n_qblocks):
                c = int(cnt[b, h, m])
                idx[b, h, m, :c] = torch.randperm(n_kblocks, generator=gen)[:c]
                if garbage and c < max_blocks:
                    idx[b, h, m, c:] = 10**6 + m  # never read: out of range on purpose
    if zero_rows and n_qblocks > 1:
        cnt[..., 1] = 0  # a whole query block with no key block
    if n_qblocks > 2:
        cnt[..., 0] = max(cnt.max().item(), 1)  # and a busy one
        idx[..., 0, : int(cnt.max())] = torch.randperm(n_kblocks, generator=gen)[: int(cnt.max())]
    return idx, cnt


# One entry per scenario: shapes, plan layout, dtypes and masks. Sizes stay tiny for the interpreter.
CASES = {
    # name: (B, H, N, Nk, D, block_m, block_n, dtype, plan_bh, kv_valid, idx_dtype)
    "d64_f32_shared_pow2": (2, 2, 200, 200, 64, 64, 64, torch.float32, (1, 1), False, torch.int32),
    "d72_f32_perhead_npow2_kvvalid": (2, 2, 150, 230, 72, 48, 40, torch.float32, (2, 2), True, torch.int32),
    "d128_f32_perhead_small_blocks": (1, 2, 130, 100, 128, 32, 32, torch.float32, (1, 2), True, torch.int64),
    "d64_bf16_even": (2, 2, 192, 192, 64, 64, 64, torch.bfloat16, (2, 2), False, torch.int32),
    "d72_f16_npow2_kvvalid": (1, 2, 170, 120, 72, 48, 40, torch.float16, (1, 1), True, torch.int32),
    "d128_bf16_batchplan_kvvalid": (2, 1, 97, 160, 128, 64, 32, torch.bfloat16, (2, 1), True, torch.int32),
    "d64_f16_even_kvvalid_split": (1, 2, 256, 256, 64, 128, 128, torch.float16, (1, 2), True, torch.int32),
    "d64_f32_big_npow2_blocks": (1, 1, 300, 290, 64, 245, 100, torch.float32, (1, 1), True, torch.int32),
    "d72_bf16_npow2": (1, 2, 140, 111, 72, 48, 40, torch.bfloat16, (1, 2), False, torch.int64),
    "d128_f16_shared": (2, 2, 100, 140, 128, 64, 64, torch.float16, (1, 1), False, torch.int32),
}


def _make_case(name, layout="contiguous"):
    B, H, N, Nk, D, bm, bn, dtype, (pb, ph), use_valid, idx_dtype = CASES[name]
    gen = seeded(zlib.crc32(f"{name}/{layout}".encode()))
    if layout == "bnhd":  # the diffusers layout, viewed as (B, H, N, D): non-contiguous
        q = torch.randn(B, N, H, D, generator=gen).transpose(1, 2)
        k = torch.randn(B, Nk, H, D, generator=gen).transpose(1, 2)
        v = torch.randn(B, Nk, H, D, generator=gen).transpose(1, 2)
    else:
        q = torch.randn(B, H, N, D, generator=gen)
        k = torch.randn(B, H, Nk, D, generator=gen)
        v = torch.randn(B, H, Nk, D, generator=gen)
    q, k, v = (t.to(dtype) for t in (q, k, v))
    n_qb, n_kb = -(-N // bm), -(-Nk // bn)
    idx, cnt = make_plan(gen, pb, ph, n_qb, n_kb)
    kv_valid = None
    if use_valid:
        kv_valid = torch.rand(B, Nk, generator=gen) > 0.25
        kv_valid[:, : min(bn, Nk)] = False  # key block 0 fully masked ...
        idx[..., -1, 0] = 0  # ... and the only block of the last query block: a fully masked row set
        cnt[..., -1] = 1
    idx, cnt = idx.to(idx_dtype), cnt.to(idx_dtype)
    return (q, k, v, idx, cnt, bm, bn, kv_valid)


def _check(out, lse, q, k, v, idx, cnt, bm, bn, kv_valid, scale=None):
    N, Nk = q.shape[2], k.shape[2]
    mask = plan_to_token_mask(idx.cpu(), cnt.cpu(), N, Nk, bm, bn, None if kv_valid is None else kv_valid.cpu())
    ref, ref_lse = dense_reference(q.cpu(), k.cpu(), v.cpu(), mask, scale)
    out, lse = out.cpu(), lse.cpu()
    assert out.dtype == q.dtype and out.shape == q.shape
    assert lse.dtype == torch.float32 and lse.shape == q.shape[:3]
    assert torch.isfinite(out).all(), "NaN/inf in the output"
    assert not torch.isnan(lse).any(), "NaN in lse"
    rel = ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    assert rel < TOL[q.dtype], f"relative error {rel:.3e} >= {TOL[q.dtype]}"
    ref_inf = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse) & (lse < 0), ref_inf), "lse -inf pattern differs from the reference"
    empty_rows = ~mask.expand(q.shape[0], q.shape[1], N, Nk).any(-1)
    assert torch.equal(ref_inf, empty_rows)
    assert (out[empty_rows] == 0).all(), "rows without a key must be exactly 0"
    fin = ~ref_inf
    if fin.any():
        err = (lse.double()[fin] - ref_lse[fin]).abs() / ref_lse[fin].abs().clamp_min(1.0)
        assert err.max().item() < LSE_TOL[q.dtype], f"lse error {err.max().item():.3e}"
    return empty_rows


@pytest.fixture
def poisoned_empty(monkeypatch):
    """torch.empty returns NaN-filled float tensors: every output element must be written."""
    real_empty = torch.empty

    def empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        if t.is_floating_point():
            t.fill_(float("nan"))
        return t

    monkeypatch.setattr(torch, "empty", empty)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference(name, backend, poisoned_empty):
    q, k, v, idx, cnt, bm, bn, kv_valid = to_device(DEVICE, *_make_case(name))
    out, lse = block_sparse_attention(q, k, v, idx, cnt, bm, bn, kv_valid=kv_valid, backend=backend)
    empty_rows = _check(out, lse, q, k, v, idx, cnt, bm, bn, kv_valid)
    assert empty_rows.any(), "the case should contain rows without keys"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["d72_f32_perhead_npow2_kvvalid", "d64_bf16_even"])
def test_strided_inputs_and_scale(name, backend):
    q, k, v, idx, cnt, bm, bn, kv_valid = to_device(DEVICE, *_make_case(name, layout="bnhd"))
    assert not q.is_contiguous()
    out, lse = block_sparse_attention(q, k, v, idx, cnt, bm, bn, scale=0.3, kv_valid=kv_valid, backend=backend)
    assert out.is_contiguous()
    _check(out, lse, q, k, v, idx, cnt, bm, bn, kv_valid, scale=0.3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_broadcast_kv_valid_and_return_lse_false(backend):
    q, k, v, idx, cnt, bm, bn, _ = to_device(DEVICE, *_make_case("d64_f32_shared_pow2"))
    kv_valid = (torch.arange(k.shape[2]) % 3 != 1).unsqueeze(0).to(DEVICE)  # (1, Nk) for B=2
    out = block_sparse_attention(q, k, v, idx, cnt, bm, bn, kv_valid=kv_valid, return_lse=False, backend=backend)
    assert isinstance(out, torch.Tensor)
    _, lse = block_sparse_attention(q, k, v, idx, cnt, bm, bn, kv_valid=kv_valid, backend=backend)
    _check(out, lse, q, k, v, idx, cnt, bm, bn, kv_valid.expand(q.shape[0], -1))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_full_plan_equals_sdpa(backend, dtype):
    gen = seeded(7 + (dtype == torch.float16))
    B, H, N, D, blk = 1, 2, 160, 64, 64
    q, k, v = (torch.randn(B, H, N, D, generator=gen).to(dtype).to(DEVICE) for _ in range(3))
    nb = -(-N // blk)
    idx = torch.arange(nb, dtype=torch.int32).expand(1, 1, nb, nb).contiguous().to(DEVICE)
    cnt = torch.full((1, 1, nb), nb, dtype=torch.int32, device=DEVICE)
    out, lse = block_sparse_attention(q, k, v, idx, cnt, blk, blk, backend=backend)
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    rel = ((out.float() - ref).norm() / ref.norm()).item()
    assert rel < TOL[dtype]
    ref_lse = torch.logsumexp((q.float() @ k.float().transpose(-1, -2)) / D**0.5, dim=-1)
    assert torch.allclose(lse, ref_lse, atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_rows_pruned(backend):
    gen = seeded(11)
    q, k, v = (torch.randn(1, 2, 70, 64, generator=gen).to(DEVICE) for _ in range(3))
    idx = torch.zeros(1, 1, 2, 3, dtype=torch.int32, device=DEVICE)
    cnt = torch.zeros(1, 1, 2, dtype=torch.int32, device=DEVICE)
    out, lse = block_sparse_attention(q, k, v, idx, cnt, 64, 32, backend=backend)
    assert (out == 0).all() and torch.isneginf(lse).all()


@pytest.mark.skipif(not TRITON_OK, reason=TRITON_SKIP_REASON)
def test_backends_agree():
    q, k, v, idx, cnt, bm, bn, kv_valid = to_device(DEVICE, *_make_case("d72_f16_npow2_kvvalid"))
    o_t, l_t = block_sparse_attention(q, k, v, idx, cnt, bm, bn, kv_valid=kv_valid, backend="triton")
    o_p, l_p = block_sparse_attention(q, k, v, idx, cnt, bm, bn, kv_valid=kv_valid, backend="torch")
    assert ((o_t.float() - o_p.float()).norm() / o_p.float().norm()).item() < 2e-2
    assert torch.equal(torch.isneginf(l_t), torch.isneginf(l_p))


# -------------------------------------------------------------------------------------------------
# Validation and the custom op change nothing
# -------------------------------------------------------------------------------------------------

def _backend_direct(backend, q, k, v, idx, cnt, bm, bn, scale, kv_valid):
    """The engine as it ran before validation and the custom op: the backend function itself."""
    if backend == "triton":
        from fastdit.kernels.block_sparse_triton import block_sparse_attention_triton

        return block_sparse_attention_triton(q, k, v, idx, cnt, bm, bn, scale, kv_valid)
    from fastdit.kernels.block_sparse_torch import block_sparse_attention_torch

    shape = q.shape[:2] + idx.shape[2:]
    return block_sparse_attention_torch(q, k, v, idx.long().expand(shape), cnt.long().expand(shape[:3]),
                                        bm, bn, scale, kv_valid)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["d72_f32_perhead_npow2_kvvalid", "d64_bf16_even", "d128_f16_shared"])
def test_valid_plans_unchanged(name, backend):
    """Validation and the custom op change no bit of a valid plan's result."""
    q, k, v, idx, cnt, bm, bn, kv_valid = to_device(DEVICE, *_make_case(name))
    assert validate_plan(idx, cnt, -(-k.shape[2] // bn), -(-q.shape[2] // bm)) == []
    scale = q.shape[-1] ** -0.5
    ref_out, ref_lse = _backend_direct(backend, q, k, v, idx, cnt, bm, bn, scale, kv_valid)
    for validate in (True, False):
        out, lse = block_sparse_attention(q, k, v, idx, cnt, bm, bn, kv_valid=kv_valid, backend=backend,
                                          validate=validate)
        assert out.is_contiguous() and lse.is_contiguous()
        assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    _check(out, lse, q, k, v, idx, cnt, bm, bn, kv_valid)


# -------------------------------------------------------------------------------------------------
# Plan helpers
# -------------------------------------------------------------------------------------------------

def test_plan_to_token_mask_hand_made():
    # N=5 queries in blocks of 2 (3 query blocks), Nk=6 keys in blocks of 3 (2 key blocks).
    idx = torch.tensor([[[[1, 9], [1, 0], [5, 5]]]], dtype=torch.int32)  # junk beyond the counts
    cnt = torch.tensor([[[1, 2, 0]]], dtype=torch.int32)
    kv_valid = torch.tensor([[True, True, False, True, True, True]])
    mask = plan_to_token_mask(idx, cnt, 5, 6, block_m=2, block_n=3, kv_valid=kv_valid)
    expected = torch.tensor(
        [
            [0, 0, 0, 1, 1, 1],
            [0, 0, 0, 1, 1, 1],
            [1, 1, 0, 1, 1, 1],
            [1, 1, 0, 1, 1, 1],
            [0, 0, 0, 0, 0, 0],
        ],
        dtype=torch.bool,
    )
    assert mask.shape == (1, 1, 5, 6)
    assert torch.equal(mask[0, 0], expected)
    no_valid = plan_to_token_mask(idx, cnt, 5, 6, block_m=2, block_n=3)
    assert no_valid[0, 0, 2].all() and not no_valid[0, 0, 4].any()


def test_validate_plan():
    gen = seeded(3)
    idx, cnt = make_plan(gen, 2, 3, 5, 6)
    assert validate_plan(idx, cnt, 6, 5) == []  # junk in unused slots is fine
    assert validate_plan(idx.int(), cnt.int(), 6) == []
    assert validate_plan(idx.int(), cnt.long(), 6) == []  # mixed widths

    bad = idx.clone()
    bad[0, 0, 0, 0] = 6  # == n_kv_blocks: out of range
    problems = validate_plan(bad, cnt, 6, n_k=70, block_n=12)
    assert problems == [
        "kv_indices[0, 0, 0, 0] = 6 is out of range: outside [0, 6), the 6 key blocks (Nk=70, block_n=12); "
        "1 used indices out of range"
    ]

    bad = idx.clone()
    bad[1, 2, 0, 0] = -1
    bad[1, 2, 0, 1] = 10**6
    (problem,) = validate_plan(bad, cnt, 6)
    assert problem.startswith("kv_indices[1, 2, 0, 0] = -1 is out of range") and "2 used indices" in problem

    dup = idx.clone()
    dup[0, 1, 0, 3] = dup[0, 1, 0, 1]  # row 0 has the max count (>= 4)
    (problem,) = validate_plan(dup, cnt, 6)
    assert problem.startswith(f"kv_indices[0, 1, 0] lists key block {int(dup[0, 1, 0, 1])} twice (slots 1 and 3)")
    assert "duplicate" in problem

    big = cnt.clone()
    big[0, 0, 2] = idx.shape[-1] + 1
    problems = validate_plan(idx, big, 6)  # the row's junk slots are now used, and out of range
    assert problems[0].startswith(f"kv_counts[0, 0, 2] = {idx.shape[-1] + 1} exceeds max_blocks = {idx.shape[-1]}")

    neg = cnt.clone()
    neg[1, 1, 3] = -2
    (problem,) = validate_plan(idx, neg, 6)
    assert problem.startswith("kv_counts[1, 1, 3] = -2 is negative")

    # no key block at all: only all-zero counts are valid
    assert validate_plan(idx, torch.zeros_like(cnt), 0) == []
    (problem,) = validate_plan(idx, cnt, 0, n_k=0, block_n=8)
    assert "kv_counts[0, 0, 0]" in problem and "no keys (Nk=0" in problem

    # several problems at once are all reported
    assert len(validate_plan(bad, neg, 6)) == 2

    assert validate_plan(idx, cnt, 6, n_q_blocks=4)  # wrong number of query blocks
    assert validate_plan(idx.float(), cnt, 6)  # not integer
    assert validate_plan(idx[0], cnt, 6)  # wrong rank


def test_available_backends_say_what_can_run(monkeypatch):
    """``available_backends`` lists the torch fallback always, and Triton only where it can run:
    installed, and for a device, on CUDA or under the interpreter."""
    from fastdit.kernels import BACKENDS, available_backends
    from fastdit.kernels import block_sparse as bs

    assert "torch" in available_backends() and "torch" in available_backends("cpu")
    assert set(available_backends()) <= set(BACKENDS) - {"auto"}
    monkeypatch.setattr(bs, "_triton_available", lambda: True)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert available_backends() == ("triton", "torch")
    assert available_backends("cpu") == ("torch",)
    assert available_backends(torch.device("cuda", 0)) == ("triton", "torch")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert available_backends("cpu") == ("triton", "torch")
    monkeypatch.setattr(bs, "_triton_available", lambda: False)
    assert available_backends("cuda") == ("torch",) and available_backends() == ("torch",)
