"""Corrections for dropped key blocks (``correction="pooled"`` / ``"cached"``) and the skip rule
through the block-sparse methods: exactness where the math says exact (nothing dropped, refresh
steps, unchanged inputs), an independent float64 reference of the pooled rule, lower error than
the plain method at the same plan on attention with real (local, decaying) structure, and bad
options rejected at patch time."""
from __future__ import annotations

import math

import pytest
import torch

import fastdit
from fastdit.kernels import dense_reference
from fastdit.layout import TokenLayout
from fastdit.methods.base import get_method
from fastdit.methods.corrections import computed_block_mask

from tiny_transformers import tiny_wan

GRID = (5, 6, 7)  # 210 video tokens, odd sizes: STA tiles overhang (padding slots)
STA = dict(tile=(2, 3, 4), window=(1, 3, 1), dense_steps=0)  # a really sparse window


def _structured(seed, layout, heads=2, batch=2, dim=24, width=1.6, drift=None):
    """q, k, v of a video-like layer: scores fall off with the 3-D distance of latent positions
    (``-|p_i - p_j|^2 / (2 width^2)`` plus noise), values vary smoothly with position plus noise;
    text tokens (if any) get random features. ``drift``: (generator, size) adds fresh noise."""
    gen = torch.Generator().manual_seed(seed)
    t, h, w = layout.grid
    pos = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij"), -1)
    pos = pos.reshape(-1, 3).double()
    c = math.sqrt(math.sqrt(dim)) / width  # q . k * dim**-0.5 == -|p_i - p_j|^2 / (2 width^2)
    sq = (pos**2).sum(-1)
    q = torch.randn(batch, heads, layout.seq_len, dim, generator=gen, dtype=torch.float64) * 0.3
    k = torch.randn(batch, heads, layout.seq_len, dim, generator=gen, dtype=torch.float64) * 0.3
    v = torch.randn(batch, heads, layout.seq_len, dim, generator=gen, dtype=torch.float64) * 0.3
    vid = layout.video_positions() if hasattr(layout, "video_positions") else torch.arange(layout.video_len)
    q[:, :, vid, :3], k[:, :, vid, :3] = c * pos, c * pos
    q[:, :, vid, 3], k[:, :, vid, 3] = -0.5 * c * sq, c
    q[:, :, vid, 4], k[:, :, vid, 4] = c, -0.5 * c * sq
    phase = torch.randn(dim, 3, generator=gen, dtype=torch.float64)
    v[:, :, vid] += torch.sin(pos @ phase.t() * 0.5)
    if drift is not None:
        dgen, size = drift
        q = q + size * torch.randn(q.shape, generator=dgen, dtype=torch.float64)
        k = k + size * torch.randn(k.shape, generator=dgen, dtype=torch.float64)
        v = v + size * torch.randn(v.shape, generator=dgen, dtype=torch.float64)
    return q.float(), k.float(), v.float()


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _pooled_reference(q, k, v, plan, key_mask, scale):
    """Float64: the computed keys plus, per dropped key block, one pseudo-key (mean of the block's
    valid keys, weight = their count) with the mean value; one joint softmax per query."""
    batch, heads, seq, dim = q.shape
    q64, k64, v64 = q.double(), k.double(), v.double()
    kernel_pos = plan.inverse if plan.inverse is not None else torch.arange(seq)
    clusters = getattr(plan, "q_blocks", None) is not None  # svg2: blocks are k-means clusters
    computed = (plan.kept_pairs() if clusters else computed_block_mask(plan)).expand(batch, heads, -1, -1)
    out = torch.zeros(batch, heads, seq, dim, dtype=torch.float64)
    for b in range(batch):
        for h in range(heads):
            if getattr(plan, "head_inverses", None) is not None:  # svg: each head its own kernel order
                kernel_pos = plan.head_inverses[b, h]
            qb, kb = kernel_pos // plan.block_m, kernel_pos // plan.block_n
            if clusters:
                qb, kb = plan.q_blocks[b, h], plan.k_blocks[b, h]
            for i in range(seq):
                keep = computed[b, h, qb[i]][kb] & key_mask[b]
                logits = [q64[b, h, i] @ k64[b, h, keep].t() * scale]
                values = [v64[b, h, keep]]
                for block in (~computed[b, h, qb[i]]).nonzero().flatten().tolist():
                    members = (kb == block) & key_mask[b]
                    if members.any():
                        n = members.sum().double()
                        logits.append((q64[b, h, i] @ k64[b, h, members].mean(0) * scale + n.log()).view(1))
                        values.append(v64[b, h, members].mean(0).view(1, -1))
                weights = torch.softmax(torch.cat(logits), 0)
                out[b, h, i] = weights @ torch.cat(values)
    return out


