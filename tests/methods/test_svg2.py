"""Sparse VideoGen 2 ("svg2"): clustering, scoring, selection, the variable-size engine call, options.

References are written here, independently of ``fastdit/methods/svg2.py``: k-means by the direct
float64 Lloyd's of ``test_kmeans``, scores and selection from the formula in Python loops, a token
mask from the labels, and float64 masked-softmax attention (``dense_reference``).
"""
from __future__ import annotations

import math

import pytest
import torch

import fastdit
from fastdit.kernels import dense_reference, validate_varlen_plan
from fastdit.layout import TokenLayout
from fastdit.methods import svg2
from fastdit.pipelines import registered_adapters

from helpers import randn_qkv
from test_kmeans import direct_kmeans
from tiny_models import TINY, run

NO_DENSE = dict(dense_steps=0, dense_layers=0)
UNPATCHABLE = {a.family for a in registered_adapters() if a.unsupported}
FAMILIES = [name for name in TINY if name not in UNPATCHABLE and name != "cogvideox15"]


def run_svg2(q, k, v, layout, key_mask=None, state=None, step=0, backend="torch", **options):
    out, info = fastdit.attention(q, k, v, "svg2", layout=layout, key_mask=key_mask, backend=backend, step=step,
                                  state=state, return_info=True, **{**NO_DENSE, **options})
    return out, info["plan"], info


def spread(x, clusters):
    """The documented cold start: distinct points drawn with seed 0, in increasing order."""
    chosen = sorted(torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(0))[:clusters].tolist())
    return x[chosen]


def reference_mask(q, k, layout, b, h, cq, ck, top_p, iters, key_mask=None, rank="mass"):
    """Token mask ``(S, S)`` of one (batch, head) from the definition (cold start, float64); key
    clusters taken by mass (``rank="mass"``) or by mass per valid key (``"per_token"``)."""
    video = layout.video_positions()
    xq, xk = q[b, h, video].double(), k[b, h, video].double()
    valid = None if key_mask is None else key_mask[b, video]
    q_c, q_labels, _ = direct_kmeans(xq, spread(xq, cq), iters)
    k_c, k_labels, k_sizes = direct_kmeans(xk, spread(xk, ck), iters, valid)
    scale = 1.0 / math.sqrt(q.shape[-1])
    kept = torch.zeros(cq, ck, dtype=torch.bool)
    for m in range(cq):
        weights = [k_sizes[j] * math.exp(scale * float(q_c[m] @ k_c[j])) for j in range(ck)]
        total = sum(weights)
        per_key = [weights[j] / max(float(k_sizes[j]), 1.0) if rank == "per_token" else weights[j] for j in range(ck)]
        ranked = sorted(range(ck), key=lambda j: -per_key[j])
        mass = 0.0
        for j in ranked:
            if top_p < 1.0 and mass >= top_p and kept[m].any():
                break
            kept[m, j] = True
            mass += weights[j] / total
    mask = torch.ones(layout.seq_len, layout.seq_len, dtype=torch.bool)  # text rows and columns dense
    mask[video[:, None], video[None, :]] = kept[q_labels][:, k_labels]
    if key_mask is not None:
        mask &= key_mask[b][None, :]
    return mask


def check_varlen_plan(plan):
    """The engine's own validator accepts the plan (it was run with ``validate=False``)."""
    problems = validate_varlen_plan(plan.q_offsets, plan.k_offsets, plan.kv_indices, plan.kv_counts, plan.seq_len,
                                    plan.seq_len)
    assert not problems, problems


# -- against the definition --------------------------------------------------------------------------

@pytest.mark.parametrize("layout", [TokenLayout((3, 4, 5)), TokenLayout((2, 5, 4), 6, "prefix"),
                                    TokenLayout((3, 3, 4), 5, "suffix")], ids=lambda l: l.describe())
