"""The structured q/k/v generator (fastdit.eval.bench.structured): its heads have the documented attention."""
from __future__ import annotations

import math

import pytest
import torch

from fastdit.eval.bench.structured import (DEFAULT_KINDS, KINDS, SEMANTIC_BETA, StructuredInputs, attention_masses,
                                     check_kinds, head_features, semantic_objects, structured_qkv)


@pytest.mark.parametrize("grid,text_len,position", [((4, 6, 10), 0, "none"), ((3, 7, 5), 9, "suffix"),
                                                    ((5, 5, 7), 11, "prefix")])
def test_heads_have_their_documented_structure(grid, text_len, position):
    x = structured_qkv(grid, heads=6, head_dim=48, batch=2, text_len=text_len, text_position=position, seed=3)
    assert isinstance(x, StructuredInputs) and x.kinds == DEFAULT_KINDS * 2 and "semantic" in KINDS
    seq = math.prod(grid) + text_len
    assert x.q.shape == x.k.shape == x.v.shape == (2, 6, seq, 48) and x.layout.seq_len == seq
    assert all(torch.isfinite(t).all() for t in (x.q, x.k, x.v))
    masses = attention_masses(x.q, x.k, x.layout)
    check_kinds(masses, x.kinds, grid[0])
    spatial, temporal, diffuse = masses[:3]
    # Each kind is distinguishable from the others by its own measure.
    assert spatial["local"] > diffuse["local"] + 0.2 and spatial["same_position"] < 0.1
    assert temporal["same_position"] > 3 * max(spatial["same_position"], diffuse["same_position"])
    assert diffuse["entropy"] > max(spatial["entropy"], temporal["entropy"]) + 0.3


def test_image_grid_has_spatial_and_global_heads():
    x = structured_qkv((1, 9, 11), heads=2, head_dim=32)
    assert x.kinds == ("spatial", "global")
    check_kinds(attention_masses(x.q, x.k, x.layout), x.kinds, 1)


def test_check_kinds_fails_on_random_inputs():
    """Random q and k (the inputs the generator replaces) have none of the structures."""
    layout = structured_qkv((3, 5, 6), heads=2, head_dim=32).layout
    gen = torch.Generator().manual_seed(1)
    q, k = (torch.randn(1, 2, layout.seq_len, 32, generator=gen) for _ in range(2))
    masses = attention_masses(q, k, layout)
    with pytest.raises(AssertionError, match="spatial"):
        check_kinds(masses, ("spatial", "global"), 3)
    with pytest.raises(AssertionError, match="temporal"):
        check_kinds(masses, ("temporal", "global"), 3)
    labelled = attention_masses(q, k, layout, objects=semantic_objects(layout.grid, 4, seed=0))
    with pytest.raises(AssertionError, match="semantic"):
        check_kinds(labelled, ("semantic", "global"), 3)


@pytest.mark.parametrize("grid,objects,text_len", [((5, 8, 12), 6, 0), ((4, 9, 7), 5, 7)])
def test_semantic_heads_attend_their_object_everywhere(grid, objects, text_len):
    """A semantic head puts its mass on its object's tokens (checked against the labels), spread
    over the video: far less of it is local than a spatial head's; the objects are irregular,
    span every frame and drift between frames."""
    x = structured_qkv(grid, heads=3, head_dim=32, kinds=("semantic", "spatial", "semantic"), objects=objects,
                       text_len=text_len, seed=4)
    labels = semantic_objects(grid, objects, seed=4)
    assert labels.shape == (math.prod(grid),) and int(labels.min()) >= 0 and int(labels.max()) < objects
    masses = attention_masses(x.q, x.k, x.layout, objects=labels)
    check_kinds(masses, x.kinds, grid[0])
    semantic, spatial = masses[0], masses[1]
    assert all(math.isfinite(value) for mass in masses for value in mass.values())
    assert semantic["local"] < spatial["local"] - 0.3
    assert semantic["same_object"] - semantic["local"] > 0.4  # most of the mass is far, in the object
    frames = labels.reshape(grid[0], -1)
    sizes = torch.bincount(labels, minlength=objects)
    assert (sizes > 0).sum() >= 3 and not torch.equal(frames[0], frames[-1])
    biggest = int(sizes.argmax())
    assert bool((frames == biggest).any(dim=1).all())  # the largest object is in every frame
    # a different seed draws different objects; the other kinds' draws do not depend on them
    assert not torch.equal(labels, semantic_objects(grid, objects, seed=5))
    plain = structured_qkv(grid, heads=1, head_dim=32, kinds=("spatial",), seed=4, text_len=text_len)
    other = structured_qkv(grid, heads=1, head_dim=32, kinds=("spatial",), seed=4, objects=3, text_len=text_len)
    assert torch.equal(plain.q, other.q)


