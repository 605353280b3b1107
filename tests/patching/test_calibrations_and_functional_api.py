"""Calibration files only where they mean what they were calibrated for (grids, layers, options
beside ``calibration=``), bounded state on bare transformers, a functional API that never silently
drops keys or goes dense, and small command-line checks."""
import gc
import os

import pytest
import torch

import fastdit
import fastdit.calibration.calibration_file
from fastdit.methods.base import OptionError

from helpers import nothing_installed, one_line_error  # the fixture no_model: conftest.py

SPARSE_METHODS = [m for m in fastdit.method_names() if m != "dense"]


# -- the functional API runs sparse by default ---------------------------------------------------
@pytest.mark.parametrize("method", SPARSE_METHODS)
def test_functional_attention_runs_sparse_by_default(method):
    layout = fastdit.TokenLayout((3, 8, 8))
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, layout.seq_len, 16) for _ in range(3))
    out, info = fastdit.attention(q, k, v, method, layout=layout, return_info=True)
    assert not info["dense"], f"{method} ran dense outside a pipeline (a pipeline default applied)"
    assert torch.isfinite(out).all()


def test_functional_attention_fraction_needs_num_steps():
    layout = fastdit.TokenLayout((3, 8, 8))
    q = torch.randn(1, 2, layout.seq_len, 16)
    with pytest.raises(OptionError, match="num_steps"):
        fastdit.attention(q, q, q, "sta", layout=layout, dense_steps=0.5)
    _, info = fastdit.attention(q, q, q, "sta", layout=layout, dense_steps=0.5, num_steps=4, step=1, return_info=True)
    assert info["dense"]
    _, info = fastdit.attention(q, q, q, "sta", layout=layout, dense_steps=0.5, num_steps=4, step=2, return_info=True)
    assert not info["dense"]
    _, info = fastdit.attention(q, q, q, "svg", layout=layout, dense_layers=1, layer=0, return_info=True)
    assert info["dense"]


# -- keys of another length than the queries ------------------------------------------------------
def _reference(q, k, v, key_mask=None):
    """Float64 softmax(q k^T / sqrt(D)) v over the valid keys."""
    scores = q.double() @ k.double().transpose(-1, -2) / q.shape[-1] ** 0.5
    if key_mask is not None:
        scores = scores.masked_fill(~key_mask[:, None, None, :], float("-inf"))
    return (scores.softmax(-1) @ v.double()).float()


@pytest.mark.parametrize("extra", [37, -29])
@pytest.mark.parametrize("method", fastdit.method_names())
def test_functional_attention_other_key_length(method, extra):
    layout = fastdit.TokenLayout((3, 6, 10), text_len=7, text_position="prefix")
    torch.manual_seed(1)
    seq = layout.seq_len
    q = torch.randn(2, 2, seq, 16)
    k, v = torch.randn(2, 2, seq + extra, 16), torch.randn(2, 2, seq + extra, 16)
    key_mask = torch.rand(2, seq + extra) > 0.2
    if method not in ("dense", "prune"):  # the methods that take another key length (Method.any_key_length)
        with pytest.raises(ValueError) as error:
            fastdit.attention(q, k, v, method, layout=layout, key_mask=key_mask)
        assert f"{seq} queries and {seq + extra} keys" in str(error.value)
        return
    state = {}
    options = {"ratio": 0.5, "refresh_every": 8, "block_size": 16} if method == "prune" else {}
    for step in range(3):  # prune: a full step, then steps that recompute only some query blocks
        out = fastdit.attention(q, k, v, method, layout=layout, key_mask=key_mask, state=state, step=step,
                                num_steps=3, **options)
        torch.testing.assert_close(out, _reference(q, k, v, key_mask), atol=2e-5, rtol=1e-4)


# -- sta strategy entries for layers that do not exist -------------------------------------------
def test_sta_strategy_for_a_missing_layer_is_refused():
    from tiny_transformers import tiny_wan

    model = tiny_wan()
    layers = fastdit.calibration.calibration_file.model_facts(model)[2]
    for key in (f"0_{layers}_0", "0_50_0"):
        with pytest.raises(ValueError, match=rf"strategy entry '{key}' names layer {key.split('_')[1]} but the model "
                                             rf"has {layers} patched attention layers"):
            fastdit.patch(model, "sta", tile=(1, 2, 2), window=(1, 3, 3), strategy={key: (1, 1, 1)})
        assert getattr(model, "_fastdit_patch", None) is None  # nothing installed
    fastdit.patch(model, "sta", tile=(1, 2, 2), window=(1, 3, 3), strategy={f"0_{layers - 1}_0": (1, 1, 1)}).remove()


