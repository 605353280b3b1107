"""Sparse VideoGen ("svg"): pattern rules, per-head selection, the per-head engine call, options.

References here are written independently of ``fastdit/methods/svg.py``: plain Python loops over
tokens for the block rules, float64 attention (``dense_reference``) for outputs and sample errors.
"""
from __future__ import annotations

import math

import pytest
import torch

import fastdit
from fastdit.kernels import dense_reference
from fastdit.layout import TokenLayout
from fastdit.methods import svg

from helpers import randn_qkv

NO_DENSE = dict(dense_steps=0, dense_layers=0)


def run_svg(q, k, v, layout, key_mask=None, backend="torch", step=0, state=None, **options):
    out, info = fastdit.attention(q, k, v, "svg", layout=layout, key_mask=key_mask, backend=backend, step=step,
                                  state=state, return_info=True, **{**NO_DENSE, **options})
    return out, info["plan"], info


# -- the rules, written token by token ---------------------------------------------------------------

def kernel_list(layout, pattern, block):
    """Model token at each kernel position (None for padding) for ``pattern``'s order."""
    t_, f_ = layout.frames, layout.frame_len
    if pattern == "temporal":  # position-major: every frame's token at position p, then p + 1, ...
        video = [layout.video_start + t * f_ + p for p in range(f_) for t in range(t_)]
    else:
        video = [layout.video_start + i for i in range(t_ * f_)]
    pad = lambda xs: xs + [None] * (-len(xs) % block)  # noqa: E731
    return pad(video) + pad(list(range(layout.text_start, layout.text_start + layout.text_len)))


def reference_mask(layout, pattern, density, block):
    """Token mask ``(S, S)`` (model order) of one pattern, from the module docstring's rule."""
    order = kernel_list(layout, pattern, block)
    n = layout.video_len
    n_vb = -(-n // block)
    unit, n_units = {"spatial": (layout.frame_len, layout.frames), "temporal": (layout.frames, layout.frame_len)}.get(
        pattern, (None, None))
    mask = torch.zeros(layout.seq_len, layout.seq_len, dtype=torch.bool)
    for qi, q_tok in enumerate(order):
        if q_tok is None:
            continue
        m = qi // block
        for kj, k_tok in enumerate(order):
            if k_tok is None:
                continue
            j = kj // block
            if m >= n_vb or j >= n_vb:  # text row or text column
                keep = True
            elif pattern == "textural":
                keep = (j - m) % max(1, math.floor(1 / density + 0.5)) == 0
            else:
                first, last = m * block // unit, (min((m + 1) * block, n) - 1) // unit
                want = max(1, min(n_units, math.floor(density * n_units + 0.5)))
                extra = max(0, want - (last - first + 1))
                lo, hi = first - extra // 2, last + extra - extra // 2
                if lo < 0:
                    lo, hi = 0, hi - lo
                if hi > n_units - 1:
                    lo, hi = max(0, lo - (hi - n_units + 1)), n_units - 1
                keep = lo * unit // block <= j <= ((hi + 1) * unit - 1) // block  # j overlaps [lo U, (hi + 1) U)
            mask[q_tok, k_tok] = keep
    return mask


LAYOUTS = [TokenLayout((3, 5, 7)), TokenLayout((4, 3, 5), 6, "prefix"), TokenLayout((5, 2, 3), 7, "suffix")]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: l.describe())
@pytest.mark.parametrize("pattern", svg.PATTERNS)
@pytest.mark.parametrize("density,block", [(0.3, 8), (0.5, 6)])
def test_each_pattern_equals_its_rule_token_by_token(layout, pattern, density, block):
    q, k, v = randn_qkv(layout, batch=1, heads=2)
    out, plan, _ = run_svg(q, k, v, layout, patterns=(pattern,), density=density, block_size=block)
    expected = reference_mask(layout, pattern, density, block)
    assert 0.05 < expected.double().mean() < 0.85, "the rule should be really sparse here"
    for head in range(2):
        assert torch.equal(plan.token_mask(head), expected), (pattern, head)
        ref, _ = dense_reference(q[:, head:head + 1], k[:, head:head + 1], v[:, head:head + 1], expected)
        assert torch.allclose(out[:, head:head + 1].double(), ref, atol=1e-5)


