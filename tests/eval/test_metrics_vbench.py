"""VBench: parsing its results, the official total-score formula, temporal flickering, the video
files written for it and running it (errors, and a stub package in place of the real one).
"""

import json
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from fastdit.eval.metrics import vbench as vb

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"  # tests/fixtures


def _rng(seed=0):
    return np.random.default_rng(seed)

# ----------------------------------------------------------------------------- VBench

def _official_total(raw):
    """VBench scripts/cal_final_score.py, transcribed with its space-separated keys."""
    norm = {"subject consistency": (0.1462, 1.0), "background consistency": (0.2615, 1.0),
            "temporal flickering": (0.6293, 1.0), "motion smoothness": (0.706, 0.9975),
            "dynamic degree": (0.0, 1.0), "aesthetic quality": (0.0, 1.0), "imaging quality": (0.0, 1.0),
            "object class": (0.0, 1.0), "multiple objects": (0.0, 1.0), "human action": (0.0, 1.0),
            "color": (0.0, 1.0), "spatial relationship": (0.0, 1.0), "scene": (0.0, 0.8222),
            "appearance style": (0.0009, 0.2855), "temporal style": (0.0, 0.364),
            "overall consistency": (0.0, 0.364)}
    weight = {k: (0.5 if k == "dynamic degree" else 1) for k in norm}
    quality = ["subject consistency", "background consistency", "temporal flickering", "motion smoothness",
               "aesthetic quality", "imaging quality", "dynamic degree"]
    semantic = [k for k in norm if k not in quality]
    data = {k.replace("_", " "): v for k, v in raw.items()}
    data = {k: data.get(k, 0) for k in norm}
    ns = {k: (data[k] - norm[k][0]) / (norm[k][1] - norm[k][0]) * weight[k] for k in norm}
    q = sum(ns[k] for k in quality) / sum(weight[k] for k in quality)
    s = sum(ns[k] for k in semantic) / sum(weight[k] for k in semantic)
    return q, s, (q * 4 + s) / 5


def test_parse_vbench_results_fixture():
    res = vb.parse_vbench_results(FIXTURES / "vbench_eval_results.json")
    assert len(res) == 16 and res["temporal_flickering"] == pytest.approx(0.9825)
    assert res["dynamic_degree"] == pytest.approx(0.45)
    full = vb.parse_vbench_results(FIXTURES / "vbench_eval_results.json", per_video=True)
    score, videos = full["subject_consistency"]
    assert score == pytest.approx(0.9612) and len(videos) == 2 and videos[0]["video_results"] == 0.9701


def test_vbench_scores_match_official_formula():
    raw = vb.parse_vbench_results(FIXTURES / "vbench_eval_results.json")
    q, s, t = _official_total(raw)
    out = vb.vbench_scores(raw)
    assert out["quality_score"] == pytest.approx(q, abs=1e-12)
    assert out["semantic_score"] == pytest.approx(s, abs=1e-12)
    assert out["total_score"] == pytest.approx(t, abs=1e-12)
    assert out["missing"] == []
    # hand check of one normalisation: temporal flickering (0.9825 - 0.6293) / (1 - 0.6293)
    assert out["normalized"]["temporal_flickering"] == pytest.approx((0.9825 - 0.6293) / 0.3707)


def test_vbench_scores_extremes_and_missing():
    top = {d: hi for d, (lo, hi) in vb.NORMALIZE.items()}
    bottom = {d: lo for d, (lo, hi) in vb.NORMALIZE.items()}
    assert vb.vbench_scores(top)["total_score"] == pytest.approx(1.0)
    assert vb.vbench_scores(bottom)["total_score"] == pytest.approx(0.0)
    partial = {"temporal flickering": 0.9825, "Dynamic Degree": 0.45}
    skip = vb.vbench_scores(partial)
    expected_q = ((0.9825 - 0.6293) / 0.3707 + 0.5 * 0.45) / 1.5
    assert skip["quality_score"] == pytest.approx(expected_q)
    assert skip["semantic_score"] is None and skip["total_score"] is None and len(skip["missing"]) == 14
    zero = vb.vbench_scores(partial, missing="zero")
    assert zero["total_score"] == pytest.approx(_official_total(
        {"temporal_flickering": 0.9825, "dynamic_degree": 0.45})[2])
    with pytest.raises(KeyError):
        vb.vbench_scores(partial, missing="error")
    with pytest.raises(KeyError, match="unknown"):
        vb.vbench_scores({"sharpness": 1.0})