# -- options beside calibration= -------------------------------------------------------------------
def tiny_wan_plan(method="sta", grids=None, **changes):
    """A hand-made plan for ``tiny_wan`` (2 patched layers of 2 heads)."""
    plan = {"format": "fastdit-plan", "version": 1, "method": method,
            "model": {"family": "wan", "transformer": "WanTransformer3DModel", "layers": 2, "heads": 2,
                      "grids": grids if grids is not None else [[2, 4, 4]]},
            "step_buckets": [0]}
    if method == "sta":
        plan["options"] = {"tile": [1, 2, 2], "fit_tile": False, "dense_steps": 0, "dense_layers": 0}
        plan["strategy"] = {f"0_{layer}_{head}": [1, 1, 3] for layer in range(2) for head in range(2)}
    else:
        plan["options"] = {"tile": [1, 2, 2], "dense_steps": 0, "dense_layers": 0}
        plan["settings"] = {"0_0": {"topk": 0.5}, "0_1": None}
    plan.update(changes)
    return plan


@pytest.mark.parametrize("method, given, named", [
    ("sta", {"strategy": {"0_0_0": (1, 1, 1)}}, "strategy"),
    ("sta", {"tile": (1, 4, 4)}, "tile"),
    ("sta", {"window": (3, 3, 3)}, "window"),
    ("sta", {"dense_steps": 2}, "dense_steps"),
    ("sparge", {"topk": 0.9}, "topk"),
    ("sparge", {"layer_settings": {"0_1": {"topk": 0.2}}}, "layer_settings"),
])
def test_options_the_calibration_sets_cannot_be_passed_beside_it(method, given, named):
    from fastdit.calibration.calibration_file import CalibrationError
    from tiny_transformers import tiny_wan

    model = tiny_wan()
    with pytest.raises(CalibrationError, match=rf"sets option\(s\) \[.*'{named}'.*\]: they cannot be passed beside calibration="):
        fastdit.patch(model, method, calibration=tiny_wan_plan(method), **given)
    assert getattr(model, "_fastdit_patch", None) is None


def test_options_the_calibration_does_not_set_apply_on_top():
    from tiny_transformers import tiny_wan

    model = tiny_wan()
    with fastdit.patch(model, "sta", calibration=tiny_wan_plan("sta"), skip_threshold=4.0) as p:
        assert p.config.skip_threshold == 4.0 and p.config.tile == (1, 2, 2)
        assert p.config.strategy["0_1_1"] == (1, 1, 3)
    with fastdit.patch(model, "sparge", calibration=tiny_wan_plan("sparge"), cdf=0.5) as p:
        assert p.config.cdf == 0.5 and p.config.layer_settings == {"0_0": {"topk": 0.5}, "0_1": None}


# -- a calibration on a grid it was not made for -----------------------------------------------------
def _grid_of(model, inputs):
    from fastdit.pipelines import find_adapter

    return tuple(find_adapter(model).grid(model, (), inputs))


@pytest.mark.parametrize("method, options", [("sparge", {}), ("sta", {"tile": [4, 4, 8], "fit_tile": True,
                                                                     "dense_steps": 0, "dense_layers": 0})])
def test_calibration_on_another_grid_is_refused_at_the_first_call(method, options):
    from fastdit.calibration.calibration_file import CalibrationError
    from tiny_transformers import tiny_wan, wan_inputs

    model = tiny_wan()
    # 5 x 4 x 8 and 3 x 4 x 8 tokens: sta's fitted tile is 5x4x8 on one, 3x4x8 on the other
    planned, other = wan_inputs(frames=5, height=8, width=16), wan_inputs(frames=3, height=8, width=16)
    grid, other_grid = _grid_of(model, planned), _grid_of(model, other)
    plan = tiny_wan_plan(method, grids=[list(grid)])
    if options:
        plan["options"] = options
    with torch.no_grad():
        reference = model(**other).sample
        p = fastdit.patch(model, method, calibration=plan)
        model(**planned)  # its own grid runs
        for _ in range(2):  # refused at every call on that grid, not only the first
            with pytest.raises(CalibrationError) as error:
                model(**other)
            assert str(grid) in str(error.value) and str(other_grid) in str(error.value)
        model(**planned)  # and the patch still works on its own grid
        p.remove()
        nothing_installed(model)
        assert torch.equal(model(**other).sample, reference)


def test_fixed_tile_sta_calibration_runs_on_another_grid():
    from tiny_transformers import tiny_wan, wan_inputs

    model = tiny_wan()
    plan = tiny_wan_plan("sta", grids=[[3, 4, 8]])  # tile (1, 2, 2), fit_tile False: windows in fixed tiles
    with torch.no_grad(), fastdit.patch(model, "sta", calibration=plan) as p:
        model(**wan_inputs(frames=3, height=16, width=16))
        assert p.stats.sparse_calls > 0


def test_compare_with_a_calibration_on_another_grid_is_one_line_error(tmp_path, capsys):
    import json

    from fastdit.cli import main
    from fastdit.pipelines.tiny import TINY_TEST_DEFAULTS

    size = TINY_TEST_DEFAULTS["wan"]  # 9 frames at 80x112: a 3 x 5 x 7 grid; 4 layers of 2 heads
    plan = tiny_wan_plan("sparge", grids=[[3, 5, 7]])
    plan["model"]["layers"] = 4
    plan["settings"] = {"0_0": {"topk": 0.5}, "0_1": None}
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    argv = ["compare", "--model", "tiny-wan", "--frames", str(size["num_frames"]), "--height", "96", "--width", str(size["width"]),
            "--steps", "1", "--methods", "dense,sparge", "--calibration", str(path),
            "--out", str(tmp_path / "out")]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code != 0
    err = capsys.readouterr().err.strip().splitlines()[-1]  # the dense run's progress bars come first
    assert err.startswith("fastdit: error: CalibrationError") and "(3, 5, 7)" in err and "(3, 6, 7)" in err, err


