"""Calibration files were "plan files" (issue 41, item 6: "plan" now means ``BlockPlan`` only). The
earlier names keep working, silently: ``plan=`` on ``fastdit.patch`` and the app's request,
``--plan`` on the command lines, ``fastdit.calibration.plan_file`` and its names, files tagged
``"fastdit-plan"``; both names at once are refused. The reference for "the same patch" is the
method's options written out by hand from the file (not what the loader returns)."""
import json
import warnings

import pytest
import torch

import fastdit
from fastdit.calibration import calibration_file
from fastdit.calibration.calibration_file import CalibrationError, load_calibration, write_calibration

from tiny_transformers import tiny_wan, wan_inputs


def sparge_calibration(tag="fastdit-calibration"):
    """A calibration of sparge for ``tiny_wan`` (2 patched layers of 2 heads): layer 0 keeps half
    of its key blocks, layer 1 runs dense."""
    return {"format": tag, "version": 2, "method": "sparge",
            "model": {"family": "wan", "transformer": "WanTransformer3DModel", "layers": 2, "heads": 2,
                      "grids": [[3, 8, 8]]},
            "step_buckets": [0], "options": {"tile": [1, 2, 2], "dense_steps": 0, "dense_layers": 0},
            "settings": {"0_0": {"topk": 0.5}, "0_1": None}}


def _run(model, inputs, **patch_kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the alias warns about nothing
        with torch.no_grad(), fastdit.patch(model, "sparge", **patch_kwargs) as p:
            out = model(**inputs, return_dict=False)[0]
            assert p.stats.sparse_calls > 0 and p.stats.as_dict()["sparse_density"] < 0.9  # really sparse
            return out, p.config


@pytest.mark.parametrize("tag", ["fastdit-calibration", "fastdit-plan"])
def test_plan_keyword_and_old_tag_give_the_calibrations_patch(tmp_path, tag):
    model, inputs = tiny_wan(), wan_inputs(frames=3, height=16, width=16)  # latent grid (3, 8, 8)
    path = write_calibration(sparge_calibration(tag), tmp_path / "c.json")
    by_hand, by_hand_config = _run(model, inputs, tile=(1, 2, 2), dense_steps=0, dense_layers=0,
                                   layer_settings={"0_0": {"topk": 0.5}, "0_1": None})
    for keyword in ("calibration", "plan"):
        out, config = _run(model, inputs, **{keyword: path})
        assert config.layer_settings == by_hand_config.layer_settings and config.tile == (1, 2, 2)
        assert torch.equal(out, by_hand), keyword
    assert torch.isfinite(by_hand).all()


def test_both_names_at_once_are_refused_and_nothing_is_installed(tmp_path):
    model = tiny_wan()
    path = write_calibration(sparge_calibration(), tmp_path / "c.json")
    with pytest.raises(CalibrationError, match="calibration and its alias plan were both given"):
        fastdit.patch(model, "sparge", calibration=path, plan=path)
    assert getattr(model, "_fastdit_patch", None) is None


def test_new_files_carry_the_new_tag_and_a_wrong_tag_is_refused(tmp_path):
    from fastdit.calibration.search import calibrate  # noqa: F401 (the writer imports cleanly)

    assert calibration_file.CALIBRATION_FORMAT == "fastdit-calibration"
    data = load_calibration(write_calibration(sparge_calibration("fastdit-plan"), tmp_path / "old.json"))
    assert data["format"] == "fastdit-plan"  # read as written, not rewritten
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(sparge_calibration("fastdit-mask")))
    with pytest.raises(CalibrationError, match="entry 'format' must be 'fastdit-calibration'"):
        load_calibration(bad)


def test_the_old_module_names_are_the_new_objects():
    from fastdit.calibration import plan_file

    pairs = {"PlanError": "CalibrationError", "load_plan": "load_calibration", "write_plan": "write_calibration",
             "check_plan": "check_calibration", "plan_options": "calibration_options",
             "plan_options_for": "calibration_options_for", "with_plan": "with_calibration",
             "PLAN_FORMAT": "CALIBRATION_FORMAT", "PLAN_VERSION": "CALIBRATION_VERSION"}
    for old, new in pairs.items():
        assert getattr(plan_file, old) is getattr(calibration_file, new), old
    assert issubclass(plan_file.PlanError, ValueError)


@pytest.mark.parametrize("command", ["compare", "eval", "calibrate-free"])
def test_plan_flag_is_the_calibration_flag(command, tmp_path):
    from fastdit.cli.command import build_parser

    if command == "calibrate-free":  # the app's parser (fastdit app)
        argv = ["app"]
    else:
        argv = [command, "--methods", "dense,sparge"]
    parser = build_parser()
    for flag in ("--calibration", "--plan"):
        args = parser.parse_args(argv + [flag, str(tmp_path / "c.json")])
        assert args.calibration == str(tmp_path / "c.json"), flag
        assert not hasattr(args, "plan")


def test_the_apps_request_takes_the_old_name():
    pytest.importorskip("gradio")
    from fastdit.app.errors import AppError
    from fastdit.app.service import RunRequest

    assert RunRequest(plan="c.json").calibration == "c.json"
    assert RunRequest(calibration="c.json").calibration == "c.json"
    with pytest.raises(AppError, match="both"):
        RunRequest(calibration="a.json", plan="b.json")
