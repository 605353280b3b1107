"""The benchmarks' CPU versions: the attention benchmark's patched path (``--path patched --quick``)
and the transformer benchmark at ``--scale tiny``, run in-process; their JSON must hold the
expected rows, finite times and, for sparse methods, densities below 1. Plus cheap checks of the
published configs, the budget's skip rows and the GPU script's syntax."""
import json
import math
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from fastdit.eval.bench import attention as bench_attention
from fastdit.eval.bench import transformer as bench_transformer
from fastdit.eval.bench import transformer_models as bench_transformer_models

ROOT = Path(__file__).resolve().parents[2]
SPARSE = ("sta", "radial")


def _finite_positive(x):
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.mark.slow
def test_attention_patched_path_cpu(tmp_path):
    out = tmp_path / "attention.json"
    assert bench_attention.main(["--path", "patched", "--quick", "--reps", "1", "--warmup", "0",
                                 "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    meta = report["meta"]
    assert meta["path"] == "patched" and meta["timer"] == "perf_counter"
    for key in ("timestamp", "cpu", "torch", "triton"):
        assert key in meta
    rows = report["rows"]
    assert all(r["path"] == "patched" for r in rows)
    by = {(r["case"], r["method"], r["impl"]): r for r in rows}
    expected = {("wan480", "dense", "sdpa"), ("hunyuan720", "dense", "sdpa"), ("hunyuan720", "dense", "sdpa_nomask")}
    expected |= {(case, m, impl) for case in ("wan480", "hunyuan720") for m in SPARSE
                 for impl in ("kernel", "run_plan", "attention")}
    assert set(by) == expected
    for r in rows:
        assert _finite_positive(r["time_ms"]), r
        assert len(r["times_ms"]) == 1 and r["reps"] == 1 and r["warmup"] == 0
        assert r["torch"] == torch.__version__ and r["gpu"] is None
        if r["method"] == "dense":
            assert r["density"] == 1.0
            continue
        assert 0 < r["density"] < 1, r
        assert 0 < r["block_density"] < 1, r
        assert r["rel_err_kernel_vs_attention"] < 1e-5, r  # the same computation
        launch = r["kernel_launch"]  # what the engine ran: only the Triton backend reports it
        assert launch is None if r["backend"] != "triton" else launch["variant"] in ("tma", "cp_async"), r
        assert r["config"]["dense_steps"] == 0 and r["plan"].startswith(r["method"])
        assert _finite_positive(r["speedup"]) and _finite_positive(r["vs_kernel"])
    # the HunyuanVideo case has text after the video, partly masked
    hy = by[("hunyuan720", "sta", "attention")]
    assert hy["text_len"] == 256 and hy["text_valid"] == 64 and hy["N"] == math.prod(hy["grid"]) + 256
    # the family's settings: Wan radial with the sink, HunyuanVideo without
    assert by[("wan480", "radial", "kernel")]["config"]["sink"] is True
    assert by[("hunyuan720", "radial", "kernel")]["config"]["sink"] is False


@pytest.mark.slow
def test_transformer_benchmark_tiny_cpu(tmp_path):
    out = tmp_path / "transformer.json"
    assert bench_transformer.main(["--scale", "tiny", "--reps", "1", "--warmup", "0", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["meta"]["scale"] == "tiny" and report["meta"]["compile_backend"] == "aot_eager"
    rows = report["rows"]
    keys = [(r["model_key"], r["mode"], r["method"]) for r in rows]
    assert keys == [(m, mode, method) for m in ("wan", "hunyuan") for mode in ("eager", "compiled")
                    for method in ("dense", "sta", "radial")]
    for r in rows:
        assert not r.get("skipped") and not r.get("error"), r
        assert _finite_positive(r["time_ms"]) and _finite_positive(r["speedup"]), r
        assert r["out_finite"] is True
        assert r["timer"] == "perf_counter" and r["torch"] == torch.__version__
        if r["method"] == "dense":
            assert r["density"] == 1.0 and r["speedup"] == 1.0
        else:
            assert 0 < r["density"] < 1, r
            assert 0 < r["block_density"] < 1, r
            assert r["method_config"]["dense_steps"] == 0
            stats = r["patch_stats"]
            assert stats["sparse_calls"] > 0 and stats["fallback_calls"] == 0, stats
        if r["mode"] == "compiled":
            assert r["compile_s"] > 0 and isinstance(r["graph_breaks"], int) and r["graph_count"] >= 1
            assert r["dynamo"]["unique_graphs"] >= 1
    hy = [r for r in rows if r["model_key"] == "hunyuan"]
    assert all(r["tokens"] == 4 * 16 * 24 + 32 and r["joint_text"] == 32 for r in hy)
    # Wan radial keeps its family default: the first layer dense (one of two layers)
    wan_radial = next(r for r in rows if r["model_key"] == "wan" and r["method"] == "radial")
    assert wan_radial["method_config"]["dense_layers"] == 1 and wan_radial["patch_stats"]["dense_calls"] >= 1


def test_transformer_budget_skips(tmp_path):
    out = tmp_path / "t.json"
    assert bench_transformer.main(["--scale", "tiny", "--models", "wan", "--budget-s", "0.001", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 6 and all(r["skipped"].startswith("time budget") for r in rows)


def test_published_configs():
    """Full-size configs give the published parameter counts (meta-device build: no memory)."""
    wan = bench_transformer_models.count_parameters("wan", bench_transformer_models.WAN_1_3B)
    hunyuan = bench_transformer_models.count_parameters("hunyuan", bench_transformer_models.HUNYUAN_13B)
    assert 1.40e9 < wan < 1.44e9
    assert 12.7e9 < hunyuan < 12.9e9
    config, latent, text, valid, _ = bench_transformer_models.model_spec("wan", "full")
    assert bench_transformer_models.token_grid(config, latent) == (21, 30, 52) and text == 512 and valid is None
    config, latent, text, valid, _ = bench_transformer_models.model_spec("hunyuan", "full")
    assert bench_transformer_models.token_grid(config, latent) == (33, 45, 80) and (text, valid) == (256, 64)


def test_first_blocks_only_restores():
    config, *_ = bench_transformer_models.model_spec("hunyuan", "tiny")
    config = dict(config, num_layers=2, num_single_layers=3)
    model = bench_transformer_models.build_model("hunyuan", config, torch.device("cpu"), torch.float32)
    blocks, single = model.transformer_blocks, model.single_transformer_blocks
    with bench_transformer_models.first_blocks_only(model, ("transformer_blocks", "single_transformer_blocks")):
        assert len(model.transformer_blocks) == 1 and len(model.single_transformer_blocks) == 1
        assert model.transformer_blocks[0] is blocks[0]
    assert model.transformer_blocks is blocks and model.single_transformer_blocks is single


def test_build_keeps_fp32_modules():
    config, *_ = bench_transformer_models.model_spec("wan", "tiny")
    model = bench_transformer_models.build_model("wan", config, torch.device("cpu"), torch.bfloat16)
    dtypes = {name: p.dtype for name, p in model.named_parameters()}
    assert dtypes["scale_shift_table"] == torch.float32  # _keep_in_fp32_modules, as from_pretrained keeps it
    assert dtypes["blocks.0.attn1.to_q.weight"] == torch.bfloat16


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_gpu_check_script_parses():
    subprocess.run(["bash", "-n", str(ROOT / "scripts" / "gpu_check.sh")], check=True)


def test_graph_break_probe_silences_only_the_size_warning(monkeypatch):
    """The probe's small copy must not print the "is predicted to gain" warning for a call nobody times,
    and nothing else may be swallowed with it. The warning's text is the cost model's own (on an H200)."""
    import warnings

    from fastdit import costmodel
    from fastdit.eval.bench.transformer_run import quiet_size_warnings

    monkeypatch.setattr(costmodel, "gpu_for", lambda device=None: costmodel.GPUS["H200"])
    q = torch.zeros(1, 12, 192, 128)
    text = costmodel.worth_warning("sta", q, q, {"performed": 1, "total": 1})  # density 1: no gain
    assert text and "192 tokens" in text
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with quiet_size_warnings():
            warnings.warn(f"fastdit: {text}", UserWarning)
            warnings.warn("fastdit: something else", UserWarning)
        warnings.warn(f"fastdit: {text}", UserWarning)
    assert [str(w.message) for w in seen] == ["fastdit: something else", f"fastdit: {text}"]
