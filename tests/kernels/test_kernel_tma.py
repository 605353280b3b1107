"""The Hopper / Blackwell TMA variant of the fixed-size forward (``kernels/block_sparse_tma.py``).

Under the Triton interpreter (``TRITON_INTERPRET=1``; Triton 3.9's interpreter emulates tensor
descriptors, zero fill of out-of-bounds rows and columns included) the variant, forced with
``FASTDIT_TRITON_VARIANT=tma``, must equal the float64 reference on every case of
``test_kernel.py`` (odd sizes, key masks, rows without keys, bf16 / fp16 / fp32, the diffusers
layout) and the skip rule's float64 walk. Warp specialisation and the real TMA unit need a GPU:
the offline census (``test_offline_compile.py``) checks that their instructions are compiled in.
The choice of variant is checked with faked GPU capabilities (no GPU needed).
"""
from __future__ import annotations

import json

import pytest
import torch
import triton

from fastdit.kernels import block_sparse_attention, skip_reference
from fastdit.kernels import block_sparse_tma as tma
from fastdit.kernels import triton_tuning as tuning

from helpers import load_script
from kernel_backends import DEVICE, TRITON_OK, TRITON_SKIP_REASON, to_device
from test_kernel import CASES, _check, _make_case, poisoned_empty  # noqa: F401  (fixture)
from test_skip_threshold import _local_inputs, _pick_threshold, _plan

needs_triton = pytest.mark.skipif(not TRITON_OK, reason=TRITON_SKIP_REASON)


@pytest.fixture
def forced_tma(monkeypatch):
    """FASTDIT_TRITON_VARIANT=tma, and a count of the TMA kernel's launches."""
    monkeypatch.setenv(tma.VARIANT_ENV, "tma")
    launches = []
    real = tma.launch_tma

    def counting(grid, args, config, capability):
        launches.append(config)
        return real(grid, args, config, capability)

    monkeypatch.setattr(tma, "launch_tma", counting)
    return launches


@needs_triton
@pytest.mark.parametrize("name", list(CASES))
def test_tma_variant_matches_reference(name, forced_tma, poisoned_empty):  # noqa: F811
    q, k, v, idx, cnt, bm, bn, kv_valid = to_device(DEVICE, *_make_case(name))
    out, lse = block_sparse_attention(q, k, v, idx, cnt, bm, bn, kv_valid=kv_valid, backend="triton")
    assert forced_tma, "the TMA kernel did not run"
    empty_rows = _check(out, lse, q, k, v, idx, cnt, bm, bn, kv_valid)
    assert empty_rows.any(), "the case should contain rows without keys"


@needs_triton
@pytest.mark.parametrize("name", ["d72_f32_perhead_npow2_kvvalid", "d64_bf16_even"])
def test_tma_variant_strided_layout_and_scale(name, forced_tma):
    q, k, v, idx, cnt, bm, bn, kv_valid = to_device(DEVICE, *_make_case(name, layout="bnhd"))
    assert not q.is_contiguous() and q.stride(3) == 1  # (B, N, H, D) storage: TMA can take it
    out, lse = block_sparse_attention(q, k, v, idx, cnt, bm, bn, scale=0.3, kv_valid=kv_valid, backend="triton")
    assert forced_tma
    _check(out, lse, q, k, v, idx, cnt, bm, bn, kv_valid, scale=0.3)


@needs_triton
def test_tma_variant_equals_classic_kernel():
    """Same tiles, same order of operations: the two variants agree to float32 rounding."""
    q, k, v, idx, cnt, bm, bn, kv_valid = to_device(DEVICE, *_make_case("d72_f16_npow2_kvvalid"))
    results = {}
    for variant in ("cp_async", "tma"):
        with tuning.env_var(tma.VARIANT_ENV, variant):
            results[variant] = block_sparse_attention(q, k, v, idx, cnt, bm, bn, kv_valid=kv_valid, backend="triton")
    (o_c, l_c), (o_t, l_t) = results["cp_async"], results["tma"]
    assert (o_c.float() - o_t.float()).abs().max().item() < 2e-3
    assert torch.equal(torch.isneginf(l_c), torch.isneginf(l_t))
    fin = torch.isfinite(l_c)
    assert (l_c[fin] - l_t[fin]).abs().max().item() < 1e-4


