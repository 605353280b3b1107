"""sla: sparse-linear attention against a float64 token-level implementation of the published formulas.

The reference is written here from the paper's definitions, token by token: blocks from grid
coordinates (not the method's permutation), block scores from pooled means, the critical /
negligible / marginal split per query block, softmax attention over the critical pairs' tokens and
linear attention ``phi(q_i) . phi(k_j)`` weights over the marginal pairs' tokens (not the method's
blockwise sums), then ``O_s + O_l W^T + c``.
"""
from __future__ import annotations

import math

import pytest
import torch

from fastdit.context import AttentionContext, CallState
from fastdit.layout import TokenLayout
from fastdit.methods.base import OptionError
from fastdit.methods.sla import SLA, feature

from kernel_backends import BACKENDS, DEVICE


def tile_blocks(layout, tile):
    """Block index of every model token: 3-D tiles in tile-grid order, then text in blocks of the
    tile's token count."""
    t_, h_, w_ = layout.grid
    n_h, n_w = -(-h_ // tile[1]), -(-w_ // tile[2])
    block = [0] * layout.seq_len
    start = layout.video_start
    for t in range(t_):
        for h in range(h_):
            for w in range(w_):
                block[start + (t * h_ + h) * w_ + w] = ((t // tile[0]) * n_h + h // tile[1]) * n_w + w // tile[2]
    n_video = -(-t_ // tile[0]) * n_h * n_w
    size = math.prod(tile)
    for i, position in enumerate(layout.text_positions().tolist()):
        block[position] = n_video + i // size
    return torch.tensor(block), n_video, n_video + -(-layout.text_len // size)


def reference(q, k, v, layout, tile, topk_ratio, negligible_ratio, feature_map, weight, bias, key_mask=None,
              query_mask=None):
    """SLA in float64, token level (module docstring)."""
    q, k, v = q.double().cpu(), k.double().cpu(), v.double().cpu()  # differentiable moves: grads reach the inputs
    key_mask = None if key_mask is None else key_mask.cpu()
    query_mask = None if query_mask is None else query_mask.cpu()
    batch, heads, seq, dim = q.shape
    blocks, n_video, n = tile_blocks(layout, tile)
    scale = 1 / math.sqrt(dim)
    key_mask = torch.ones(batch, seq, dtype=torch.bool) if key_mask is None else key_mask
    query_ok = torch.ones(batch, seq, dtype=torch.bool) if query_mask is None else query_mask
    out = torch.zeros_like(q)
    n_critical = min(n, max(1, math.ceil(topk_ratio * n)))
    n_negligible = math.floor(negligible_ratio * n)
    for b in range(batch):
        for h in range(heads):
            with torch.no_grad():  # the selection is a constant
                q_means, k_means = [], []
                for j in range(n):
                    members = blocks == j
                    qs, ks = members & query_ok[b], members & key_mask[b]
                    q_means.append(q[b, h, qs].mean(0) if qs.any() else torch.zeros(dim, dtype=torch.float64))
                    k_means.append(k[b, h, ks].mean(0) if ks.any() else None)
                pair = torch.zeros(n, n, dtype=torch.long)  # 1 critical, 0 marginal, -1 negligible / no key
                for m in range(n):
                    scores = [-math.inf if km is None else scale * float(q_means[m] @ km) for km in k_means]
                    ranked = sorted(range(n), key=lambda j: -scores[j])
                    for r, j in enumerate(ranked):
                        if r < n_critical or j >= n_video or m >= n_video:
                            pair[m, j] = 1
                        elif r >= n - n_negligible or k_means[j] is None:
                            pair[m, j] = -1
            kind = pair[blocks][:, blocks]  # (S, S) per token pair
            valid = key_mask[b][None, :]
            s = scale * q[b, h] @ k[b, h].T
            s = s.masked_fill(~((kind == 1) & valid), -math.inf)
            o_s = torch.softmax(s, -1) @ v[b, h]
            phi_q, phi_k = feature(q[b, h], feature_map), feature(k[b, h], feature_map)
            a = (phi_q @ phi_k.T) * ((kind == 0) & valid)
            den = a.sum(-1, keepdim=True)
            o_l = torch.where(den > 0, (a @ v[b, h]) / torch.where(den > 0, den, 1.0), 0.0)
            o = o_s if weight is None else o_s + o_l @ weight.double().cpu().T + bias.double().cpu()
            out[b, h] = o * query_ok[b][:, None]
    return out


def call(method, q, k, v, layout, proj=None, key_mask=None, query_mask=None, backend="torch"):
    """One call of ``method`` through the protocol, with ``proj`` as the layer's parameters."""
    ctx = AttentionContext(layer=0, layer_name="layer", step=0, num_steps=None, branch=0, layout=layout,
                           call=CallState(), key_mask=key_mask, query_mask=query_mask, num_heads=q.shape[1],
                           params=proj, backend=backend)
    return method(ctx, q, k, v), ctx


def make(**options):
    """The method as one call outside a pipeline resolves it (no dense steps, the guard off)."""
    return SLA(SLA.resolve(options={"guard": False, **options}, where="call"))


def projection(dim, seed):
    proj = SLA().layer_module(2, dim)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        proj.weight.copy_(torch.randn(dim, dim, generator=gen) * 0.3)
        proj.bias.copy_(torch.randn(dim, generator=gen) * 0.1)
    return proj


#: float32 computation against the float64 reference
TOL = dict(rtol=1e-4, atol=2e-5)

CASES = [  # layout, options, key mask (second batch's last text keys padded), query mask
    (TokenLayout((3, 5, 7)), dict(tile=(1, 2, 3), topk_ratio=0.2, negligible_ratio=0.3), False, False),
    (TokenLayout((2, 6, 5), 7, "prefix"), dict(tile=(2, 3, 2), topk_ratio=0.3, feature_map="elu"), True, False),
    (TokenLayout((4, 5, 6), 9, "suffix"), dict(tile=(2, 2, 3), topk_ratio=0.15, negligible_ratio=0.2,
                                                feature_map="relu"), True, True),
    (TokenLayout((1, 9, 7), 5, "prefix"), dict(tile=(1, 3, 4), topk_ratio=0.25), True, False),  # image: 2-D tiles
]


def _inputs(layout, seed, heads=2, dim=8):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(2, heads, layout.seq_len, dim, generator=gen) for _ in range(3)]  # the engine: float32 at most


def _masks(layout, key, query, seed):
    key_mask = query_mask = None
    if key:
        key_mask = torch.ones(2, layout.seq_len, dtype=torch.bool)
        key_mask[1, layout.text_positions()[-3:]] = False
    if query:
        gen = torch.Generator().manual_seed(seed)
        query_mask = torch.rand(2, layout.seq_len, generator=gen) > 0.2
    return key_mask, query_mask


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout,options,key,query", CASES)
def test_forward_equals_float64_reference(layout, options, key, query, backend):
    seed = 1000 + sum(layout.grid) + layout.text_len
    method = make(**options)
    q, k, v = _inputs(layout, seed)
    key_mask, query_mask = _masks(layout, key, query, seed)
    proj = projection(q.shape[-1], seed)
    on = [t.to(DEVICE) if t is not None else None for t in (q, k, v, key_mask, query_mask)]
    out, ctx = call(method, *on[:3], layout, proj.to(DEVICE), *on[3:], backend=backend)
    out = out.cpu()
    tile = method.tile_for(layout)
    expected = reference(q, k, v, layout, tile, method.config.topk_ratio, method.config.negligible_ratio,
                         method.config.feature_map, proj.weight, proj.bias, key_mask, query_mask)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), expected, **TOL)
    # really sparse: the sparse branch computes well under half of the pairs, the linear branch has work
    assert ctx.info["plan"].density < 0.6
    assert float(ctx.info["marginal_density"].min()) > 0.1


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout,options,key,query", CASES[1:3])
def test_backward_equals_float64_reference(layout, options, key, query, backend):
    seed = 2000 + sum(layout.grid)
    method = make(**options)
    q, k, v = (t.to(DEVICE).requires_grad_() for t in _inputs(layout, seed))
    key_mask, query_mask = (None if m is None else m.to(DEVICE) for m in _masks(layout, key, query, seed))
    proj = projection(q.shape[-1], seed).to(DEVICE)
    out, _ = call(method, q, k, v, layout, proj, key_mask, query_mask, backend=backend)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v, proj.weight, proj.bias), grad)
    ref_w, ref_b = (p.detach().clone().requires_grad_() for p in (proj.weight, proj.bias))
    expected_out = reference(q, k, v, layout, method.tile_for(layout), method.config.topk_ratio,
                             method.config.negligible_ratio, method.config.feature_map, ref_w, ref_b, key_mask,
                             query_mask)
    expected = torch.autograd.grad(expected_out, (q, k, v, ref_w, ref_b), grad.double().cpu())
    for name, a, b in zip(("q", "k", "v", "weight", "bias"), got, expected):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a.double().cpu(), b.double().cpu(), **TOL, msg=lambda m, name=name: f"d{name}: {m}")


