"""The app with a plan file (``fastdit calibrate``): the plan input and ``--plan PATH`` apply it
through ``fastdit.patch(..., calibration=...)``; a plan that does not fit shows the CalibrationError message and
leaves the model unpatched. Same harness as ``tests/app/test_app.py`` (service layer and gradio_client)."""
import json

import pytest
from app_harness import assert_unpatched, drop_repository_root_from_sys_path, launch

drop_repository_root_from_sys_path()  # before gradio and fastdit (see tests/app_harness.py)

gr = pytest.importorskip("gradio", reason="the app needs gradio (pip install 'fastdit[app]')")
gradio_client = pytest.importorskip("gradio_client", reason="the app tests need gradio_client")

from fastdit.pipelines.tiny import TINY_TEST_DEFAULTS  # noqa: E402

SIZE = TINY_TEST_DEFAULTS["wan"]  # 9 frames at 80x112, 2 steps: a 3 x 5 x 7 latent grid, 4 layers, 2 heads
SMALL = dict(model="tiny-wan", frames=SIZE["num_frames"], height=SIZE["height"], width=SIZE["width"],
             steps=SIZE["num_inference_steps"], seed=0)
SETTINGS = {"0_0": {"topk": 0.25}, "0_1": None, "0_2": {"topk": 0.5}, "0_3": {"topk": 0.25},
            "1_0": {"topk": 0.5}, "1_1": {"topk": 0.25}, "1_2": None, "1_3": {"topk": 0.5}}


def write(tmp_path, name="plan.json", **changes):
    plan = {"format": "fastdit-plan", "version": 1, "method": "sparge",
            "model": {"family": "wan", "transformer": "WanTransformer3DModel", "layers": 4, "heads": 2,
                      "grids": [[3, 5, 7]]},
            "options": {"tile": [1, 2, 2], "simthresh": -1.0, "dense_steps": 0, "dense_layers": 0, "guard": False},
            "step_buckets": [0, 1], "settings": SETTINGS}
    plan.update(changes)
    path = tmp_path / name
    path.write_text(json.dumps(plan))
    return str(path)


def request(**overrides):
    from fastdit.app import RunRequest

    fields = dict(model="tiny-wan", prompt="a fox", seed=5, steps=SMALL["steps"], frames=SMALL["frames"],
                  height=SMALL["height"], width=SMALL["width"], method="sparge",
                  options={"topk": "0.9", "dense_steps": "1"})  # ignored when a plan is given
    return RunRequest(**{**fields, **overrides})


def expected_density():
    """Effective density from the plan alone: sparge with topk t on 36 key blocks of 4 video tokens
    keeps ceil(t * 36) blocks per query block (the text keys of Wan's self-attention: none)."""
    per_call = {None: 1.0, 0.25: 9 / 36, 0.5: 18 / 36}
    values = [per_call[None if s is None else s["topk"]] for s in SETTINGS.values()]
    return sum(values) / len(values)


def test_runner_applies_the_plan_and_refuses_a_mismatched_one(tmp_path):
    from fastdit.app import AppError, Runner

    runner = Runner()
    out = runner.compare(request(calibration=write(tmp_path)))
    metrics = out.metrics
    assert metrics["calibration"] == "plan.json" and any("calibration plan.json applied" in n for n in out.notes)
    assert metrics["options"]["layer_settings"] == {k: (None if v is None else {"topk": v["topk"]})
                                                    for k, v in SETTINGS.items()}
    assert metrics["options"]["dense_steps"] == 0 and metrics["options"]["tile"] == [1, 2, 2]  # not the boxes
    assert metrics["dense_calls"] > 0 and metrics["sparse_calls"] > 0  # the null entries ran dense
    assert metrics["effective_density"] == pytest.approx(expected_density(), abs=1e-6)
    assert metrics["dense_digest"] != metrics["method_digest"]
    assert_unpatched(runner)
    cases = [
        (write(tmp_path, "six.json", model={"family": "wan", "transformer": "WanTransformer3DModel", "layers": 6,
                                            "heads": 2, "grids": []}),
         "number of patched attention layers is 4 but the calibration was made for 6"),
        (write(tmp_path, "sta.json"), None),  # applied with method sta below: another method's plan
        (str(tmp_path / "missing.json"), "cannot read it"),
        (write(tmp_path, "bad.json", settings={"0_0": {"topk": 3.0}}), "settings entry '0_0'|layer_settings entry '0_0'"),
        # calibrated on another grid: refused at the first call on this one, naming both grids
        (write(tmp_path, "grid.json", model={"family": "wan", "transformer": "WanTransformer3DModel", "layers": 4,
                                             "heads": 2, "grids": [[3, 6, 7]]}),
         r"cannot be applied to grid \(3, 5, 7\).*measured on grid\(s\) \[\(3, 6, 7\)\]"),
    ]
    for path, message in cases:
        method = "sta" if path.endswith("sta.json") else "sparge"
        with pytest.raises(AppError, match=message or "is for method 'sparge', not 'sta'"):
            runner.compare(request(calibration=path, method=method))
        assert_unpatched(runner)


