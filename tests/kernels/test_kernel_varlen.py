"""Variable-size block-sparse attention (``block_sparse_attention_varlen``): both backends against
the float64 reference ``varlen_reference`` (itself checked against a brute-force softmax), the
fixed-size engine on uniform offsets, the device-side row-tile schedule, every validation error,
and the custom op under ``torch.compile``. Sizes stay tiny for the Triton interpreter (its row
tiles are 16 rows, so a block of 30+ rows runs several tiles).
"""
from __future__ import annotations

import itertools
import math
import zlib

import pytest
import torch

from fastdit.kernels import (
    block_sparse_attention,
    block_sparse_attention_varlen,
    validate_varlen_plan,
    varlen_reference,
    varlen_to_token_mask,
)
from fastdit.kernels.block_sparse_varlen_torch import block_sparse_attention_varlen_torch
from fastdit.kernels.block_sparse_varlen_triton import launch_config, row_tile_schedule

from kernel_backends import BACKENDS, DEVICE, seeded, to_device

TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-2}
LSE_TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 1e-2}
JUNK = 10**6


def random_offsets(gen, total, n_blocks, lead, big=0):
    """``(lead..., n_blocks + 1)`` int64 boundaries from 0 to ``total``: per entry one empty block,
    one block of a single token, one of ``big`` tokens (when > 0), the rest a random split; the
    blocks in random order, block 0 not empty."""
    out = torch.zeros(*lead, n_blocks + 1, dtype=torch.int64)
    for pos in itertools.product(*(range(d) for d in lead)):
        fixed = [0, 1] + ([big] if big else [])
        rest = total - sum(fixed)
        n_rest = n_blocks - len(fixed)
        cuts = torch.sort(torch.randint(0, rest + 1, (n_rest - 1,), generator=gen)).values.tolist()
        sizes = fixed + [b - a for a, b in zip([0] + cuts, cuts + [rest])]
        sizes = [sizes[i] for i in torch.randperm(n_blocks, generator=gen).tolist()]
        first = next(i for i, size in enumerate(sizes) if size > 0)  # block 0 holds rows (it lists nothing)
        sizes[0], sizes[first] = sizes[first], sizes[0]
        out[tuple(pos)][1:] = torch.tensor(sizes).cumsum(0)
    return out


def random_lists(gen, lead, n_qblocks, n_kblocks, max_count):
    """Random key-block lists: distinct indices in random order, counts in [1, max_count] but
    query block 0 always empty, junk past the counts."""
    width = max_count + 1
    idx = torch.full((*lead, n_qblocks, width), JUNK, dtype=torch.int32)
    cnt = torch.randint(1, max_count + 1, (*lead, n_qblocks), generator=gen, dtype=torch.int32)
    cnt[..., 0] = 0
    flat_idx, flat_cnt = idx.view(-1, n_qblocks, width), cnt.view(-1, n_qblocks)
    for r in range(flat_idx.shape[0]):
        for m in range(n_qblocks):
            c = int(flat_cnt[r, m])
            flat_idx[r, m, :c] = torch.randperm(n_kblocks, generator=gen)[:c].int()
    return idx, cnt


# name: (B, H, N, Nk, D, Mq, Mk, q_lead, k_lead, plan_lead, kv_valid, layout)
CASES = {
    "perhead_d24_kvvalid": (2, 3, 77, 91, 24, 7, 9, (2, 3), (1, 3), (2, 1), True, "bhnd"),
    "shared_d32_bnhd": (1, 2, 64, 53, 32, 5, 6, (1, 1), (1, 1), (1, 1), False, "bnhd"),
    "batch_d16_dead_block": (2, 2, 45, 60, 16, 6, 6, (2, 1), (1, 1), (1, 2), True, "bhnd"),
}