def test_zero_projection_is_the_sparse_branch_alone():
    """The published initialisation (zero) and no parameters both give the sparse branch alone."""
    layout = TokenLayout((3, 4, 5), 4, "suffix")
    method = make(tile=(1, 2, 5), topk_ratio=0.3, negligible_ratio=0.2)
    q, k, v = _inputs(layout, 7)
    zero = method.layer_module(2, q.shape[-1])
    assert not zero.weight.any() and not zero.bias.any()
    expected = reference(q, k, v, layout, method.tile_for(layout), 0.3, 0.2, "softmax", None, None)
    for params in (None, zero):
        out, _ = call(method, q, k, v, layout, params)
        torch.testing.assert_close(out.double(), expected, **TOL)


def test_topk_ratio_one_is_dense():
    layout = TokenLayout((2, 3, 5), 3, "prefix")
    q, k, v = _inputs(layout, 11)
    out, ctx = call(make(tile=(1, 3, 5), topk_ratio=1.0), q, k, v, layout, projection(q.shape[-1], 11))
    dense = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    # every pair critical: no marginal pair, so the linear branch is 0 and only the bias is added
    assert float(ctx.info["marginal_density"].max()) == 0.0
    torch.testing.assert_close(out, dense + projection(q.shape[-1], 11).bias.detach(), **TOL)