def test_aligned_blocks_give_whole_frames_and_whole_positions():
    """When blocks divide frames (spatial) or positions (temporal) the rules are exactly the papers':
    frames within a band of the query's frame; keys at neighbouring positions in every frame."""
    layout = TokenLayout((5, 3, 4))  # F = 12, T = 5
    t = torch.arange(60) // 12
    p = torch.arange(60) % 12
    _, plan, _ = run_svg(*randn_qkv(layout, 1, 1), layout, patterns=("spatial",), density=0.6, block_size=6)
    # 3 frames: the query's frame and one on each side, shifted inwards at the ends
    centre = t.clamp(1, 3)
    assert torch.equal(plan.token_mask(0), (centre[:, None] - t[None, :]).abs() <= 1)
    _, plan, _ = run_svg(*randn_qkv(layout, 1, 1), layout, patterns=("temporal",), density=0.25, block_size=5)
    # a block of 5 tokens is one position in every frame: 3 positions p-1, p, p+1 (shifted at the ends)
    centre = p.clamp(1, 10)
    assert torch.equal(plan.token_mask(0), (centre[:, None] - p[None, :]).abs() <= 1)


def test_density_one_equals_dense_with_text_and_key_mask():
    layout = TokenLayout((3, 4, 5), 7, "prefix")
    q, k, v = randn_qkv(layout, seed=3)
    key_mask = torch.ones(2, layout.seq_len, dtype=torch.bool)
    key_mask[0, 3:7] = False  # padded text of the first prompt
    out, plan, info = run_svg(q, k, v, layout, key_mask=key_mask, density=1.0, block_size=8)
    ref, _ = dense_reference(q, k, v, key_mask[:, None, None, :])
    assert torch.allclose(out.double(), ref, atol=1e-5)
    assert info["density"] == pytest.approx(1.0)


def test_text_rows_and_columns_stay_dense():
    layout = TokenLayout((4, 3, 5), 9, "suffix")
    _, plan, info = run_svg(*randn_qkv(layout, seed=1), layout, density=0.2, block_size=6)
    text = layout.text_positions()
    assert info["density"] < 0.7
    for b in range(2):
        for head in range(3):
            mask = plan.token_mask(head, batch=b)
            assert mask[text].all() and mask[:, text].all()
            assert not mask.all()


# -- selection -------------------------------------------------------------------------------------

def direct_errors(q, k, v, layout, patterns, density, block, samples, key_mask=None):
    """Relative squared L2 error of each pattern on ``samples``, float64, per (batch, head)."""
    batch, heads = q.shape[:2]
    errors = torch.zeros(batch, heads, len(patterns), dtype=torch.float64)
    valid = torch.ones(batch, layout.seq_len, dtype=torch.bool) if key_mask is None else key_mask
    for p, pattern in enumerate(patterns):
        mask = reference_mask(layout, pattern, density, block)[samples]
        for b in range(batch):
            qs = q[b:b + 1, :, samples]
            exact, _ = dense_reference(qs, k[b:b + 1], v[b:b + 1], valid[b][None, None, None, :])
            approx, _ = dense_reference(qs, k[b:b + 1], v[b:b + 1], mask & valid[b][None, :])
            errors[b, :, p] = ((approx - exact) ** 2).sum((-1, -2))[0] / (exact ** 2).sum((-1, -2))[0]
    return errors


def test_selection_equals_direct_argmin_of_sample_errors():
    layout = TokenLayout((4, 5, 3), 5, "prefix")
    q, k, v = randn_qkv(layout, batch=2, heads=4, seed=7)
    # make heads differ: the plain random heads are near-uniform, so scale some scores up
    q = q * torch.tensor([0.5, 2.0, 4.0, 1.0]).view(1, 4, 1, 1)
    key_mask = torch.ones(2, layout.seq_len, dtype=torch.bool)
    key_mask[1, :2] = False
    _, plan, _ = run_svg(q, k, v, layout, key_mask=key_mask, density=0.3, block_size=6, n_samples=9)
    samples = svg.layout_plan(layout, svg.SVGConfig(density=0.3, block_size=6, n_samples=9), "cpu").samples
    assert samples.numel() == 9 and bool((samples >= 5).all()), "samples are video rows"
    expected = direct_errors(q, k, v, layout, svg.PATTERNS, 0.3, 6, samples, key_mask)
    assert torch.allclose(plan.info["errors"].double(), expected, rtol=1e-3, atol=1e-6)
    assert torch.equal(plan.choice, expected.argmin(-1))
    assert len(set(plan.choice.flatten().tolist())) > 1, "a test where every head picks the same proves little"


def positional_heads(grid, kinds, dim=32, batch=1, sharpness=12.0, seed=0):
    """q = k: one-hot of the token's frame (spatial: attention stays in the frame) or of its
    position (temporal: attention goes to the same position in every frame), plus noise."""
    t_, h_, w_ = grid
    n = t_ * h_ * w_
    g = torch.Generator().manual_seed(seed)
    heads = []
    for kind in kinds:
        key = torch.arange(n) // (h_ * w_) if kind == "spatial" else torch.arange(n) % (h_ * w_)
        feats = torch.nn.functional.one_hot(key, dim).double() * math.sqrt(sharpness * math.sqrt(dim))
        heads.append(feats + 0.05 * torch.randn(n, dim, generator=g, dtype=torch.float64))
    qk = torch.stack(heads)[None].expand(batch, -1, -1, -1).float()
    return qk, qk.clone(), torch.randn(batch, len(kinds), n, dim, generator=g)