def dead_query_block(q_off):
    """A query block (not block 0) with rows in every batch / head, the smallest such one."""
    sizes = (q_off[..., 1:] - q_off[..., :-1]).flatten(0, 1).amin(0).tolist()
    return min((size, m) for m, size in enumerate(sizes) if m > 0 and size > 0)[1]


def make_case(name, dtype):
    B, H, N, Nk, D, Mq, Mk, q_lead, k_lead, plan_lead, use_valid, layout = CASES[name]
    gen = seeded(zlib.crc32(f"{name}/{dtype}".encode()))
    shape_q, shape_k = ((B, N, H, D), (B, Nk, H, D)) if layout == "bnhd" else ((B, H, N, D), (B, H, Nk, D))
    q, k, v = (torch.randn(s, generator=gen) for s in (shape_q, shape_k, shape_k))
    if layout == "bnhd":  # the diffusers layout viewed as (B, H, N, D): not contiguous
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    q, k, v = (t.to(dtype) for t in (q, k, v))
    q_off = random_offsets(gen, N, Mq, q_lead, big=35)
    k_off = random_offsets(gen, Nk, Mk, k_lead, big=20).to(torch.int32)
    idx, cnt = random_lists(gen, plan_lead, Mq, Mk, max_count=Mk // 2)
    kv_valid = None
    if use_valid:
        kv_valid = torch.rand(B, Nk, generator=gen) > 0.25
        if k_lead == (1, 1):  # a whole key block invalid, and the only block of one query block
            sizes = (k_off[0, 0, 1:] - k_off[0, 0, :-1]).tolist()
            j = min((size, j) for j, size in enumerate(sizes) if size >= 2)[1]
            kv_valid[:, int(k_off[0, 0, j]):int(k_off[0, 0, j + 1])] = False
            m = dead_query_block(q_off)
            idx[..., m, 0], cnt[..., m] = j, 1
    return to_device(DEVICE, q, k, v, q_off, k_off, idx, cnt, kv_valid)


def check(out, lse, q, k, v, q_off, k_off, idx, cnt, kv_valid, scale=None):
    """Output against ``varlen_reference``; returns the rows with no attended key."""
    mask = varlen_to_token_mask(q_off, k_off, idx, cnt, q.shape[2], k.shape[2], kv_valid)
    mask = mask.expand(q.shape[0], q.shape[1], -1, -1)
    density = mask.float().mean().item()
    assert 0.02 < density < 0.75, f"the plan should be sparse (and not empty), density {density:.2f}"
    ref, ref_lse = varlen_reference(q, k, v, q_off, k_off, idx, cnt, scale, kv_valid)
    out, lse = out.cpu(), lse.cpu()
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    assert lse.shape == q.shape[:3] and lse.dtype == torch.float32
    assert torch.isfinite(out).all() and not torch.isnan(lse).any()
    rel = ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    assert rel < TOL[q.dtype], f"relative error {rel:.3e}"
    empty = ~mask.any(-1)
    assert torch.equal(torch.isneginf(lse), empty) and torch.equal(torch.isneginf(ref_lse), empty)
    assert (out[empty] == 0).all(), "rows with no attended key must be exactly 0"
    fin = ~empty
    err = (lse.double()[fin] - ref_lse[fin]).abs() / ref_lse[fin].abs().clamp_min(1.0)
    assert err.max().item() < LSE_TOL[q.dtype], f"lse error {err.max().item():.3e}"
    return empty


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_against_reference(case, dtype, backend):
    q, k, v, q_off, k_off, idx, cnt, kv_valid = make_case(case, dtype)
    out, lse = block_sparse_attention_varlen(q, k, v, q_off, k_off, idx, cnt, kv_valid=kv_valid, backend=backend)
    empty = check(out, lse, q, k, v, q_off, k_off, idx, cnt, kv_valid)
    assert empty.any(), "each case has rows with no attended key (query block 0 lists none)"
    if case == "batch_d16_dead_block":  # this query block lists only an invalid key block: no key either
        m = dead_query_block(q_off.cpu())
        for b in range(q.shape[0]):
            rows = range(int(q_off[b, 0, m]), int(q_off[b, 0, m + 1]))
            assert len(rows) > 0 and all(bool(empty[b, :, r].all()) for r in rows)


@pytest.mark.parametrize("case", list(CASES))
def test_torch_unfused_path(case):
    """The float32 masked-softmax steps the torch backend runs off the CPU (a GPU without Triton)."""
    q, k, v, q_off, k_off, idx, cnt, kv_valid = make_case(case, torch.float32)
    scale = 1 / math.sqrt(q.shape[-1])
    out, lse = block_sparse_attention_varlen_torch(q, k, v, q_off, k_off, idx, cnt, scale, kv_valid, fused=False)
    check(out, lse, q, k, v, q_off, k_off, idx, cnt, kv_valid)


@pytest.mark.parametrize("backend", BACKENDS)
def test_scale_and_out_only(backend):
    q, k, v, q_off, k_off, idx, cnt, kv_valid = make_case("perhead_d24_kvvalid", torch.float32)
    out = block_sparse_attention_varlen(q, k, v, q_off, k_off, idx, cnt, scale=0.3, kv_valid=kv_valid,
                                        return_lse=False, backend=backend)
    ref, _ = varlen_reference(q, k, v, q_off, k_off, idx, cnt, 0.3, kv_valid)
    assert ((out.cpu().double() - ref).norm() / ref.norm()).item() < 1e-4


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("blocks", [(16, 16), (20, 12)])
def test_uniform_offsets_equal_fixed_engine(backend, blocks):
    """Offsets ``m * b`` (the last block cut at N) are the fixed-size plan: same result as
    ``block_sparse_attention`` with ``block_m = b``."""
    bm, bn = blocks
    gen = seeded(bm * 100 + bn)
    B, H, N, Nk, D = 1, 2, 50, 45, 32
    q, k, v = (torch.randn(B, H, n, D, generator=gen) for n in (N, Nk, Nk))
    mq, mk = -(-N // bm), -(-Nk // bn)
    q_off = (torch.arange(mq + 1) * bm).clamp(max=N).view(1, 1, -1)
    k_off = (torch.arange(mk + 1) * bn).clamp(max=Nk).view(1, 1, -1)
    idx, cnt = random_lists(gen, (1, H), mq, mk, max_count=2)
    kv_valid = torch.rand(B, Nk, generator=gen) > 0.2
    q, k, v, q_off, k_off, idx, cnt, kv_valid = to_device(DEVICE, q, k, v, q_off, k_off, idx, cnt, kv_valid)
    out, lse = block_sparse_attention_varlen(q, k, v, q_off, k_off, idx, cnt, kv_valid=kv_valid, backend=backend)
    f_out, f_lse = block_sparse_attention(q, k, v, idx, cnt, bm, bn, kv_valid=kv_valid, backend=backend)
    check(out, lse, q, k, v, q_off, k_off, idx, cnt, kv_valid)
    assert torch.allclose(out, f_out, atol=1e-5, rtol=1e-5)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(f_lse))
    fin = torch.isfinite(lse)
    assert torch.allclose(lse[fin], f_lse[fin], atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_blocks_at_the_ends(backend):
    """Empty blocks first and last (starting at 0 / at N or Nk) in one head, none in the other."""
    gen = seeded(5)
    q, k, v = (torch.randn(1, 2, n, 16, generator=gen) for n in (40, 33, 33))
    q_off = torch.tensor([[[0, 9, 20, 31, 40], [0, 0, 22, 40, 40]]])  # the last (b, h): an out-of-range trap
    k_off = torch.tensor([[[0, 12, 33, 33], [0, 0, 17, 33]]])
    idx = torch.tensor([[[[2, 1], [0, JUNK], [1, 2], [0, 2]], [[1, 2], [0, 1], [2, JUNK], [1, JUNK]]]],
                       dtype=torch.int32)
    cnt = torch.tensor([[[2, 1, 2, 2], [2, 2, 1, 1]]], dtype=torch.int32)
    args = to_device(DEVICE, q, k, v, q_off, k_off, idx, cnt)
    out, lse = block_sparse_attention_varlen(*args, backend=backend)
    check(out, lse, *args, None)


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_keys(backend):
    """Nk = 0 (one boundary, no key block): every row is empty."""
    q = torch.randn(1, 2, 9, 16, device=DEVICE)
    k = torch.randn(1, 2, 0, 16, device=DEVICE)
    q_off = torch.tensor([[[0, 4, 9]]], device=DEVICE)
    k_off = torch.zeros(1, 1, 1, dtype=torch.int32, device=DEVICE)
    idx = torch.zeros(1, 1, 2, 1, dtype=torch.int32, device=DEVICE)
    cnt = torch.zeros(1, 1, 2, dtype=torch.int32, device=DEVICE)
    out, lse = block_sparse_attention_varlen(q, k, k, q_off, k_off, idx, cnt, backend=backend)
    assert (out == 0).all() and torch.isneginf(lse).all()


def test_reference_against_brute_force():
    """``varlen_reference`` against a softmax written out row by row in Python floats."""
    gen = seeded(7)
    q, k, v = (torch.randn(1, 2, n, 3, generator=gen) for n in (6, 7, 7))
    q_off = torch.tensor([[[0, 2, 2, 6]], [[0, 1, 5, 6]]]).view(1, 2, 4)
    k_off = torch.tensor([[[0, 3, 4, 7]]])
    idx = torch.tensor([[[[2, 0], [1, JUNK], [1, 2]]], [[[0, JUNK], [2, 1], [JUNK, JUNK]]]]).view(1, 2, 3, 2)
    cnt = torch.tensor([[[2, 1, 2], [1, 2, 0]]])
    kv_valid = torch.tensor([[True, False, True, True, True, True, False]])
    out, lse = varlen_reference(q, k, v, q_off, k_off, idx, cnt, 0.7, kv_valid)
    for h in range(2):
        offs, koffs = q_off[0, h].tolist(), k_off[0, 0].tolist()
        for i in range(6):
            m = max(b for b in range(3) if offs[b] <= i and (offs[b + 1] > i))
            keys = [t for j in idx[0, h, m, :cnt[0, h, m]].tolist() for t in range(koffs[j], koffs[j + 1])
                    if kv_valid[0, t]]
            if not keys:
                assert math.isinf(lse[0, h, i]) and lse[0, h, i] < 0 and (out[0, h, i] == 0).all()
                continue
            s = [0.7 * sum(float(q[0, h, i, d]) * float(k[0, h, t, d]) for d in range(3)) for t in keys]
            z = sum(math.exp(x) for x in s)
            want = [sum(math.exp(x) / z * float(v[0, h, t, d]) for x, t in zip(s, keys)) for d in range(3)]
            assert abs(float(lse[0, h, i]) - math.log(z)) < 1e-12
            assert max(abs(float(out[0, h, i, d]) - want[d]) for d in range(3)) < 1e-12


def test_row_tile_schedule_covers_every_row_once():
    gen = seeded(3)
    n, block_m = 200, 16
    q_off = random_offsets(gen, n, 12, (2, 3), big=70)
    n_slots = 12 + -(-n // block_m)
    block, tile = row_tile_schedule(q_off, block_m, n_slots)
    for b in range(2):
        for h in range(3):
            seen = torch.zeros(n, dtype=torch.int64)
            offs = q_off[b, h].tolist()
            for m, t in zip(block[b, h].tolist(), tile[b, h].tolist()):
                if m == 12:  # past the pair's last tile
                    continue
                start = offs[m] + t * block_m
                assert start < offs[m + 1], "a slot must start inside its block"
                seen[start:min(start + block_m, offs[m + 1])] += 1
            assert (seen == 1).all()
            assert block[b, h, -1] == 12, "the bound leaves spare slots for this split"


# -------------------------------------------------------------------------------------------------
# Bad input and bad plans
# -------------------------------------------------------------------------------------------------

def _small():
    """B=1, H=2, N=10, Nk=12, D=16; 3 query blocks, 3 key blocks; a valid plan."""
    gen = seeded(11)
    q = torch.randn(1, 2, 10, 16, generator=gen)
    k, v = torch.randn(1, 2, 12, 16, generator=gen), torch.randn(1, 2, 12, 16, generator=gen)
    q_off = torch.tensor([[[0, 3, 3, 10], [0, 5, 9, 10]]], dtype=torch.int32)
    k_off = torch.tensor([[[0, 4, 5, 12]]], dtype=torch.int32)
    idx = torch.tensor([[[[0, 2], [1, JUNK], [2, 1]]]], dtype=torch.int32)
    cnt = torch.tensor([[[2, 1, 2]]], dtype=torch.int32)
    return q, k, v, q_off, k_off, idx, cnt


BAD_PLANS = [
    ("q_offsets", (0, 0, 0), 1, r"q_offsets\[0, 0, 0\] = 1: the first offset must be 0"),
    ("q_offsets", (0, 1, 3), 9, r"q_offsets\[0, 1, 3\] = 9: the last offset must be 10"),
    ("q_offsets", (0, 1, 2), 4, r"q_offsets\[0, 1, 2\] = 4 is below q_offsets\[0, 1, 1\] = 5: offsets must be "
                                r"non-decreasing"),
    ("k_offsets", (0, 0, 3), 13, r"k_offsets\[0, 0, 3\] = 13: the last offset must be 12"),
    ("k_offsets", (0, 0, 2), 3, r"k_offsets\[0, 0, 2\] = 3 is below k_offsets\[0, 0, 1\] = 4"),
    ("kv_counts", (0, 0, 1), 3, r"kv_counts\[0, 0, 1\] = 3 exceeds max_blocks = 2"),
    ("kv_counts", (0, 0, 2), -1, r"kv_counts\[0, 0, 2\] = -1 is negative"),
    ("kv_indices", (0, 0, 2, 1), 3, r"kv_indices\[0, 0, 2, 1\] = 3 is out of range: outside \[0, 3\)"),
    ("kv_indices", (0, 0, 0, 1), 0, r"kv_indices\[0, 0, 0\] lists key block 0 twice"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name, where, value, message", BAD_PLANS, ids=[m[:30] for *_, m in BAD_PLANS])
def test_bad_plan_values(name, where, value, message, backend, monkeypatch):
    args = _small()
    pos = ("q", "k", "v", "q_offsets", "k_offsets", "kv_indices", "kv_counts").index(name)
    bad = args[pos].clone()
    bad[where] = value
    args = args[:pos] + (bad,) + args[pos + 1:]
    args = to_device(DEVICE, *args)
    with pytest.raises(ValueError, match=message):
        block_sparse_attention_varlen(*args, backend=backend)
    assert validate_varlen_plan(*args[3:], 10, 12), "validate_varlen_plan reports it too"
    monkeypatch.setenv("FASTDIT_DEBUG", "1")  # validates even with validate=False
    with pytest.raises(ValueError, match=message):
        block_sparse_attention_varlen(*args, backend=backend, validate=False)


def test_valid_plan_has_no_problems():
    assert validate_varlen_plan(*_small()[3:], 10, 12) == []


def test_bad_shapes_and_types():
    q, k, v, q_off, k_off, idx, cnt = _small()

    def call(**over):
        kw = dict(q=q, k=k, v=v, q_offsets=q_off, k_offsets=k_off, kv_indices=idx, kv_counts=cnt, backend="torch")
        kw.update(over)
        return block_sparse_attention_varlen(**kw)

    with pytest.raises(ValueError, match=r"\bq\b.*rank 4"):
        call(q=q[0])
    with pytest.raises(ValueError, match="share one dtype"):
        call(k=k.half())
    with pytest.raises(ValueError, match=r"q_offsets must be int32 \(or int64\), got torch.float32"):
        call(q_offsets=q_off.float())
    with pytest.raises(ValueError, match="k_offsets must have rank 3"):
        call(k_offsets=k_off[0])
    with pytest.raises(ValueError, match=r"kv_indices shape \(1, 1, 2, 2\) lists 2 query blocks but q_offsets has 3"):
        call(kv_indices=idx[:, :, :2], kv_counts=cnt[:, :, :2])
    with pytest.raises(ValueError, match=r"kv_counts shape \(1, 1, 2\) must equal"):
        call(kv_counts=cnt[:, :, :2])
    with pytest.raises(ValueError, match=r"k_offsets shape \(1, 3, 4\): leading dims must be \(1 or 1, 2 or 1\)"):
        call(k_offsets=k_off.expand(1, 3, 4))
    with pytest.raises(ValueError, match="q_offsets needs at least one entry"):
        call(q_offsets=q_off[..., :0])
    with pytest.raises(ValueError, match="kv_indices is on meta"):
        call(kv_indices=idx.to("meta"))
    with pytest.raises(ValueError, match="kv_valid shape"):
        call(kv_valid=torch.ones(1, 11, dtype=torch.bool))
    with pytest.raises(ValueError, match="backend must be one of"):
        call(backend="cuda")


# -------------------------------------------------------------------------------------------------
# The custom op under torch.compile
# -------------------------------------------------------------------------------------------------

def _attend(q, k, v, q_off, k_off, idx, cnt, kv_valid, backend="torch"):
    out, lse = block_sparse_attention_varlen(q, k, v, q_off, k_off, idx, cnt, kv_valid=kv_valid, backend=backend)
    return out * 2.0, lse


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("compile_backend", ["eager", "aot_eager"])
def test_compile_one_opaque_call(compile_backend, backend):
    torch._dynamo.reset()
    args = make_case("perhead_d24_kvvalid", torch.float32)
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def attend(*a):
        return _attend(*a, backend=backend)

    with torch.no_grad():
        eager = attend(*args)
        out, lse = torch.compile(attend, backend=compile_backend, fullgraph=True)(*args)
        torch._dynamo.reset()
        torch.compile(attend, backend=capture, fullgraph=True)(*args)
    assert torch.equal(out, eager[0]) and torch.equal(lse, eager[1])
    check(out / 2, lse, *args)
    (gm,) = graphs
    names = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert sum("fastdit.block_sparse_attention_varlen" in n for n in names) == 1, names
    assert sum("fastdit.check_varlen_plan" in n for n in names) == 1, names


@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck(backend):
    q, k, v, q_off, k_off, idx, cnt, kv_valid = make_case("batch_d16_dead_block", torch.float32)
    op = torch.ops.fastdit.block_sparse_attention_varlen.default
    torch.library.opcheck(op, (q, k, v, q_off, k_off, idx, cnt, 0.25, kv_valid, backend))
    torch.library.opcheck(torch.ops.fastdit.check_varlen_plan.default, (q_off, k_off, idx, cnt, 45, 60))


def test_launch_config_follows_mean_block_sizes():
    """GPU tiles: key chunks no longer than the mean key block allows, 128-row tiles only for big blocks."""
    assert launch_config(32760, 100, 32760, 500, 128) == (128, 32, 8, 2)   # svg2-like: 328-row / 66-key blocks
    assert launch_config(12288, 192, 12288, 96, 64) == (64, 64, 4, 2)
    assert launch_config(1000, 10, 1000, 100, 256) == (64, 16, 4, 2)