@needs_triton
def test_tma_variant_skip_rule_matches_reference(forced_tma):
    """The skip rule in the TMA variant: outputs, lse and skipped counts of the float64 walk."""
    q, k, v, gen = _local_inputs(seed=1)
    batch, heads, n_q, _ = q.shape
    n_k = k.shape[2]
    block_m, block_n, tile = 40, 24, (16, 16)
    idx, cnt = _plan(gen, batch, heads, n_q, n_k, block_m, block_n)
    kv_valid = torch.rand(batch, n_k, generator=gen) > 0.15

    def ref_fn(thr):
        return skip_reference(q, k, v, idx, cnt, block_m, block_n, thr, tile, kv_valid=kv_valid)

    thr, ref = _pick_threshold(ref_fn, (3.0, 2.0, 5.0, 1.5, 8.0))
    args = [t.to(DEVICE) for t in (q, k, v, idx, cnt)]
    out, lse, skipped = block_sparse_attention(*args, block_m, block_n, kv_valid=kv_valid.to(DEVICE),
                                               backend="triton", skip_threshold=thr, skip_tile=tile,
                                               return_skipped=True)
    assert forced_tma == [(16, 16, 4, 1)]
    assert int(ref["skipped"].sum()) > 0 and torch.equal(skipped.cpu().long(), ref["skipped"])
    assert (out.cpu().double() - ref["out"]).abs().max().item() < 1e-4
    fin = torch.isfinite(ref["lse"])
    assert torch.equal(torch.isfinite(lse.cpu()), fin)
    assert (lse.cpu().double()[fin] - ref["lse"][fin]).abs().max().item() < 1e-4


@needs_triton
def test_auto_keeps_the_classic_kernel_under_the_interpreter(monkeypatch):
    launches = []
    monkeypatch.setattr(tma, "launch_tma", lambda *a: launches.append(a))
    monkeypatch.delenv(tma.VARIANT_ENV, raising=False)
    q, k, v, idx, cnt, bm, bn, kv_valid = to_device(DEVICE, *_make_case("d64_bf16_even"))
    out, lse = block_sparse_attention(q, k, v, idx, cnt, bm, bn, kv_valid=kv_valid, backend="triton")
    assert launches == []
    _check(out, lse, q, k, v, idx, cnt, bm, bn, kv_valid)


@needs_triton
def test_forced_tma_on_a_layout_it_cannot_take_fails_before_launch(forced_tma):
    q, k, v, idx, cnt, bm, bn, kv_valid = to_device(DEVICE, *_make_case("d64_bf16_even"))
    k_bad = k.transpose(2, 3).contiguous().transpose(2, 3)  # head-dim stride != 1
    with pytest.raises(ValueError, match=r"FASTDIT_TRITON_VARIANT=tma.*k has stride \d+ on the head dim"):
        block_sparse_attention(q, k_bad, v, idx, cnt, bm, bn, kv_valid=kv_valid, backend="triton")
    assert forced_tma == []


# -------------------------------------------------------------------------------------------------
# Which variant runs (faked GPUs: no device needed)
# -------------------------------------------------------------------------------------------------

@pytest.fixture
def table(tmp_path, monkeypatch):
    """The offline table replaced by ``rows`` of (kernel, capability, dtype, head dim, config, clean)."""
    path = tmp_path / "table.json"
    monkeypatch.setattr(tuning, "TABLE_PATH", path)

    def write(rows):
        path.write_text(json.dumps({"entries": [
            {"kernel": kern, "capability": cap, "dtype": dt, "head_dim": d, "config": list(cfg), "clean": clean,
             "registers": 100, "error": None, "triton": triton.__version__}
            for kern, cap, dt, d, cfg, clean in rows]}))
        tuning._table_verdicts.cache_clear()

    yield write
    tuning._table_verdicts.cache_clear()