def test_page_plan_input_and_plan_argument(tmp_path):
    """``--plan PATH`` presets the page's plan input (and selects its method); a run through the page
    with that plan applies it; an uploaded plan of another model is a Gradio error with CalibrationError's text."""
    from fastdit.app import add_app_parser, build_app
    from fastdit.app.launch import check_calibration_argument

    import argparse

    parser = argparse.ArgumentParser(prog="fastdit")
    add_app_parser(parser.add_subparsers(dest="command", required=True))
    path = write(tmp_path)
    assert parser.parse_args(["app", "--calibration", path]).calibration == path
    with pytest.raises(SystemExit, match="argument --calibration: calibration file .*missing.json: cannot read it"):
        check_calibration_argument(str(tmp_path / "missing.json"))
    demo = build_app("tiny-wan", calibration=check_calibration_argument(path))
    demo.queue(default_concurrency_limit=1)
    url = launch(demo)
    try:
        client = gradio_client.Client(url, verbose=False)
        params = client.view_api(return_format="dict", print_info=False)["named_endpoints"]["/compare"]["parameters"]
        defaults = {p["parameter_name"]: p.get("parameter_default") for p in params}
        assert defaults["method"] == "sparge" and defaults["calibration"] is not None  # preset by --calibration
        result = client.predict(**SMALL, method="sparge", calibration=gradio_client.handle_file(path), api_name="/compare")
        metrics = result[8]
        assert metrics["calibration"] == "plan.json" and metrics["options"]["layer_settings"]["0_1"] is None
        assert metrics["effective_density"] == pytest.approx(expected_density(), abs=1e-6)
        other = write(tmp_path, "other.json", model={"family": "wan", "transformer": "WanTransformer3DModel",
                                                     "layers": 4, "heads": 3, "grids": []})
        with pytest.raises(gradio_client.exceptions.AppError, match="number of attention heads is 2 but the calibration"):
            client.predict(**SMALL, method="sparge", calibration=gradio_client.handle_file(other), api_name="/compare")
        assert_unpatched(demo.runner)
    finally:
        demo.close()


def test_auto_is_offered_and_runs_from_a_calibration_only(tmp_path):
    """``auto`` is in the method list; without a calibration (none shipped with tiny-wan, none given)
    the run is refused with what to do, before any work and leaving the model unpatched; with one
    given, the method frames equal those of ``fastdit.patch(pipe, "auto", calibration=...)`` run by hand."""
    import numpy as np
    import torch

    import fastdit
    from fastdit.app import AppError, Runner, method_choices
    from fastdit.calibration.search import calibrate
    from fastdit.pipelines.tiny import tiny

    assert method_choices()[-1] == "auto" and "dense" not in method_choices()
    runner = Runner()
    with pytest.raises(AppError, match=r"auto runs from a calibration.*grid \(3, 5, 7\).*fastdit calibrate"):
        runner.compare(request(method="auto", options={}))
    assert_unpatched(runner)
    pipe = tiny("wan")
    call = dict(TINY_TEST_DEFAULTS["wan"])
    out = tmp_path / "auto.json"
    plan = calibrate(pipe, "auto", ["a fox"], budget=1e9, out=out, call_kwargs=call, rows=32, progress=False,
                     candidates=[{"method": "sta", "tile": (1, 2, 2), "window": (1, 1, 1)},
                                 {"method": "todo", "factor": 2}])
    # on a CPU the calibration may keep every head dense (sparse is slower there): a mix by hand
    plan["choices"] = {f"0_{layer}_{head}": [0, 1, None][(layer + head) % 3] for layer in range(4) for head in range(2)}
    out.write_text(json.dumps(plan))
    result = runner.compare(request(method="auto", options={}, calibration=str(out)))
    assert result.metrics["sparse_calls"] > 0 and any("calibration auto.json applied" in n for n in result.notes)
    assert result.metrics["method_digest"] != result.metrics["dense_digest"]  # the mix really changed the video
    assert_unpatched(runner)
    patch = fastdit.patch(pipe, "auto", calibration=out)
    try:
        by_hand = pipe(prompt="a fox", generator=torch.Generator().manual_seed(5), output_type="np", **call).frames[0]
    finally:
        patch.remove()
    got = np.asarray(result.method_frames, dtype=np.float64)
    want = np.asarray(by_hand, dtype=np.float64)
    if got.max() > 1.5:  # the app keeps uint8 frames
        want = (np.clip(want, 0, 1) * 255).round()
    assert got.shape == want.shape and np.abs(got - want).max() <= 1.0