@pytest.mark.parametrize("rank", ["mass", "per_token"])
def test_output_equals_float64_reference_under_the_cluster_mask(layout, rank):
    q, k, v = randn_qkv(layout, batch=2, heads=2, seed=1)
    q = q * 3.0  # sharper attention than plain random: the clusters' scores differ
    key_mask = torch.ones(2, layout.seq_len, dtype=torch.bool)
    if layout.text_len:
        key_mask[1, layout.text_positions()[-2:]] = False  # padded text of the second prompt
    options = dict(q_clusters=3, k_clusters=5, top_p=0.6, init_iters=4, estimator="centroids", rank=rank)  # SVG2's scores
    out, plan, info = run_svg2(q, k, v, layout, key_mask=key_mask, **options)
    check_varlen_plan(plan)
    assert torch.isfinite(out).all()
    measured = 0.0
    for b in range(2):
        for h in range(2):
            expected = reference_mask(q, k, layout, b, h, 3, 5, 0.6, 4, key_mask, rank)
            assert torch.equal(plan.token_mask(h, key_mask=key_mask, batch=b), expected), (b, h)
            ref, _ = dense_reference(q[b:b + 1, h:h + 1], k[b:b + 1, h:h + 1], v[b:b + 1, h:h + 1], expected)
            assert torch.allclose(out[b:b + 1, h:h + 1].double(), ref, rtol=1e-4, atol=1e-5)
            measured += plan.token_mask(h, batch=b).double().mean().item()
    assert info["density"] == pytest.approx(measured / 4)  # token pairs, text included
    assert 0.1 < info["density"] < 0.8, "the test must be really sparse"


def test_top_p_one_equals_dense_with_text_and_key_mask():
    layout = TokenLayout((3, 4, 5), 7, "prefix")
    q, k, v = randn_qkv(layout, seed=3)
    key_mask = torch.ones(2, layout.seq_len, dtype=torch.bool)
    key_mask[0, 3:7] = False
    out, plan, info = run_svg2(q, k, v, layout, key_mask=key_mask, q_clusters=4, k_clusters=7, top_p=1.0)
    ref, _ = dense_reference(q, k, v, key_mask[:, None, None, :])
    assert torch.isfinite(out).all() and torch.allclose(out.double(), ref, atol=1e-5)
    assert info["density"] == pytest.approx(1.0)


