"""Quantised block-sparse attention (``quant=``): the PyTorch emulation and the Triton kernels
against an independent float64 statement of the same quantisation (loops over blocks, plan masks
from ``plan_to_token_mask`` / ``varlen_to_token_mask``), really sparse plans, odd sizes, and the
option's checks on the methods. Every comparison also checks that the quantisation is visible
(the unquantised result is far outside the tolerance), so the tests can fail.
"""
from __future__ import annotations

import math
import zlib

import pytest
import torch

import fastdit
from fastdit.kernels import (block_sparse_attention, block_sparse_attention_varlen, plan_to_token_mask,
                             varlen_to_token_mask)
from fastdit.kernels.quant import check_quant
from fastdit.methods.base import OptionError, get_method

from kernel_backends import BACKENDS, seeded
from test_kernel_varlen import random_lists, random_offsets


def quant_reference(q, k, v, mask, q_groups, k_groups, scale, mode="int8"):
    """float64 ``(out, lse)``: ``mask`` bool ``(B, H, N, Nk)``, ``q_groups`` / ``k_groups`` per
    (b, h) lists of ``(start, end)`` row ranges sharing one scale. Written from the formulas of
    ``fastdit.kernels.quant.emulation`` with plain loops, in float64 except the quantisation steps
    the formulas state in float32 (smoothed keys, ``amax / 127`` and ``x / scale`` before rounding:
    where a quotient falls on a rounding boundary is part of the definition)."""
    batch, heads, n_q, dim = q.shape
    out = torch.zeros(batch, heads, n_q, dim, dtype=torch.float64)
    lse = torch.full((batch, heads, n_q), -math.inf, dtype=torch.float64)
    for b in range(batch):
        for h in range(heads):
            qd, vd = q[b, h].double(), v[b, h].double()
            mu = k[b, h].double().mean(0).float()
            k_smooth = k[b, h].float() - mu
            mu = mu.double()

            def quantize(x, groups):  # x float32
                x8, sc = torch.zeros(x.shape, dtype=torch.float64), torch.ones(x.shape[0], dtype=torch.float64)
                for s, e in groups:
                    if e == s:
                        continue
                    amax = x[s:e].abs().max()
                    step = amax / 127 if amax > 0 else torch.ones((), dtype=torch.float32)
                    x8[s:e] = torch.round(x[s:e] / step).clamp(-127, 127).double()
                    sc[s:e] = step.double()
                return x8, sc

            q8, qs = quantize(q[b, h].float(), q_groups[b][h])
            k8, ks = quantize(k_smooth, k_groups[b][h])
            s = (q8 @ k8.T) * qs[:, None] * ks[None, :] * scale
            if mode == "int8-fp8":
                vs = vd.abs().amax(0) / 448
                vd_used = (vd / vs).to(torch.float8_e4m3fn).double() * vs
            for i in range(n_q):
                row = s[i][mask[b, h, i]]
                if row.numel() == 0:
                    continue
                m = row.max()
                p = torch.exp(s[i] - m) * mask[b, h, i]
                if mode == "int8-fp8":
                    out[b, h, i] = (p * 448).to(torch.float8_e4m3fn).double() @ vd_used / (448 * p.sum())
                else:
                    out[b, h, i] = p.to(q.dtype).double() @ vd / p.sum()
                lse[b, h, i] = m + p.sum().log() + scale * (qd[i] @ mu)
    return out, lse


def fixed_groups(batch, heads, n, block):
    return [[[(s, min(n, s + block)) for s in range(0, n, block)] for _ in range(heads)] for _ in range(batch)]


def offset_groups(offsets, batch, heads):
    off = offsets.long().expand(batch, heads, -1)
    return [[[(int(off[b, h, j]), int(off[b, h, j + 1])) for j in range(off.shape[-1] - 1)] for h in range(heads)]
            for b in range(batch)]


