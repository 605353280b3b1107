"""The skip rule (``skip_threshold``): Triton kernel and PyTorch fallback against the float64
reference walk (``skip_reference``), on inputs with real structure (scores decaying with distance,
so far key sub-tiles really fall below the running maximum), odd sizes, ragged per-head plans and
key-validity holes. Triton runs in the interpreter on the CPU (tiny sizes)."""
from __future__ import annotations

import math

import pytest
import torch

from fastdit.kernels import block_sparse_attention, skip_reference, skip_subtiles_walked

from kernel_backends import DEVICE, TRITON_OK  # shared with the other kernel tests
BACKENDS = [
    pytest.param("torch", id="torch"),
    pytest.param("triton", id="triton", marks=pytest.mark.skipif(not TRITON_OK, reason="needs CUDA or TRITON_INTERPRET=1")),
]


def _local_inputs(seed, batch=2, heads=2, n_q=75, n_k=83, dim=16, width=6.0):
    """q, k, v whose scores fall off with the distance of positions: ``s_ij ~ -(i - j')^2 / (2
    width^2)`` plus noise (``j'`` the key position rescaled to the query axis), as in video
    attention maps with a local, decaying pattern."""
    gen = torch.Generator().manual_seed(seed)
    pos_q = torch.arange(n_q, dtype=torch.float64)
    pos_k = torch.arange(n_k, dtype=torch.float64) * (n_q / n_k)
    scale = 1.0 / math.sqrt(dim)
    c = 1.0 / (width * width * scale)
    q = torch.randn(batch, heads, n_q, dim, generator=gen, dtype=torch.float64) * 0.5
    k = torch.randn(batch, heads, n_k, dim, generator=gen, dtype=torch.float64) * 0.5
    # q . k gets c * (i j' - i^2/2 - j'^2/2) = -c (i - j')^2 / 2 from three dimensions
    q[..., 0], q[..., 1], q[..., 2] = math.sqrt(c) * pos_q, -0.5 * math.sqrt(c) * pos_q**2 / n_q, math.sqrt(c) * n_q
    k[..., 0], k[..., 1], k[..., 2] = math.sqrt(c) * pos_k, math.sqrt(c) * n_q, -0.5 * math.sqrt(c) * pos_k**2 / n_q
    v = torch.randn(batch, heads, n_k, dim, generator=gen, dtype=torch.float64)
    return q.float(), k.float(), v.float(), gen


