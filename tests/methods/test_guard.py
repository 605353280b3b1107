"""The quality guard (issue 39): exact sampled rows, acting per head, memory, reports, bad input.

References are built here, independently of ``fastdit/methods/guard.py``: float64 softmax
attention over the whole call, and true kept masses from float64 log-sum-exps."""
import math
from dataclasses import dataclass

import pytest
import torch

import fastdit
from fastdit.layout import TokenLayout
from fastdit.methods import base
from fastdit.methods.base import Method, MethodConfig, register_method
from fastdit.methods.guard import exact_rows, row_count, sample_rows
from fastdit.stats import PatchStats

pytestmark = pytest.mark.guard_defaults


def dense64(q, k, v, key_mask=None):
    """float64 attention ``(out, lse)`` of a whole call."""
    scores = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if key_mask is not None:
        scores = scores.masked_fill(~key_mask[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(scores, -1)
    probs = torch.softmax(scores, -1).nan_to_num(0.0)
    return probs @ v.double(), lse


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def adversarial_heads(grid=(4, 16, 16), heads=2, dim=32, seed=0):
    """Heads the project's own generator does not make: key norms spread over three orders of
    magnitude and a logit offset that grows with the key's position (a distance bias)."""
    from fastdit.eval.bench.guard import offset_norm_heads

    return offset_norm_heads(grid, heads, dim, seed)


@dataclass
class BrokenConfig(MethodConfig):
    pass


class Broken(Method):
    """Dense attention with chosen heads replaced by noise at chosen steps (a method gone wrong)."""

    name = "test_broken"
    config_cls = BrokenConfig
    guard_default = 0.1
    broken_heads = (1,)
    broken_steps = None  # None: every step

    def attend(self, ctx, q, k, v):
        out = ctx.dense().clone()
        if self.broken_steps is None or ctx.step in self.broken_steps:
            gen = torch.Generator().manual_seed(ctx.step)
            for h in self.broken_heads:
                if ctx.head_offset <= h < ctx.head_offset + ctx.num_heads:
                    out[:, h - ctx.head_offset] = torch.randn(out[:, 0].shape, generator=gen)
        ctx.record(performed=0.5 * q.shape[2] ** 2 * q.shape[0] * q.shape[1], total=q.shape[2] ** 2 * q.shape[0] * q.shape[1])
        return out


@pytest.fixture
def broken():
    register_method(Broken)
    Broken.broken_steps = None
    yield Broken
    base._REGISTRY.pop(Broken.name, None)


def qkv(seq=300, heads=3, dim=16, seed=0, batch=1):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(batch, heads, seq, dim, generator=gen) for _ in range(3))


def test_exact_rows_equal_a_float64_reference_with_masked_keys():
    q, k, v = qkv(seq=77, heads=2, dim=8, seed=3, batch=2)
    key_mask = torch.rand(2, 77, generator=torch.Generator().manual_seed(1)) > 0.3
    key_mask[1] = False  # a batch element with no valid key: rows are 0, lse -inf
    rows = torch.tensor([0, 5, 40, 76])
    out, lse = exact_rows(q, k, v, rows, key_mask)
    ref_out, ref_lse = dense64(q, k, v, key_mask)
    assert rel(out[0], ref_out[0][:, rows]) < 1e-5
    assert torch.allclose(lse[0].double(), ref_lse[0][:, rows], atol=1e-5)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.isinf(lse[1]).all()
    # float64 inputs stay float64
    out64, _ = exact_rows(q.double(), k.double(), v.double(), rows, key_mask)
    assert out64.dtype == torch.float64 and rel(out64[0], ref_out[0][:, rows]) < 1e-12


def test_rows_are_stratified_deterministic_and_cover_every_128_tokens():
    rows = sample_rows(8192, 0.005, (3, 2, 1, 0), "cpu")
    assert rows.numel() == row_count(8192, 0.005) == 64
    assert torch.equal(rows, sample_rows(8192, 0.005, (3, 2, 1, 0), "cpu"))  # keyed, not counted
    assert not torch.equal(rows, sample_rows(8192, 0.005, (3, 3, 1, 0), "cpu"))
    assert torch.equal(rows // 128, torch.arange(64))  # one row in each 128-token stretch
    assert row_count(100, 0.01) == 32 and row_count(10, 0.5) == 10 and row_count(8192, 0.02) == 164


def test_a_garbage_head_is_caught_and_run_dense(broken):
    q, k, v = qkv()
    layout = TokenLayout((3, 10, 10))
    out, info = fastdit.attention(q, k, v, "test_broken", layout=layout, return_info=True)
    ref, _ = dense64(q, k, v)
    guard = info["guard"]
    assert guard["action"] == ["pass", "dense", "pass"]
    assert rel(out, ref) < 1e-5  # the broken head replaced by exact dense attention
    assert info["head_density"] == [0.5, 1.0, 0.5]
    assert guard["error"][1] == 0.0 and guard["rows"] == 32
    # off in one keyword: the garbage stays
    out_off, info_off = fastdit.attention(q, k, v, "test_broken", layout=layout, return_info=True, guard=False)
    assert rel(out_off[:, 1], ref[:, 1]) > 1.0 and "guard" not in info_off


@pytest.mark.parametrize("method, options", [("svg2", dict(top_p=0.9)), ("sparge", dict(cdf=0.9))])
def test_a_sharp_head_at_a_low_threshold_keeps_its_mass_under_the_guard(method, options):
    q, k, v, layout = adversarial_heads()
    ref, ref_lse = dense64(q, k, v)
    _, plain = fastdit.attention(q, k, v, method, layout=layout, return_info="mass", guard=False, **options)
    assert min(plain["kept_mass"]) < options.get("top_p", options.get("cdf")) - 0.05  # the failure is real
    out, info = fastdit.attention(q, k, v, method, layout=layout, return_info="mass", guard=0.1, **options)
    true_mass = torch.exp(info["lse"].double() - ref_lse).mean(-1)[0]  # independent of info["kept_mass"]
    assert (true_mass >= 0.9 - 0.05).all(), true_mass
    assert rel(out, ref) < 0.1
    assert set(info["guard"]["action"]) <= {"widened", "dense"}


def test_decisions_are_remembered_then_refreshed(broken):
    Broken.broken_steps = (0,)
    q, k, v = qkv()
    layout = TokenLayout((3, 10, 10))
    state = {}
    actions = []
    for step in range(6):
        _, info = fastdit.attention(q, k, v, "test_broken", layout=layout, return_info=True, step=step, state=state,
                                    guard_refresh=4)
        actions.append(info["guard"]["action"][1])
    # step 0 fails -> dense; steps 1-3 start dense (remembered); step 4 starts a new bucket at the
    # method's own setting, which passes now that the head is fine
    assert actions == ["dense", "dense", "dense", "dense", "pass", "pass"]


def test_the_guard_changes_nothing_on_dense_calls():
    q, k, v = qkv()
    layout = TokenLayout((3, 10, 10))
    out, info = fastdit.attention(q, k, v, "dense", layout=layout, return_info=True, guard=0.01)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert torch.equal(out, ref) and "guard" not in info


def test_nonfinite_input_is_reported_not_hidden(broken):
    q, k, v = qkv()
    v[0, 0, 17] = float("nan")
    layout = TokenLayout((3, 10, 10))
    out, info = fastdit.attention(q, k, v, "svg2", layout=layout, return_info=True, top_p=0.5)
    out_off = fastdit.attention(q, k, v, "svg2", layout=layout, top_p=0.5, guard=False)
    assert info["guard"]["nonfinite"] and info["guard"]["action"] == ["nonfinite"] * 3
    assert torch.equal(torch.isnan(out), torch.isnan(out_off))


def test_statistics_count_what_the_guard_did(broken):
    q, k, v = qkv()
    layout = TokenLayout((3, 10, 10))
    stats = PatchStats()
    for step in range(3):
        _, ctx = fastdit.functional.run_call(q, k, v, "test_broken", layout=layout, step=step)
        stats.count_call(ctx.info, 3 * 300 * 300)
    assert (stats.guard_head_calls, stats.guard_dense, stats.guard_widened) == (9, 3, 0)
    # per call: 0.5 of the work by the method, 32/300 checked on every head, one head re-run dense
    expected = 0.5 + 32 / 300 + 1 / 3
    assert stats.effective_density == pytest.approx(expected)
    assert stats.guard_density == pytest.approx(32 / 300 + 1 / 3)
    assert stats.as_dict()["guard"]["dense"] == 3


def test_two_identical_calls_give_identical_outputs():
    q, k, v, layout = adversarial_heads(seed=1)
    first = fastdit.attention(q, k, v, "sparge", layout=layout, cdf=0.9)
    second = fastdit.attention(q, k, v, "sparge", layout=layout, cdf=0.9)
    assert torch.equal(first, second)


@pytest.mark.parametrize("options, words", [
    (dict(guard=0), "guard must be a number in (0, inf)"),
    (dict(guard=-1.0), "guard must be"),
    (dict(guard=float("nan")), "guard must be"),
    (dict(guard=float("inf")), "guard must be"),
    (dict(guard="high"), "guard must be"),
    (dict(guard=True), "guard must be"),
    (dict(guard_rows=0.0), "guard_rows must be a number in (0, 1]"),
    (dict(guard_rows=1.5), "guard_rows must be"),
    (dict(guard_refresh=0), "guard_refresh must be an int >= 1"),
])
def test_bad_guard_options_name_the_option(options, words):
    with pytest.raises(ValueError) as error:
        base.get_method("sparge").make_config(**options)
    assert words in str(error.value)


def test_defaults_on_for_dynamic_and_token_methods_off_for_static():
    for name in ("sparge", "svg", "svg2", "todo", "tome", "optiprune"):
        cls = base.get_method(name)
        assert cls.resolve(cls.make_config()).guard == base.GUARD_DEFAULT
    for name in ("sta", "radial", "dense", "window", "prune"):
        cls = base.get_method(name)
        assert cls.resolve(cls.make_config()).guard is False
        assert cls.resolve(cls.make_config(guard=0.2)).guard == 0.2  # available on every method


def test_exact_rows_through_the_engine_match_the_float64_reference():
    """The GPU path (fastdit's engine over every key block, fp32 accumulation) run on the CPU."""
    q, k, v = qkv(seq=70, heads=2, dim=16, seed=5)
    key_mask = torch.ones(1, 70, dtype=torch.bool)
    key_mask[0, 60:] = False
    rows = torch.tensor([1, 33, 69])
    out, lse = exact_rows(q, k, v, rows, key_mask, engine=True)
    ref_out, ref_lse = dense64(q, k, v, key_mask)
    assert rel(out, ref_out[:, :, rows]) < 1e-5
    assert torch.allclose(lse.double(), ref_lse[:, :, rows], atol=1e-5)


def test_ulysses_head_shards_make_the_same_decisions_as_one_process():
    """Under Ulysses a rank holds some heads over the whole sequence (``head_offset``): its guard
    samples the same rows and decides the same for each head as one process does."""
    from fastdit.context import AttentionContext, CallState
    from fastdit.methods.sparge import Sparge

    q, k, v, layout = adversarial_heads(heads=3, seed=2)
    q[:, 1] = q[:, 1] * 0.05  # a diffuse head beside two sharp ones: mixed decisions
    method = Sparge(cdf=0.9, guard=0.1, dense_steps=0, dense_layers=0)

    def call(offset, count):
        part = slice(offset, offset + count)
        ctx = AttentionContext(layer=0, layer_name="l0", step=0, num_steps=1, branch=0, layout=layout,
                               call=CallState(1), head_offset=offset, num_heads=count, total_heads=3,
                               dense_fn=lambda: torch.nn.functional.scaled_dot_product_attention(q[:, part], k[:, part],
                                                                                                 v[:, part]))
        out = method(ctx, q[:, part], k[:, part], v[:, part])
        return out, ctx.info["guard"]

    whole, report = call(0, 3)
    first, report_a = call(0, 2)
    second, report_b = call(2, 1)
    assert report["action"] == report_a["action"] + report_b["action"]
    assert len(set(report["action"])) > 1, report["action"]
    torch.testing.assert_close(whole, torch.cat([first, second], 1), rtol=1e-5, atol=1e-6)


def test_compare_reports_the_guard_writes_a_contact_sheet_and_warns(tmp_path, capsys):
    import json

    from PIL import Image

    from fastdit.cli import main
    from fastdit.compare import quality_warning

    out = tmp_path / "cmp"
    code = main(["compare", "--model", "tiny-wan", "--frames", "9", "--height", "80", "--width", "112", "--steps", "2",
                 "--methods", "dense,sparge", "--set", "sparge.dense_steps=0", "--set", "sparge.topk=0.3",
                 "--set", "sparge.tile=1,2,2", "--out", str(out), "--no-warmup"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "guard" in printed
    report = json.loads((out / "report.json").read_text())
    sparge = report["runs"][1]
    guard = sparge["guard"]
    # 2 steps x 4 layers x (CFG: 2 branches) ... every sparse call checks each of its 2 heads
    assert guard["head_calls"] == 2 * sparge["sparse_calls"] > 0
    assert guard["widened"] + guard["dense"] <= guard["head_calls"] and guard["density"] > 0
    sheet = Image.open(report["contact_sheet"])
    assert sheet.format == "PNG" and sheet.size[1] >= 2 * 80  # a row per run
    # the warning: far from dense, or adherence well below dense's
    assert quality_warning({"method": "svg2", "psnr_db": 12.0}, {"method": "dense"}).startswith("warning: svg2")
    assert "adherence" in quality_warning({"method": "x", "psnr_db": 30.0, "adherence": 0.5},
                                          {"method": "dense", "adherence": 0.7})
    assert quality_warning({"method": "x", "psnr_db": 30.0, "adherence": 0.65}, {"method": "dense", "adherence": 0.7}) is None


def test_the_estimate_and_its_bound_against_a_direct_computation():
    from fastdit.methods.guard import estimate

    gen = torch.Generator().manual_seed(11)
    ref = torch.randn(2, 3, 40, 8, generator=gen, dtype=torch.float64)
    out = ref + 0.2 * torch.randn(2, 3, 40, 8, generator=gen, dtype=torch.float64)
    out[1, 2, :5] += 3.0  # a few bad rows
    lse = torch.zeros(2, 3, 40, dtype=torch.float64)
    error, bound, mass, live = estimate(out, ref, lse, lse_rows=lse - 0.1)
    direct = ((out - ref).pow(2).sum((-1, -2)) / ref.pow(2).sum((-1, -2))).sqrt()
    assert torch.allclose(error, direct)
    assert (bound > error).all() and torch.allclose(mass, torch.full_like(mass, math.exp(-0.1)))
    assert bound[1, 2] / error[1, 2] > bound[0, 0] / error[0, 0]  # concentrated errors: a wider bound
    assert torch.equal(live, torch.ones_like(live))


def test_exact_rows_plain_path_equals_the_fused_one(monkeypatch):
    from fastdit.methods import guard

    q, k, v = qkv(seq=90, heads=2, dim=8, seed=9, batch=2)
    key_mask = torch.ones(2, 90, dtype=torch.bool)
    key_mask[1, 30:] = False
    rows = torch.tensor([0, 44, 89])
    fused = exact_rows(q, k, v, rows, key_mask)
    monkeypatch.setattr(guard, "_CPU_FLASH", None)
    plain = exact_rows(q, k, v, rows, key_mask)
    ref_out, ref_lse = dense64(q, k, v, key_mask)
    for out, lse in (fused, plain):
        assert rel(out, ref_out[:, :, rows]) < 1e-5 and torch.allclose(lse.double(), ref_lse[:, :, rows], atol=1e-5)


def test_cost_model_predicts_a_small_share_at_real_sizes():
    from fastdit.costmodel import GPUS, guard_share

    for gpu in GPUS.values():
        share, check, dense = guard_share(gpu, 75600, 128, row_count(75600, 0.005), heads=24)
        assert 0 < share < 0.03 and check < dense


def test_training_runs_without_the_guard_unless_asked():
    from tiny_transformers import tiny_wan

    from fastdit.train.recipe import training_options

    model = tiny_wan()
    options, note = training_options(model, "sparge", {"dense_steps": 0})
    assert options["guard"] is False and "guard" in note
    options, note = training_options(model, "sparge", {"dense_steps": 0, "guard": 0.2})
    assert options["guard"] == 0.2 and note is None
    assert "guard" not in training_options(model, "sta", {"dense_steps": 0})[0]  # off by default already
