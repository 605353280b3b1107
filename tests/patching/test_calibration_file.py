"""Calibration files: round trip, refusals that name the mismatch, malformed files that name the file and entry."""
import copy
import json

import pytest
import torch

from fastdit.layout import TokenLayout
from fastdit.methods.sta import SlidingTile
from fastdit.calibration.calibration_file import CalibrationError, load_calibration, calibration_options, write_calibration


def make_plan(**changes):
    plan = {
        "format": "fastdit-plan", "version": 1, "method": "sta",
        "model": {"family": "wan", "transformer": "WanTransformer3DModel", "layers": 2, "heads": 3, "grids": [[5, 6, 10]]},
        "options": {"tile": [1, 2, 2], "fit_tile": False, "dense_steps": 0, "dense_layers": 0},
        "step_buckets": [0, 2],
        "strategy": {"0_0_0": [1, 3, 3], "0_0_1": [0, 0, 0], "0_0_2": [5, 1, 3], "0_1_0": [3, 3, 0],
                     "0_1_1": [3, 3, 3], "0_1_2": [3, 3, 3], "2_0_0": [1, 1, 1], "2_0_1": [3, 3, 3],
                     "2_0_2": [3, 3, 3], "2_1_0": [3, 3, 3], "2_1_1": [3, 3, 3], "2_1_2": [3, 0, 5]},
        "budget": 0.05, "prompts": ["a", "b"], "measured": {"layers": []},
    }
    plan.update(changes)
    return plan


def masks(options, layout, heads=3):
    method = SlidingTile(**options)
    result = {}
    for step in (0, 1, 2, 5):
        for layer in (0, 1):
            plan = method.windows_plan(layout, method.window_list(step, layer, heads), "cpu")
            for head in range(heads):
                result[step, layer, head] = (torch.ones(layout.seq_len, layout.seq_len, dtype=torch.bool)
                                             if plan is None else plan.token_mask(head if plan.kv_indices.shape[1] > 1 else 0))
    return result


def test_round_trip_same_masks(tmp_path):
    plan = make_plan()
    path = write_calibration(plan, tmp_path / "plan.json")
    loaded = load_calibration(path)
    assert loaded == plan
    layout = TokenLayout((5, 6, 10))
    before = masks(calibration_options(plan, "sta"), layout)
    after = masks(calibration_options(path, "sta", family="wan", transformer="WanTransformer3DModel", layers=2, heads=3), layout)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    # the settings really differ per head and step (the round trip is not trivially all-equal)
    assert not torch.equal(after[0, 0, 0], after[0, 0, 2]) and not torch.equal(after[0, 0, 0], after[2, 0, 0])
    assert after[0, 0, 1].all()  # 0,0,0: the whole grid
    assert calibration_options(plan, "sta")["strategy"]["0_0_0"] == (1, 3, 3)


@pytest.mark.parametrize("fact, value, reason", [
    ("family", "hunyuan_video", "model family is 'hunyuan_video'"),
    ("transformer", "HunyuanVideoTransformer3DModel", "transformer class"),
    ("layers", 4, "number of patched attention layers is 4"),
    ("heads", 2, "number of attention heads is 2"),
])
def test_mismatched_model_is_refused_with_the_reason(tmp_path, fact, value, reason):
    path = write_calibration(make_plan(), tmp_path / "plan.json")
    with pytest.raises(CalibrationError) as error:
        calibration_options(path, "sta", **{fact: value})
    assert reason in str(error.value) and str(path) in str(error.value)


def test_other_method_is_refused():
    with pytest.raises(CalibrationError, match="for method 'sta', not 'radial'"):
        calibration_options(make_plan(), "radial")


def test_other_grid_applies_with_a_fixed_tile_and_is_refused_with_a_fitted_one():
    options = calibration_options(make_plan(), "sta", grids=[(9, 12, 20)])
    assert options["tile"] == (1, 2, 2)  # windows in tiles of a fixed size: the same token extents
    fitted = make_plan(options={"tile": [4, 4, 8], "fit_tile": True, "dense_steps": 0})
    fitted["model"]["grids"] = [[8, 32, 48]]
    assert calibration_options(fitted, "sta", grids=[(8, 32, 48)])["fit_tile"] is True  # its own grid
    with pytest.raises(CalibrationError, match="cannot be applied to grid.*tile is fitted per grid"):
        calibration_options(fitted, "sta", grids=[(3, 5, 7)])


@pytest.mark.parametrize("mutate, needle", [
    (lambda p: p.update(version=3), "'version'"),
    (lambda p: p.update(format="other"), "'format'"),
    (lambda p: p.update(method="nope"), "'method'"),
    (lambda p: p["model"].update(layers=0), "'model.layers'"),
    (lambda p: p.update(step_buckets=[2, 0]), "'step_buckets'"),
    (lambda p: p["strategy"].update({"0_x_0": [1, 1, 1]}), "'0_x_0'"),
    (lambda p: p["strategy"].update({"0_0_0": [2, 1, 1]}), "'0_0_0'"),
    (lambda p: p["strategy"].update({"0_5_0": [1, 1, 1]}), "'0_5_0'"),
    (lambda p: p["strategy"].update({"1_0_0": [1, 1, 1]}), "'1_0_0'"),
    (lambda p: p["options"].update(tile=[0, 1, 1]), "'options'"),
])
def test_malformed_plans_name_file_and_entry(tmp_path, mutate, needle):
    plan = copy.deepcopy(make_plan())
    mutate(plan)
    path = tmp_path / "bad_plan.json"
    path.write_text(json.dumps(plan))
    with pytest.raises(CalibrationError) as error:
        load_calibration(path)
    assert str(path) in str(error.value) and needle in str(error.value)


def test_truncated_and_missing_files(tmp_path):
    path = write_calibration(make_plan(), tmp_path / "plan.json")
    text = open(path).read()
    truncated = tmp_path / "truncated.json"
    truncated.write_text(text[: len(text) // 2])
    with pytest.raises(CalibrationError, match=f"{truncated}.*truncated or malformed"):
        load_calibration(truncated)
    with pytest.raises(CalibrationError, match="cannot read it"):
        load_calibration(tmp_path / "missing.json")


def test_other_methods_take_settings_per_layer():
    plan = make_plan(method="radial", options={"dense_steps": 0}, settings={"0_0": {"decay": 0.5}, "0_1": {"decay": 0.8}})
    del plan["strategy"]
    plan["step_buckets"] = [0]
    assert calibration_options(plan, "radial")["layer_settings"] == {"0_0": {"decay": 0.5}, "0_1": {"decay": 0.8}}
    plan["settings"]["0_1"] = None  # dense
    assert calibration_options(plan, "radial")["layer_settings"]["0_1"] is None
    plan["settings"]["0_1"] = {"decay": -1.0}
    with pytest.raises(CalibrationError, match="entry 'settings': layer_settings entry '0_1': decay"):
        calibration_options(plan, "radial")
    with pytest.raises(CalibrationError, match="cannot be applied to grid"):
        calibration_options(dict(plan, settings={"0_0": {"decay": 0.5}}), "radial", grids=[(1, 2, 3)])