def test_layer_module_is_the_published_zero_linear():
    proj = SLA().layer_module(4, 16)
    assert isinstance(proj, torch.nn.Linear) and proj.weight.shape == (16, 16) and proj.bias.shape == (16,)
    assert not proj.weight.any() and not proj.bias.any()
    assert SLA(feature_map="elu").layer_module_key() == {"feature_map": "elu"}


@pytest.mark.parametrize("options,words", [
    (dict(topk_ratio=0.0), "topk_ratio"),
    (dict(topk_ratio=1.5), "topk_ratio"),
    (dict(negligible_ratio=1.0), "negligible_ratio"),
    (dict(topk_ratio=0.6, negligible_ratio=0.5), "topk_ratio + negligible_ratio"),
    (dict(feature_map="hedgehog"), "feature_map"),
    (dict(correction="pooled"), "correction"),
    (dict(tile=(2, 0, 4)), "tile"),
])
def test_bad_options_name_the_option(options, words):
    with pytest.raises(ValueError, match=words.replace("+", r"\+")):
        make(**options)


def test_mass_is_refused_with_the_reason():
    import fastdit

    layout = TokenLayout((2, 4, 4))
    q = torch.randn(1, 2, layout.seq_len, 8)
    with pytest.raises(ValueError, match="sla.*another branch"):
        fastdit.attention(q, q, q, "sla", layout=layout, return_info="mass")


def test_ring_is_refused_with_a_reason():
    from fastdit.methods.parallel.ring import ring_refusal

    reason = ring_refusal(SLA())
    assert reason is not None and "sla" in reason and "Ulysses" in reason and "linear branch" in reason


def test_option_error_is_a_value_error():
    with pytest.raises(OptionError):
        SLA(feature_map="cosine")


def test_projection_trains_saves_and_loads_with_the_patch(tmp_path):
    """The projection is a trainable parameter of the patch (one per layer, never on the model), saved
    and loaded beside the adapter; parameters of another feature map are refused naming both."""
    import fastdit
    from fastdit.calibration.calibration_file import CalibrationError
    from fastdit.calibration.method_params import method_parameters, save_method_params

    from tiny_models import TINY

    tiny = TINY["wan"]
    model = tiny.build(0)
    inputs = tiny.inputs(model, (4, 8, 8), 0)
    options = dict(tile=(2, 4, 4), topk_ratio=0.25, dense_steps=0, dense_layers=0, guard=False)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with fastdit.patch(model, "sla", backend="torch", trainable=True, **options) as p:
        params = method_parameters(p)
        assert params and all(not t.any() for t in params)  # published init: zero
        out = model(**dict(inputs, timestep=torch.tensor([400])))[0]
        grads = torch.autograd.grad(out.square().sum(), params)
        assert all(torch.isfinite(g).all() for g in grads) and any(g.abs().sum() > 0 for g in grads)
        with torch.no_grad():
            for t, g in zip(params, grads):
                t.sub_(1e-2 * g / g.abs().max().clamp_min(1e-12))
            trained = model(**dict(inputs, timestep=torch.tensor([400])))[0]
        save_method_params(p, tmp_path)
    assert {n: t for n, t in model.named_parameters() if not torch.equal(t, before[n])} == {}  # model untouched
    with torch.no_grad(), fastdit.patch(model, "sla", backend="torch", method_params=tmp_path, **options):
        loaded = model(**dict(inputs, timestep=torch.tensor([400])))[0]
    torch.testing.assert_close(loaded, trained, rtol=1e-5, atol=1e-6)
    assert (loaded - out.detach()).abs().max() > 1e-6  # the learned linear branch changes the output
    with pytest.raises(CalibrationError, match="softmax.*elu|elu.*softmax"):
        fastdit.patch(model, "sla", backend="torch", method_params=tmp_path, **dict(options, feature_map="elu"))
    other = tiny.inputs(model, (2, 8, 8), 0)  # another latent grid than the one trained on
    with torch.no_grad(), fastdit.patch(model, "sla", backend="torch", method_params=tmp_path, **options):
        with pytest.raises(CalibrationError, match=r"\(4, 8, 8\).*\(2, 8, 8\)|4, 8, 8.*2, 8, 8"):
            model(**dict(other, timestep=torch.tensor([400])))


