"""Gradients of the block-sparse engine (fixed-size and variable-size plans), both backends.

Every case compares dq, dk, dv (through ``out`` and through ``lse``, with random upstream
gradients) against float64 autograd of the masked dense reference (``dense_reference`` under the
plan's token mask: a different computation, dense, in float64). Plans are random and really
sparse, with query blocks that list nothing, fully masked rows (``kv_valid``), odd sizes, block
sizes that are not powers of two and head dims that are not either. NaN never passes
(``_rel_error`` fails on any non-finite gradient). The PyTorch fallback is also checked by
``torch.autograd.gradcheck`` in float64 (finite differences of its own forward). The Triton cases
run through the interpreter (``TRITON_INTERPRET=1``) at small sizes.
"""
from __future__ import annotations

import zlib

import pytest
import torch

from fastdit.kernels import (
    block_sparse_attention,
    block_sparse_attention_op,
    block_sparse_attention_varlen,
    dense_reference,
    plan_to_token_mask,
    transpose_plan,
    varlen_to_token_mask,
)

from kernel_backends import BACKENDS, DEVICE, seeded, to_device

TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}

# name: (B, H, N, Nk, D, block_m, block_n, plan (B|1, H|1), kv_valid)
FIXED = {
    "odd_perhead_kvvalid": (1, 2, 70, 53, 24, 16, 16, (1, 2), True),
    "npow2_blocks_shared": (2, 1, 45, 61, 20, 24, 20, (1, 1), False),
    "batch_plan_kvvalid": (2, 2, 33, 40, 16, 16, 24, (2, 1), True),
}