def test_temporal_flickering_synthetic():
    r = _rng(16)
    static = np.repeat(r.random((1, 16, 20, 3)), 5, axis=0)
    assert vb.temporal_flickering(static) == 1.0
    ramp = np.stack([np.full((16, 20, 3), 7 * k, np.uint8) for k in range(6)])  # +7 per frame
    assert vb.temporal_flickering(ramp) == pytest.approx((255 - 7) / 255)
    # alternating 0 / 51 on half the pixels: MAE 25.5 for every pair
    alt = np.zeros((4, 8, 8, 3), np.uint8)
    alt[1::2, :4] = 51
    assert vb.temporal_flickering(alt) == pytest.approx((255 - 25.5) / 255)
    # float input is quantised to uint8 first, as a written video is
    assert vb.temporal_flickering(ramp / 255.0) == pytest.approx((255 - 7) / 255)
    with pytest.raises(ValueError):
        vb.temporal_flickering(static[:1])


def test_write_vbench_videos_naming_and_flicker_from_file(tmp_path):
    r = _rng(17)
    static = np.repeat(r.random((1, 32, 48, 3)), 4, axis=0)
    ramp = np.stack([np.full((32, 48, 3), 10 * k, np.uint8) for k in range(4)])
    paths = vb.write_vbench_videos([static, ramp, static], ["a cat", "a cat", "a dog"], tmp_path / "std")
    assert [p.name for p in paths] == ["a cat-0.mp4", "a cat-1.mp4", "a dog-0.mp4"]
    assert vb.read_video_frames(paths[0]).shape == (4, 32, 48, 3)
    assert vb.temporal_flickering(paths[0]) == pytest.approx(1.0, abs=2e-3)
    assert vb.temporal_flickering(paths[1]) == pytest.approx((255 - 10) / 255, abs=2e-3)
    with pytest.raises(ValueError, match="custom"):
        vb.write_vbench_videos([static], ["a/b"], tmp_path / "std")
    paths = vb.write_vbench_videos([static, static], ["a/b: c?", "a/b: c?"], tmp_path / "cus", mode="custom")
    prompts = json.loads((tmp_path / "cus" / "prompts.json").read_text())
    assert prompts == {p.name: "a/b: c?" for p in paths} and len(paths) == 2


def test_run_vbench_errors(tmp_path, monkeypatch):
    monkeypatch.delenv("FASTDIT_VBENCH_PYTHON", raising=False)
    with pytest.raises(FileNotFoundError, match="FASTDIT_VBENCH_PYTHON"):
        vb.run_vbench(tmp_path, ["temporal_flickering"])
    with pytest.raises(FileNotFoundError, match="not found"):
        vb.run_vbench(tmp_path, ["temporal_flickering"], python=tmp_path / "nope" / "python")
    with pytest.raises(RuntimeError, match="not importable"):  # this interpreter has no vbench
        vb.run_vbench(tmp_path, ["temporal_flickering"], python=sys.executable,
                      env={"PYTHONPATH": str(tmp_path)})
    with pytest.raises(ValueError, match="custom"):
        vb.run_vbench(tmp_path, ["color"], python=sys.executable, mode="custom")


def test_run_vbench_with_stub_package(tmp_path):
    """Drives the real command line against a stub `vbench` whose launcher writes a results file."""
    pkg = tmp_path / "site" / "vbench"
    (pkg / "launch").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "launch" / "evaluate.py").write_text(textwrap.dedent("""
        import argparse, json, os, sys
        p = argparse.ArgumentParser()
        p.add_argument("--videos_path"); p.add_argument("--dimension", nargs="+")
        p.add_argument("--output_path"); p.add_argument("--mode"); p.add_argument("--prompt_file")
        a = p.parse_args()
        res = {d: [0.5, [{"video_path": os.path.join(a.videos_path, v), "video_results": 0.5}
                         for v in sorted(os.listdir(a.videos_path)) if v.endswith(".mp4")]]
               for d in a.dimension}
        res["_argv"] = [0.0, sys.argv[1:]]
        json.dump(res, open(os.path.join(a.output_path, "results_x_eval_results.json"), "w"))
    """))
    videos = tmp_path / "videos"
    vb.write_vbench_videos([np.zeros((2, 16, 16, 3))], ["a cat"], videos, mode="custom")
    out = vb.run_vbench(videos, ["temporal flickering", "dynamic_degree"], python=sys.executable,
                        out_dir=tmp_path / "out", mode="custom", env={"PYTHONPATH": str(tmp_path / "site")})
    assert out["temporal_flickering"] == 0.5 and out["dynamic_degree"] == 0.5
    argv = vb.parse_vbench_results(tmp_path / "out", per_video=True)["_argv"][1]
    assert argv[argv.index("--mode") + 1] == "custom_input"
    assert argv[argv.index("--prompt_file") + 1] == str((videos / "prompts.json").resolve())
