"""The GPU cost model (``fastdit.costmodel``), its CLI (``fastdit.eval.predict``) and the
patch-time "is sparse worth it" warning."""
import json
import math
import warnings

import pytest
import torch

import fastdit
from fastdit import costmodel
from fastdit.costmodel import GPUS
from fastdit.plan import BlockPlan

from tiny_transformers import tiny_wan, wan_inputs

H100 = GPUS["H100"]


def test_dense_call_is_flops_over_the_rate():
    b, h, n, d = 2, 12, 32760, 128
    call = costmodel.dense_call(H100, b, h, n, n, d)
    flops = 2 * (2 * n * n * d) * b * h  # Q K^T and P V, 2 FLOPs a multiply-add
    assert call.flops == flops
    expected_ms = flops / (989e12 * H100.sdpa_eff) * 1e3 + costmodel.LAUNCH_US * 1e-3  # compute-bound at this size
    assert call.total_ms == pytest.approx(expected_ms, rel=1e-12)
    # memory-bound when the sequence is short: bytes over bandwidth instead
    tiny = costmodel.dense_call(H100, 1, 1, 64, 64, 128)
    assert tiny.kernel_ms == pytest.approx(4 * 64 * 128 * 2 / (3350e9 * 0.8) * 1e3 + 5e-3, rel=1e-12)


def test_plan_pairs_counts_whole_kernel_tiles():
    """Every listed (query block, key block) costs its blocks rounded up to kernel tiles, over every
    batch element and head, also when the plan broadcasts over them."""
    g = torch.Generator().manual_seed(3)
    n_blocks, block_m, block_n = 7, 100, 70
    counts = torch.randint(0, n_blocks + 1, (1, 3, n_blocks), generator=g, dtype=torch.int32)
    indices = torch.zeros(1, 3, n_blocks, n_blocks, dtype=torch.int32)
    plan = BlockPlan(indices, counts, block_m, block_n, seq_len=650)
    tile = (64, 32)
    brute = 0
    for b in range(2):  # batch 2 over a broadcast batch
        for head in range(3):
            for m in range(n_blocks):
                for _ in range(int(counts[0, head, m])):
                    for _row_tile in range(math.ceil(block_m / tile[0])):
                        for _col_tile in range(math.ceil(block_n / tile[1])):
                            brute += tile[0] * tile[1]
    assert costmodel.plan_pairs(plan, 2, 3, tile) == brute


def test_sparse_plan_is_predicted_faster_and_a_full_plan_slower():
    n, heads, d, block = 32768, 12, 128, 128
    blocks = n // block
    full = BlockPlan(torch.arange(blocks, dtype=torch.int32).expand(1, 1, blocks, blocks).contiguous(),
                     torch.full((1, 1, blocks), blocks, dtype=torch.int32), block, block, seq_len=n)
    dense = costmodel.dense_call(H100, 1, heads, n, n, d)
    everything = costmodel.plan_call(H100, full, 1, heads, d)
    assert everything.density == pytest.approx(1.0)
    # same work at the kernel's lower efficiency
    assert everything.total_ms / dense.total_ms == pytest.approx(H100.sdpa_eff / H100.kernel_eff, rel=1e-3)
    tenth = costmodel.density_call(H100, 0.1, 1, heads, n, d, dynamic=False)
    assert 5 < dense.total_ms / tenth.total_ms < 10  # 0.1 of the work at 2/3 of the efficiency


def test_no_prediction_on_cpu_and_a_warning_text_when_gain_is_small():
    q = torch.randn(1, 2, 256, 64)
    n_blocks = 2
    plan = BlockPlan(torch.tensor([[[[0, 1], [0, 1]]]], dtype=torch.int32), torch.full((1, 1, n_blocks), 2, dtype=torch.int32),
                     128, 128, seq_len=256)
    assert costmodel.gpu_for(q.device) is None
    assert costmodel.worth_warning("sta", q, q, {"plan": plan}) is None  # CPU: the model does not cover it
    gpu, dense, call = costmodel.call_gain(q, q, {"plan": plan}, gpu=H100)
    assert call.total_ms >= dense.total_ms  # a full plan never beats dense
    assert costmodel.call_gain(q, q, {"dense": True}, gpu=H100) is None


def test_patch_warns_once_when_the_predicted_gain_is_small(monkeypatch):
    """On a modelled GPU (pretended here: the CPU tensors are costed as an H100's), a tiny model's
    calls are all launch overhead: one warning naming the prediction, however many calls."""
    model, inputs = tiny_wan(), wan_inputs()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with fastdit.patch(model, "sta", tile=(1, 2, 2), window=(1, 3, 3), dense_steps=0), torch.no_grad():
            model(**inputs)
            model(**inputs)
    assert not [w for w in caught if "predicted to gain" in str(w.message)]  # CPU: no prediction, no warning

    monkeypatch.setattr(costmodel, "gpu_for", lambda device=None: H100)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with fastdit.patch(model, "sta", tile=(1, 2, 2), window=(1, 3, 3), dense_steps=0), torch.no_grad():
            model(**inputs)
            model(**inputs)
    mine = [str(w.message) for w in caught if "predicted to gain" in str(w.message)]
    assert len(mine) == 1, mine
    assert "'sta'" in mine[0] and "H100" in mine[0] and "ms" in mine[0]


