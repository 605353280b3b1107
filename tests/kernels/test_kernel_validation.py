"""Block-sparse attention engine, bad input: shapes, dtypes, devices and backends (each a
ValueError naming the argument), and bad plan values, validated by default on both backends (every
bad plan a ValueError naming the argument and entry; ``FASTDIT_DEBUG`` validates even with
``validate=False``), plus the inputs that used to crash the process, run in a child process.
"""
from __future__ import annotations

import pytest
import torch

import fastdit.kernels.block_sparse as bs
from fastdit.kernels import block_sparse_attention, dense_reference

from kernel_backends import BACKENDS, DEVICE, HAS_TRITON, seeded, to_device


# -------------------------------------------------------------------------------------------------
# Bad input
# -------------------------------------------------------------------------------------------------

def _small(dtype=torch.float32, N=64, Nk=64, D=32, blk=32):
    q = torch.randn(1, 2, N, D, dtype=dtype)
    k = torch.randn(1, 2, Nk, D, dtype=dtype)
    v = torch.randn(1, 2, Nk, D, dtype=dtype)
    nq, nk = -(-N // blk), -(-Nk // blk)
    idx = torch.arange(nk, dtype=torch.int32).expand(1, 1, nq, nk).contiguous()
    cnt = torch.full((1, 1, nq), nk, dtype=torch.int32)
    return q, k, v, idx, cnt


def _call(q, k, v, idx, cnt, **kw):
    kw.setdefault("block_m", 32)
    kw.setdefault("block_n", 32)
    kw.setdefault("backend", "torch")
    return block_sparse_attention(q, k, v, idx, cnt, **kw)


def test_bad_rank():
    q, k, v, idx, cnt = _small()
    with pytest.raises(ValueError, match=r"\bq\b.*rank 4"):
        _call(q[0], k, v, idx, cnt)
    with pytest.raises(ValueError, match=r"\bk\b.*rank 4"):
        _call(q, k[0], v, idx, cnt)
    with pytest.raises(ValueError, match="kv_indices.*rank 4"):
        _call(q, k, v, idx[0], cnt)
    with pytest.raises(ValueError, match="kv_counts.*rank 3"):
        _call(q, k, v, idx, cnt[0])


def test_bad_dtype():
    q, k, v, idx, cnt = _small()
    with pytest.raises(ValueError, match="q has unsupported dtype"):
        _call(q.double(), k.double(), v.double(), idx, cnt)
    with pytest.raises(ValueError, match="unsupported dtype"):
        _call(q.int(), k.int(), v.int(), idx, cnt)
    with pytest.raises(ValueError, match="share one dtype"):
        _call(q, k.half(), v, idx, cnt)
    with pytest.raises(ValueError, match="kv_indices"):
        _call(q, k, v, idx.float(), cnt)
    with pytest.raises(ValueError, match="kv_counts"):
        _call(q, k, v, idx, cnt.to(torch.int16))
    with pytest.raises(ValueError, match="kv_valid"):
        _call(q, k, v, idx, cnt, kv_valid=torch.ones(1, 64))


def test_bad_device():
    q, k, v, idx, cnt = _small()
    with pytest.raises(ValueError, match=r"\bk\b is on meta"):
        _call(q, k.to("meta"), v, idx, cnt)
    with pytest.raises(ValueError, match="kv_indices is on meta"):
        _call(q, k, v, idx.to("meta"), cnt)
    with pytest.raises(ValueError, match="kv_valid is on meta"):
        _call(q, k, v, idx, cnt, kv_valid=torch.ones(1, 64, dtype=torch.bool, device="meta"))


def test_bad_shapes():
    q, k, v, idx, cnt = _small()
    with pytest.raises(ValueError, match="kv_indices shape"):
        _call(q, k, v, idx[:, :, :1], cnt)  # 1 query block, q needs 2
    with pytest.raises(ValueError, match="kv_indices shape"):
        _call(q, k, v, idx.expand(3, 1, -1, -1), cnt.expand(3, 1, -1))  # batch 3 vs 1
    with pytest.raises(ValueError, match="kv_counts shape"):
        _call(q, k, v, idx, cnt[:, :, :1])
    with pytest.raises(ValueError, match=r"\bk shape"):
        _call(q, k[..., :16], v[..., :16], idx, cnt)
    with pytest.raises(ValueError, match=r"\bv shape"):
        _call(q, k, v[:, :, :32], idx, cnt)
    with pytest.raises(ValueError, match="kv_valid shape"):
        _call(q, k, v, idx, cnt, kv_valid=torch.ones(1, 63, dtype=torch.bool))
    with pytest.raises(ValueError, match="block_m"):
        _call(q, k, v, idx, cnt, block_m=0)
    with pytest.raises(ValueError, match="block_n"):
        _call(q, k, v, idx, cnt, block_n=32.0)
    with pytest.raises(ValueError, match="head dim"):
        big = torch.randn(1, 1, 8, 512)
        _call(big, big, big, idx[:, :, :1], cnt[:, :, :1])
    with pytest.raises(ValueError, match="backend"):
        _call(q, k, v, idx, cnt, backend="cuda")


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_triton_cpu_without_interpreter(monkeypatch):
    monkeypatch.setattr(bs, "triton_interpreter_enabled", lambda: False)
    q, k, v, idx, cnt = _small()
    with pytest.raises(ValueError, match="backend='torch'"):
        _call(q, k, v, idx, cnt, backend="triton")
    # "auto" picks the fallback for CPU tensors
    out = _call(q, k, v, idx, cnt, backend="auto", return_lse=False)
    assert torch.isfinite(out).all()


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("block_m,block_n,dim,dtype", [
    (128, 128, 128, torch.bfloat16), (384, 384, 128, torch.bfloat16), (48, 40, 72, torch.float16),
    (16, 16, 64, torch.float32), (64, 64, 256, torch.float16), (128, 128, 64, torch.float32),
])
def test_autotune_prune(block_m, block_n, dim, dtype, monkeypatch):
    """The pruning filter keeps tiles within the plan block (next power of two), never returns an
    empty list, and keeps the K/V pipeline inside an A100-sized shared memory."""
    from fastdit.kernels import block_sparse_triton as bst

    monkeypatch.setitem(bst._SMEM_CACHE, 0, 163 * 1024)
    q = torch.empty(1, 1, 8, dim, dtype=dtype)
    nargs = {"block_m": block_m, "block_n": block_n, "BLOCK_D": max(16, bst.next_pow2(dim)), "Q": q}
    kept = bst._prune_configs(bst.AUTOTUNE_CONFIGS, nargs)
    assert kept
    for c in kept:
        assert c.kwargs["BLOCK_M"] <= max(16, bst.next_pow2(block_m))
        assert c.kwargs["BLOCK_N"] <= max(16, bst.next_pow2(block_n))
        assert c.kwargs["BLOCK_M"] >= 16 and c.kwargs["BLOCK_N"] >= 16
    if block_m >= 128 and dtype != torch.float32 and dim <= 128:
        assert any(c.kwargs["BLOCK_M"] == 128 for c in kept), "128-row query tiles must stay candidates"


# -------------------------------------------------------------------------------------------------
# Bad plans: values (validated by default, on both backends)
# -------------------------------------------------------------------------------------------------

JUNK = 10**6  # in slots past the count: never read, never reported


def _plan_inputs(n_k=50, seed=5):
    """q (1, 2, 40, 16), k / v (1, 2, n_k, 16), blocks of 16: 3 query blocks, 4 key blocks when
    n_k = 50 (the last one partial). A sparse per-head plan with junk past the counts."""
    gen = seeded(seed)
    q = torch.randn(1, 2, 40, 16, generator=gen)
    k = torch.randn(1, 2, n_k, 16, generator=gen)
    v = torch.randn(1, 2, n_k, 16, generator=gen)
    idx = torch.tensor(
        [[[[2, 0, JUNK, JUNK], [1, 3, JUNK, JUNK], [3, JUNK, JUNK, JUNK]],
          [[0, 1, 3, JUNK], [JUNK, JUNK, JUNK, JUNK], [2, 0, JUNK, JUNK]]]],
        dtype=torch.int32,
    )
    cnt = torch.tensor([[[2, 2, 1], [3, 0, 2]]], dtype=torch.int32)
    return q, k, v, idx, cnt


def _bad_index(value):
    def make(q, k, v, idx, cnt):
        idx = idx.clone()
        idx[0, 1, 2, 1] = value  # a used slot (count 2)
        return q, k, v, idx, cnt
    return make


def _bad_count(value):
    def make(q, k, v, idx, cnt):
        cnt = cnt.clone()
        cnt[0, 0, 1] = value
        return q, k, v, idx, cnt
    return make


def _duplicate(q, k, v, idx, cnt):
    idx = idx.clone()
    idx[0, 1, 0, 2] = 0  # row (0, 1, 0) lists 0, 1, 0
    return q, k, v, idx, cnt


def _no_keys(q, k, v, idx, cnt):
    return q, k[:, :, :0], v[:, :, :0], idx, cnt


BAD_PLANS = {
    # name: (make, message pattern: the argument and entry named)
    "index_eq_n_blocks": (_bad_index(4), r"kv_indices\[0, 1, 2, 1\] = 4 is out of range: outside \[0, 4\), the 4 key blocks \(Nk=50"),
    "index_neg": (_bad_index(-1), r"kv_indices\[0, 1, 2, 1\] = -1 is out of range"),
    "index_huge": (_bad_index(10**6), r"kv_indices\[0, 1, 2, 1\] = 1000000 is out of range"),
    "count_over_width": (_bad_count(5), r"kv_counts\[0, 0, 1\] = 5 exceeds max_blocks = 4"),
    "count_neg": (_bad_count(-1), r"kv_counts\[0, 0, 1\] = -1 is negative"),
    "duplicate": (_duplicate, r"kv_indices\[0, 1, 0\] lists key block 0 twice \(slots 0 and 2\).*duplicate"),
    "no_keys_nonzero_count": (_no_keys, r"kv_counts\[0, 0, 0\] = 2 but there are no keys \(Nk=0"),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(BAD_PLANS))
def test_bad_plan_raises(name, backend):
    make, pattern = BAD_PLANS[name]
    q, k, v, idx, cnt = to_device(DEVICE, *make(*_plan_inputs()))
    with pytest.raises(ValueError, match="invalid block plan: .*" + pattern):
        block_sparse_attention(q, k, v, idx, cnt, 16, 16, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_shared_plan_raises(backend):
    """A plan broadcast over batch and heads (the shared-plan path of both backends)."""
    q, k, v, idx, cnt = to_device(DEVICE, *_plan_inputs())
    idx, cnt = idx[:, 1:].clone(), cnt[:, 1:]
    idx[0, 0, 0, 1] = 4
    with pytest.raises(ValueError, match=r"kv_indices\[0, 0, 0, 1\] = 4 is out of range"):
        block_sparse_attention(q, k, v, idx, cnt, 16, 16, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_debug_env_validates_even_without_validate(backend, monkeypatch):
    q, k, v, idx, cnt = to_device(DEVICE, *_duplicate(*_plan_inputs()))
    # validate=False skips the plan check: the duplicate is counted twice (undefined, but no error)
    out = block_sparse_attention(q, k, v, idx, cnt, 16, 16, backend=backend, validate=False, return_lse=False)
    assert out.shape == q.shape
    monkeypatch.setenv("FASTDIT_DEBUG", "1")
    with pytest.raises(ValueError, match=r"kv_indices\[0, 1, 0\] lists key block 0 twice"):
        block_sparse_attention(q, k, v, idx, cnt, 16, 16, backend=backend, validate=False)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("validate", [True, False])
def test_no_keys(backend, validate):
    """Nk = 0 with all counts 0: output 0 and lse -inf, the reference's answer for empty rows."""
    q, k, v, idx, cnt = to_device(DEVICE, *_no_keys(*_plan_inputs()))
    cnt = torch.zeros_like(cnt)
    out, lse = block_sparse_attention(q, k, v, idx, cnt, 16, 16, backend=backend, validate=validate)
    ref, ref_lse = dense_reference(q.cpu(), k.cpu(), v.cpu())
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == q.shape[:3]
    assert torch.equal(out.cpu().double(), ref) and (out == 0).all()
    assert torch.equal(lse.cpu().double(), ref_lse) and torch.isneginf(lse).all()


_SUBPROCESS_CASES = r"""
import sys, torch
from fastdit.kernels import block_sparse_attention
backend = sys.argv[1]
dev = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
q = torch.randn(1, 2, 40, 16, device=dev)
k = torch.randn(1, 2, 50, 16, device=dev)
empty = k[:, :, :0]
idx = torch.tensor([[[[0, 1], [1, 3], [3, 2]]]], dtype=torch.int32, device=dev)
cnt = torch.tensor([[[2, 2, 1]]], dtype=torch.int32, device=dev)
# no keys but counts >= 1: validated -> ValueError; unvalidated -> no crash, empty rows
try:
    block_sparse_attention(q, empty, empty, idx, cnt, 16, 16, backend=backend)
    print("no error")
except ValueError as e:
    print("ValueError", "kv_counts[" in str(e))
out, lse = block_sparse_attention(q, empty, empty, idx, cnt, 16, 16, backend=backend, validate=False)
print("empty", bool((out == 0).all()), bool(torch.isneginf(lse).all()))
# the backend functions themselves (below the op) are safe too
if backend == "triton":
    from fastdit.kernels.block_sparse_triton import block_sparse_attention_triton as direct
else:
    from fastdit.kernels.block_sparse_torch import block_sparse_attention_torch
    def direct(q, k, v, idx, cnt, *rest):
        return block_sparse_attention_torch(q, k, v, idx.long().expand(1, 2, 3, 2), cnt.long().expand(1, 2, 3), *rest)
out, lse = direct(q, empty, empty, idx, cnt, 16, 16, 0.25, None)
print("empty", bool((out == 0).all()), bool(torch.isneginf(lse).all()))
# the cases that crashed the Triton kernel: now ValueErrors before any launch
for i, c in (((0, 0, 1, 0), 4), ((0, 0, 1, 0), -1), ((0, 0, 1, 0), 10**6)):
    bad = idx.clone(); bad[i] = c
    try:
        block_sparse_attention(q, k, k, bad, cnt, 16, 16, backend=backend)
        print("no error")
    except ValueError as e:
        print("ValueError", "kv_indices[0, 0, 1, 0]" in str(e))
wide = cnt.clone(); wide[0, 0, 0] = 3
try:
    block_sparse_attention(q, k, k, idx, wide, 16, 16, backend=backend)
    print("no error")
except ValueError as e:
    print("ValueError", "kv_counts[0, 0, 0]" in str(e))
print("done")
"""


@pytest.mark.parametrize("backend", BACKENDS)
def test_former_crashes_in_subprocess(backend, tmp_path):
    """Inputs that used to kill the process (SIGFPE / SIGSEGV) now raise or return empty rows; run
    in a child so that a regression fails this test instead of the test session."""
    import os
    import subprocess
    import sys

    script = tmp_path / "cases.py"
    script.write_text(_SUBPROCESS_CASES)
    env = dict(os.environ)
    if backend == "triton" and not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    res = subprocess.run([sys.executable, str(script), backend], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, f"rc {res.returncode}: {res.stderr[-2000:]}"
    assert res.stdout.split("\n")[:-1] == ["ValueError True"] + ["empty True True"] * 2 + ["ValueError True"] * 4 + ["done"]