def inputs(gen, shape_q, shape_k, dtype, key_offset=3.0):
    """Normal q, v; k with a large common offset per channel (what smoothing removes)."""
    q = torch.randn(shape_q, generator=gen)
    k = torch.randn(shape_k, generator=gen) + key_offset * torch.randn(shape_k[-1], generator=gen)
    v = torch.randn(shape_k, generator=gen)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def random_fixed_plan(gen, lead, n_qblocks, n_kblocks, density=0.3):
    """Per (b, h, query block) a random subset of about ``density`` of the key blocks (one query
    block empty), in random order, junk past the counts."""
    count = max(1, round(density * n_kblocks))
    idx = torch.full((*lead, n_qblocks, count + 1), 10**6, dtype=torch.int32)
    cnt = torch.randint(1, count + 1, (*lead, n_qblocks), generator=gen, dtype=torch.int32)
    cnt[..., 1] = 0
    flat, flat_cnt = idx.view(-1, n_qblocks, count + 1), cnt.view(-1, n_qblocks)
    for r in range(flat.shape[0]):
        for m in range(n_qblocks):
            flat[r, m, :int(flat_cnt[r, m])] = torch.randperm(n_kblocks, generator=gen)[:int(flat_cnt[r, m])].int()
    return idx, cnt


def assert_matches(out, lse, ref_out, ref_lse, plain_out, plain_lse, dtype):
    """``out`` / ``lse`` near the float64 reference, NaN-free, and the unquantised result far from it."""
    assert torch.isfinite(out.float()).all()
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)  # empty rows: -inf in both, nothing else
    lse_err = (lse.double() - ref_lse)[finite].abs().max().item()
    plain_lse_err = (plain_lse.double() - ref_lse)[finite].abs().max().item()
    out_err = ((out.double() - ref_out).norm() / ref_out.norm()).item()
    plain_out_err = ((plain_out.double() - ref_out).norm() / ref_out.norm()).item()
    out_tol = 1e-3 if dtype == torch.float16 else 6e-3
    assert lse_err < 2e-4 and out_err < out_tol, (lse_err, out_err)
    assert plain_lse_err > 10 * 2e-4 and (dtype != torch.float16 or plain_out_err > 3 * out_err), (
        plain_lse_err, plain_out_err)  # the test sees the quantisation
    assert (ref_out[~finite] == 0).all() and (out[~finite] == 0).all()


# name: (B, H, N, Nk, D, block_m, block_n, per-head plan, kv_valid)
FIXED = {
    "self_d24_perhead_valid": (2, 2, 77, 77, 24, 16, 12, True, True),
    "cross_d32_shared": (1, 3, 45, 70, 32, 13, 16, False, False),
}


TRITON = [p for p in BACKENDS if p.id == "triton"]
# the interpreter is slow: Triton runs one dtype per case (bfloat16 on the one with kv_valid)
FIXED_RUNS = [(case, dtype, "torch") for case in sorted(FIXED) for dtype in (torch.float16, torch.bfloat16)] + [
    pytest.param(case, dtype, "triton", marks=TRITON[0].marks, id=f"{case}-{dtype}-triton")
    for case, dtype in (("cross_d32_shared", torch.float16), ("self_d24_perhead_valid", torch.bfloat16))]


