"""``fastdit.patch(..., trainable=True)``: the sparse methods with gradients, on the tiny Wan.

* Gradients are those of the function the patch computes: a central finite difference of the
  loss (run without gradients, i.e. through the inference op) along a random direction of the
  attention weights equals the directional derivative from autograd (trainable path), and the
  trainable forward's output equals the inference forward's.
* Without ``trainable`` the model's own attention runs with gradients (counted fallbacks), with it
  none; the statistics count every call.
* Methods whose result depends on another call's cache, or whose backward would not be exact,
  are refused at patch time, naming the method and the reason, and the model stays unpatched.
* ``torch.compile(backend="aot_eager")``: one SGD step equals eager's.
"""
from __future__ import annotations

import copy

import pytest
import torch

import fastdit
from fastdit.methods.base import OptionError, get_method

from tiny_models import TINY

GRID = (4, 8, 8)  # 256 video tokens: room for really sparse plans
#: options that make each method really sparse on GRID (density checked below)
OPTIONS = {
    "sta": {"tile": (2, 4, 4), "window": (1, 1, 1)},
    "radial": {"block_size": 64},
    "sparge": {"tile": (2, 4, 4), "topk": 0.25, "min_blocks": 1},
    "sla": {"tile": (2, 4, 4), "topk_ratio": 0.25},
    "svg": {"block_size": 32, "density": 0.25},
    "svg2": {},
    "todo": {},
    "window": {"tile": (2, 4, 4), "window": (1, 1, 1), "refresh_every": 4},
    "tome": {},
    "optiprune": {},
}


#: selection (blocks, clusters, matchings) computed from q and k: a perturbation of the weights
#: that produce q and k may change it (a jump the finite difference would see)
DYNAMIC = ("sparge", "svg", "svg2", "tome", "sla", "optiprune")


def _model_and_inputs(seed=0, grid=GRID):
    tiny = TINY["wan"]
    model = tiny.build(seed)
    return model, tiny.inputs(model, grid, seed)


def _attention_weights(model):
    return [p for n, p in model.named_parameters() if ".attn1.to_" in n and n.endswith("weight")]


def _patch(model, method, **kw):
    options = dict(get_method(method).tiny_options)
    options.update(OPTIONS.get(method, {}), dense_steps=0, dense_layers=0)  # every call sparse (bare transformer)
    options.update(kw)
    return fastdit.patch(model, method, backend="torch", **options)


def _evaluate(model, method, inputs, target, weights, shift=(), grad=False):
    """``(loss, patch stats)`` of one measured call (timestep 400) on a fresh patch, after a warm
    call (timestep 500, unperturbed weights: window's full step, whose residual the measured
    window step reuses as a constant); ``shift``: added to ``weights`` for the measured call only."""
    with _patch(model, method, trainable=True) as p:
        with torch.no_grad():
            model(**dict(inputs, timestep=torch.tensor([500])))
            for w, s in zip(weights, shift):
                w.add_(s)
        try:
            with torch.set_grad_enabled(grad):
                loss = (model(**dict(inputs, timestep=torch.tensor([400])))[0] * target).sum()
                grads = torch.autograd.grad(loss, weights) if grad else None
        finally:
            with torch.no_grad():
                for w, s in zip(weights, shift):
                    w.sub_(s)
        return loss.detach(), grads, p.stats


@pytest.mark.parametrize("method", list(OPTIONS))
def test_gradient_is_the_derivative_of_the_patched_function(method):
    model, inputs = _model_and_inputs(grid=(8, 8, 8) if method == "radial" else GRID)  # radial: sparse from 8 frames
    weights = _attention_weights(model)
    if method in DYNAMIC:  # the finite difference moves the last layer's values only: the selection stays put
        weights = [p for n, p in model.named_parameters() if n.endswith("blocks.1.attn1.to_v.weight")]
    gen = torch.Generator().manual_seed(1)
    direction = [torch.randn(w.shape, generator=gen) for w in weights]
    target = torch.randn(model(**inputs)[0].shape, generator=gen)
    loss, grads, stats = _evaluate(model, method, inputs, target, weights, grad=True)
    assert stats.fallback_calls == 0, stats.fallbacks
    assert stats.sparse_calls == 4 and stats.sparse_density < 0.8, stats.as_dict()  # really sparse
    assert all(torch.isfinite(g).all() for g in grads)
    same, _, _ = _evaluate(model, method, inputs, target, weights)  # the inference op computes the same
    torch.testing.assert_close(same, loss, rtol=1e-5, atol=1e-4)
    analytic = sum((g * d).sum() for g, d in zip(grads, direction)).item()
    eps = 1e-3
    plus, _, _ = _evaluate(model, method, inputs, target, weights, [eps * d for d in direction])
    minus, _, _ = _evaluate(model, method, inputs, target, weights, [-eps * d for d in direction])
    numeric = (plus - minus).item() / (2 * eps)
    assert abs(numeric - analytic) <= 2e-2 * abs(analytic) + 1e-3, (numeric, analytic)
    # the sparse model's gradient is not the dense model's: the mask matters
    dense = torch.autograd.grad((model(**dict(inputs, timestep=torch.tensor([400])))[0] * target).sum(), weights)
    assert max((a - b).abs().max().item() for a, b in zip(grads, dense)) > 1e-3
    if method in DYNAMIC:  # the gradient reaches the weights behind q and k too (no NaN, not zero)
        _, all_grads, _ = _evaluate(model, method, inputs, target, _attention_weights(model), grad=True)
        assert all(torch.isfinite(g).all() and g.abs().sum() > 0 for g in all_grads)


def test_without_trainable_gradients_fall_back_and_are_counted():
    model, inputs = _model_and_inputs()
    with _patch(model, "sta") as p:
        model(**inputs)[0].sum().backward()
        assert p.stats.fallback_calls > 0 and p.stats.sparse_calls == 0
        assert all("trainable=True" in reason for reason in p.stats.fallbacks)
    with _patch(model, "sta", trainable=True) as p:
        model(**inputs)[0].sum().backward()
        assert p.stats.fallback_calls == 0 and p.stats.sparse_calls > 0


@pytest.mark.parametrize("method, options, reason", [
    ("prune", {}, "cached at earlier steps"),
    ("window", {"share_steps": True}, "share_steps"),
    ("window", {"share_cfg": True}, "share_cfg"),
    ("sta", {"correction": "cached"}, "correction='cached'"),
    ("sparge", {"skip_threshold": 5.0}, "skip_threshold"),
])
def test_untrainable_methods_are_refused_at_patch_time(method, options, reason):
    model, _ = _model_and_inputs()
    with pytest.raises(OptionError, match=f"method '{method}' cannot run with trainable=True") as error:
        fastdit.patch(model, method, trainable=True, **options)
    assert reason in str(error.value)
    fastdit.patch(model, "sta").remove()  # nothing was installed: the model can be patched


def test_compiled_training_step_equals_eager():
    model, inputs = _model_and_inputs()
    twin = copy.deepcopy(model)
    results = []
    for m, compile_it in ((model, False), (twin, True)):
        with _patch(m, "sta", trainable=True):
            run = torch.compile(m, backend="aot_eager") if compile_it else m
            opt = torch.optim.SGD(m.parameters(), lr=0.1)
            loss = run(**inputs)[0].square().mean()
            loss.backward()
            opt.step()
            results.append((loss.detach(), [p.detach().clone() for p in m.parameters()]))
    (loss_e, params_e), (loss_c, params_c) = results
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-6, atol=1e-6)
    for a, b in zip(params_c, params_e):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
