"""Selection reuse across steps (``fastdit/methods/selection/reuse.py``) for sparge, svg and svg2.

References are written here: the similarity test from chunk means in float64 loops, and each
output against float64 masked-softmax attention under the token mask of the selection that should
have been used (the stored one for reused heads, a fresh one for re-selected heads).
"""
from __future__ import annotations

import copy
import json
import math

import pytest
import torch

import fastdit
from fastdit.layout import TokenLayout
from fastdit.methods import get_method
from fastdit.methods.selection import reuse

from test_kmeans import direct_kmeans
from tiny_models import TINY, run

LAYOUT = TokenLayout((4, 6, 7), 5, "prefix")  # 173 tokens: two chunks of the signatures, the second short
HEADS = 3
#: really sparse selections on this grid (svg2 without warm start: a head's selection is then a
#: function of its own q, k only, so a fresh selection of some heads is comparable)
METHODS = {
    "sparge": dict(tile=(2, 3, 7), topk=0.3, simthresh=-1.0),
    "svg": dict(density=0.25, block_size=16, n_samples=32),
    "svg2": dict(q_clusters=6, k_clusters=10, top_p=0.5, warm_start=False),
}
BASE = dict(dense_steps=0, dense_layers=0, guard=False, backend="torch")


def qkv(seed, batch=2, heads=HEADS, dim=16):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, heads, LAYOUT.seq_len, dim, generator=gen) for _ in range(3)]


def call(method, q, k, v, state, step, **options):
    return fastdit.attention(q, k, v, method, layout=LAYOUT, state=state, step=step, return_info=True,
                             **{**BASE, **METHODS[method], **options})


def mask_of(plan, batch, head):
    """The ``(S, S)`` token mask a plan computes for one (batch, head), in model order."""
    try:
        return plan.token_mask(head=head, batch=batch)
    except TypeError:  # a plain BlockPlan: its first batch element's lists
        sliced = copy.copy(plan)
        sliced.kv_indices, sliced.kv_counts = plan.kv_indices[batch:batch + 1], plan.kv_counts[batch:batch + 1]
        return sliced.token_mask(head=head)