def test_pooled_matches_float64_reference_with_permutation_and_key_mask():
    layout = TokenLayout((3, 4, 5), text_len=7, text_position="suffix")
    q, k, v = _structured(0, layout, heads=2, batch=2, dim=16)
    key_mask = torch.rand(2, layout.seq_len, generator=torch.Generator().manual_seed(1)) > 0.2
    opts = dict(tile=(1, 2, 3), window=(1, 1, 1), dense_steps=0)
    out, info = fastdit.attention(q, k, v, "sta", layout=layout, key_mask=key_mask, backend="torch",
                                  correction="pooled", return_info=True, **opts)
    plan = info["plan"]
    assert plan.perm is not None and info["density"] < 0.6  # permuted, padded and really sparse
    ref = _pooled_reference(q, k, v, plan, key_mask, q.shape[-1] ** -0.5)
    assert torch.isfinite(out).all()
    assert (out.double() - ref).abs().max().item() < 1e-5
    plain = fastdit.attention(q, k, v, "sta", layout=layout, key_mask=key_mask, backend="torch", **opts)
    assert (plain.double() - ref).abs().max().item() > 1e-3  # the correction really changed the output


def _svg_orders_differ(plan):
    orders = plan.head_orders[:, :, :3].tolist()
    return len({tuple(o) for row in orders for o in row}) == 2


PER_HEAD_POOLED = {  # method -> (grid, text position, options, check that the per-head blocks really differ)
    # svg: each head its own kernel order (frame- or position-major); heads of opposite kinds, so
    # both orders occur and the pooled blocks are each head's own
    "svg": ((8, 4, 6), "prefix", dict(density=0.375, block_size=8, n_samples=32), _svg_orders_differ),
    # svg2: the blocks are each head's k-means clusters, text in a block of its own
    "svg2": ((4, 5, 6), "suffix", dict(q_clusters=6, k_clusters=10, top_p=0.6), lambda plan: True),
}


@pytest.mark.parametrize("method", sorted(PER_HEAD_POOLED))
def test_pooled_per_head_blocks_match_float64_reference(method):
    from fastdit.eval.bench.structured import structured_qkv

    grid, text_position, opts, blocks_differ = PER_HEAD_POOLED[method]
    opts = dict(opts, dense_steps=0, dense_layers=0)
    inputs = structured_qkv(grid=grid, heads=2, head_dim=16, batch=2, kinds=("spatial", "temporal"),
                            text_len=5, text_position=text_position, seed=4)
    q, k, v, layout = inputs.q, inputs.k, inputs.v, inputs.layout
    key_mask = torch.rand(2, layout.seq_len, generator=torch.Generator().manual_seed(2)) > 0.15
    out, info = fastdit.attention(q, k, v, method, layout=layout, key_mask=key_mask, backend="torch",
                                  correction="pooled", return_info=True, **opts)
    plan = info["plan"]
    assert blocks_differ(plan) and info["density"] < 0.6
    ref = _pooled_reference(q, k, v, plan, key_mask, q.shape[-1] ** -0.5)
    assert torch.isfinite(out).all()
    assert (out.double() - ref).abs().max().item() < 1e-5
    plain = fastdit.attention(q, k, v, method, layout=layout, key_mask=key_mask, backend="torch", **opts)
    assert (plain.double() - ref).abs().max().item() > 1e-3  # the correction really changed the output


