"""Per-(step bucket, layer) settings of any method (``layer_settings``), calibrated per layer.

Checked against the plan file (an independent bucket lookup here) and against direct options and
a float64 softmax reference, never against what the method recorded about itself.
"""
import bisect
import math

import pytest
import torch

import fastdit
from fastdit.calibration.search import calibrate, select_settings
from fastdit.layout import TokenLayout
from fastdit.methods.sparge import Sparge
from fastdit.pipelines.tiny import TINY_TEST_DEFAULTS, tiny
from fastdit.calibration.calibration_file import CalibrationError, load_calibration, write_calibration

CALL = dict(TINY_TEST_DEFAULTS["wan"])  # 3 x 5 x 7 latent tokens, 2 steps, CFG, 4 patched layers, 2 heads
GRID = (3, 5, 7)
BASE = {"tile": (1, 2, 2), "simthresh": -1.0, "dense_steps": 0}  # 36 key blocks of 4 tokens; every block may be dropped
CANDIDATES = [{"topk": 0.5}, {"topk": 0.25}, {"topk": 0.1}]


@pytest.fixture(scope="module")
def pipe():
    return tiny("wan")


def sparge_plan(settings, buckets):
    return {"format": "fastdit-plan", "version": 1, "method": "sparge",
            "model": {"family": "wan", "transformer": "WanTransformer3DModel", "layers": 4, "heads": 2,
                      "grids": [list(GRID)]},
            "options": {"tile": [1, 2, 2], "simthresh": -1.0, "dense_steps": 0, "dense_layers": 0},
            "step_buckets": buckets, "settings": settings}


def expected_setting(settings, step, layer):
    """The plan file's rule, written again: the bucket with the largest start <= step."""
    starts = sorted({int(k.split("_")[0]) for k in settings})
    position = bisect.bisect_right(starts, step) - 1
    return settings.get(f"{starts[position]}_{layer}", "base") if position >= 0 else "base"


@pytest.fixture
def spy(monkeypatch):
    """(step, layer, topk) of every call that reached ``Sparge.attend`` (dense calls never do)."""
    calls = []
    original = Sparge.attend

    def attend(self, ctx, q, k, v):
        calls.append((ctx.step, ctx.layer, self.config.topk))
        return original(self, ctx, q, k, v)

    monkeypatch.setattr(Sparge, "attend", attend)
    return calls


def test_patch_with_plan_uses_each_layer_and_bucket_setting(pipe, tmp_path, spy):
    settings = {"0_0": {"topk": 0.5}, "0_1": None, "0_2": {"topk": 0.1}, "0_3": {"topk": 0.25},
                "1_0": {"topk": 0.1}, "1_1": {"topk": 0.5}, "1_2": None}  # layer 3 not named in bucket 1
    path = write_calibration(sparge_plan(settings, [0, 1]), tmp_path / "plan.json")
    with fastdit.patch(pipe, "sparge", calibration=path) as p:
        pipe(prompt="a red fox", **CALL, output_type="latent")
        base_topk = p.config.topk
        per_layer = p.stats.as_dict()
    seen = {}
    for step, layer, topk in spy:
        seen.setdefault((step, layer), set()).add(topk)
    for step in (0, 1):
        for layer in range(4):
            want = expected_setting(settings, step, layer)
            if want is None:
                assert (step, layer) not in seen, (step, layer)  # dense: the method never ran
            else:
                topk = base_topk if want == "base" else want["topk"]
                assert seen[step, layer] == {topk}, (step, layer, seen.get((step, layer)))
    assert per_layer["effective_density"] < 1.0


