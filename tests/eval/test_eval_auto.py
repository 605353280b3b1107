"""``fastdit eval --methods auto`` (issue 40 item 2: the auto calibration serves compare, eval and the app).

``auto`` runs only a calibration's per-head choices: one given with ``--calibration``, or the one shipped
beside tiny-shapes' weights at its native latent grid. Without either the run is refused before any
model loads, saying how to make one (and, for tiny-shapes at another size, naming both grids).
"""
import json
import os

import numpy as np
import pytest
import torch

import fastdit
from fastdit.calibration.search import calibrate
from fastdit.cli.eval import build_parser, config_from_args, main as eval_main
from fastdit.pipelines.tiny import TINY_TEST_DEFAULTS, tiny

SIZE = TINY_TEST_DEFAULTS["wan"]
PROMPT = "A boat sails on a calm lake."


def _config(argv):
    return config_from_args(build_parser().parse_args(argv))


@pytest.mark.parametrize("argv, needle", [
    (["--model", "tiny-wan", "--methods", "dense,auto"], "fastdit calibrate --model MODEL --method auto"),
    (["--model", "tiny-shapes", "--methods", "auto", "--height", "64", "--width", "64"],
     "shipped with tiny-shapes is for its native latent grid [9, 32, 32], this call's is [9, 16, 16]"),
])
def test_auto_without_a_calibration_is_refused_before_any_model_loads(argv, needle, monkeypatch):
    from fastdit.cli.common import CLIError
    from fastdit.pipelines import loading

    monkeypatch.setattr(loading, "load_pipeline", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(CLIError) as error:
        _config([*argv, "--out", "unused", "--prompts", "shapes"])
    assert needle in str(error.value) and "--calibration auto.json" in str(error.value)


def test_tiny_shapes_runs_its_shipped_auto_calibration_at_its_native_size():
    from fastdit.eval.runner.settings import build_settings

    cfg = _config(["--model", "tiny-shapes", "--methods", "dense,auto", "--out", "unused"])
    path = cfg.options["auto"]["calibration"]
    assert path.endswith(os.path.join("tiny-shapes", "calibrations", "auto.json"))
    assert json.load(open(path))["method"] == "auto"
    assert [s.name for s in build_settings(cfg)] == ["dense", "auto"]


def test_eval_runs_auto_from_a_calibration_as_a_patch_by_hand_does(tmp_path):
    """End to end on tiny-wan: the stored auto frames equal ``fastdit.patch(pipe, "auto", calibration=...)``
    run by hand (uint8 rounding: at most 1 of 255), differ from dense, and the record counts sparse calls."""
    pipe = tiny("wan")
    call = dict(SIZE)
    plan_path = tmp_path / "auto.json"
    plan = calibrate(pipe, "auto", [PROMPT], budget=1e9, out=plan_path, call_kwargs=call, rows=32, progress=False,
                     candidates=[{"method": "sta", "tile": (1, 2, 2), "window": (1, 1, 1)},
                                 {"method": "todo", "factor": 2}])
    # on a CPU the calibration may keep every head dense (sparse is slower there): a mix by hand
    plan["choices"] = {f"0_{layer}_{head}": [0, 1, None][(layer + head) % 3] for layer in range(4) for head in range(2)}
    plan_path.write_text(json.dumps(plan))
    prompts = tmp_path / "one.txt"
    prompts.write_text(PROMPT + "\n")
    out = tmp_path / "run"
    assert eval_main(["--model", "tiny-wan", "--frames", str(SIZE["num_frames"]), "--height", str(SIZE["height"]),
                      "--width", str(SIZE["width"]), "--steps", str(SIZE["num_inference_steps"]), "--device", "cpu",
                      "--methods", "dense,auto", "--calibration", str(plan_path), "--prompts", str(prompts),
                      "--seeds", "0", "--metrics", "psnr", "--out", str(out), "--no-progress", "--no-plots",
                      "--no-warmup"]) == 0
    results = json.load(open(out / "results.json"))
    dense, auto = results["settings"]
    assert auto["method"] == "auto" and auto["sparse_calls"] > 0 and auto["density"] < 1
    frames = {name: np.load(next((out / "samples" / name).glob("*_0.npy"))) for name in ("dense", "auto")}
    assert np.abs(frames["auto"].astype(int) - frames["dense"].astype(int)).max() > 1  # the mix changed the video
    record = json.load(open(next((out / "samples" / "auto").glob("*_0.json"))))
    with fastdit.patch(pipe, "auto", calibration=plan_path):  # the call the run recorded (its guidance, text length)
        by_hand = pipe(prompt=PROMPT, generator=torch.Generator().manual_seed(0), output_type="np",
                       **record["call"]).frames[0]
    want = (np.clip(np.asarray(by_hand, dtype=np.float64), 0, 1) * 255).round()
    assert frames["auto"].shape == want.shape and np.abs(frames["auto"] - want).max() <= 1.0