def _plan(gen, batch, heads, n_q, n_k, block_m, block_n, diagonal_first=True):
    """A per-head plan with ragged counts: each query block lists key blocks nearest first (so the
    running maximum is high early and far sub-tiles get skipped), the rest in random order."""
    n_qb, n_kb = -(-n_q // block_m), -(-n_k // block_n)
    centre = (torch.arange(n_qb) * block_m + block_m / 2) * (n_k / n_q) / block_n
    order = (torch.arange(n_kb)[None, :] - centre[:, None]).abs().argsort(-1)  # (n_qb, n_kb) nearest first
    idx = order.expand(batch, heads, n_qb, n_kb).clone()
    if not diagonal_first:
        for b in range(batch):
            idx[b, :, :, :] = idx[b, :, :, torch.randperm(n_kb, generator=gen)]
    cnt = torch.randint(max(1, n_kb // 2), n_kb + 1, (batch, heads, n_qb), generator=gen)
    cnt[0, 0, 0] = 0  # an empty query block
    return idx.int(), cnt.int()


def _pick_threshold(ref_fn, candidates):
    """The first threshold whose decisions are all clear of float32 rounding and that skips some
    but not all sub-tiles (the test must be able to fail both ways)."""
    for thr in candidates:
        ref = ref_fn(thr)
        total_skipped, total_walked = int(ref["skipped"].sum()), int(ref["walked"].sum())
        if ref["margin"] > 1e-3 and 0 < total_skipped < total_walked:
            return thr, ref
    raise AssertionError("no usable threshold among the candidates")


@pytest.mark.parametrize("backend", BACKENDS)
def test_finite_threshold_matches_reference_rule(backend):
    """Outputs, lse and skipped counts equal the float64 literal walk of the rule."""
    q, k, v, gen = _local_inputs(seed=1)
    batch, heads, n_q, _ = q.shape
    n_k = k.shape[2]
    block_m, block_n, tile = 40, 24, (16, 16)  # plan blocks cut into 16-row/-key sub-tiles, last partial
    idx, cnt = _plan(gen, batch, heads, n_q, n_k, block_m, block_n)
    kv_valid = torch.rand(batch, n_k, generator=gen) > 0.15

    def ref_fn(thr):
        return skip_reference(q, k, v, idx, cnt, block_m, block_n, thr, tile, kv_valid=kv_valid)

    thr, ref = _pick_threshold(ref_fn, (3.0, 2.0, 5.0, 1.5, 8.0))
    no_skip = ref_fn(float("inf"))
    assert not torch.equal(ref["mask"], no_skip["mask"])  # the rule really removed keys
    args = [t.to(DEVICE) for t in (q, k, v, idx, cnt)]
    out, lse, skipped = block_sparse_attention(*args, block_m, block_n, kv_valid=kv_valid.to(DEVICE), backend=backend,
                                               skip_threshold=thr, skip_tile=tile, return_skipped=True)
    assert skipped.dtype == torch.int32 and tuple(skipped.shape) == (batch, heads)
    assert torch.equal(skipped.cpu().long(), ref["skipped"])
    assert torch.equal(skip_subtiles_walked(cnt, n_q, block_m, block_n, tile), ref["walked"])
    assert torch.isfinite(out).all()
    assert (out.cpu().double() - ref["out"]).abs().max().item() < 1e-4
    fin = torch.isfinite(ref["lse"])
    assert torch.equal(torch.isfinite(lse.cpu()), fin) and (~fin).any()
    assert (lse.cpu().double()[fin] - ref["lse"][fin]).abs().max().item() < 1e-4
    # and the skipped keys mattered: the result differs from the plan without skipping
    assert (ref["out"] - no_skip["out"]).abs().max().item() > 1e-6


@pytest.mark.parametrize("backend", BACKENDS)
def test_infinite_threshold_changes_nothing(backend):
    q, k, v, gen = _local_inputs(seed=2, n_q=50, n_k=41)
    idx, cnt = _plan(gen, 2, 2, 50, 41, 32, 16, diagonal_first=False)
    args = [t.to(DEVICE) for t in (q, k, v, idx, cnt)]
    plain, plain_lse = block_sparse_attention(*args, 32, 16, backend=backend)
    out, lse, skipped = block_sparse_attention(*args, 32, 16, backend=backend, skip_threshold=math.inf,
                                               skip_tile=(32, 16), return_skipped=True)
    assert int(skipped.abs().sum()) == 0
    assert torch.allclose(out, plain, atol=1e-6, rtol=0) and torch.allclose(lse, plain_lse, atol=1e-6, rtol=0)
    assert torch.isfinite(out).all()


def test_backends_agree_and_threshold_zero_skips_more():
    """Threshold 0 skips every sub-tile strictly below the running max; larger thresholds skip
    fewer (monotone), and the torch fallback's counts track the reference at each."""
    q, k, v, gen = _local_inputs(seed=3, batch=1, heads=3, n_q=64, n_k=64)
    idx, cnt = _plan(gen, 1, 3, 64, 64, 32, 32)
    counts, checked = [], 0
    for thr in (0.0, 1.0, 4.0, 16.0):
        ref = skip_reference(q, k, v, idx, cnt, 32, 32, thr, (16, 16))
        out, skipped = block_sparse_attention(q, k, v, idx, cnt, 32, 32, backend="torch", skip_threshold=thr,
                                              skip_tile=(16, 16), return_lse=False, return_skipped=True)
        if ref["margin"] > 1e-3:
            assert torch.equal(skipped.long(), ref["skipped"])
            assert (out.double() - ref["out"]).abs().max().item() < 1e-4
            checked += 1
        counts.append(int(ref["skipped"].sum()))
    assert checked == 4
    assert counts == sorted(counts, reverse=True) and counts[0] > counts[-1] == 0


def test_default_path_untouched_and_return_shapes():
    q, k, v, gen = _local_inputs(seed=4, batch=1, heads=1, n_q=33, n_k=33)
    idx, cnt = _plan(gen, 1, 1, 33, 33, 16, 16)
    out = block_sparse_attention(q, k, v, idx, cnt, 16, 16, backend="torch", return_lse=False)
    out2, lse2, skipped = block_sparse_attention(q, k, v, idx, cnt, 16, 16, backend="torch", return_skipped=True)
    assert torch.equal(out, out2) and skipped.dtype == torch.int32 and int(skipped.abs().sum()) == 0


@pytest.mark.parametrize("bad", [-0.5, float("nan"), "2", True])
def test_bad_threshold_raises(bad):
    q = torch.randn(1, 1, 16, 16)
    idx, cnt = torch.zeros(1, 1, 1, 1, dtype=torch.int32), torch.ones(1, 1, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="skip_threshold"):
        block_sparse_attention(q, q, q, idx, cnt, 16, 16, backend="torch", skip_threshold=bad)


@pytest.mark.parametrize("tile", [(48, 64), (8, 64), (64,), (512, 64)])
def test_bad_skip_tile_raises(tile):
    q = torch.randn(1, 1, 16, 16)
    idx, cnt = torch.zeros(1, 1, 1, 1, dtype=torch.int32), torch.ones(1, 1, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="skip_tile"):
        block_sparse_attention(q, q, q, idx, cnt, 16, 16, backend="torch", skip_threshold=1.0, skip_tile=tile)


def test_skip_op_fake_and_compile():
    """The skip op's fake outputs match the real ones, and a compiled caller holds one opaque op."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k, v, gen = _local_inputs(seed=5, batch=1, heads=2, n_q=40, n_k=40)
    idx, cnt = _plan(gen, 1, 2, 40, 40, 16, 16)
    op = torch.ops.fastdit.block_sparse_attention_skip.default
    real = op(q, k, v, idx, cnt, 16, 16, 0.25, None, "torch", 1.0, 16, 16)
    with FakeTensorMode() as mode:
        fake = op(*[mode.from_tensor(t) for t in (q, k, v, idx, cnt)], 16, 16, 0.25, None, "torch", 1.0, 16, 16)
    for r, f in zip(real, fake):
        assert (r.shape, r.stride(), r.dtype) == (f.shape, f.stride(), f.dtype)
    torch.library.opcheck(op, (q, k, v, idx, cnt, 16, 16, 0.25, None, "torch", 1.0, 16, 16))

    def fn(q, k, v, idx, cnt):
        return block_sparse_attention(q, k, v, idx, cnt, 16, 16, backend="torch", skip_threshold=1.0,
                                      skip_tile=(16, 16), return_skipped=True)

    torch._dynamo.reset()
    explained = torch._dynamo.explain(fn)(q, k, v, idx, cnt)
    assert explained.graph_break_count == 0, explained.break_reasons
    compiled = torch.compile(fn, backend="eager", fullgraph=True)(q, k, v, idx, cnt)
    eager = fn(q, k, v, idx, cnt)
    assert all(torch.equal(a, b) for a, b in zip(compiled, eager))