# -- a bare transformer called repeatedly at one timestep -------------------------------------------
def _state_size(store):
    """(tensors, bytes) held by a CallState's method store (nested dicts / lists / tuples)."""
    seen, count, size = set(), 0, 0
    stack = [store]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            key = (item.untyped_storage().data_ptr(), item.untyped_storage().nbytes())
            if key not in seen:
                seen.add(key)
                count, size = count + 1, size + key[1]
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif hasattr(item, "__dict__") and not isinstance(item, type):
            stack.extend(vars(item).values())
    return count, size


def _rss_mb():
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.parametrize("method, options", [
    ("prune", {"ratio": 0.5, "refresh_every": 4, "block_size": 32}),
    ("window", {"tile": (1, 2, 2), "window": (1, 3, 3), "refresh_every": 4}),
    ("sparge", {"tile": (1, 2, 4), "topk": 0.25, "correction": "cached", "dense_steps": 0}),
])
def test_bare_transformer_at_one_timestep_keeps_state_and_memory_bounded(method, options):
    from tiny_transformers import tiny_wan, wan_inputs

    model = tiny_wan()
    inputs = wan_inputs(frames=3, height=8, width=16, timestep=999.0)  # 3 x 4 x 8 tokens, batch 2
    sizes, rss = [], []
    with torch.no_grad(), fastdit.patch(model, method, **options) as p:
        for i in range(200):
            model(**inputs)
            sizes.append(_state_size(p.call_state.store))
            if i in (9, 199):
                gc.collect()
                rss.append(_rss_mb())
        entries = len(p.call_state.store)
        assert entries <= 2 * len(p.layers), f"{entries} (layer, branch) states"  # at most two branches
        assert p.stats.sparse_calls + p.stats.dense_calls == 200 * len(p.layers)
    assert max(sizes[10:]) <= max(sizes[:10]), f"method state grows: {sizes[9]} after 10 calls, {sizes[-1]} after 200"
    assert rss[1] - rss[0] < 8, f"RSS grew {rss[1] - rss[0]:.1f} MB from call 10 to call 200"


def test_repeated_timestep_starts_a_new_call_after_two_branches():
    from tiny_transformers import tiny_wan, wan_inputs

    model = tiny_wan()
    branches = []
    with torch.no_grad(), fastdit.patch(model, "dense") as p:
        for timestep in (999, 999, 999, 999, 999, 500, 500, 999):
            model(**wan_inputs(frames=1, height=4, width=4, timestep=timestep))
            branches.append((p.call_state.step, p.call_state.calls_in_round))
        p.branches_per_step = 3
        for _ in range(3):
            model(**wan_inputs(frames=1, height=4, width=4, timestep=999))
            branches.append((p.call_state.step, p.call_state.calls_in_round))
    # (step, calls in the step so far): 999 twice = one CFG step; again = a new call; 500 = step 1
    assert branches == [(0, 1), (0, 2), (0, 1), (0, 2), (0, 1), (1, 1), (1, 2), (0, 1), (0, 2), (0, 3), (0, 1)]


# -- smaller command-line checks ------------------------------------------------------------------------------

def test_calibrate_radial_without_candidates_is_refused_before_loading(tmp_path, capsys, no_model):
    from fastdit.cli import main

    with pytest.raises(SystemExit) as info:
        main(["calibrate", "--method", "radial", "--budget", "0.1", "--out", str(tmp_path / "plan.json")])
    line = one_line_error(capsys, info)
    assert "--candidates" in line and "candidates=[" not in line, line


def test_compare_with_no_methods_is_a_one_line_error(tmp_path, capsys, no_model):
    from fastdit.cli import main

    for methods in ("", " , "):
        with pytest.raises(SystemExit) as info:
            main(["compare", "--methods", methods, "--out", str(tmp_path / "out")])
        assert "--methods" in one_line_error(capsys, info)


def test_hand_edited_sta_calibration_without_options_or_a_head_is_refused():
    from fastdit.calibration.calibration_file import CalibrationError, check_calibration

    check_calibration(tiny_wan_plan("sta"))
    no_options = tiny_wan_plan("sta")
    del no_options["options"]
    with pytest.raises(CalibrationError, match="'options' must give the 'tile'"):
        check_calibration(no_options)
    no_head = tiny_wan_plan("sta")
    del no_head["strategy"]["0_1_1"]
    with pytest.raises(CalibrationError, match=r"no entry for head\(s\) \[1\] of step bucket 0, layer 1"):
        check_calibration(no_head)