def test_forced_tma_on_an_older_gpu_names_the_gpu_and_the_variant():
    for cap, name in ((80, "NVIDIA A100-SXM4-80GB"), (89, "NVIDIA L40S"), (86, "NVIDIA RTX A6000")):
        with pytest.raises(ValueError) as err:
            tma.forward_variant("tma", cap, name, "bf16", 128)
        text = str(err.value)
        assert name in text and f"sm_{cap}" in text and "TMA forward variant" in text and tma.VARIANT_ENV in text


def test_auto_choice_follows_the_offline_table(table):
    first, second = tuning.TMA_PREFERENCE[:2]
    table([("fixed_tma", 90, "bf16", 128, first, False), ("fixed_tma", 90, "bf16", 128, second, True),
           ("fixed_tma", 100, "bf16", 128, first, True), ("fixed_tma", 90, "fp16", 64, first, False)])
    assert tma.forward_variant("auto", 90, "H100", "bf16", 128) == "tma"
    assert tma.tma_config(90, 128, "bf16") == second
    assert tma.forward_variant("auto", 100, "B200", "bf16", 128) == "tma"
    assert tma.forward_variant("auto", 90, "H100", "fp16", 64) == "cp_async"  # nothing clean there
    assert tma.forward_variant("auto", 90, "H100", "bf16", 64) == "cp_async"  # not tabled
    assert tma.forward_variant("auto", 80, "A100", "bf16", 128) == "cp_async"  # never below sm_90
    assert tma.forward_variant("auto", 90, "H100", "bf16", 128, skip=True) == "cp_async"
    assert tma.forward_variant("auto", 90, "H100", "bf16", 128, layout_error="k has stride 2") == "cp_async"
    assert tma.forward_variant("auto", None, "cpu", "bf16", 128) == "cp_async"
    assert tma.forward_variant("cp_async", 90, "H100", "bf16", 128) == "cp_async"
    assert tma.forward_variant("tma", 90, "H100", "fp16", 64) == "tma"  # forced: runs where it can
    with pytest.raises(ValueError, match="H100.*k has stride 2"):
        tma.forward_variant("tma", 90, "H100", "bf16", 128, layout_error="k has stride 2")


def test_variant_env_is_checked(monkeypatch):
    monkeypatch.setenv(tma.VARIANT_ENV, "wgmma")
    with pytest.raises(ValueError, match=r"FASTDIT_TRITON_VARIANT='wgmma'.*auto, tma, cp_async"):
        tma.requested_variant()
    monkeypatch.setenv(tma.VARIANT_ENV, " TMA ")
    assert tma.requested_variant() == "tma"


def test_layout_rules():
    q = torch.zeros(1, 2, 40, 64, dtype=torch.bfloat16)
    assert tma.tma_layout_error(q, q, q) is None
    assert tma.tma_layout_error(q, q.transpose(2, 3).contiguous().transpose(2, 3), q).startswith("k has stride")
    odd = torch.zeros(1, 2, 40, 72, dtype=torch.bfloat16)[..., :60]  # token stride 144 B: fine
    assert tma.tma_layout_error(odd, odd, odd) is None
    odd = torch.zeros(1, 2, 40, 60, dtype=torch.bfloat16)  # token stride 120 B: not a multiple of 16
    assert "token stride (60 elements)" in tma.tma_layout_error(q, q, odd)


def test_warp_specialisation_only_on_blackwell():
    assert [tma.warp_spec_for(c) for c in (None, 80, 90, 100, 120)] == [False, False, False, True, False]


@needs_triton
def test_bench_script_checks_and_times_both_variants(tmp_path):
    """scripts/bench_tma.py (gpu_check.sh's tma part) end to end on tiny sizes: the float64 check of
    both variants passes and every row is timed."""
    bench = load_script("bench_tma")
    out = tmp_path / "tma.json"
    assert bench.main(["--device", DEVICE.type, "--tokens", "160", "--head-dims", "64", "--densities", "0.5",
                       "--runs", "1", "--heads", "1", "--check-tokens", "200,150", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert len(result["check"]) == 4 and all(r["ok"] for r in result["check"])
    rows = {r["row"]: r for r in result["rows"]}
    assert {"cp_async autotuned", "cp_async default", "tma"} <= set(rows)
    assert all(r["ms"] is not None and r["error"] is None for r in result["rows"])