@pytest.mark.guard_defaults
def test_the_guard_checks_sla_and_replaces_failing_heads():
    """Off by default (it would undo a fine-tuned model); asked for, a head over the bound is retried at twice
    topk_ratio, then dense."""
    import fastdit

    assert SLA.resolve().guard is False
    layout = TokenLayout((3, 6, 6), 5, "suffix")
    q, k, v = (t[:1] for t in _inputs(layout, 21, dim=16))
    dense = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    out, info = fastdit.attention(q, k, v, "sla", layout=layout, tile=(1, 3, 3), topk_ratio=0.1, guard=0.01,
                                  return_info=True)
    assert info["guard"]["action"] == ["dense", "dense"] and min(info["guard"]["first_error"]) > 0.01
    torch.testing.assert_close(out, dense, **TOL)
    loose, info = fastdit.attention(q, k, v, "sla", layout=layout, tile=(1, 3, 3), topk_ratio=0.1, guard=100.0,
                                    return_info=True)
    assert info["guard"]["action"] == ["pass", "pass"] and (loose - dense).abs().max() > 1e-2


def test_calibrate_tries_sla_candidates_and_its_plan_runs(tmp_path):
    """``candidates`` (topk_ratio 0.5 .. 0.05) are what fastdit.calibrate tries; a huge budget keeps the sparsest."""
    import fastdit
    from fastdit.calibration.search import calibrate
    from fastdit.pipelines.tiny import TINY_TEST_DEFAULTS, tiny

    pipe = tiny("wan")
    call = dict(TINY_TEST_DEFAULTS["wan"])
    plan = calibrate(pipe, "sla", ["a cat"], budget=10.0, out=tmp_path / "plan.json", call_kwargs=call,
                     options={"tile": (1, 2, 2)}, rows=48, progress=False)
    assert [c["topk_ratio"] for c in plan["candidates"]] == [0.5, 0.3, 0.2, 0.1, 0.05]
    assert set(map(str, plan["settings"].values())) == {str({"topk_ratio": 0.05})}
    with fastdit.patch(pipe, "sla", calibration=tmp_path / "plan.json", guard=False) as p:
        pipe("a cat", **call)
    assert p.stats.sparse_calls > 0 and p.stats.sparse_density < 0.2


@pytest.mark.guard_defaults
def test_training_eval_measures_the_method_not_the_guard(monkeypatch):
    """``fastdit.train --eval``'s video PSNR runs the method as it trains (guard off unless asked for):
    with a guard on, failing heads would run dense and the 'before' row would be dense's."""
    from fastdit.pipelines.tiny import tiny
    from fastdit.train.__main__ import TINY_CALL
    from fastdit.train.evaluate import dense_videos, video_fidelity

    pipe = tiny("wan")
    pipe.set_progress_bar_config(disable=True)
    call = dict(TINY_CALL, num_inference_steps=2)
    dense = dense_videos(pipe, ["a cat"], (0,), call)
    options = dict(tile=(2, 4, 4), topk_ratio=0.25, dense_steps=0, dense_layers=0)
    monkeypatch.setattr(SLA, "guard_default", 0.1)  # a method whose guard is on by default (sparge's)
    assert video_fidelity(pipe, dense, ["a cat"], (0,), call, "sla", options)["density"] < 0.5
    assert video_fidelity(pipe, dense, ["a cat"], (0,), call, "sla", dict(options, guard=0.01))["density"] > 1.0