def test_pooled_with_nothing_dropped_equals_sparse_and_dense():
    layout = TokenLayout((3, 4, 6))
    q, k, v = _structured(2, layout)
    full = dict(tile=(1, 2, 3), window=(5, 3, 3), dense_steps=0)  # every tile in every window
    plain, info = fastdit.attention(q, k, v, "sta", layout=layout, backend="torch", return_info=True, **full)
    assert info["plan"].kv_counts.min().item() == info["plan"].num_kv_blocks
    pooled = fastdit.attention(q, k, v, "sta", layout=layout, backend="torch", correction="pooled", **full)
    assert torch.equal(pooled, plain)
    dense, _ = dense_reference(q, k, v)
    assert _rel(pooled, dense) < 1e-5


def _steps(layout, n_steps, seed=3, drift=0.05):
    base_gen = torch.Generator().manual_seed(seed + 100)
    return [_structured(seed, layout, drift=(base_gen, drift * s)) for s in range(n_steps)]


def test_cached_refresh_is_dense_and_schedule_is_honest():
    layout = TokenLayout(GRID)
    steps = _steps(layout, 5)
    state, infos, errors = {}, [], []
    for step, (q, k, v) in enumerate(steps):
        out, info = fastdit.attention(q, k, v, "sta", layout=layout, backend="torch", correction="cached",
                                      refresh_every=3, state=state, step=step, return_info=True, **STA)
        infos.append(info)
        errors.append(_rel(out, dense_reference(q, k, v)[0]))
    # steps 0 and 3 refresh: dense work (density 1), output = dense attention up to float rounding
    assert [i["dense"] for i in infos] == [True, False, False, True, False]
    assert [i["density"] for i in infos][::3] == [1.0, 1.0] and max(i["density"] for i in infos[1:3]) < 0.5
    assert errors[0] < 1e-5 and errors[3] < 1e-5
    assert all(e > 1e-4 for e in (errors[1], errors[2], errors[4]))
    # unchanged inputs after a refresh: the cached correction reproduces dense exactly
    q, k, v = steps[3]
    again = fastdit.attention(q, k, v, "sta", layout=layout, backend="torch", correction="cached",
                              refresh_every=3, state=state, step=4, **STA)
    assert _rel(again, dense_reference(q, k, v)[0]) < 1e-5


def test_cached_first_sparse_step_after_dense_steps_refreshes():
    layout = TokenLayout(GRID)
    q, k, v = _structured(4, layout)
    state = {}
    opts = dict(STA, dense_steps=2, correction="cached", refresh_every=2)
    dense_flags = [fastdit.attention(q, k, v, "sta", layout=layout, backend="torch", state=state, step=s,
                                     return_info=True, **opts)[1]["dense"] for s in range(6)]
    assert dense_flags == [True, True, True, False, True, False]  # steps 0-1 dense, 2 and 4 refresh


METHODS = {  # method -> (grid, options): really sparse plans on small grids
    "sta": (GRID, STA),
    "radial": ((8, 4, 8), dict(block_size=64, decay=0.2, sink=False, adjacent="band", dense_steps=0)),
    "sparge": ((6, 6, 7), dict(tile=(4, 4, 4), topk=0.125, simthresh=-1.0, dense_steps=0)),
    "svg": ((6, 6, 7), dict(density=0.25, block_size=16, n_samples=64, dense_steps=0, dense_layers=0)),
    "svg2": ((6, 6, 7), dict(q_clusters=8, k_clusters=24, top_p=0.5, warm_start=False, dense_steps=0, dense_layers=0)),
}


@pytest.mark.parametrize("method", sorted(METHODS))
@pytest.mark.parametrize("correction", ["pooled", "cached"])
def test_correction_lowers_error_on_local_attention(method, correction):
    """Same plan, same density: the corrected output is closer to dense attention than the plain
    sparse one, on every sparse step of a drifting local/decaying attention pattern."""
    grid, opts = METHODS[method]
    layout = TokenLayout(grid)
    steps = _steps(layout, 4, seed=5, drift=0.05)
    state, checked = {}, 0
    for step, (q, k, v) in enumerate(steps):
        dense, _ = dense_reference(q, k, v)
        plain, info = fastdit.attention(q, k, v, method, layout=layout, backend="torch", return_info=True, **opts)
        fixed, fixed_info = fastdit.attention(q, k, v, method, layout=layout, backend="torch", correction=correction,
                                              refresh_every=4, state=state, step=step, return_info=True, **opts)
        if fixed_info["dense"]:  # the cached refresh step
            continue
        assert info["density"] < 0.5 and fixed_info["density"] == info["density"]
        err_plain, err_fixed = _rel(plain, dense), _rel(fixed, dense)
        assert err_fixed < 0.9 * err_plain, (step, err_fixed, err_plain)
        checked += 1
    assert checked == (3 if correction == "cached" else 4)