@pytest.mark.parametrize("case, dtype, backend", FIXED_RUNS)
def test_fixed_engine_against_float64(case, dtype, backend):
    B, H, N, Nk, D, bm, bn, per_head, use_valid = FIXED[case]
    gen = seeded(zlib.crc32(f"{case}/{dtype}".encode()))
    q, k, v = inputs(gen, (B, H, N, D), (B, H, Nk, D), dtype)
    idx, cnt = random_fixed_plan(gen, (B, H) if per_head else (1, 1), -(-N // bm), -(-Nk // bn))
    kv_valid = torch.rand(B, Nk, generator=gen) > 0.2 if use_valid else None
    mask = plan_to_token_mask(idx, cnt, N, Nk, bm, bn, kv_valid).expand(B, H, N, Nk)
    assert mask.float().mean() < 0.4  # really sparse
    scale = 0.7 / math.sqrt(D)
    out, lse = block_sparse_attention(q, k, v, idx, cnt, bm, bn, scale=scale, kv_valid=kv_valid, backend=backend,
                                      quant="int8")
    plain_out, plain_lse = block_sparse_attention(q, k, v, idx, cnt, bm, bn, scale=scale, kv_valid=kv_valid,
                                                  backend="torch")
    ref_out, ref_lse = quant_reference(q, k, v, mask, fixed_groups(B, H, N, bm), fixed_groups(B, H, Nk, bn), scale)
    assert_matches(out, lse, ref_out, ref_lse, plain_out, plain_lse, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_varlen_engine_against_float64(backend):
    B, H, N, Nk, D, Mq, Mk = 2, 2, 61, 70, 24, 6, 7
    dtype = torch.float16
    gen = seeded(28)
    q, k, v = inputs(gen, (B, H, N, D), (B, H, Nk, D), dtype)
    q_off = random_offsets(gen, N, Mq, (B, H), big=25)
    k_off = random_offsets(gen, Nk, Mk, (1, H), big=20).to(torch.int32)
    idx, cnt = random_lists(gen, (B, 1), Mq, Mk, max_count=Mk // 2)
    kv_valid = torch.rand(B, Nk, generator=gen) > 0.2
    mask = varlen_to_token_mask(q_off, k_off, idx, cnt, N, Nk, kv_valid)
    assert mask.float().mean() < 0.5
    out, lse = block_sparse_attention_varlen(q, k, v, q_off, k_off, idx, cnt, kv_valid=kv_valid, backend=backend,
                                             quant="int8")
    plain_out, plain_lse = block_sparse_attention_varlen(q, k, v, q_off, k_off, idx, cnt, kv_valid=kv_valid,
                                                         backend="torch")
    ref_out, ref_lse = quant_reference(q, k, v, mask, offset_groups(q_off, B, H), offset_groups(k_off, B, H),
                                       1 / math.sqrt(D))
    assert_matches(out, lse, ref_out, ref_lse, plain_out, plain_lse, dtype)


def test_fp8_emulation_against_float64():
    """The ``"int8-fp8"`` formulas (run through the emulation directly: the engine refuses the mode
    without FP8 tensor cores)."""
    from fastdit.kernels.quant import allowed_blocks, fixed_blocks, quant_attention_emulated

    B, H, N, D, bm = 1, 2, 50, 16, 16
    gen = seeded(89)
    q, k, v = inputs(gen, (B, H, N, D), (B, H, N, D), torch.bfloat16)
    idx, cnt = random_fixed_plan(gen, (B, H), -(-N // bm), -(-N // bm), density=0.5)
    mask = plan_to_token_mask(idx, cnt, N, N, bm, bm).expand(B, H, N, N)
    allowed = allowed_blocks(idx, cnt, B, H, -(-N // bm))
    blocks = fixed_blocks(N, bm, q.device)
    out, lse = quant_attention_emulated(q, k, v, blocks, blocks, allowed, 0.25, None, "int8-fp8")
    ref_out, ref_lse = quant_reference(q, k, v, mask, fixed_groups(B, H, N, bm), fixed_groups(B, H, N, bm), 0.25,
                                       "int8-fp8")
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert (lse.double() - ref_lse)[finite].abs().max() < 2e-4
    assert ((out.double() - ref_out).norm() / ref_out.norm()) < 1.5e-2  # e4m3 rounding near ties differs


def test_quant_lse_merges_like_the_plain_engine():
    """The lse undoes the smoothing: splitting the keys in two calls (each with its own mean) and
    merging through the lse gives the one-call result (what corrections and ring attention do)."""
    gen = seeded(5)
    q, k, v = inputs(gen, (1, 2, 40, 16), (1, 2, 64, 16), torch.float16)
    idx = torch.arange(4, dtype=torch.int32).expand(1, 1, 3, 4).contiguous()
    cnt = torch.full((1, 1, 3), 2, dtype=torch.int32)
    parts = [block_sparse_attention(q, k[:, :, s], v[:, :, s], idx, cnt, 16, 16, backend="torch", quant="int8")
             for s in (slice(0, 32), slice(32, 64))]
    (o1, l1), (o2, l2) = parts
    lse = torch.logaddexp(l1, l2)
    merged = o1.float() * (l1 - lse).exp()[..., None] + o2.float() * (l2 - lse).exp()[..., None]
    whole_idx = torch.tensor([0, 1, 2, 3], dtype=torch.int32).expand(1, 1, 3, 4).contiguous()
    plain, plain_lse = block_sparse_attention(q, k, v, whole_idx, torch.full((1, 1, 3), 4, dtype=torch.int32), 16, 16,
                                              backend="torch")
    # each half is quantised with its own scales, so the merge equals dense attention up to quantisation
    assert (lse - plain_lse).abs().max() < 0.05
    assert ((merged - plain.float()).norm() / plain.float().norm()) < 0.03


def test_nan_input_is_not_hidden():
    q, k, v = inputs(seeded(1), (1, 1, 32, 16), (1, 1, 32, 16), torch.float16)
    q[0, 0, 3, 2] = float("nan")
    idx = torch.arange(2, dtype=torch.int32).expand(1, 1, 2, 2).contiguous()
    out = block_sparse_attention(q, k, v, idx, torch.full((1, 1, 2), 2, dtype=torch.int32), 16, 16,
                                 backend="torch", quant="int8", return_lse=False)
    assert torch.isnan(out[0, 0, :16]).any()


def test_bad_modes_and_inputs():
    q = torch.zeros(1, 1, 16, 8)
    idx, cnt = torch.zeros(1, 1, 1, 1, dtype=torch.int32), torch.ones(1, 1, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        block_sparse_attention(q, q, q, idx, cnt, 16, 16, quant="int8")
    with pytest.raises(ValueError, match="not a quantisation mode.*'int8'"):
        block_sparse_attention(q.half(), q.half(), q.half(), idx, cnt, 16, 16, quant="int4")
    with pytest.raises(ValueError, match="compute capability 8.9"):
        check_quant("int8-fp8", torch.float16, "cpu")
    with pytest.raises(ValueError, match="skip_threshold and quant"):
        block_sparse_attention(q.half(), q.half(), q.half(), idx, cnt, 16, 16, quant="int8", skip_threshold=1.0)


@pytest.mark.parametrize("method", ["sta", "radial", "sparge", "svg", "svg2"])
def test_every_block_sparse_method_accepts_quant(method):
    cls = get_method(method)
    assert cls.make_config(quant="int8").quant == "int8"
    assert "quant has no backward" in cls(quant="int8").trainable_refusal()
    with pytest.raises(OptionError, match="quant"):
        cls.make_config(quant="fp4")
    with pytest.raises(OptionError, match="skip_threshold"):
        cls.make_config(quant="int8", skip_threshold=2.0)


@pytest.mark.parametrize("token", ["tome", "todo", "prune"])
def test_token_method_refuses_quant(token):
    assert not hasattr(get_method(token).config_cls(), "quant")
    with pytest.raises(OptionError, match=f"quant is an option of the block-sparse methods.*{token}"):
        get_method(token).make_config(quant="int8")


@pytest.mark.parametrize("method", ["sta", "svg2"])
def test_method_call_runs_quantised(method):
    """``fastdit.attention`` with ``quant``: float32 inputs refused at the call (naming the option),
    half inputs close to the unquantised call and not equal to it."""
    layout = fastdit.TokenLayout(grid=(2, 8, 8))
    gen = seeded(3)
    q, k, v = inputs(gen, (1, 2, layout.seq_len, 16), (1, 2, layout.seq_len, 16), torch.float16)
    options = dict(tile=(2, 4, 4), window=(1, 1, 1)) if method == "sta" else dict(q_clusters=4, k_clusters=4)
    with pytest.raises(OptionError, match="quant='int8' needs float16 or bfloat16"):
        fastdit.attention(q.float(), k.float(), v.float(), method=method, layout=layout, quant="int8", **options)
    out = fastdit.attention(q, k, v, method=method, layout=layout, quant="int8", **options)
    plain = fastdit.attention(q, k, v, method=method, layout=layout, **options)
    err = ((out.float() - plain.float()).norm() / plain.float().norm()).item()
    assert 1e-4 < err < 0.05, err


@pytest.mark.parametrize("backend", TRITON)
@pytest.mark.parametrize("varlen", [False, True])
def test_triton_matches_the_emulation(backend, varlen):
    """The Triton quantiser writes the emulation's INT8 values and scales bit for bit; the kernel's
    output and lse match the emulation to float32 rounding (online vs one-pass softmax)."""
    from fastdit.kernels.quant import fixed_blocks, quantize_blocks, smooth_keys, varlen_blocks
    from fastdit.kernels.quant.triton_fixed import quantize_triton

    gen = seeded(40 + varlen)
    B, H, N, D = 1, 2, 70, 40
    q, k, v = inputs(gen, (B, H, N, D), (B, H, N, D), torch.float16)
    offsets = random_offsets(gen, N, 5, (1, H), big=30) if varlen else None
    blocks = varlen_blocks(offsets, N) if varlen else fixed_blocks(N, 24, q.device)
    n_blocks = 5 if varlen else 3
    k_s, mu = smooth_keys(k)
    want8, _, want_scale = quantize_blocks(k_s, blocks, n_blocks)
    got8, got_scale = quantize_triton(k, None if varlen else 24, mean=mu, offsets=offsets)
    assert torch.equal(got8.float(), want8) and torch.equal(got_scale, want_scale)
    if varlen:
        idx, cnt = random_lists(gen, (B, H), 5, 5, max_count=2)
        args = (q, k, v, offsets, offsets, idx, cnt)
        run = block_sparse_attention_varlen
    else:
        idx, cnt = random_fixed_plan(gen, (B, H), 3, 3, density=0.5)
        args = (q, k, v, idx, cnt, 24, 24)
        run = block_sparse_attention
    out, lse = run(*args, backend="triton", quant="int8")
    e_out, e_lse = run(*args, backend="torch", quant="int8")
    finite = torch.isfinite(e_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert (lse - e_lse)[finite].abs().max() < 1e-5
    assert ((out.float() - e_out.float()).norm() / e_out.float().norm()) < 1e-3  # fp16 P rounded per tile


def test_compare_checks_quant_before_running():
    """``fastdit compare --set sta.quant=int8`` on a float32 model stops before the dense run, naming
    the option and the fix."""
    from types import SimpleNamespace

    from fastdit.cli.common import CLIError
    from fastdit.cli.compare import check_quant_options

    pipe = SimpleNamespace(transformer=SimpleNamespace(dtype=torch.float32, device=torch.device("cpu")))
    with pytest.raises(CLIError, match=r"--set sta.quant: quant='int8' needs float16.*--dtype bfloat16"):
        check_quant_options({"sta": {"quant": "int8"}}, pipe)
    pipe.transformer.dtype = torch.bfloat16
    check_quant_options({"sta": {"quant": "int8"}, "svg": {}}, pipe)  # fine
    with pytest.raises(CLIError, match="compute capability 8.9"):
        check_quant_options({"svg2": {"quant": "int8-fp8"}}, pipe)