def masked_reference(q, k, v, masks):
    """float64 attention, ``masks[b][h]`` the kept (query, key) pairs; rows without a key give 0."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            scores = (q[b, h].double() @ k[b, h].double().t()) / math.sqrt(q.shape[-1])
            scores = scores.masked_fill(~masks[b][h], float("-inf"))
            probs = torch.softmax(scores, -1).nan_to_num(0.0)
            out[b, h] = probs @ v[b, h].double()
    return out


def masks(plan, batch=2, heads=HEADS):
    return [[mask_of(plan, b, h) for h in range(heads)] for b in range(batch)]


def close(out, ref):
    return float((out.double() - ref).norm() / ref.norm()) < 1e-5


def structured(kinds, seed):
    from fastdit.eval.bench.structured import structured_qkv

    made = structured_qkv(grid=LAYOUT.grid, heads=len(kinds), head_dim=16, batch=2, kinds=kinds,
                          text_len=LAYOUT.text_len, text_position=LAYOUT.text_position, seed=seed)
    return made.q, made.k, made.v


@pytest.mark.parametrize("method", sorted(METHODS))
def test_reused_selection_is_the_earlier_mask_on_the_new_inputs(method):
    q0, k0, v0 = structured(("spatial", "temporal", "spatial"), 1)
    state = {}
    _, info0 = call(method, q0, k0, v0, state, 0, reuse_threshold=0.99)
    assert info0["reuse"] == {"heads": HEADS, "reused": 0, "selected": [0, 1, 2]} and info0["density"] < 0.7
    stored = masks(info0["plan"])
    q1, k1, v1 = structured(("temporal", "spatial", "temporal"), 2)  # other heads: other selections
    # the similarity test is checked elsewhere: here the stored signatures are the new inputs', so it passes
    state["fastdit.reuse"]["q"], state["fastdit.reuse"]["k"] = reuse.signatures(q1), reuse.signatures(k1)
    out, info1 = call(method, q1, k1, v1, state, 1, reuse_threshold=0.99)
    assert info1["reuse"]["reused"] == HEADS
    assert info1["plan"] is info0["plan"]
    assert close(out, masked_reference(q1, k1, v1, stored))
    # a fresh selection on the new inputs is another mask, so the reference above can tell them apart
    _, fresh = call(method, q1, k1, v1, {}, 1)
    fresh_masks = masks(fresh["plan"])
    assert all(not torch.equal(stored[b][h], fresh_masks[b][h]) for b in range(2) for h in range(HEADS))
    assert not close(out, masked_reference(q1, k1, v1, fresh_masks))


@pytest.mark.parametrize("method", sorted(METHODS))
def test_a_head_whose_queries_change_is_reselected_alone(method):
    q0, k0, v0 = qkv(3)
    state = {}
    _, info0 = call(method, q0, k0, v0, state, 0, reuse_threshold=0.9)
    stored = masks(info0["plan"])
    q1, k1, v1 = q0.clone(), k0.clone(), v0.clone()
    fresh_q, fresh_k, _ = qkv(4, heads=1)
    q1[:, 1:2], k1[:, 1:2] = fresh_q, fresh_k  # head 1 changes completely, heads 0 and 2 not at all
    out, info1 = call(method, q1, k1, v1, state, 1, reuse_threshold=0.9)
    sim = info1["reuse"]["similarity"]
    assert sim[0] > 0.999999 and sim[2] > 0.999999 and sim[1] < 0.9
    assert info1["reuse"]["reused"] == HEADS - 1 and info1["reuse"]["selected"] == [1]
    _, fresh = call(method, q1, k1, v1, {}, 1)
    got = masks(info1["plan"])
    for b in range(2):
        assert torch.equal(got[b][0], stored[b][0]) and torch.equal(got[b][2], stored[b][2])
        assert torch.equal(got[b][1], mask_of(fresh["plan"], b, 1))
    assert close(out, masked_reference(q1, k1, v1, got))


def test_similarity_follows_the_formula():
    """1 - ||P - P0|| / ||P0|| of the row-centred score maps of 128-token chunk means, smallest over
    the batch; a shift shared by every key changes nothing, a scale change is seen."""
    q0, k0, v0 = qkv(5)
    n1, n2, _ = qkv(6)
    q1, k1 = q0 + 0.5 * n1, k0 + 0.3 * n2

    def chunk_means(x, b, h):
        rows = x[b, h].double()
        return torch.stack([rows[s:s + 128].mean(0) for s in range(0, rows.shape[0], 128)])

    def centred(q, k, b, h):
        scores = chunk_means(q, b, h) @ chunk_means(k, b, h).t()
        return scores - scores.mean(1, keepdim=True)

    def want(q, k, h):
        return min(1 - float((centred(q, k, b, h) - centred(q0, k0, b, h)).norm() / centred(q0, k0, b, h).norm())
                   for b in range(2))

    for q, k in ((q1, k1), (2 * q0, k0), (q0, k0 + torch.randn(16, generator=torch.Generator().manual_seed(0)))):
        state = {}
        call("sparge", q0, k0, v0, state, 0, reuse_threshold=0.5)
        _, info = call("sparge", q, k, v0, state, 1, reuse_threshold=0.5)
        for h in range(HEADS):
            assert abs(info["reuse"]["similarity"][h] - want(q, k, h)) < 1e-5
    assert abs(info["reuse"]["similarity"][0] - 1) < 1e-5  # keys shifted by one vector: the same map
    assert abs(want(2 * q0, k0, 0)) < 1e-9  # queries twice as large: a change as large as the map


@pytest.mark.parametrize("method", sorted(METHODS))
def test_reselected_every_max_steps_and_when_the_step_goes_back(method):
    q, k, v = qkv(7)
    state = {}
    reused = [call(method, q, k, v, state, s, reuse_threshold=1.0, reuse_max_steps=2)[1]["reuse"]["reused"]
              for s in range(5)]
    assert reused == [0, HEADS, 0, HEADS, 0]  # identical inputs: reused up to the forced re-selection
    assert call(method, q, k, v, state, 2, reuse_threshold=1.0, reuse_max_steps=2)[1]["reuse"]["reused"] == 0
    state = {}
    every = [call(method, q, k, v, state, s, reuse_threshold=0.0, reuse_max_steps=1)[1]["reuse"]["reused"]
             for s in range(3)]
    assert every == [0, 0, 0]


def test_off_by_default_and_the_stored_selection_follows_the_shape():
    q, k, v = qkv(8)
    state = {}
    _, info = call("svg2", q, k, v, state, 0)
    assert "reuse" not in info and "fastdit.reuse" not in state
    call("svg2", q, k, v, state, 0, reuse_threshold=0.5)
    _, info = call("svg2", q[:1], k[:1], v[:1], state, 1, reuse_threshold=0.5)  # another batch: select again
    assert info["reuse"]["reused"] == 0


def test_svg2_warm_started_heads_are_reselected_from_their_own_centroids():
    q0, k0, v0 = qkv(9)
    state = {}
    opts = dict(reuse_threshold=0.9, warm_start=True, kmeans_iters=1)
    call("svg2", q0, k0, v0, state, 0, **opts)
    before = {name: state["svg2_centroids"][name].clone() for name in ("q", "k")}
    q1 = q0.clone()
    q1[:, 2] = qkv(10, heads=1)[0][:, 0]
    out, info = call("svg2", q1, k0, v0, state, 1, **opts)
    assert info["reuse"]["reused"] == HEADS - 1
    after = {name: state["svg2_centroids"][name].view(2, HEADS, -1, 16) for name in ("q", "k")}
    for name in ("q", "k"):  # heads 0 and 1 keep their centroids
        assert torch.equal(after[name][:, :2], before[name].view(2, HEADS, -1, 16)[:, :2])
    video = LAYOUT.video_positions()
    for b in range(2):  # head 2: one k-means iteration from its own stored centroids on its new queries
        want, _, _ = direct_kmeans(q1[b, 2, video], before["q"].view(2, HEADS, -1, 16)[b, 2], 1)
        assert torch.allclose(after["q"][b, 2].double(), want, atol=1e-5)
    assert close(out, masked_reference(q1, k0, v0, masks(info["plan"])))


@pytest.mark.parametrize("method", sorted(METHODS))
def test_the_guard_checks_reused_calls_and_failed_heads_are_reselected(method):
    q, k, v = qkv(11)
    state = {}
    loose = dict(reuse_threshold=0.5, guard=10.0)
    call(method, q, k, v, state, 0, **loose)
    _, info = call(method, q, k, v, state, 1, **loose)
    assert info["reuse"]["reused"] == HEADS and info["guard"]["action"] == ["pass"] * HEADS
    strict = dict(reuse_threshold=0.5, guard=1e-9)  # every head fails its check ...
    _, info = call(method, q, k, v, state, 2, **strict)
    assert info["reuse"]["reused"] == HEADS and "pass" not in info["guard"]["action"]
    _, info = call(method, q, k, v, state, 3, **strict)  # ... and is selected again at the next call
    assert info["reuse"]["reused"] == 0


def test_deterministic():
    q0, k0, v0 = qkv(12)
    n, _, _ = qkv(13)
    results = []
    for _ in range(2):
        state, outs = {}, []
        for step, scale in enumerate((0.0, 0.1, 0.2, 2.0)):
            out, info = call("svg2", q0 + scale * n, k0, v0, state, step, reuse_threshold=0.95, warm_start=True)
            outs.append((out, info["reuse"]))
        results.append(outs)
    for (a, ra), (b, rb) in zip(*results):
        assert torch.equal(a, b) and ra == rb


@pytest.mark.parametrize("method", sorted(METHODS))
@pytest.mark.parametrize("option,value", [("reuse_threshold", -0.1), ("reuse_threshold", 1.5),
                                          ("reuse_threshold", float("nan")), ("reuse_threshold", "0.5"),
                                          ("reuse_threshold", True), ("reuse_max_steps", 0),
                                          ("reuse_max_steps", 2.5), ("reuse_max_steps", True)])
def test_bad_reuse_options_name_the_option(method, option, value):
    with pytest.raises(ValueError, match=option):
        get_method(method).make_config(**{option: value})
    q, k, v = qkv(14, batch=1, heads=1)
    with pytest.raises(ValueError, match=option):
        fastdit.attention(q, k, v, method, layout=LAYOUT, **{option: value})


def test_refused_where_no_layer_state_or_training():
    from fastdit.integrations import vllm_omni

    with pytest.raises(ValueError, match="reuse_threshold"):
        vllm_omni.plugin("svg2").options({"reuse_threshold": 0.9})
    refusal = get_method("sparge")(reuse_threshold=0.9).trainable_refusal()
    assert refusal and "reuse_threshold" in refusal
    assert get_method("sparge")().trainable_refusal() is None


def test_pipeline_state_resets_per_call_and_after_remove_and_stats_count_reuse():
    case = TINY["wan"]
    model = case.build(0)
    kwargs = case.inputs(model, case.grid)

    def steps():
        return [run(model, dict(kwargs, timestep=kwargs["timestep"] * (1.0 - 0.02 * i))) for i in range(3)]

    plain = steps()
    opts = dict(q_clusters=4, k_clusters=8, top_p=0.5, init_iters=3, dense_steps=0, dense_layers=0, guard=False,
                reuse_threshold=0.5, reuse_max_steps=4, backend="torch")
    with fastdit.patch(model, "svg2", **opts) as p:
        first = steps()
        counts = dict(p.stats.as_dict()["reuse"])
        second = steps()  # the timestep goes up again: a new call, nothing stored
        again = p.stats.as_dict()["reuse"]
    layers = len(p.layers)
    heads = model.config.num_attention_heads
    assert counts["head_calls"] == 3 * layers * heads and 0 < counts["reused"] <= 2 * layers * heads
    assert again["head_calls"] == 2 * counts["head_calls"] and again["reused"] == 2 * counts["reused"]
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    for a, b in zip(plain, steps()):  # removed: the model's own attention again
        assert torch.equal(a, b)
    with fastdit.patch(model, "svg2", **opts):  # patched again: a fresh state, the same run
        for a, b in zip(first, steps()):
            assert torch.equal(a, b)


def test_bench_selection_reports_the_cost_with_and_without_reuse(tmp_path):
    from fastdit.eval.bench import selection as bench

    out = tmp_path / "sel.json"
    bench.main(["--frames", "2", "--height", "8", "--width", "16", "--kinds", "spatial", "--heads", "1",
                "--head-dim", "32", "--thresholds", "0.9", "--oracle-densities", "0.5", "--no-time",
                "--methods", "svg2:q_clusters=8:k_clusters=16", "--runs", "1", "--warmup", "0", "--reuse", "0.5",
                "--reuse-steps", "3", "--reuse-max-steps", "2", "--json", str(out)])
    rows = json.loads(out.read_text())["reuse"]
    assert [r["reuse_threshold"] for r in rows] == [None, 0.5]
    assert rows[0]["reuse_rate"] is None and rows[0]["saving"] == 1.0
    assert abs(rows[1]["reuse_rate"] - 1 / 3) < 1e-9  # steps 0 and 2 select (reuse_max_steps 2), step 1 reuses
    assert all(r["select_ms"] > 0 and 0 < r["density"] <= 1 and r["error"] >= 0 for r in rows)


def test_auto_members_reuse_inside_their_head_group():
    q, k, v = qkv(15)
    candidate = {"method": "svg2", **METHODS["svg2"], "reuse_threshold": 0.5, "reuse_max_steps": 4}
    options = dict(candidates=[candidate], choices={"0_0_0": 0, "0_0_1": 0, "0_0_2": None}, backend="torch")
    state = {}
    fastdit.attention(q, k, v, "auto", layout=LAYOUT, state=state, step=0, **options)
    group = state[("auto", 0, (0, 1))]["fastdit.reuse"]
    plan = group["plan"]
    out = fastdit.attention(q, k, v, "auto", layout=LAYOUT, state=state, step=1, **options)
    assert group["plan"] is plan and group["since"] == [0, 0]  # both heads of the group kept the selection
    ref = masked_reference(q[:, :2], k[:, :2], v[:, :2], masks(plan, heads=2))
    assert close(out[:, :2], ref)


def test_compare_table_shows_the_reused_head_calls():
    from fastdit.compare import format_table

    rows = [{"method": "dense", "latency_s": 2.0, "speedup": 1.0},
            {"method": "svg2", "latency_s": 1.0, "speedup": 2.0, "reuse": {"head_calls": 108, "reused": 60}}]
    lines = format_table(rows).splitlines()
    assert lines[0].split()[-1] == "reused" and lines[2].split()[-1] == "-" and lines[3].endswith("60 /108")
    assert "reused" not in format_table(rows[:1])
