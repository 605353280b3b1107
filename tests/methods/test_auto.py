"""method="auto": the chooser on structured inputs of mixed head kinds, mixed methods in one layer
(against per-head calls built independently), plans, calibration and bad input."""
import json
import math

import pytest
import torch

import fastdit
from fastdit.calibration.auto_report import compare_single, heatmap, score_call, summary
from fastdit.calibration.candidates import auto_candidates, select_auto
from fastdit.calibration.calibration_file import CalibrationError, load_calibration
from fastdit.calibration.search import calibrate
from fastdit.context import AttentionContext, CallState
from fastdit.costmodel import gpu_named
from fastdit.eval.bench.structured import structured_qkv
from fastdit.layout import TokenLayout
from fastdit.methods.auto import Auto
from fastdit.pipelines.tiny import TINY_TEST_DEFAULTS, tiny

KINDS = ("spatial", "temporal", "semantic", "global")
#: one or two settings per method: the test's candidate list (the bench scores the full default list)
STRUCTURED = ([{"method": "sta", "tile": (1, 8, 8), "window": w} for w in ((1, 3, 3), (5, 1, 1))]
              + [{"method": "radial", "decay": 0.5}, {"method": "sparge", "topk": 0.3},
                 {"method": "svg", "density": 0.2}, {"method": "svg2", "top_p": 0.9},
                 {"method": "todo", "factor": 2}, {"method": "tome", "ratio": 0.5}])


def reference(q, k, v, key_mask=None):
    """Dense attention in float64, written out."""
    scores = q.double() @ k.double().transpose(-1, -2) / math.sqrt(q.shape[-1])
    if key_mask is not None:
        scores = scores.masked_fill(~key_mask[:, None, None, :], float("-inf"))
    return torch.softmax(scores, -1) @ v.double()


def test_auto_beats_every_single_method_on_mixed_head_kinds():
    """The issue's check: 4096 tokens, one head of each kind; at budget B every head's error (run
    through method "auto", against float64 dense) is within B, and auto's predicted time is below
    the best single method's with its own per-head choice at the same budget."""
    budget = 0.2  # at 4096 tokens and 4 heads launches weigh: at 0.1 auto only ties sta (docs/auto.md)
    q, k, v, layout, _ = structured_qkv((4, 32, 32), heads=4, head_dim=64, kinds=KINDS, seed=3)
    assert layout.seq_len >= 4096
    results = [score_call(q, k, v, layout, STRUCTURED, "H100", backend="torch")]
    rows = {row["label"]: row for row in compare_single(results, STRUCTURED, budget)}
    auto = rows.pop("auto")
    best = min(rows.values(), key=lambda row: row["predicted_ms"])
    assert auto["predicted_ms"] < best["predicted_ms"], (auto, best)
    assert len(set(auto["heads"]) - {"dense"}) >= 2  # really mixed
    choice = auto["choice"]
    out, info = fastdit.attention(q, k, v, "auto", layout=layout, candidates=STRUCTURED, backend="torch",
                                  choices={f"{key}": value for key, value in choice.items()}, return_info=True)
    expected = reference(q, k, v)
    err = ((out.double() - expected).pow(2).sum((0, 2, 3)) / expected.pow(2).sum((0, 2, 3))).sqrt()
    assert not torch.isnan(err).any() and bool((err <= budget + 1e-3).all()), err
    assert 0 < info["density"] < 1 and len(info["head_density"]) == 4