def structured(grid, kinds):
    """``fastdit.eval.bench.structured``'s Fourier-feature heads (a second, smoother construction)."""
    from fastdit.eval.bench.structured import structured_qkv

    q, k, v, _, _ = structured_qkv(grid=grid, heads=len(kinds), head_dim=64, kinds=kinds, seed=0)
    return q, k, v


@pytest.mark.parametrize("make", [positional_heads, structured], ids=["one-hot", "structured"])
def test_picks_spatial_for_a_local_head_and_temporal_for_a_temporal_head(make):
    grid = (6, 4, 5)
    q, k, v = make(grid, ("spatial", "temporal"))
    layout = TokenLayout(grid)
    out, plan, info = run_svg(q, k, v, layout, density=0.2, block_size=10)
    patterns = plan.info["patterns"]
    assert [patterns[c] for c in plan.choice[0].tolist()] == ["spatial", "temporal"]
    assert info["density"] < 0.5
    ref, _ = dense_reference(q, k, v)
    rel = ((out.double() - ref).norm(dim=(-1, -2)) / ref.norm(dim=(-1, -2)))[0]
    assert bool((rel < 0.35).all()), rel


# -- the engine call, statistics, special layouts --------------------------------------------------

def test_mixed_heads_equal_float64_reference_under_their_own_masks():
    layout = TokenLayout((3, 4, 5), 4, "suffix")
    q, k, v = positional_heads((3, 4, 5), ("spatial", "temporal", "temporal", "spatial"), dim=24, batch=2, seed=2)
    q = torch.cat([q, torch.randn(2, 4, 4, 24)], dim=2)  # text rows
    k = torch.cat([k, torch.randn(2, 4, 4, 24)], dim=2)
    v = torch.cat([v, torch.randn(2, 4, 4, 24)], dim=2)
    key_mask = torch.ones(2, layout.seq_len, dtype=torch.bool)
    key_mask[1, -1] = False
    out, plan, info = run_svg(q, k, v, layout, key_mask=key_mask, density=0.34, block_size=7)
    assert len(set(plan.choice.flatten().tolist())) > 1
    pairs = 0.0
    for b in range(2):
        for head in range(4):
            mask = plan.token_mask(head, key_mask=key_mask, batch=b)
            name = plan.info["patterns"][int(plan.choice[b, head])]
            assert torch.equal(mask, reference_mask(layout, name, 0.34, 7) & key_mask[b][None, :])
            ref, _ = dense_reference(q[b:b + 1, head:head + 1], k[b:b + 1, head:head + 1], v[b:b + 1, head:head + 1], mask)
            assert torch.allclose(out[b:b + 1, head:head + 1].double(), ref, atol=1e-5)
            pairs += reference_mask(layout, name, 0.34, 7).double().sum().item()
    assert plan.dynamic
    assert info["density"] == pytest.approx(pairs / (8 * layout.seq_len ** 2))  # per-head choices counted


def test_triton_interpreter_matches_torch():
    pytest.importorskip("triton")
    layout = TokenLayout((3, 2, 5), 3, "prefix")
    q, k, v = positional_heads((3, 2, 5), ("temporal", "spatial"), dim=16, seed=4)
    q, k, v = (torch.cat([t, torch.randn(1, 2, 3, 16)], dim=2) for t in (q, k, v))
    a, plan, _ = run_svg(q, k, v, layout, density=0.34, block_size=16, backend="torch")
    b, _, _ = run_svg(q, k, v, layout, density=0.34, block_size=16, backend="triton")
    assert torch.allclose(a, b, atol=1e-4)


def test_skip_threshold_and_cached_correction_run_per_head():
    layout = TokenLayout((3, 4, 5), 4, "prefix")
    q, k, v = randn_qkv(layout, seed=8)
    opts = dict(density=0.34, block_size=7)
    plain, plan, _ = run_svg(q, k, v, layout, **opts)
    same, _, _ = run_svg(q, k, v, layout, skip_threshold=float("inf"), **opts)
    assert torch.allclose(plain, same, atol=1e-6)  # an infinite threshold skips nothing
    skipped, _, _ = run_svg(q, k, v, layout, skip_threshold=0.0, **opts)
    assert torch.isfinite(skipped).all() and not torch.allclose(skipped, plain)
    state = {}
    refresh, _, info = run_svg(q, k, v, layout, correction="cached", refresh_every=2, step=0, **opts, state=state)
    assert info["dense"]  # a refresh step: the plan and its complement, i.e. dense attention
    dense, _ = dense_reference(q, k, v)
    assert torch.allclose(refresh.double(), dense, atol=1e-5)
    corrected, _, info = run_svg(q, k, v, layout, correction="cached", refresh_every=2, step=1, **opts, state=state)
    assert not info["dense"] and torch.allclose(corrected.double(), dense, atol=1e-4)  # same inputs: exact


