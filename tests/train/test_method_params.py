"""A method's own trainable parameters (``Method.layer_module``, ``fastdit/calibration/method_params.py``).

A toy method registered here scales the model's attention per head by ``1 + w_h`` with ``w``
(zero-initialised) its per-layer parameter: the patch builds one per layer (never on the model),
``trainable=True`` trains it, ``save_method_params`` / ``fastdit.patch(..., method_params=)`` round
trip it, and a file for another method, model, option or grid is refused naming both.
"""
from dataclasses import dataclass

import pytest
import torch

import fastdit
from fastdit.calibration.calibration_file import CalibrationError
from fastdit.methods.base import Method, MethodConfig, option, register_method, unregister_method
from fastdit.calibration.method_params import FILE, method_parameters, save_method_params

from tiny_transformers import tiny_hunyuan, tiny_wan, wan_inputs


@dataclass
class ScaleConfig(MethodConfig):
    """Options of the toy."""

    tag: int = option(0, "an option the parameters depend on", range=(0, None), widget="number")


class HeadScale(Method):
    """The model's attention times ``1 + w_h`` per head (``w`` trainable, zero at first)."""

    name = "toy_head_scale"
    config_cls = ScaleConfig
    default_options = {"dense_steps": 0, "dense_layers": 0}

    def layer_module(self, heads, head_dim):
        module = torch.nn.Module()
        module.weight = torch.nn.Parameter(torch.zeros(heads))
        return module

    def layer_module_key(self):
        return {"tag": self.config.tag}

    def attend(self, ctx, q, k, v):
        out = ctx.dense()
        if ctx.params is None:
            return out
        w = ctx.params.weight[ctx.head_offset:ctx.head_offset + ctx.num_heads].to(out.dtype)
        return out * (1 + w)[None, :, None, None]


@pytest.fixture
def toy():
    register_method(HeadScale)
    try:
        yield HeadScale
    finally:
        unregister_method(HeadScale.name)


def _run(model, inputs):
    return model(**inputs).sample


def test_parameters_live_on_the_patch_train_and_round_trip(toy, tmp_path):
    model, inputs = tiny_wan(), wan_inputs(frames=5, height=6, width=6, batch=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        reference = _run(model, inputs)
    with fastdit.patch(model, "toy_head_scale", trainable=True) as p:
        params = method_parameters(p)
        assert len(params) == len(p.layers) and all(x.requires_grad for x in params)
        assert set(model.state_dict()) == set(before)  # nothing added to the model
        with torch.no_grad():
            assert torch.allclose(_run(model, inputs), reference, atol=1e-6)  # zero init: training-free form
        loss = _run(model, inputs).square().mean()
        loss.backward()
        assert all(x.grad is not None and x.grad.abs().sum() > 0 for x in params)
        with torch.no_grad():
            for i, x in enumerate(params):
                x.fill_(0.1 * (i + 1))
            trained = _run(model, inputs)
        path = save_method_params(p, tmp_path)
    assert path.name == FILE and not torch.allclose(trained, reference)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    with torch.no_grad():
        assert torch.equal(_run(model, inputs), reference)  # removed
        with fastdit.patch(model, "toy_head_scale", method_params=tmp_path) as p:
            assert not any(x.requires_grad for x in method_parameters(p))
            assert torch.allclose(_run(model, inputs), trained, atol=1e-6)


def test_parameters_for_another_model_option_or_grid_are_refused(toy, tmp_path):
    model, inputs = tiny_wan(), wan_inputs(frames=5, height=6, width=6, batch=1)
    with torch.no_grad(), fastdit.patch(model, "toy_head_scale") as p:
        _run(model, inputs)
        save_method_params(p, tmp_path)
    with pytest.raises(CalibrationError, match=r"options \{'tag': 0\}.*options \{'tag': 1\}"):
        fastdit.patch(model, "toy_head_scale", tag=1, method_params=tmp_path)
    assert not hasattr(model, "_fastdit_patch")  # a refused load leaves the model unpatched
    with pytest.raises(CalibrationError, match="model class 'WanTransformer3DModel'.*model class 'HunyuanVideo"):
        fastdit.patch(tiny_hunyuan(), "toy_head_scale", method_params=tmp_path)
    with pytest.raises(CalibrationError, match=r"grid\(s\) \[\(5, 3, 3\)\].*grid is \(5, 4, 3\)"):
        with torch.no_grad(), fastdit.patch(model, "toy_head_scale", method_params=tmp_path):
            _run(model, wan_inputs(frames=5, height=8, width=6, batch=1))
    with pytest.raises(CalibrationError, match="is not a file"):
        fastdit.patch(model, "toy_head_scale", method_params=tmp_path / "missing")