def test_mixed_layer_equals_per_head_calls_and_keeps_global_heads():
    torch.manual_seed(7)
    layout = TokenLayout((3, 6, 10), text_len=5, text_position="suffix")
    batch, heads, seq, dim = 2, 5, layout.seq_len, 16
    q, k, v = (torch.randn(batch, heads, seq, dim) for _ in range(3))
    key_mask = torch.ones(batch, seq, dtype=torch.bool)
    key_mask[1, -3:] = False  # padded text keys of the second prompt
    candidates = [{"method": "sta", "tile": (1, 2, 2), "window": (1, 1, 1)}, {"method": "todo", "factor": 2},
                  {"method": "sparge", "tile": (1, 2, 4), "topk": 0.3, "simthresh": -1.0}]
    picks = [0, 1, None, 0, 2]
    choices = {f"0_0_{h}": c for h, c in enumerate(picks)}
    out, info = fastdit.attention(q, k, v, "auto", layout=layout, key_mask=key_mask, candidates=candidates,
                                  choices=choices, backend="torch", return_info=True)
    for head, pick in enumerate(picks):  # each head alone, through its own method (or float64 dense)
        one = slice(head, head + 1)
        if pick is None:
            expected, density = reference(q[:, one], k[:, one], v[:, one], key_mask), 1.0
        else:
            options = {key: value for key, value in candidates[pick].items() if key != "method"}
            expected, single = fastdit.attention(q[:, one], k[:, one], v[:, one], candidates[pick]["method"],
                                                 layout=layout, key_mask=key_mask, backend="torch",
                                                 return_info=True, guard=False, **options)
            density = single["density"]  # auto runs its candidates without the guard
        torch.testing.assert_close(out[:, one].double(), expected.double(), rtol=1e-4, atol=1e-4)
        assert info["head_density"][head] == pytest.approx(density, rel=1e-9)
    assert max(info["head_density"]) == 1.0 > min(info["head_density"])  # really sparse heads beside dense
    # Ulysses: a rank holding heads 2..4 runs their own choices (global indices)
    method = Auto(candidates=candidates, choices=choices, dense_steps=0, dense_layers=0)
    part = slice(2, 5)
    ctx = AttentionContext(layer=0, layer_name="l0", step=0, num_steps=1, branch=0, layout=layout, call=CallState(1),
                           key_mask=key_mask, head_offset=2, num_heads=3, total_heads=5, backend="torch",
                           dense_fn=lambda: reference(q[:, part], k[:, part], v[:, part], key_mask).float())
    torch.testing.assert_close(method(ctx, q[:, part], k[:, part], v[:, part]), out[:, part], rtol=1e-4, atol=1e-4)
    assert ctx.info["head_density"] == pytest.approx(info["head_density"][2:])


def test_select_auto_prefers_dense_when_sparse_is_slower_or_too_wrong():
    result = {"0_0": {"err2": [[0.01, 0.0], [4.0, 0.01]], "ref2": [1.0, 1.0], "density": [[0.1, 0.5], [0.1, 0.5]],
                      "time": [[1.0, 3.0], [1.0, 6.0]], "dense_time": [5.0, 5.0], "calls": 1}}
    candidates = [{"method": "sta", "window": (1, 1, 1)}, {"method": "svg", "density": 0.5}]
    choice, measured = select_auto([result], candidates, 0.2)
    assert choice == {"0_0_0": 0, "0_0_1": None}  # head 1: sta too wrong (2.0), svg slower than dense
    assert measured["0_0"]["head_time"] == [1.0, 5.0]
    choice, _ = select_auto([result], candidates, 0.2, allowed={"svg"})
    assert choice == {"0_0_0": 1, "0_0_1": None}


def test_unknown_gpu_and_auto_candidates():
    with pytest.raises(ValueError, match="unknown gpu 'X999'.*H100"):
        gpu_named("X999")
    assert gpu_named("rtx4090").name == "RTX 4090"
    layout = TokenLayout((3, 5, 7))
    names = {c["method"] for c in auto_candidates(layout, {"sta": {"tile": (1, 2, 2)}})}
    assert names == {"sta", "radial", "sparge", "svg", "svg2", "todo", "tome"}
    with pytest.raises(ValueError, match="prune"):
        auto_candidates(layout, {"prune": {}})


@pytest.fixture(scope="module")
def pipe():
    return tiny("wan")