def test_semantic_features_give_the_documented_scores():
    """scale * f_i . f_j = SEMANTIC_BETA [same object] + 0.5 sum_axes kappa: 6 + 1.5 on the diagonal,
    the positional part bounded by 1.5, so every same-object pair outscores every other pair's bound."""
    grid, dim, objects = (3, 4, 5), 24, 4
    scale = 1 / math.sqrt(dim)
    labels = semantic_objects(grid, objects, seed=1)
    feats = head_features("semantic", grid, dim, scale, labels)
    scores = scale * feats @ feats.T
    same = (labels[:, None] == labels[None]).double()
    assert torch.allclose(scores.diagonal(), torch.full((60,), SEMANTIC_BETA + 1.5, dtype=torch.float64))
    positional = scores - SEMANTIC_BETA * same
    assert positional.abs().max() <= 1.5 + 1e-9
    assert scores[same.bool()].min() > scores[~same.bool()].max()


def test_features_give_the_documented_scores():
    """scale * f_i . f_j = beta * sum_axes kappa(d): 3 * beta on the diagonal for spatial heads,
    equal for the same (h, w) in different frames for temporal heads, and bounded."""
    grid, dim = (3, 4, 5), 40
    scale = 1 / math.sqrt(dim)
    spatial = head_features("spatial", grid, dim, scale)
    scores = scale * spatial @ spatial.T
    assert torch.allclose(scores.diagonal(), torch.full((60,), 3 * 8.0, dtype=torch.float64))
    assert scores.max() <= 24.0 + 1e-9
    temporal = head_features("temporal", grid, dim, scale)
    same_hw = scale * temporal[:20] @ temporal[40:].T  # frame 0 against frame 2
    assert torch.allclose(same_hw.diagonal(), torch.full((20,), 2 * 12.0, dtype=torch.float64))


def test_bad_arguments():
    with pytest.raises(ValueError, match="kind"):
        structured_qkv((2, 3, 3), heads=1, kinds=("sideways",))
    with pytest.raises(ValueError, match="frames"):
        structured_qkv((1, 3, 3), heads=1, kinds=("temporal",))
    with pytest.raises(ValueError, match="heads"):
        structured_qkv((2, 3, 3), heads=2, kinds=("spatial",))
    with pytest.raises(ValueError, match="objects"):
        structured_qkv((2, 3, 3), heads=1, head_dim=8, kinds=("semantic",), objects=7)
    with pytest.raises(ValueError, match="objects"):
        semantic_objects((2, 3, 3), objects=0)
    x = structured_qkv((2, 3, 3), heads=1, head_dim=16, kinds=("semantic",), objects=3)
    with pytest.raises(ValueError, match="objects"):
        check_kinds(attention_masses(x.q, x.k, x.layout), x.kinds, 2)


def test_seed_and_dtype():
    a = structured_qkv((2, 3, 4), heads=3, seed=5, dtype=torch.bfloat16)
    b = structured_qkv((2, 3, 4), heads=3, seed=5, dtype=torch.bfloat16)
    c = structured_qkv((2, 3, 4), heads=3, seed=6, dtype=torch.bfloat16)
    assert a.q.dtype == torch.bfloat16 and torch.equal(a.q, b.q) and not torch.equal(a.q, c.q)


def test_rotary_and_smooth_heads_are_norm_preserving_and_smooth():
    grid, dim = (4, 12, 12), 64
    scale = 1 / math.sqrt(dim)
    for kind in ("rotary", "smooth"):
        feats = head_features(kind, grid, dim, scale, seed=2)
        norms = feats.norm(dim=1)
        # No feature grows with position: every token's feature vector has the same norm.
        assert torch.allclose(norms, norms[0].expand_as(norms), rtol=1e-9), kind
    smooth = head_features("smooth", grid, dim, scale, seed=2)[:, :32]
    cos = torch.nn.functional.normalize(smooth, dim=1)
    t, h, w = 1, 5, 5
    i = (t * 12 + h) * 12 + w
    near = float(cos[i] @ cos[i + 1])  # the next token along w
    far = float((cos[i] @ cos[(3 * 12 + 11) * 12:].T).abs().mean())  # the far corner of the last frame
    assert near > 0.6 and far < 0.4, (near, far)
    x = structured_qkv((3, 10, 10), heads=2, head_dim=dim, kinds=("rotary", "smooth"), seed=4)
    check_kinds(attention_masses(x.q, x.k, x.layout), x.kinds, 3)
    y = structured_qkv((3, 10, 10), heads=2, head_dim=dim, kinds=("spatial", "temporal"), seed=4)
    z = structured_qkv((3, 10, 10), heads=2, head_dim=dim, kinds=("spatial", "temporal"), seed=4)
    assert torch.equal(y.q, z.q)
