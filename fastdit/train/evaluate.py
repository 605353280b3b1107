"""How close the sparse model is to the dense one: before and after ``train_lora``.

* ``video_fidelity``: PSNR / SSIM (``fastdit.eval.metrics``) of the sparse pipeline's decoded
  videos against the dense pipeline's (no adapter, no patch) on held-out prompts and seeds.
* ``layer_errors``: per patched attention layer, ``||A_sparse - A_dense|| / ||A_dense||`` of the
  attention modules' outputs in one transformer call on a held-out sample: the dense base model
  (adapter off, no patch) against the sparse model (patched, adapter as it is).

* ``output_error``: ``mean ||F_sparse - F_dense||^2 / mean ||F_dense||^2`` of the transformer's
  output (the distillation objective, relative) on held-out samples (``make_samples`` of other
  prompts and seeds).

Density is the patch's ``stats.sparse_density`` of the same runs (reported beside, so that a
gain cannot come from a denser mask).
"""
from __future__ import annotations

import contextlib

import numpy as np
import torch

from .recipe import training_options


@contextlib.contextmanager
def adapters_off(transformer):
    """The base model: the LoRA adapter disabled inside the block (if there is one)."""
    has = bool(getattr(transformer, "_hf_peft_config_loaded", False))
    if has:
        transformer.disable_adapters()
    try:
        yield
    finally:
        if has:
            transformer.enable_adapters()


def _videos(pipe, prompts, seeds, call_kwargs):
    out = []
    with torch.no_grad():
        for prompt in prompts:
            for seed in seeds:
                frames = pipe(prompt=prompt, **call_kwargs, output_type="np",
                              generator=torch.Generator().manual_seed(seed)).frames[0]
                out.append(np.asarray(frames, dtype=np.float32))
    return out


def dense_videos(pipe, prompts, seeds, call_kwargs):
    with adapters_off(pipe.transformer):
        return _videos(pipe, prompts, seeds, call_kwargs)


def video_fidelity(pipe, dense, prompts, seeds, call_kwargs, method, options, backend="auto", method_params=None):
    """``{"psnr", "ssim", "density"}`` (means over the videos) of the patched pipeline against
    ``dense`` (``dense_videos`` of the same prompts and seeds); ``method_params``: the method's
    trained parameters (``fastdit.patch(..., method_params=)``), None for its training-free form.
    The quality guard is off unless ``options`` set it, as in ``layer_errors`` / ``output_error`` and
    in training: its dense re-runs of failing heads would be measured instead of the method."""
    import fastdit
    from fastdit.eval.metrics.fidelity import psnr, ssim

    options = {"guard": False, **options}
    with fastdit.patch(pipe, method, backend=backend, method_params=method_params, **options) as p:
        sparse = _videos(pipe, prompts, seeds, call_kwargs)
        density = p.stats.sparse_density
    return {"psnr": float(np.mean([psnr(a, b) for a, b in zip(sparse, dense)])),
            "ssim": float(np.mean([ssim(a, b) for a, b in zip(sparse, dense)])), "density": density}


def _attention_outputs(transformer, sample, names):
    captured, hooks = {}, []
    modules = dict(transformer.named_modules())
    for name in names:
        hooks.append(modules[name].register_forward_hook(
            lambda m, a, o, name=name: captured.__setitem__(name, (o[0] if isinstance(o, tuple) else o).detach())))
    try:
        with torch.no_grad():
            transformer(hidden_states=sample["hidden_states"], timestep=sample["timestep"],
                        encoder_hidden_states=sample["encoder_hidden_states"], return_dict=False)
    finally:
        for h in hooks:
            h.remove()
    return captured


def layer_errors(transformer, sample, method, options, backend="auto", method_params=None):
    """``{layer name: relative error}`` of each patched attention layer's output (module docstring)."""
    import fastdit

    options = training_options(transformer, method, options)[0]  # a bare transformer: no denoising steps
    with fastdit.patch(transformer, method, backend=backend, method_params=method_params, **options) as p:
        names = list(p.layers)
        sparse = _attention_outputs(transformer, sample, names)
    with adapters_off(transformer):
        dense = _attention_outputs(transformer, sample, names)
    return {n: float((sparse[n].float() - dense[n].float()).norm() / dense[n].float().norm().clamp_min(1e-12))
            for n in names}


def output_error(transformer, samples, method, options, backend="auto", method_params=None):
    """Relative squared error of the patched transformer's output against the dense targets of
    ``samples`` (module docstring)."""
    import fastdit

    err = ref = 0.0
    options = training_options(transformer, method, options)[0]  # a bare transformer: no denoising steps
    patch = fastdit.patch(transformer, method, backend=backend, method_params=method_params, **options)
    with patch, torch.no_grad():
        for s in samples:
            pred = transformer(hidden_states=s["hidden_states"], timestep=s["timestep"],
                               encoder_hidden_states=s["encoder_hidden_states"], return_dict=False)[0]
            err += float((pred.float() - s["target"].float()).square().mean())
            ref += float(s["target"].float().square().mean())
    return err / max(ref, 1e-30)