def test_skip_threshold_through_the_method():
    layout = TokenLayout(GRID)
    q, k, v = _structured(6, layout)
    plain = fastdit.attention(q, k, v, "sta", layout=layout, backend="torch", **STA)
    ctx_state = {}
    same = fastdit.attention(q, k, v, "sta", layout=layout, backend="torch", skip_threshold=math.inf,
                             state=ctx_state, **STA)
    assert torch.allclose(same, plain, atol=1e-6, rtol=0)
    skipping, info = fastdit.attention(q, k, v, "sta", layout=layout, backend="torch", skip_threshold=0.0,
                                       return_info=True, **STA)
    assert torch.isfinite(skipping).all() and not torch.allclose(skipping, plain, atol=1e-6)
    skipped, walked = info["skipped_subtiles"], info["walked_subtiles"]
    assert 0 < int(skipped.sum()) < int(walked.expand_as(skipped).sum())


@pytest.mark.parametrize("options, match", [
    (dict(skip_threshold=-1.0), "skip_threshold"),
    (dict(skip_threshold=float("nan")), "skip_threshold"),
    (dict(skip_threshold="big"), "skip_threshold"),
    (dict(correction="mean"), "correction"),
    (dict(refresh_every=0), "refresh_every"),
])
def test_bad_block_sparse_options(options, match):
    for method in ("sta", "radial"):
        with pytest.raises(ValueError, match=match):
            get_method(method).make_config(**options)
    model = tiny_wan()
    with pytest.raises(ValueError, match=match):
        fastdit.patch(model, "sta", **options)
    assert not hasattr(model, "_fastdit_patch")


@pytest.mark.parametrize("option", [dict(correction="pooled"), dict(skip_threshold=2.0), dict(refresh_every=3)])
def test_block_sparse_option_on_dense_is_rejected_at_patch_time(option):
    model = tiny_wan()
    name = next(iter(option))
    with pytest.raises(ValueError, match=rf"{name} applies to block-sparse methods"):
        fastdit.patch(model, "dense", **option)
    assert not hasattr(model, "_fastdit_patch")
    layout = TokenLayout((1, 2, 8))
    q = torch.randn(1, 1, 16, 16)
    with pytest.raises(ValueError, match=name):
        fastdit.attention(q, q, q, "dense", layout=layout, **option)


def test_cached_with_text_and_key_mask():
    """Joint attention (text prefix, a key mask with holes in video and text): a refresh step
    equals masked dense attention; the next step with unchanged inputs too; masked keys never
    leak into the residual."""
    layout = TokenLayout((3, 4, 5), text_len=6, text_position="prefix")
    q, k, v = _structured(7, layout, dim=16)
    key_mask = torch.rand(2, layout.seq_len, generator=torch.Generator().manual_seed(8)) > 0.25
    key_mask[:, 0] = True
    opts = dict(tile=(1, 2, 3), window=(1, 1, 1), dense_steps=0, correction="cached", refresh_every=5)
    dense, _ = dense_reference(q, k, v, key_mask[:, None, None, :])
    state = {}
    for step in (0, 1):
        out, info = fastdit.attention(q, k, v, "sta", layout=layout, key_mask=key_mask, backend="torch", state=state,
                                      step=step, return_info=True, **opts)
        assert info["dense"] == (step == 0)
        assert torch.isfinite(out).all() and _rel(out, dense) < 1e-5
    # a changed value at a masked key changes nothing
    v2 = v.clone()
    v2[0, :, ~key_mask[0]] += 100.0
    out2 = fastdit.attention(q, k, v2, "sta", layout=layout, key_mask=key_mask, backend="torch", state={}, step=0,
                             **opts)
    assert torch.allclose(out2[:1], dense[:1].float(), atol=1e-5)
