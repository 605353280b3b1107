"""``correction="ear"`` (SVG-EAR's error-aware routing with centroid compensation,
``fastdit/methods/corrections/error_routing.py``): the routed blocks and the output against an independent
float64 reference written from the module's formulas (per query block, per key block, in loops),
on permuted / padded sliding-tile plans with text and key masks and on svg2's cluster plans; the
budget is the method's own; nothing dropped means dense; lower error than ``pooled`` at the same
plan cost on the structured generator's spatial and smooth heads; bad options and ring refused."""
from __future__ import annotations

import pytest
import torch

import fastdit
from fastdit.eval.bench.structured import structured_qkv
from fastdit.kernels import dense_reference
from fastdit.layout import TokenLayout
from fastdit.methods.corrections import computed_block_mask

from test_corrections import _pooled_reference, _rel, _structured


def _blocks_of(plan, batch, head, seq):
    """Each model token's query and key block in ``plan`` (one (batch, head))."""
    if getattr(plan, "q_blocks", None) is not None:  # svg2: k-means clusters
        return plan.q_blocks[batch, head], plan.k_blocks[batch, head]
    pos = plan.inverse if plan.inverse is not None else torch.arange(seq)
    if getattr(plan, "head_inverses", None) is not None:
        pos = plan.head_inverses[batch, head]
    return pos // plan.block_m, pos // plan.block_n


def _kept(plan, batch, heads):
    clusters = getattr(plan, "q_blocks", None) is not None
    return (plan.kept_pairs() if clusters else computed_block_mask(plan)).expand(batch, heads, -1, -1)


def _routing_reference(q, k, v, plan, key_mask, scale):
    """Float64: the kept block pairs of the error-aware routing of ``plan`` (module doc), bool
    ``(B, H, n_qb, n_kb)``."""
    batch, heads, seq, _ = q.shape
    q64, k64, v64 = q.double(), k.double(), v.double()
    kept = _kept(plan, batch, heads)
    clusters = getattr(plan, "q_blocks", None) is not None
    routed = torch.zeros_like(kept)
    for b in range(batch):
        for h in range(heads):
            qb, kb = _blocks_of(plan, b, h, seq)
            n_qb, n_kb = kept.shape[-2:]
            cost = [float((kb == j).sum()) if clusters else float(plan.block_n) for j in range(n_kb)]
            for a in range(n_qb):
                rows = qb == a
                if not rows.any():
                    continue
                probe = q64[b, h, rows].mean(0)
                scores = k64[b, h] @ probe * scale
                live = key_mask[b]
                peak = scores[live].max()
                total = torch.exp(scores[live] - peak).sum()
                ratio = []
                for j in range(n_kb):
                    members = (kb == j) & live
                    if not members.any():
                        ratio.append(float("-inf"))
                        continue
                    w = torch.exp(scores[members] - peak)
                    exact = torch.cat([w @ v64[b, h, members], w.sum().view(1)])
                    n = members.sum().double()
                    centre = n * torch.exp(probe @ k64[b, h, members].mean(0) * scale - peak)
                    approx = torch.cat([centre * v64[b, h, members].mean(0), centre.view(1)])
                    ratio.append(float((exact - approx).norm() / total) / cost[j])
                budget = sum(cost[j] for j in range(n_kb) if kept[b, h, a, j] and ratio[j] > float("-inf"))
                spent = 0.0
                for j in sorted(range(n_kb), key=lambda j: -ratio[j]):
                    if spent < budget and ratio[j] > float("-inf"):
                        routed[b, h, a, j] = True
                        spent += cost[j]
    return routed


def _check_against_reference(method, q, k, v, layout, key_mask, opts):
    common = dict(layout=layout, key_mask=key_mask, backend="torch", return_info=True, dense_steps=0, **opts)
    _, plain = fastdit.attention(q, k, v, method, **common)
    out, info = fastdit.attention(q, k, v, method, correction="ear", **common)
    original, routed = plain["plan"], info["plan"]
    batch, heads = q.shape[:2]
    assert plain["density"] < 0.6  # really sparse
    expected = _routing_reference(q, k, v, original, key_mask, q.shape[-1] ** -0.5)
    got = _kept(routed, batch, heads)
    assert torch.equal(got, expected)
    assert not torch.equal(got, _kept(original, batch, heads))  # routing really changed the blocks
    ref = _pooled_reference(q, k, v, routed, key_mask, q.shape[-1] ** -0.5)
    assert torch.isfinite(out).all()
    assert (out.double() - ref).abs().max().item() < 1e-5
    return original, routed