def test_dense_entry_and_override_match_direct_options_and_float64_reference():
    torch.manual_seed(0)
    layout = TokenLayout((3, 5, 7), 5, "suffix")
    q, k, v = (torch.randn(1, 2, layout.seq_len, 16) for _ in range(3))
    settings = {"0_0": {"topk": 0.25}, "0_1": None, "2_1": {"topk": 0.5}}
    with_settings = dict(BASE, layer_settings=settings)
    direct = fastdit.attention(q, k, v, "sparge", layout=layout, **BASE, topk=0.25)
    out = fastdit.attention(q, k, v, "sparge", layout=layout, layer=0, **with_settings)
    assert torch.isfinite(out).all() and torch.equal(out, direct)
    # layer 1 at step 1 runs dense: equal to softmax(q k^T / sqrt(d)) v in float64
    out, info = fastdit.attention(q, k, v, "sparge", layout=layout, layer=1, step=1, return_info=True, **with_settings)
    scores = q.double() @ k.double().transpose(-1, -2) / math.sqrt(16)
    reference = torch.softmax(scores, -1) @ v.double()
    assert info["dense"] and torch.isfinite(out).all()
    assert ((out.double() - reference).norm() / reference.norm()) < 1e-5
    # step 2 of layer 1: the second bucket's setting; a layer the settings do not name: the base options
    sparse = fastdit.attention(q, k, v, "sparge", layout=layout, layer=1, step=2, **with_settings)
    assert torch.equal(sparse, fastdit.attention(q, k, v, "sparge", layout=layout, **BASE, topk=0.5))
    unnamed, info = fastdit.attention(q, k, v, "sparge", layout=layout, layer=3, return_info=True, **with_settings)
    assert torch.equal(unnamed, fastdit.attention(q, k, v, "sparge", layout=layout, **BASE))
    assert info["density"] < 1.0  # the masks are really sparse


def test_state_is_cleared_when_a_layer_changes_setting():
    """prune reuses cached query blocks between full steps; at a bucket boundary where the layer's
    setting changes, no cache of the old setting is read: that step is a full (dense-equal) step."""
    torch.manual_seed(1)
    layout = TokenLayout((2, 4, 8))
    q0, k, v = (torch.randn(1, 2, layout.seq_len, 16) for _ in range(3))
    q1 = q0 + 0.5 * torch.randn_like(q0)
    options = dict(ratio=0.5, refresh_every=100, block_size=8, warmup=0.0)
    dense = torch.softmax(q1.double() @ k.double().transpose(-1, -2) / 4.0, -1) @ v.double()

    def run(settings):
        state = {}
        fastdit.attention(q0, k, v, "prune", layout=layout, step=0, num_steps=4, state=state,
                          layer_settings=settings, **options)
        return fastdit.attention(q1, k, v, "prune", layout=layout, step=1, num_steps=4, state=state,
                                 layer_settings=settings, **options).double()

    def error(out):
        return float((out - dense).norm() / dense.norm())

    assert error(run({"0_0": {"ratio": 0.5}})) > 1e-2  # same setting: step 1 reuses half the blocks
    assert error(run({"0_0": {"ratio": 0.5}, "1_0": {"ratio": 0.25}})) < 1e-5  # changed: a full step


@pytest.mark.parametrize("settings, needle", [
    ({"0_x": {"topk": 0.5}}, "entry '0_x': keys are 'step_layer'"),
    ({"0_1": {"nope": 1}}, "entry '0_1': unknown option"),
    ({"0_1": {"topk": 7}}, "entry '0_1': topk must be"),
    ({"0_2": {"dense_steps": 1}}, "entry '0_2': option.*dense_steps.*cannot be set per layer"),
    ({"0_1": 3}, "entry '0_1': a setting is a dict of options or None"),
    ({"0_9": {"topk": 0.5}}, "entry '0_9' names layer 9 but the model has 4 patched attention layers"),
])
def test_bad_settings_are_refused_and_nothing_is_patched(pipe, settings, needle):
    processors = [m.processor for m in pipe.transformer.modules() if hasattr(m, "processor")]
    with pytest.raises(ValueError, match=needle):
        fastdit.patch(pipe, "sparge", layer_settings=settings, **BASE)
    assert getattr(pipe.transformer, "_fastdit_patch", None) is None
    assert [m.processor for m in pipe.transformer.modules() if hasattr(m, "processor")] == processors


