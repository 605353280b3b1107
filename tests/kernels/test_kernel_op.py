"""The engine as ``torch.library`` custom ops: ``opcheck``, fake (meta) outputs, and
``torch.compile`` of code calling ``block_sparse_attention`` (one opaque call, no graph break,
validation kept). CPU shapes are tiny; the Triton backend runs in the interpreter
(``TRITON_INTERPRET=1``) or on a GPU.
"""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from fastdit.kernels import block_sparse_attention, dense_reference, plan_to_token_mask

from kernel_backends import BACKENDS, DEVICE, TRITON_OK, TRITON_SKIP_REASON, to_device

OP = torch.ops.fastdit.block_sparse_attention.default
CHECK = torch.ops.fastdit.check_block_plan.default


def _inputs(dtype=torch.float32, strided=False, seed=0):
    """B=2, H=2, N=40, Nk=50, D=16, blocks of 16 (3 query blocks, 4 key blocks, the last
    partial); a sparse per-head plan with junk past the counts, a kv_valid with holes."""
    gen = torch.Generator().manual_seed(seed)
    if strided:  # (B, N, H, D) storage viewed as (B, H, N, D)
        q = torch.randn(2, 40, 2, 16, generator=gen).transpose(1, 2)
        k = torch.randn(2, 50, 2, 16, generator=gen).transpose(1, 2)
        v = torch.randn(2, 50, 2, 16, generator=gen).transpose(1, 2)
    else:
        q = torch.randn(2, 2, 40, 16, generator=gen)
        k = torch.randn(2, 2, 50, 16, generator=gen)
        v = torch.randn(2, 2, 50, 16, generator=gen)
    q, k, v = (t.to(dtype) for t in (q, k, v))
    junk = 10**6
    idx = torch.tensor(
        [[[[2, 0, junk, junk], [1, 3, junk, junk], [3, junk, junk, junk]],
          [[0, 1, 3, junk], [junk, junk, junk, junk], [2, 0, junk, junk]]]],
        dtype=torch.int32,
    )
    cnt = torch.tensor([[[2, 2, 1], [3, 0, 2]]], dtype=torch.int32)
    kv_valid = torch.rand(2, 50, generator=gen) > 0.3
    return to_device(DEVICE, q, k, v, idx, cnt, kv_valid)


def _reference(q, k, v, idx, cnt, kv_valid, scale=None):
    mask = plan_to_token_mask(idx.cpu(), cnt.cpu(), q.shape[2], k.shape[2], 16, 16, kv_valid.cpu())
    density = mask.expand(2, 2, -1, -1).float().mean().item()
    assert 0.1 < density < 0.7, f"the plan should be sparse, density {density:.2f}"
    return dense_reference(q.cpu(), k.cpu(), v.cpu(), mask, scale)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("strided", [False, True])
def test_opcheck(backend, strided):
    q, k, v, idx, cnt, kv_valid = _inputs(strided=strided)
    for valid in (kv_valid, None):
        torch.library.opcheck(OP, (q, k, v, idx, cnt, 16, 16, 0.25, valid, backend))
    torch.library.opcheck(CHECK, (idx, cnt, 4, 3, 50, 16))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fake_matches_real(backend, dtype):
    """The fake implementation gives the real outputs' shapes, dtypes and strides (contiguous),
    whatever the input strides."""
    q, k, v, idx, cnt, kv_valid = _inputs(dtype, strided=True)
    out, lse = OP(q, k, v, idx, cnt, 16, 16, 0.25, kv_valid, backend)
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        fake = [mode.from_tensor(t) for t in (q, k, v, idx, cnt, kv_valid)]
        f_out, f_lse = OP(*fake[:5], 16, 16, 0.25, fake[5], backend)
    assert out.is_contiguous() and lse.is_contiguous()
    for real, meta in ((out, f_out), (lse, f_lse)):
        assert (real.shape, real.stride(), real.dtype, real.device) == (meta.shape, meta.stride(), meta.dtype, meta.device)
    assert out.dtype == dtype and lse.dtype == torch.float32
    ref, ref_lse = _reference(q, k, v, idx, cnt, kv_valid, 0.25)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert ((out.cpu().double() - ref).norm() / ref.norm()).item() < tol


def _attend(q, k, v, idx, cnt, kv_valid, backend="torch"):
    out, lse = block_sparse_attention(q, k, v, idx, cnt, 16, 16, kv_valid=kv_valid, backend=backend)
    return out * 2.0, lse


@pytest.mark.parametrize("compile_backend", ["eager", "aot_eager"])
def test_compile_no_graph_break(compile_backend):
    torch._dynamo.reset()
    args = _inputs()
    with torch.no_grad():
        explained = torch._dynamo.explain(_attend)(*args)
        assert explained.graph_break_count == 0, explained.break_reasons
        assert explained.graph_count == 1
        eager_out, eager_lse = _attend(*args)
        compiled = torch.compile(_attend, backend=compile_backend, fullgraph=True)
        out, lse = compiled(*args)
        assert torch.equal(out, eager_out) and torch.equal(lse, eager_lse)
        ref, ref_lse = _reference(*args)
        assert ((out.cpu().double() / 2 - ref).norm() / ref.norm()).item() < 1e-4
        fin = torch.isfinite(ref_lse)
        assert torch.equal(torch.isneginf(lse.cpu()), ~fin) and (~fin).any()
        assert torch.allclose(lse.cpu().double()[fin], ref_lse[fin], atol=1e-4)

        # the plan check stays in the graph: a bad plan raises at run time, no recompile needed
        q, k, v, idx, cnt, kv_valid = args
        bad = idx.clone()
        bad[0, 1, 2, 1] = 4
        with pytest.raises(ValueError, match=r"kv_indices\[0, 1, 2, 1\] = 4 is out of range"):
            compiled(q, k, v, bad, cnt, kv_valid)


def test_compiled_graph_holds_one_attention_call():
    """The traced graph calls the engine as one op (plus its plan check), nothing inside it."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(_attend, backend=capture, fullgraph=True)(*_inputs())
    (gm,) = graphs
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    ops = [t for t in targets if isinstance(t, torch._ops.OpOverload) or isinstance(t, torch._ops.OpOverloadPacket)]
    names = [str(t) for t in ops]
    assert sum("fastdit.block_sparse_attention" in n for n in names) == 1, names
    assert sum("fastdit.check_block_plan" in n for n in names) == 1, names
    assert not any("index_select" in str(t) or "flash" in str(t) for t in targets), targets


@pytest.mark.skipif(not TRITON_OK, reason=TRITON_SKIP_REASON)
def test_compile_triton_backend():
    torch._dynamo.reset()
    args = _inputs()
    with torch.no_grad():
        eager = _attend(*args, backend="triton")
        compiled = torch.compile(lambda *a: _attend(*a, backend="triton"), backend="aot_eager", fullgraph=True)
        out, lse = compiled(*args)
    assert torch.equal(out, eager[0]) and torch.equal(lse, eager[1])