def test_ear_matches_float64_reference_on_sliding_tiles_with_text_and_key_mask():
    layout = TokenLayout((3, 5, 5), text_len=6, text_position="suffix")  # tiles overhang: padding slots
    q, k, v = _structured(5, layout, heads=2, batch=2, dim=16)
    key_mask = torch.rand(2, layout.seq_len, generator=torch.Generator().manual_seed(3)) > 0.2
    original, routed = _check_against_reference("sta", q, k, v, layout, key_mask,
                                                dict(tile=(1, 2, 3), window=(1, 1, 1)))
    # the budget is the method's: as many blocks per query block (fixed-size blocks cost the same),
    # less the kept blocks whose keys are all masked (nothing to route there)
    routed_counts, counts = routed.kv_counts.long(), original.kv_counts.long().expand_as(routed.kv_counts)
    assert (routed_counts <= counts).all() and routed_counts.sum() >= 0.95 * counts.sum()


def test_ear_matches_float64_reference_on_svg2_clusters():
    inputs = structured_qkv(grid=(4, 5, 6), heads=2, head_dim=16, batch=2, kinds=("semantic", "smooth"),
                            text_len=5, text_position="prefix", seed=6)
    key_mask = torch.rand(2, inputs.layout.seq_len, generator=torch.Generator().manual_seed(4)) > 0.15
    _check_against_reference("svg2", inputs.q, inputs.k, inputs.v, inputs.layout, key_mask,
                             dict(q_clusters=6, k_clusters=10, top_p=0.6, dense_layers=0))


def test_ear_with_nothing_dropped_is_dense():
    layout = TokenLayout((3, 4, 6))
    q, k, v = _structured(7, layout)
    full = dict(tile=(1, 2, 3), window=(5, 3, 3), dense_steps=0)  # every tile in every window
    out = fastdit.attention(q, k, v, "sta", layout=layout, backend="torch", correction="ear", **full)
    dense, _ = dense_reference(q, k, v)
    assert _rel(out, dense) < 1e-5


@pytest.mark.parametrize("kind", ["spatial", "smooth"])
def test_ear_lowers_error_against_pooled_at_the_same_plan_cost(kind):
    """Measured (BENCHMARKS.md "Error-aware compensation"): on these kinds routing by the
    compensation error beats pooled at the same number of blocks; the test fails if it does not."""
    inputs = structured_qkv(grid=(6, 16, 16), heads=2, head_dim=32, kinds=(kind, kind), seed=1)
    q, k, v, layout = inputs.q, inputs.k, inputs.v, inputs.layout
    dense, _ = dense_reference(q, k, v)
    opts = dict(layout=layout, backend="torch", tile=(2, 4, 4), window=(1, 3, 3), dense_steps=0,
                return_info=True)
    errors, densities = {}, {}
    for correction in ("none", "pooled", "ear"):
        out, info = fastdit.attention(q, k, v, "sta", correction=correction, **opts)
        assert torch.isfinite(out).all()
        errors[correction], densities[correction] = _rel(out, dense), info["density"]
    assert densities["ear"] == pytest.approx(densities["pooled"]) and densities["ear"] < 0.5
    assert errors["ear"] < errors["pooled"] < errors["none"]


def test_ear_options_and_ring_refusal():
    from fastdit.methods.base import get_method
    from fastdit.methods.parallel.ring import ring_refusal

    with pytest.raises(ValueError, match="ear"):
        get_method("sta").make_config(None, correction="error-aware")
    method = get_method("sta")(get_method("sta").make_config(None, correction="ear"))
    assert "correction='ear'" in ring_refusal(method)