def test_n_samples_beyond_the_video_is_clamped():
    layout = TokenLayout((2, 3, 3), 4, "prefix")
    q, k, v = randn_qkv(layout, seed=5)
    out, plan, _ = run_svg(q, k, v, layout, n_samples=10_000, density=0.5, block_size=4)
    samples = svg.layout_plan(layout, svg.SVGConfig(n_samples=10_000, density=0.5, block_size=4), "cpu").samples
    assert torch.equal(samples, layout.video_positions())  # every video row, no text row
    assert torch.isfinite(out).all()


def test_one_frame_drops_spatial_and_runs_sparse():
    layout = TokenLayout((1, 6, 7), 5, "prefix")
    q, k, v = randn_qkv(layout, seed=6)
    out, plan, info = run_svg(q, k, v, layout, density=0.25, block_size=6)
    assert plan.info["patterns"] == ("temporal", "textural") and info["density"] < 0.7
    for b in range(2):
        for head in range(3):  # temporal is a band of neighbouring tokens in raster order here
            name = plan.info["patterns"][int(plan.choice[b, head])]
            assert torch.equal(plan.token_mask(head, batch=b), reference_mask(layout, name, 0.25, 6))
    dense_out, _, info = run_svg(q, k, v, layout, patterns=("spatial",))
    assert info["dense"] and torch.allclose(dense_out, fastdit.attention(q, k, v, "dense", layout=layout))


def test_defaults_and_dense_first_layer():
    config = fastdit.methods.get_method("svg").resolve(svg.SVGConfig())
    assert (config.dense_steps, config.dense_layers, config.n_samples) == (0.25, 1, 64)
    chosen = svg.SVGConfig(patterns="textural, temporal")
    chosen.validate()
    assert chosen.patterns == ("temporal", "textural")  # the CLI's text form, in canonical order
    layout = TokenLayout((2, 3, 4))
    q, k, v = randn_qkv(layout)
    # outside a pipeline the layer-position default does not apply (issue 31): asked for, it does
    _, info = fastdit.attention(q, k, v, "svg", layout=layout, dense_steps=0, block_size=4, return_info=True)
    assert not info["dense"]
    _, info = fastdit.attention(q, k, v, "svg", layout=layout, dense_steps=0, dense_layers=1, block_size=4,
                                return_info=True)
    assert info["dense"]  # layer 0
    _, info = fastdit.attention(q, k, v, "svg", layout=layout, dense_steps=0, dense_layers=1, block_size=4, layer=1,
                                return_info=True)
    assert not info["dense"]


# -- bad options, at patch time ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_wan():
    from tiny_models import TINY

    return TINY["wan"].build(0)


@pytest.mark.parametrize("option,value", [("density", 0.0), ("density", 1.5), ("density", float("nan")),
                                          ("density", True), ("n_samples", 0), ("n_samples", 2.5),
                                          ("block_size", 0), ("patterns", ()), ("patterns", ("spatial", "banded")),
                                          ("patterns", "spatial,radial"), ("correction", "blocks")])
def test_bad_options_raise_at_patch_time_naming_the_option(option, value, tiny_wan):
    model = tiny_wan
    with pytest.raises(ValueError, match=option):
        fastdit.patch(model, "svg", **{option: value})
    with pytest.raises(ValueError, match=option):
        svg.SVGConfig(**{option: value}).validate()


def test_tiny_wan_runs_sparse_and_remove_restores_bit_identical(tiny_wan):
    """The matrix in test_models runs svg at its tiny preset (128-token blocks: dense-like on its
    small grids); here a really sparse plan runs through a patched model."""
    from tiny_models import TINY, run

    kwargs = TINY["wan"].inputs(tiny_wan, (4, 5, 7))
    before = run(tiny_wan, kwargs)
    patch = fastdit.patch(tiny_wan, "svg", backend="torch", density=0.25, block_size=8, n_samples=16, **NO_DENSE)
    try:
        out = run(tiny_wan, kwargs)
        stats = patch.stats
    finally:
        patch.remove()
    assert torch.isfinite(out).all() and not torch.allclose(out, before, atol=1e-5)
    assert stats.sparse_calls == len(patch.layers) and stats.fallback_calls == 0
    assert stats.effective_density < 0.7
    assert torch.equal(run(tiny_wan, kwargs), before)