def test_predict_cli_rows(tmp_path):
    from fastdit.eval import predict

    out = tmp_path / "pred.json"
    assert predict.main(["--models", "wan", "--gpus", "H100,RTX 4090", "--methods", "sta,sparge",
                         "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {(r["gpu"], r["method"]) for r in rows} == {(g, m) for g in ("H100", "RTX 4090")
                                                      for m in ("dense", "sta", "sparge")}
    shape = predict.model_shape("wan")
    assert shape.tokens == 21 * 30 * 52 and shape.layers == 30
    for r in rows:
        assert all(math.isfinite(v) for v in (r["attention_ms"], r["forward_ms"]))
        if r["method"] == "dense":
            assert r["attention_speedup"] == 1.0 and r["density"] == 1.0
        else:
            assert 0 < r["density"] < 1 and r["attention_speedup"] > 1
            assert 1 < r["forward_speedup"] < r["attention_speedup"]  # Amdahl: the rest does not shrink
        assert 0 < r["attention_share"] < 1
    sta = next(r for r in rows if r["method"] == "sta" and r["gpu"] == "H100")
    dense = next(r for r in rows if r["method"] == "dense" and r["gpu"] == "H100")
    other = dense["forward_ms"] - 30 * dense["attention_ms"]  # the same non-attention time
    assert sta["forward_ms"] == pytest.approx(other + 30 * sta["attention_ms"], rel=1e-9)
    with pytest.raises(SystemExit, match="not modelled"):
        predict.main(["--methods", "tome"])
    with pytest.raises(SystemExit, match="unknown GPU"):
        predict.main(["--gpus", "V100"])


def test_measured_efficiency_replaces_the_assumed_one(tmp_path):
    """``with_measured_efficiency`` (scripts/bench_tma.py's output): the kernel's time scales with
    1 / kernel_eff exactly where the kernel is compute-bound, dense SDPA with 1 / sdpa_eff; the best
    variant is taken unless one is named; bad values and unknown variants are refused."""
    import json

    import pytest

    from fastdit import costmodel
    from fastdit.eval import predict

    h100 = costmodel.GPUS["H100"]
    measured = {"sdpa_eff": 0.5, "kernel_eff cp_async autotuned": 0.2, "kernel_eff tma": 0.4,
                "kernel_eff cp_async default": None}
    gpu = costmodel.with_measured_efficiency(h100, measured)
    assert gpu.sdpa_eff == 0.5 and gpu.kernel_eff == 0.4 and "measured" in gpu.source
    assert costmodel.with_measured_efficiency(h100, measured, variant="cp_async autotuned").kernel_eff == 0.2
    assumed = costmodel.density_call(h100, 0.5, 1, 24, 32760, 128, dynamic=False).kernel_ms
    faster = costmodel.density_call(gpu, 0.5, 1, 24, 32760, 128, dynamic=False).kernel_ms
    launch = 1e-3 * costmodel.LAUNCH_US
    assert (assumed - launch) / (faster - launch) == pytest.approx(0.4 / h100.kernel_eff, rel=1e-6)
    dense_assumed = costmodel.dense_call(h100, 1, 24, 32760, 32760, 128).total_ms - launch
    dense_measured = costmodel.dense_call(gpu, 1, 24, 32760, 32760, 128).total_ms - launch
    assert dense_assumed / dense_measured == pytest.approx(0.5 / h100.sdpa_eff, rel=1e-6)
    with pytest.raises(ValueError, match="variant 'wgmma'"):
        costmodel.with_measured_efficiency(h100, measured, variant="wgmma")
    with pytest.raises(ValueError, match="sdpa_eff must be in"):
        costmodel.with_measured_efficiency(h100, {"sdpa_eff": 1.7})
    path = tmp_path / "bench_tma.json"
    path.write_text(json.dumps({"gpu": "NVIDIA H100", "efficiency": measured}))
    out = tmp_path / "pred.json"
    assert predict.main(["--gpus", "H100", "--models", "wan", "--methods", "sta", "--efficiency", str(path),
                         "--json", str(out)]) == 0
    saved = json.loads(out.read_text())["gpus"]["H100"]
    assert saved["sdpa_eff"] == 0.5 and saved["measured_kernel_eff"] == 0.4