def two_group_qkv(grid, dim=16, batch=1, heads=1, seed=0):
    """q = k: two groups of tokens (a checkerboard over h and w, so neither is contiguous) on two
    orthogonal directions: each group attends only within itself."""
    t_, h_, w_ = grid
    n = t_ * h_ * w_
    i = torch.arange(n)
    group = ((i // w_) % h_ + i % w_) % 2
    g = torch.Generator().manual_seed(seed)
    x = torch.nn.functional.one_hot(group, dim).float() * 12.0 + 0.05 * torch.randn(batch, heads, n, dim, generator=g)
    return x, x.clone(), torch.randn(batch, heads, n, dim, generator=g), group


def test_two_self_attending_groups_give_exactly_the_two_diagonal_pairs():
    layout = TokenLayout((2, 3, 5))
    q, k, v, group = two_group_qkv(layout.grid, batch=2, heads=2)
    out, plan, info = run_svg2(q, k, v, layout, q_clusters=2, k_clusters=2, top_p=0.9)
    same = group[:, None] == group[None, :]
    for b in range(2):
        for h in range(2):
            assert int(plan.kv_counts[b, h].sum()) == 2  # one key cluster per query cluster
            assert torch.equal(plan.token_mask(h, batch=b), same)
    assert info["density"] == pytest.approx(same.double().mean().item())
    ref, _ = dense_reference(q, k, v, same)
    assert torch.allclose(out.double(), ref, atol=1e-5)


def test_scores_and_selection_follow_the_formula():
    g = torch.Generator().manual_seed(4)
    cq, ck = torch.randn(2, 3, 8, generator=g), torch.randn(2, 5, 8, generator=g)
    sizes = torch.tensor([[4.0, 0.0, 2.0, 7.0, 1.0], [1.0, 1.0, 1.0, 1.0, 9.0]])
    probs = svg2.cluster_scores(cq, ck, sizes, 0.5)
    for gi in range(2):
        for m in range(3):
            w = [float(sizes[gi, j]) * math.exp(0.5 * float(cq[gi, m] @ ck[gi, j])) for j in range(5)]
            assert probs[gi, m].tolist() == pytest.approx([x / sum(w) for x in w], rel=1e-5)
    order, counts = svg2.select_clusters(probs, 0.7)
    for gi in range(2):
        for m in range(3):
            ranked = sorted(range(5), key=lambda j: -float(probs[gi, m, j]))
            kept, mass = 0, 0.0
            while mass < 0.7:
                mass += float(probs[gi, m, ranked[kept]])
                kept += 1
            assert int(counts[gi, m]) == kept and order[gi, m, :kept].tolist() == ranked[:kept]
    assert probs[0, :, 1].eq(0).all()  # the empty key cluster gets nothing
    floor_order, floor_counts = svg2.select_clusters(probs, 0.7, min_kc_ratio=0.5)  # at least ceil(2.5) = 3
    assert torch.equal(floor_order, order) and torch.equal(floor_counts, counts.clamp(min=3))
    assert bool((floor_counts > counts).any()), "the floor must matter somewhere in this test"


def test_forced_clusters_rank_first_and_count_toward_top_p():
    probs = torch.tensor([[[0.90, 0.06, 0.03, 0.01], [0.50, 0.30, 0.15, 0.05]]])
    forced = torch.tensor([[[False, False, False, True], [False, False, False, False]]])
    order, counts = svg2.select_clusters(probs, 0.95, forced=forced)
    # row 0: cluster 3 first (0.01), then 0 (0.91), 1 (0.97 >= 0.95): three kept; row 1 unchanged
    assert order[0, 0, :3].tolist() == [3, 0, 1] and counts.tolist() == [[3, 3]]
    _, counts = svg2.select_clusters(probs, 0.5, forced=torch.ones_like(forced))
    assert counts.tolist() == [[4, 4]]  # every forced cluster is kept, whatever top_p


def _two_key_groups(seed, noise):
    """``(a, b, k, q, v)``: keys ``k`` (128, 16), 64 near ``a = 6 e0`` and 64 near ``b = 6 e1``
    (Gaussian noise of std ``noise``), queries ``q`` all ``a`` (for the test to edit), values
    ``v`` (1, 1, 128, 16), all from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    dim, n = 16, 64
    a, b = torch.zeros(dim), torch.zeros(dim)
    a[0], b[1] = 6.0, 6.0
    k = torch.cat([a + noise * torch.randn(n, dim, generator=g), b + noise * torch.randn(n, dim, generator=g)])
    v = torch.randn(1, 1, 2 * n, dim, generator=g)
    return a, b, k, a.expand(2 * n, dim).clone(), v


def _kept_mass_in_one_query_cluster(q, k, v, **options):
    """svg2 with one query and two key clusters at ``top_p = 0.95``, every call sparse: the true
    kept mass of its one head."""
    _, info = fastdit.attention(q[None, None], k[None, None], v, "svg2", layout=TokenLayout((1, 8, 16)),
                                backend="torch", return_info="mass", q_clusters=1, k_clusters=2, top_p=0.95,
                                dense_steps=0, dense_layers=0, **options)
    return info["kept_mass"][0]


def test_row_guard_keeps_the_key_cluster_a_few_rows_need():
    """Two far-apart groups of keys (A, B), one query cluster: 124 rows attend to A, 4 to B. By the
    cluster's mean, B carries 3% of the mass, under 1 - top_p, so the cumulative rule alone drops
    it and those 4 rows lose everything; the row guard keeps it."""
    _, b, k, q, v = _two_key_groups(0, 0.05)
    q[::32] = b  # 4 rows of 128
    kept = {guard: _kept_mass_in_one_query_cluster(q, k, v, row_guard=guard) for guard in (False, True)}
    assert kept[False] < 0.98 and kept[True] > 0.999, kept


def test_guard_margin_sets_how_much_of_one_row_a_forced_cluster_must_hold():
    """Two far-apart groups of keys (A, B), one query cluster of 128 rows: 124 attend to A alone,
    4 put 15% of their mass on B (q = s a with 1.5 s = ln(0.85 / 0.15): scores are scale q . k).
    By the cluster's mean B holds 0.5%, so only the row guard can keep it: at top_p = 0.95 it is
    forced when 15% exceeds guard_margin x 5% (margin 2: 10%, kept) and not at margin 4 (20%)."""
    _, _, k, q, v = _two_key_groups(1, 0.01)
    q[::32] = 0.0
    q[::32, 0] = math.log(0.85 / 0.15) / 1.5  # 6 * 0.25 = 1.5: B's share of the row is 15%
    kept = {margin: _kept_mass_in_one_query_cluster(q, k, v, guard_margin=margin) for margin in (2.0, 4.0)}
    dropped = 4 * 0.15 / 128  # B's share of the whole head's mass
    assert kept[2.0] > 1 - 1e-6, kept
    assert abs(kept[4.0] - (1 - dropped)) < 2e-4, kept


@pytest.mark.parametrize("seed", [0, None])
def test_refining_every_cluster_makes_the_predicted_mass_exact(seed):
    """``refine_clusters`` = every key cluster, ``refine_keys`` >= any cluster: every row's masses
    are scored from all keys, so the predicted kept mass equals the true kept mass
    (``return_info="mass"``, float64) of the call's own selection; without it they differ."""
    from fastdit.eval.bench.structured import structured_qkv

    seed = int(torch.randint(0, 2**31 - 1, ())) if seed is None else seed
    inputs = structured_qkv((2, 8, 8), heads=2, head_dim=32, kinds=("spatial", "temporal"), text_len=0, seed=seed)
    q, k, v, layout = inputs[:4]
    got = {}
    for refine in (0, 16):
        _, info = fastdit.attention(q, k, v, "svg2", layout=layout, backend="torch", return_info="mass",
                                    q_clusters=8, k_clusters=16, top_p=0.9, refine_clusters=refine,
                                    refine_keys=128, dense_steps=0, dense_layers=0)
        got[refine] = (info["plan"].info["predicted_mass"].double().mean(0), torch.tensor(info["kept_mass"]))
    predicted, kept = got[16]
    torch.testing.assert_close(predicted, kept.double(), atol=2e-4, rtol=0, msg=f"seed {seed}")
    predicted, kept = got[0]
    assert float((predicted - kept.double()).abs().max()) > 2e-3, f"seed {seed}: the estimate alone is exact here"


@pytest.mark.parametrize("bad", [0.5, 0.0, -1.0, float("nan"), float("inf"), True, "2"])
def test_guard_margin_outside_its_range_is_refused(bad):
    with pytest.raises(ValueError, match="guard_margin"):
        fastdit.attention(*randn_qkv(TokenLayout((1, 4, 4)), seed=0), "svg2", layout=TokenLayout((1, 4, 4)),
                          guard_margin=bad)


# -- warm start ------------------------------------------------------------------------------------

def test_warm_start_reuses_centroids_only_while_the_layout_is_unchanged():
    layout = TokenLayout((3, 4, 5), 4, "suffix")
    q, k, v = randn_qkv(layout, seed=5)
    state = {}
    options = dict(q_clusters=3, k_clusters=4, top_p=0.5, init_iters=3, kmeans_iters=1)
    _, cold, _ = run_svg2(q, k, v, layout, state=state, **options)
    assert not cold.info["warm"] and cold.info["iters"] == 3
    stored = state[svg2.STATE_KEY]
    q2, k2, v2 = (t + 0.3 * torch.randn_like(t) for t in (q, k, v))
    _, warm, _ = run_svg2(q2, k2, v2, layout, state=state, step=1, **options)
    assert warm.info["warm"] and warm.info["iters"] == 1
    # the warm call is exactly one iteration from the stored centroids
    video = layout.video_positions()
    for b in range(2):
        for h in range(3):
            _, labels, _ = direct_kmeans(k2[b, h, video], stored["k"][b * 3 + h], 1)
            assert torch.equal(warm.k_blocks[b, h, video], labels)
    other = TokenLayout((3, 5, 4), 4, "suffix")  # the same token count, another grid
    _, plan, _ = run_svg2(q, k, v, other, state=state, **options)
    assert not plan.info["warm"]
    _, plan, _ = run_svg2(q, k, v, layout, state=state, warm_start=False, **options)
    assert not plan.info["warm"]


def test_cfg_batch_of_two_clusters_each_prompt_on_its_own():
    layout = TokenLayout((2, 3, 5))
    q, k, v, group = two_group_qkv(layout.grid, batch=1, heads=1)
    other, _, _, _ = two_group_qkv(layout.grid, batch=1, heads=1, seed=1)
    halves = torch.nn.functional.one_hot((torch.arange(30) >= 15).long(), 16).float() * 12.0
    q2 = torch.cat([q, halves[None, None] + 0.05 * other], 0)  # the second prompt: first half / second half
    out, plan, _ = run_svg2(q2, q2.clone(), torch.cat([v, v], 0), layout, q_clusters=2, k_clusters=2, top_p=0.9)
    first, second = plan.token_mask(0, batch=0), plan.token_mask(0, batch=1)
    assert torch.equal(first, group[:, None] == group[None, :])
    half = torch.arange(30) >= 15
    assert torch.equal(second, half[:, None] == half[None, :])
    ref, _ = dense_reference(q2, q2, torch.cat([v, v], 0), torch.stack([first, second])[:, None])
    assert torch.allclose(out.double(), ref, atol=1e-5)


# -- corrections, options --------------------------------------------------------------------------

def test_cached_correction_refreshes_then_corrects():
    layout = TokenLayout((3, 4, 5), 4, "prefix")
    q, k, v = randn_qkv(layout, seed=8)
    options = dict(q_clusters=3, k_clusters=6, top_p=0.4, correction="cached", refresh_every=2)
    state = {}
    refresh, _, info = run_svg2(q, k, v, layout, state=state, step=0, **options)
    dense, _ = dense_reference(q, k, v)
    assert info["dense"] and torch.allclose(refresh.double(), dense, atol=1e-5)  # plan + complement = dense
    sparse, plan, _ = run_svg2(q, k, v, layout, step=1, q_clusters=3, k_clusters=6, top_p=0.4, init_iters=2,
                               kmeans_iters=2)
    corrected, plan, info = run_svg2(q, k, v, layout, state=state, step=1, **options)
    assert not info["dense"] and info["density"] < 0.8
    # warm start from converged centroids keeps the clusters: same inputs, exact correction
    assert torch.allclose(corrected.double(), dense, atol=1e-4)
    assert (sparse.double() - dense).norm() > 10 * (corrected.double() - dense).norm()


@pytest.fixture(scope="module")
def tiny_wan():
    return TINY["wan"].build(0)


@pytest.mark.parametrize("option,value", [("q_clusters", 0), ("k_clusters", 0), ("k_clusters", 2.5),
                                          ("top_p", 0.0), ("top_p", 1.5), ("top_p", float("nan")),
                                          ("kmeans_iters", 0), ("init_iters", 0), ("warm_start", "yes"), ("row_guard", 1),
                                          ("min_kc_ratio", -0.1), ("min_kc_ratio", 1.5),
                                          ("correction", "blocks"), ("skip_threshold", 2.0)])
def test_bad_options_raise_at_patch_time_naming_the_option(option, value, tiny_wan):
    with pytest.raises(ValueError, match=option):
        fastdit.patch(tiny_wan, "svg2", **{option: value})
    assert getattr(tiny_wan, "_fastdit_patch", None) is None
    with pytest.raises(ValueError, match=option):
        svg2.SVG2Config(**{option: value}).validate()


def test_defaults_and_cluster_counts_clamped_to_the_video():
    config = fastdit.methods.get_method("svg2").resolve(svg2.SVG2Config())
    assert (config.dense_steps, config.dense_layers, config.q_clusters, config.k_clusters, config.top_p,
            config.kmeans_iters, config.init_iters, config.warm_start) == (0.25, 1, 100, 500, 0.9, 2, 20, True)
    layout = TokenLayout((2, 2, 3), 3, "prefix")  # 12 video tokens
    q, k, v = randn_qkv(layout, seed=9)
    out, plan, _ = run_svg2(q, k, v, layout, q_clusters=100, k_clusters=500, top_p=1.0)
    assert plan.info["q_clusters"] == 12 and plan.info["k_clusters"] == 12
    ref, _ = dense_reference(q, k, v)
    assert torch.allclose(out.double(), ref, atol=1e-5)


# -- every tiny family -----------------------------------------------------------------------------

def bare_steps(model, kwargs, calls):
    return [run(model, dict(kwargs, timestep=kwargs["timestep"] * (1.0 - 0.1 * i))) for i in range(calls)]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_runs_sparse_finite_warm_and_resets_per_call(family, monkeypatch):
    case = TINY[family]
    model = case.build(0)
    kwargs = case.inputs(model, case.grid)
    seen = []
    cluster = svg2.SparseVideoGen2.cluster

    def spy(self, ctx, q, k):
        result = cluster(self, ctx, q, k)
        seen.append((ctx.step, result.warm))
        return result

    monkeypatch.setattr(svg2.SparseVideoGen2, "cluster", spy)
    with fastdit.patch(model, "svg2", q_clusters=4, k_clusters=8, top_p=0.5, init_iters=3, backend="torch",
                       **NO_DENSE) as p:
        first = bare_steps(model, kwargs, 2)
        assert p.stats.fallback_calls == 0 and p.stats.sparse_calls == 2 * len(p.layers)
        assert p.stats.effective_density < 0.9
        second = bare_steps(model, kwargs, 2)  # the timestep goes up again: a new call, fresh state
    layers = len(p.layers)
    assert seen == ([(0, False)] * layers + [(1, True)] * layers) * 2
    for a, b in zip(first, second):
        assert torch.isfinite(a).all() and torch.equal(a, b)


def test_triton_interpreter_matches_torch():
    pytest.importorskip("triton")
    if not fastdit.kernels.triton_interpreter_enabled():
        pytest.skip("needs TRITON_INTERPRET=1 on a machine without a GPU")
    layout = TokenLayout((2, 3, 4), 3, "suffix")
    q, k, v = randn_qkv(layout, batch=1, heads=2, seed=11)
    key_mask = torch.ones(1, layout.seq_len, dtype=torch.bool)
    key_mask[0, -1] = False
    options = dict(q_clusters=3, k_clusters=5, top_p=0.5)
    a, plan, info = run_svg2(q, k, v, layout, key_mask=key_mask, backend="torch", **options)
    b, _, _ = run_svg2(q, k, v, layout, key_mask=key_mask, backend="triton", **options)
    assert info["density"] < 0.9 and torch.isfinite(b).all()
    assert torch.allclose(a, b, atol=1e-4)