def test_bad_settings_in_a_plan_file_name_the_entry(pipe, tmp_path):
    plan = sparge_plan({"0_0": {"topk": 0.5}, "0_1": {"topk": -1}}, [0])
    path = tmp_path / "bad.json"
    path.write_text(__import__("json").dumps(plan))
    with pytest.raises(CalibrationError, match=r"entry 'settings': layer_settings entry '0_1': topk must be"):
        fastdit.patch(pipe, "sparge", calibration=path)
    assert getattr(pipe.transformer, "_fastdit_patch", None) is None


def test_select_plan_per_layer_is_the_sparsest_within_budget():
    """Synthetic measurements: per (bucket, layer) the least dense candidate whose worst head error
    (over the prompts) is within the budget, by brute force."""
    generator = torch.Generator().manual_seed(3)
    density = [0.6, 0.35, 0.15]
    results = []
    for _ in range(2):  # two prompts: the worse one counts
        prompt = {}
        for key in ("0_0", "0_1", "5_0", "5_1"):
            ref2 = (torch.rand(2, generator=generator) + 0.5).tolist()
            err2 = (torch.rand(2, 3, generator=generator) * 0.02 * torch.tensor([1.0, 3.0, 9.0])).tolist()
            prompt[key] = {"err2": err2, "ref2": ref2, "density": [density] * 2, "calls": 1}
        results.append(prompt)
    for budget in (1e-9, 0.08, 0.15, 0.3, 1e9):
        choice, measured = select_settings(results, CANDIDATES, budget, per_head=False)
        for key in ("0_0", "0_1", "5_0", "5_1"):
            worst = [max(math.sqrt(r[key]["err2"][h][c] / r[key]["ref2"][h]) for r in results for h in range(2))
                     for c in range(3)]
            ok = [c for c in range(3) if worst[c] <= budget]
            want = min(ok, key=lambda c: density[c]) if ok else None
            assert choice[key] == want, (budget, key)
            assert measured[key]["error"] <= budget
        if budget == 1e9:
            assert set(choice.values()) == {2}
        if budget == 1e-9:
            assert set(choice.values()) == {None}


def test_calibrate_per_layer_round_trip(pipe, tmp_path, spy):
    """sparge calibrated on the tiny pipeline: budget ~0 gives dense everywhere, a huge budget the
    sparsest candidate everywhere, a middle budget may mix; the plan file round-trips and applies."""
    kwargs = dict(call_kwargs=CALL, options=dict(BASE), candidates=CANDIDATES, rows=48, progress=False, steps=2)
    dense = calibrate(pipe, "sparge", ["a red fox"], budget=1e-12, out=tmp_path / "dense.json", **kwargs)
    assert dense["step_buckets"] == [0, 1] and len(dense["settings"]) == 8
    assert set(map(str, dense["settings"].values())) == {"None"} and dense["measured"]["density"] == 1.0
    sparse = calibrate(pipe, "sparge", ["a red fox"], budget=1e9, out=tmp_path / "sparse.json", **kwargs)
    assert all(s == {"topk": 0.1} for s in sparse["settings"].values())
    errors = sorted(row["error"] for row in sparse["measured"]["layers"])
    middle = calibrate(pipe, "sparge", ["a red fox"], budget=errors[len(errors) // 2], out=tmp_path / "mid.json",
                       **kwargs)
    assert all(row["error"] <= middle["budget"] for row in middle["measured"]["layers"])
    assert load_calibration(tmp_path / "mid.json") == middle
    spy.clear()
    with fastdit.patch(pipe, "sparge", calibration=tmp_path / "mid.json"):
        pipe(prompt="a blue car", **CALL, output_type="latent")
    ran = {(step, layer): topk for step, layer, topk in spy}
    for step in (0, 1):
        for layer in range(4):
            want = middle["settings"][f"{step}_{layer}"]
            assert ran.get((step, layer)) == (None if want is None else want["topk"]), (step, layer)