def _fixed_case(name, dtype):
    B, H, N, Nk, D, bm, bn, (pb, ph), use_valid = FIXED[name]
    gen = seeded(zlib.crc32(f"grad/{name}".encode()))
    q, k, v = (torch.randn(B, H, n, D, generator=gen).to(dtype) for n in (N, Nk, Nk))
    mq, mk = -(-N // bm), -(-Nk // bn)
    idx = torch.stack([torch.randperm(mk, generator=gen) for _ in range(pb * ph * mq)]).view(pb, ph, mq, mk)
    cnt = torch.randint(1, max(2, mk // 2 + 1), (pb, ph, mq), generator=gen)  # about half the blocks or fewer
    cnt[..., 1] = 0  # a query block that lists nothing
    kv_valid = None
    if use_valid:
        kv_valid = torch.rand(B, Nk, generator=gen) > 0.3
        kv_valid[:, :bn] = False  # key block 0 fully masked, and the only block of the last query block
        idx[..., -1, :] = torch.arange(mk)
        cnt[..., -1] = 1
    return q, k, v, idx.int(), cnt.int(), bm, bn, kv_valid


def _upstream(out, lse, gen):
    """Random upstream gradients for ``out`` and ``lse`` (0 where lse is -inf: no key, no value)."""
    g_out = torch.randn(out.shape, generator=gen).to(out.device)
    g_lse = torch.randn(lse.shape, generator=gen).to(lse.device)
    g_lse = torch.where(torch.isinf(lse), torch.zeros_like(g_lse), g_lse)
    return g_out, g_lse


def _loss(out, lse, g_out, g_lse):
    finite_lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    return (out.to(g_out.dtype) * g_out).sum() + (finite_lse.to(g_lse.dtype) * g_lse).sum()


def _rel_error(got, want):
    assert got is not None, "no gradient"
    assert torch.isfinite(got).all(), "NaN/inf in a gradient"
    return ((got.cpu().double() - want).norm() / want.norm().clamp_min(1e-30)).item()


def _compare(run, q, k, v, mask, scale=None, seed=0):
    """Gradients of ``run(q, k, v) -> (out, lse)`` against float64 autograd of the dense reference."""
    leaves = [t.detach().to(DEVICE).requires_grad_() for t in (q, k, v)]
    out, lse = run(*leaves)
    assert torch.isfinite(out).all()
    g_out, g_lse = _upstream(out.float(), lse, seeded(seed))
    _loss(out.float(), lse, g_out, g_lse).backward()
    ref_leaves = [t.detach().double().cpu().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = dense_reference(*ref_leaves, mask, scale)
    _loss(ref_out, ref_lse, g_out.cpu().double(), g_lse.cpu().double()).backward()
    return {name: _rel_error(a.grad, b.grad) for name, a, b in zip("qkv", leaves, ref_leaves)}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("name", list(FIXED))
def test_fixed_gradients_match_float64_reference(name, dtype, backend):
    q, k, v, idx, cnt, bm, bn, kv_valid = _fixed_case(name, dtype)
    mask = plan_to_token_mask(idx, cnt, q.shape[2], k.shape[2], bm, bn, kv_valid)
    density = mask.float().mean().item()
    assert density < 0.6, f"the plan should be sparse, density {density:.2f}"
    idx_d, cnt_d, kvv_d = to_device(DEVICE, idx, cnt, kv_valid)

    def run(q_, k_, v_):
        return block_sparse_attention(q_, k_, v_, idx_d, cnt_d, bm, bn, kv_valid=kvv_d, backend=backend)

    errors = _compare(run, q, k, v, mask)
    assert max(errors.values()) < TOL[dtype], errors


def test_fallback_gradcheck_float64():
    """The fallback's backward formulas against finite differences of its own forward, in float64
    (through the custom op, whose registered autograd formula is the one under test). Through
    ``out`` only: the op's ``lse`` is float32 by contract, too coarse for finite differences (the
    gradient through ``lse`` is checked against the float64 reference above)."""
    gen = seeded(7)
    B, H, N, Nk, D, bm, bn = 1, 2, 10, 9, 5, 4, 3
    q, k, v = (torch.randn(B, H, n, D, generator=gen, dtype=torch.float64).requires_grad_() for n in (N, Nk, Nk))
    idx = torch.stack([torch.randperm(3, generator=gen) for _ in range(H * 3)]).view(1, H, 3, 3).int()
    cnt = torch.tensor([[[2, 0, 1], [1, 2, 3]]], dtype=torch.int32)
    kv_valid = torch.tensor([[True, False, True, True, True, False, True, True, True]])

    def f(q_, k_, v_):
        return block_sparse_attention_op(q_, k_, v_, idx, cnt, bm, bn, 0.7, kv_valid, "torch")[0]

    assert torch.autograd.gradcheck(f, (q, k, v), eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("backend", BACKENDS)
def test_varlen_gradients_match_float64_reference(backend):
    gen = seeded(26)
    B, H, N, Nk, D = 1, 2, 37, 45, 20
    q_off = torch.tensor([[[0, 5, 5, 21, 22, 37], [0, 13, 14, 30, 30, 37]]])
    k_off = torch.tensor([[[0, 1, 19, 19, 40, 45], [0, 8, 16, 24, 32, 45]]])
    idx = torch.tensor([[[[3, 0, 1], [2, 0, 0], [1, 4, 0], [0, 0, 0], [4, 3, 0]],
                         [[1, 2, 0], [0, 0, 0], [4, 0, 0], [2, 3, 1], [0, 0, 0]]]], dtype=torch.int32)
    cnt = torch.tensor([[[3, 1, 2, 0, 1], [2, 0, 1, 3, 1]]], dtype=torch.int32)
    kv_valid = torch.rand(B, Nk, generator=gen) > 0.2
    mask = varlen_to_token_mask(q_off, k_off, idx, cnt, N, Nk, kv_valid)
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = (torch.randn(B, H, n, D, generator=gen).to(dtype) for n in (N, Nk, Nk))
        plan = to_device(DEVICE, q_off, k_off, idx, cnt, kv_valid)

        def run(q_, k_, v_):
            return block_sparse_attention_varlen(q_, k_, v_, *plan[:4], kv_valid=plan[4], backend=backend)

        errors = _compare(run, q, k, v, mask)
        assert max(errors.values()) < TOL[dtype], (dtype, errors)


def test_transpose_plan_lists_each_query_block_once():
    gen = seeded(3)
    mq, mk = 7, 9
    idx = torch.stack([torch.randperm(mk, generator=gen) for _ in range(2 * mq)]).view(1, 2, mq, mk).int()
    cnt = torch.randint(0, mk + 1, (1, 2, mq), generator=gen).int()
    q_idx, q_cnt = transpose_plan(idx, cnt, mk)
    for h in range(2):
        for j in range(mk):
            want = [m for m in range(mq) if j in idx[0, h, m, : cnt[0, h, m]].tolist()]
            assert q_idx[0, h, j, : q_cnt[0, h, j]].tolist() == want


def test_compiled_training_step_equals_eager():
    """aot_eager traces the registered autograd formula: gradients equal eager ones exactly."""
    q, k, v, idx, cnt, bm, bn, kv_valid = _fixed_case("odd_perhead_kvvalid", torch.float32)

    def step(q_, k_, v_):
        out, lse = block_sparse_attention(q_, k_, v_, idx, cnt, bm, bn, kv_valid=kv_valid, backend="torch")
        return (out * out).sum() + torch.where(torch.isinf(lse), torch.zeros_like(lse), lse).sum()

    grads = []
    for fn in (step, torch.compile(step, backend="aot_eager", fullgraph=True)):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        fn(*leaves).backward()
        grads.append([t.grad for t in leaves])
    for eager, compiled in zip(*grads):
        torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
