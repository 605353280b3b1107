"""fastdit.calibrate on the tiny Wan pipeline: budgets, resume, applying the plan, bad input, the CLI."""
import functools
import json
import os

import pytest
import torch

import fastdit
from fastdit.calibration.search import calibrate, candidates_for, select_settings
from fastdit.layout import TokenLayout
from fastdit.pipelines.tiny import TINY_TEST_DEFAULTS, tiny
from fastdit.calibration.calibration_file import load_calibration, calibration_options_for, write_calibration

from helpers import sta_mask

CALL = {k: v for k, v in TINY_TEST_DEFAULTS["wan"].items()}  # 3 x 5 x 7 latent tokens, 2 steps, CFG
GRID, TILE = (3, 5, 7), (1, 2, 2)  # tile grid 3 x 3 x 4
CANDIDATES = [(1, 1, 1), (1, 3, 3), (3, 3, 3)]
SPARSEST = [1, 1, 1]


@pytest.fixture(scope="module")
def pipe():
    return tiny("wan")


def run(pipe, prompts, budget, out, **kwargs):
    return calibrate(pipe, "sta", prompts, budget=budget, out=out, call_kwargs=CALL, options={"tile": TILE},
                     candidates=CANDIDATES, rows=48, progress=False, **kwargs)


def test_huge_budget_sparsest_everywhere_and_resume_after_interrupt(pipe, tmp_path, monkeypatch):
    out = tmp_path / "plan.json"
    original = type(pipe).__call__
    seen = []

    @functools.wraps(original)
    def interrupted(self, *args, **kwargs):
        seen.append(kwargs["prompt"])
        if kwargs["prompt"] == "a blue car" and len(seen) == 2:
            raise KeyboardInterrupt
        return original(self, *args, **kwargs)

    monkeypatch.setattr(type(pipe), "__call__", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run(pipe, ["a red fox", "a blue car"], 1e9, out)
    assert getattr(pipe.transformer, "_fastdit_patch", None) is None  # the probe was removed
    partial = json.loads(open(f"{out}.partial.json").read())
    assert list(partial["prompts"]) == ["a red fox"] and not out.exists()
    plan = run(pipe, ["a red fox", "a blue car"], 1e9, out)
    assert seen == ["a red fox", "a blue car", "a blue car"]  # the finished prompt was not redone
    assert not os.path.exists(f"{out}.partial.json") and load_calibration(out) == plan
    assert plan["model"] == {"family": "wan", "transformer": "WanTransformer3DModel", "layers": 4, "heads": 2,
                             "grids": [list(GRID)]}
    assert len(plan["strategy"]) == 4 * 2 and set(map(tuple, plan["strategy"].values())) == {tuple(SPARSEST)}
    assert plan["prompts"] == ["a red fox", "a blue car"] and plan["options"]["tile"] == list(TILE)
    layers = plan["measured"]["layers"]
    assert len(layers) == 4 and all(0 < row["density"] < 1 and row["error"] > 0 for row in layers)
    # the same measurements at a tiny budget choose dense everywhere; the sparsest when the budget is huge
    results = [partial["prompts"]["a red fox"]]
    choice, _ = select_settings(results, partial["candidates"], 1e-12)
    assert set(choice.values()) == {None}
    choice, measured = select_settings(results, partial["candidates"], 1e9)
    assert set(choice.values()) == {0}
    # an intermediate budget: every chosen head meets it, and is the least dense that does
    budget = sorted(row["error"] for row in layers)[1]
    choice, measured = select_settings(results, partial["candidates"], budget)
    assert all(m["error"] <= budget for m in measured.values())


def test_tiny_budget_gives_all_dense(pipe, tmp_path):
    plan = run(pipe, ["a red fox"], 1e-12, tmp_path / "dense.json", steps=2)
    assert plan["step_buckets"] == [0, 1]
    assert set(map(tuple, plan["strategy"].values())) == {(0, 0, 0)}
    assert plan["measured"]["density"] == 1.0 and plan["measured"]["error"] == 0.0


def test_patch_with_plan_uses_each_layer_and_head_setting(pipe, tmp_path):
    strategy = {"0_0_0": [1, 1, 1], "0_0_1": [3, 1, 3], "0_1_0": [0, 0, 0], "0_1_1": [0, 0, 0],
                "0_2_0": [0, 0, 0], "0_2_1": [1, 3, 1], "0_3_0": [1, 1, 1], "0_3_1": [1, 1, 1],
                "1_0_0": [1, 3, 1], "1_0_1": [3, 1, 3], "1_1_0": [0, 0, 0], "1_1_1": [0, 0, 0],
                "1_3_0": [3, 3, 3], "1_3_1": [1, 0, 1]}
    plan = {"format": "fastdit-plan", "version": 1, "method": "sta",
            "model": {"family": "wan", "transformer": "WanTransformer3DModel", "layers": 4, "heads": 2,
                      "grids": [list(GRID)]},
            "options": {"tile": list(TILE), "fit_tile": False, "dense_steps": 0, "dense_layers": 0},
            "step_buckets": [0, 1], "strategy": strategy}
    path = write_calibration(plan, tmp_path / "plan.json")
    options = calibration_options_for(path, pipe, "sta", grids=[GRID])
    with fastdit.patch(pipe, "sta", record_masks=True, **options) as p:
        pipe(prompt="a red fox", **CALL, output_type="latent")
        for layer in range(4):
            for head in range(2):
                # the latest call is step 1 (bucket 1); layer 2 is not named there: the window option applies
                window = strategy.get(f"1_{layer}_{head}", options.get("window", (3, 3, 3)))
                expected = sta_mask(GRID, TILE, window)
                assert torch.equal(p.mask(layer, head), expected), (layer, head)
        assert p.last_plan(1) is None  # every head whole-grid: the model's own attention
        assert not p.mask(0, 0).all() and not torch.equal(p.mask(0, 0), p.mask(0, 1))


def test_plan_of_another_model_is_refused(pipe, tmp_path):
    plan = {"format": "fastdit-plan", "version": 1, "method": "sta",
            "model": {"family": "wan", "transformer": "WanTransformer3DModel", "layers": 6, "heads": 2, "grids": []},
            "options": {"tile": list(TILE)}, "step_buckets": [0], "strategy": {"0_0_0": [1, 1, 1], "0_0_1": [1, 1, 1]}}
    path = write_calibration(plan, tmp_path / "plan.json")
    with pytest.raises(ValueError, match="number of patched attention layers is 4 but the calibration was made for 6"):
        calibration_options_for(path, pipe, "sta")


@pytest.mark.parametrize("kwargs, needle", [
    ({"budget": 0}, "budget must be a number > 0"),
    ({"budget": -0.5}, "budget must be a number > 0"),
    ({"budget": float("nan")}, "budget must be a number > 0"),
    ({"budget": "0.1"}, "budget must be a number > 0"),
    ({"budget": True}, "budget must be a number > 0"),
    ({"budget": 0.1, "prompts": []}, "prompts is empty"),
    ({"budget": 0.1, "steps": 0}, "steps must be"),
    ({"budget": 0.1, "candidates": [(2, 1, 1)]}, "three odd ints or 0"),
    ({"budget": 0.1, "candidates": []}, "candidates is empty"),
])
def test_bad_input_is_refused_before_anything_is_patched(pipe, tmp_path, kwargs, needle):
    prompts = kwargs.pop("prompts", ["a red fox"])
    out = tmp_path / "plan.json"
    with pytest.raises(ValueError, match=needle):
        calibrate(pipe, "sta", prompts, out=out, call_kwargs=CALL, progress=False, **kwargs)
    assert getattr(pipe.transformer, "_fastdit_patch", None) is None and not out.exists()


def test_candidate_registry():
    layout = TokenLayout((8, 32, 48))
    windows = [c["window"] for c in candidates_for("sta", layout)]
    assert (0, 0, 0) in windows and (1, 1, 1) in windows and len(set(windows)) == len(windows)
    assert candidates_for("no-such-method") == []
    import dataclasses

    for name in fastdit.method_names():
        fields = {f.name for f in dataclasses.fields(fastdit.methods.get_method(name).config_cls)}
        assert all(set(c) <= fields for c in candidates_for(name, layout))


def test_cli_calibrate(tmp_path, capsys):
    from fastdit.cli import main

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red fox\n")
    out = tmp_path / "cli_plan.json"
    with pytest.raises(SystemExit) as exit_info:
        main(["calibrate", "--budget", "-1", "--out", str(out)])
    assert exit_info.value.code == 2 and "--budget" in capsys.readouterr().err
    code = main(["calibrate", "--model", "tiny-wan", "--frames", "9", "--height", "80", "--width", "112", "--steps", "2",
                 "--prompts", str(prompts), "--budget", "1e9", "--candidates", "1,1,1;1,3,3", "--set", "tile=1,2,2",
                 "--set", "dense_steps=0.5", "--rows", "32", "--out", str(out), "--no-progress"])
    captured = capsys.readouterr()
    assert code == 0 and "calibration written" in captured.out
    assert "it/s" not in captured.err and "s/it" not in captured.err, captured.err  # no bar, the pipeline's neither
    plan = load_calibration(out)
    assert plan["options"]["dense_steps"] == 0.5  # --set dense_steps is the plan's, not silently 0
    assert set(map(tuple, plan["strategy"].values())) == {(1, 1, 1)}