CALL = dict(TINY_TEST_DEFAULTS["wan"])
TINY = [{"method": "sta", "tile": (1, 2, 2), "window": (1, 1, 1)}, {"method": "todo", "factor": 2}]


def test_calibrate_auto_writes_a_v2_plan_that_patch_applies(pipe, tmp_path):
    out = tmp_path / "auto.json"
    plan = calibrate(pipe, "auto", ["a red fox"], budget=1e9, out=out, call_kwargs=CALL, candidates=TINY, rows=32,
                     progress=False, gpu="A100")
    assert plan["version"] == 2 and plan["method"] == "auto" and plan["gpu"] == "A100"
    assert len(plan["choices"]) == 4 * 2 and load_calibration(out) == plan
    assert plan["measured"]["predicted_speedup"] > 0
    assert "predicted attention time on A100" in "\n".join(summary(plan))
    # a hand-made mix on the same model: every layer runs its heads' choices
    plan["choices"] = {f"0_{layer}_{head}": [0, 1, None][(layer + head) % 3] for layer in range(4) for head in range(2)}
    out.write_text(json.dumps(plan))
    assert heatmap(load_calibration(out), tmp_path / "auto.png").stat().st_size > 0
    patch = fastdit.patch(pipe, "auto", calibration=out)
    try:
        pipe(prompt="a red fox", generator=torch.Generator().manual_seed(0), output_type="latent", **CALL)
        stats = patch.stats
        assert stats.sparse_calls > 0 and 0 < stats.effective_density < 1
    finally:
        patch.remove()


def test_bad_input_is_refused_before_model_work(pipe, tmp_path):
    with pytest.raises(ValueError, match="fastdit calibrate --model MODEL --method auto"):
        fastdit.patch(pipe, "auto")
    never = type("Never", (), {"__call__": lambda *a, **k: pytest.fail("the model ran")})()
    with pytest.raises(ValueError, match="budget must be a number > 0"):
        calibrate(never, "auto", ["x"], budget=0, out=tmp_path / "p.json", progress=False)
    with pytest.raises(ValueError, match="unknown gpu"):
        calibrate(never, "auto", ["x"], budget=0.1, out=tmp_path / "p.json", progress=False, gpu="X999")
    plan = {"format": "fastdit-plan", "version": 2, "method": "auto", "step_buckets": [0], "options": {},
            "model": {"family": "wan", "transformer": "WanTransformer3DModel", "layers": 6, "heads": 2, "grids": []},
            "candidates": TINY, "choices": {f"0_{layer}_{h}": 0 for layer in range(6) for h in range(2)}}
    with pytest.raises(CalibrationError, match="number of patched attention layers is 4 but the calibration was made for 6"):
        fastdit.patch(pipe, "auto", calibration=plan)
    with pytest.raises(CalibrationError, match="needs calibration version 2"):
        load_calibration({**plan, "version": 1})


@pytest.mark.parametrize("argv, needle", [
    (["calibrate", "--method", "auto", "--budget", "0.1", "--gpu", "X9"], "unknown gpu 'X9'"),
    (["calibrate", "--method", "sta", "--budget", "0.1", "--gpu", "H100"], "only --method auto"),
    (["calibrate", "--method", "auto", "--budget", "0.1", "--set", "prune.ratio=0.3"], "does not choose from"),
    (["compare", "--model", "tiny-wan", "--methods", "dense,auto"], "fastdit calibrate --model MODEL --method auto"),
    # tiny-shapes ships an auto calibration for its native size only: another size is refused, naming both grids
    (["compare", "--methods", "dense,auto", "--height", "64", "--width", "64"],
     "shipped with tiny-shapes is for its native latent grid [9, 32, 32], this call's is [9, 16, 16]"),
])
def test_cli_refuses_bad_auto_input_before_loading_a_model(argv, needle, capsys, monkeypatch):
    from fastdit.cli import main
    from fastdit.pipelines import loading

    monkeypatch.setattr(loading, "load_pipeline", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2 and needle in capsys.readouterr().err
