"""``fastdit.eval.bench.equal_density``: the every-method table's benchmark (issue 42). Its figures are
checked against videos made here without it (plain pipeline calls, the adapter loaded by hand), its
trained rows against a really loaded adapter, its prediction against ``fastdit.eval.predict``, and its
rows file's errors by their messages."""
import json

import numpy as np
import pytest
import torch

from fastdit.eval.bench import equal_density
from fastdit.pipelines.loading import TRAINED_DEFAULTS, load_pipeline

SMALL = ["--frames", "5", "--height", "32", "--width", "32", "--steps", "2", "--captions", "2", "--seeds", "3"]
VSA = {"block_size_3d": [3, 4, 4], "top_k_ratio": 0.25, "dense_steps": 0, "dense_layers": 0, "guard": False}


@pytest.fixture(scope="module")
def trained_vsa(tmp_path_factory):
    """A LoRA + gates from two steps of ``python -m fastdit.train`` (the folder layout the rows name)."""
    from fastdit.train.__main__ import main

    root = tmp_path_factory.mktemp("equal_density")
    options = {k: v for k, v in VSA.items() if k != "guard"}
    main(["--model", "tiny-shapes", "--method", "vsa", "--options", json.dumps(options),
          "--call", json.dumps({"num_frames": 5, "height": 32, "width": 32, "num_inference_steps": 1}),
          "--steps", "2", "--samples", "1", "--lr", "5e-2", "--backend", "torch", "--no-progress",
          "--out", str(root / "vsa")])
    return root


def _psnr(a, b):  # per frame, then the mean over frames, data range 1 (the metric's definition, written out here)
    diff = np.asarray(a, np.float64) - np.asarray(b, np.float64)
    return float(np.mean(10 * np.log10(1.0 / np.mean(diff ** 2, axis=(1, 2, 3)))))


def _videos(pipe, prompts, seed, call):
    out = []
    for prompt in prompts:
        frames = pipe(prompt=prompt, **call, output_type="np", generator=torch.Generator().manual_seed(seed)).frames[0]
        out.append(np.asarray(frames, dtype=np.float32))
    return out


def test_rows_measure_what_plain_calls_give_and_the_trained_row_uses_its_adapter(trained_vsa, tmp_path):
    import fastdit
    from fastdit.eval.runner.prompts import load_prompts

    rows = [{"label": "vsa", "method": "vsa", "options": VSA},
            {"label": "vsa trained", "method": "vsa", "options": VSA, "trained": "vsa"},
            {"label": "todo", "method": "todo", "options": {"dense_steps": 0, "dense_layers": 0, "guard": False}}]
    rows_file = tmp_path / "rows.json"
    rows_file.write_text(json.dumps(rows))
    out = tmp_path / "table.json"
    assert equal_density.main(["--rows", str(rows_file), "--trained-root", str(trained_vsa), *SMALL, "--backend",
                               "torch", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    by_label = {r["label"]: r for r in report["rows"]}
    assert report["dense"]["bit_equal"] and set(by_label) == {"vsa", "vsa trained", "todo"}

    pipe = load_pipeline("tiny-shapes", "cpu")
    pipe.set_progress_bar_config(disable=True)
    call = {**TRAINED_DEFAULTS["tiny-shapes"], "num_frames": 5, "height": 32, "width": 32, "num_inference_steps": 2}
    prompts = [p.text for p in load_prompts("shapes")][:2]
    dense = _videos(pipe, prompts, 3, call)
    with fastdit.patch(pipe, "vsa", backend="torch", **VSA):
        free = _videos(pipe, prompts, 3, call)
    pipe.load_lora_weights(str(trained_vsa / "vsa"))
    with fastdit.patch(pipe, "vsa", backend="torch", method_params=str(trained_vsa / "vsa"), **VSA):
        trained = _videos(pipe, prompts, 3, call)
    pipe.unload_lora_weights()
    for label, videos in (("vsa", free), ("vsa trained", trained)):
        psnrs = [_psnr(a, b) for a, b in zip(videos, dense)]
        row = by_label[label]
        assert row["psnr_db"] == pytest.approx(np.mean(psnrs), rel=1e-4)
        assert row["psnr_min_db"] == pytest.approx(min(psnrs), rel=1e-4)
        assert row["sparse_density"] < 0.5 and row["videos"] == 2 and row["seconds"] > 0 and row["speed"] > 0
    assert not all(np.array_equal(a, b) for a, b in zip(free, trained))  # the adapter changes the videos
    assert by_label["vsa trained"]["psnr_db"] != pytest.approx(by_label["vsa"]["psnr_db"], abs=1e-6)
    assert by_label["vsa trained"]["trained"].endswith("vsa") and by_label["vsa"]["trained"] is None
    # the LoRA was fused for the row (as deployed) and the original weights were put back exactly: the
    # dense videos after every row are bit-equal to the first ones (report["dense"]["bit_equal"] above)
    assert by_label["vsa trained"]["lora"] == "fused" and by_label["vsa"]["lora"] is None


def test_prediction_is_the_cost_models_at_the_row_density():
    from fastdit import costmodel
    from fastdit.eval.predict import model_shape, predict_model

    for method in ("sparge", "sla"):
        got = equal_density.gpu_prediction(method, {}, 0.2, "H100")
        want = {r["method"]: r for r in predict_model(model_shape("wan"), [costmodel.gpu_named("H100")],
                                                      [method], dynamic_density=0.2)}
        assert got["wan"]["attention_speedup"] == pytest.approx(want[method]["attention_speedup"])
        assert got["wan"]["forward_speedup"] == pytest.approx(want[method]["forward_speedup"])
        assert not got["wan"]["approximate"]
    sparse, denser = (equal_density.gpu_prediction("todo", {}, d, "H100")["hunyuan"] for d in (0.25, 0.5))
    assert sparse["approximate"] and sparse["attention_speedup"] > denser["attention_speedup"] > 1
    svg2 = equal_density.gpu_prediction("svg2", {}, 0.2, "H100")["wan"]  # block-sparse, outside the cost model
    assert svg2["approximate"] and svg2["attention_speedup"] == pytest.approx(
        equal_density.gpu_prediction("svg", {}, 0.2, "H100")["wan"]["attention_speedup"])  # priced as a dynamic one
    assert equal_density.gpu_prediction("dense", {}, 1.0, "H100") is None


@pytest.mark.parametrize("rows, message", [
    ([{"method": "nope"}], "unknown method 'nope'"),
    ([{"method": "sta", "opts": {}}], "unknown keys \\['opts'\\]"),
    ([{"method": "sta", "options": [1]}], "\"options\" must be an object"),
    ([{"method": "sta"}, {"method": "sta"}], "label 'sta' is used twice"),
    ([{"label": "mine", "method": "sta", "trained": "missing"}], "mine.*no pytorch_lora_weights.safetensors.*"
                                                                  "python -m fastdit.train --method sta"),
    ({"method": "sta"}, "expected a non-empty JSON list"),
])
def test_bad_rows_files_name_the_row_and_the_problem(tmp_path, rows, message):
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(rows))
    with pytest.raises(equal_density.RowsError, match=message):
        equal_density.load_rows(str(path))
    with pytest.raises(SystemExit):  # the command line says it in one line, before loading any model
        equal_density.main(["--rows", str(path)])
