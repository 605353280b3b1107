"""What a patched ComfyUI model runs: a diffusion-model wrapper and an attention override.

Both are ComfyUI's own extension points, set on the node's ``ModelPatcher.clone()`` (never on a
ComfyUI class or module):

* ``WrappersMP.DIFFUSION_MODEL`` wrapper (``ModelPatcher.add_wrapper_with_key``): around each
  forward of the diffusion model it reads the token grid off the model input ``x`` and the model's
  patch size (``families.ComfyFamily.geometry``), the text tokens of joint attention, and the step
  from the sampler's sigmas (``transformer_options["sigmas"]`` within
  ``transformer_options["sample_sigmas"]``: step ``i`` of ``len(sample_sigmas) - 1``), and publishes
  them to the attention calls of that forward (a context variable);
* ``transformer_options["optimized_attention_override"]``: ComfyUI's ``wrap_attn`` hands every
  attention call to it as ``(func, q, k, v, heads, mask=..., skip_reshape=..., transformer_options=...)``.
  Self / joint attention calls whose length is the forward's token count are the model's layers,
  numbered in call order (``dense_layers``, ``layer_settings`` and calibration files use that number); each
  runs ``fastdit.functional.run_call`` with the method's resolved config, a ``TokenLayout`` on
  ComfyUI's token order (text prefix / suffix included), the key mask ComfyUI passes (HunyuanVideo's
  text padding) and per (layer, CFG batch) state kept across the steps of one sampling run. Every
  other call (cross-attention, HunyuanVideo's text refiner, dense steps and layers, method
  ``dense``, masks that are not key masks, unknown steps, layers with more tokens than the grid and
  the text, e.g. added by another node's ``post_input`` patch) runs ComfyUI's own attention ``func``
  (or an override that was set before the node's) with its own arguments, unchanged.

``stats`` (a ``PatchStats``) counts every layer call: sparse, dense by design, and fallbacks with
their reasons (each reason warned once).
"""
from __future__ import annotations

import contextvars
import inspect
import threading
import warnings

import torch

from fastdit.calibration.calibration_file import CalibrationError, grid_reason
from fastdit.context import CallState
from fastdit.functional import run_call
from fastdit.layout import key_mask_from_attn_mask
from fastdit.stats import PatchStats

__all__ = ["WRAPPER_KEY", "FastditAttention", "step_of"]

#: The key of the node's wrapper in ComfyUI's wrapper registry.
WRAPPER_KEY = "fastdit_sparse_attention"
_ENGINE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_FORWARD = contextvars.ContextVar("fastdit_comfyui_forward", default=None)


def step_of(transformer_options):
    """``(step, num_steps)`` from ComfyUI's ``sigmas`` (this call) and ``sample_sigmas`` (the
    sampler's schedule, ``steps + 1`` values); ``(None, None)`` when either is missing or the sigma
    is not in the schedule."""
    sigmas, schedule = transformer_options.get("sigmas"), transformer_options.get("sample_sigmas")
    if sigmas is None or schedule is None:
        return None, None
    schedule = torch.as_tensor(schedule).detach().flatten().to("cpu", torch.float64)
    if schedule.numel() < 2:
        return None, None
    sigma = float(torch.as_tensor(sigmas).detach().flatten()[0])
    distance = (schedule - sigma).abs()
    index = int(distance.argmin())
    if float(distance[index]) > 1e-4 * max(1.0, abs(sigma)):
        return None, schedule.numel() - 1
    return index, schedule.numel() - 1


class _Forward:
    """What one forward of the diffusion model tells its attention calls."""

    def __init__(self, runtime, geometry, step, num_steps, branch):
        self.runtime, self.geometry, self.step, self.num_steps, self.branch = runtime, geometry, step, num_steps, branch
        self.layer = 0


class FastditAttention:
    """One node instance's method on one ComfyUI model (see the module docstring).

    Args:
        family: the model's ``ComfyFamily``; method: the method name; config: its resolved config
            (``Method.resolve`` with the family's defaults); previous: an attention override set on
            the model before the node's (dense calls go through it), or None; calibration: the
            calibration file's contents and path ``(contents, path)`` when the options came from
            one: a forward on a grid where its settings do not mean what they were calibrated for
            raises ``CalibrationError``.
    """

    def __init__(self, family, method, config, previous=None, calibration=None):
        self.family, self.method, self.config, self.previous = family, method, config, previous
        self.calibration = calibration
        self._grids_checked = set()
        self.stats = PatchStats()
        self._warned = set()
        self._lock = threading.Lock()
        self._states = {}
        self._run = None  # (schedule values, last step): a new sampling run clears the states

    def __deepcopy__(self, memo):  # ComfyUI deep-copies model_options on clone(): share, do not copy
        return self

    def __repr__(self):
        return f"<fastdit ComfyUI attention {self.method} on {self.family.label}>"

    # -- the DIFFUSION_MODEL wrapper ----------------------------------------------------------------
    def wrapper(self, executor, *args, **kwargs):
        try:
            bound = inspect.signature(executor.original).bind(*args, **kwargs)
            arguments = dict(bound.arguments)
        except TypeError:
            arguments = {}
        model = executor.class_obj
        options = arguments.get("transformer_options") or {}
        geometry = self.family.geometry(model, arguments)
        if self.calibration is not None and geometry.layout is not None:
            self._check_grid(geometry.layout.grid)
        step, num_steps = step_of(options)
        branch = tuple(options.get("cond_or_uncond") or ())
        self._new_step(options, step)
        token = _FORWARD.set(_Forward(self, geometry, step, num_steps, branch))
        try:
            return executor(*args, **kwargs)
        finally:
            _FORWARD.reset(token)

    def _check_grid(self, grid):
        if grid in self._grids_checked:
            return
        contents, path = self.calibration
        reason = grid_reason(contents, [grid])
        if reason is not None:
            raise CalibrationError(f"fastdit Sparse Attention: calibration file {path} cannot be applied to grid "
                                   f"{grid}: {reason}")
        self._grids_checked.add(grid)

    def _new_step(self, options, step):
        schedule = options.get("sample_sigmas")
        key = None if schedule is None else tuple(torch.as_tensor(schedule).detach().flatten().tolist())
        with self._lock:
            if self._run is None or self._run[0] != key or (step is not None and self._run[1] is not None
                                                              and step < self._run[1]):
                self._states = {}
            self._run = (key, step)

    # -- the attention override ---------------------------------------------------------------------
    def __call__(self, func, *args, **kwargs):
        forward = _FORWARD.get()

        def own():  # the call as ComfyUI made it: an override set before the node's, or its own attention
            return self.previous(func, *args, **kwargs) if self.previous is not None else func(*args, **kwargs)

        if forward is None or forward.runtime is not self or len(args) < 3:
            return own()
        q, k, v = args[:3]
        heads = args[3] if len(args) > 3 else kwargs.get("heads")
        mask = args[4] if len(args) > 4 else kwargs.get("mask")
        skip_reshape = kwargs.get("skip_reshape", False)
        seq_dim = 2 if skip_reshape else 1
        layout = forward.geometry.layout
        expected = layout.seq_len if layout is not None else None
        if k.shape[seq_dim] != q.shape[seq_dim] or heads is None:
            return own()  # cross-attention
        if expected is not None and q.shape[seq_dim] != expected:
            if q.shape[seq_dim] > layout.video_len:  # a layer with tokens the family's layout does not place
                return self._dense(own, f"self-attention over {q.shape[seq_dim]} tokens, but the grid {layout.grid} "
                                   f"and {layout.text_len} text tokens make {expected}", q, heads, skip_reshape)
            return own()  # shorter: not a layer of the token grid (HunyuanVideo's text refiner)
        if layout is None:
            return self._dense(own, forward.geometry.reason, q, heads, skip_reshape)
        layer = forward.layer
        forward.layer += 1
        if expected in forward.geometry.cross_lengths:
            return self._dense(own, f"text / image tokens as many as video tokens ({expected}): cross-attention "
                               "cannot be told from self-attention", q, heads, skip_reshape)
        size = _size(q, heads, skip_reshape)
        if self.method == "dense" or layer < (self.config.dense_layers or 0):
            self.stats.count_dense(size)
            return own()
        dense_steps = self.config.dense_steps or 0
        if dense_steps:
            if forward.step is None:
                return self._dense(own, "no sampler step (transformer_options has no sigmas within sample_sigmas): "
                                   f"dense_steps={dense_steps!r} needs it", q, heads, skip_reshape)
            call = CallState(forward.num_steps)  # the pipeline's rule: step i is dense iff i < the threshold
            call.rounds = forward.step
            if call.is_dense_step(dense_steps):
                self.stats.count_dense(size)
                return own()
        if q.dtype not in _ENGINE_DTYPES:
            return self._dense(own, f"{q.dtype} attention (the kernels take float16, bfloat16 and float32)", q,
                               heads, skip_reshape)
        qb, kb, vb = (_bhsd(t, heads, skip_reshape) for t in (q, k, v))
        if vb.shape[-1] != qb.shape[-1]:
            return self._dense(own, "value head_dim differs from the key's", q, heads, skip_reshape)
        key_mask, query_mask, ok = key_mask_from_attn_mask(mask, qb.shape[0], qb.shape[2], kb.shape[2])
        if not ok or query_mask is not None:
            return self._dense(own, "the attention mask is not a key (padding) mask", q, heads, skip_reshape)
        rest = {name: value for name, value in kwargs.items() if name not in ("heads", "mask", "skip_reshape",
                                                                             "skip_output_reshape")}

        def dense_bhsd():  # a layer_settings entry that runs dense: ComfyUI's own attention, (B, H, S, D)
            return func(qb, kb, vb, heads, mask=mask, skip_reshape=True, skip_output_reshape=True, **rest)

        with self._lock:
            state = self._states.setdefault((layer, forward.branch, qb.shape[0]), {})
        out, ctx = run_call(qb, kb, vb, self.method, self.config, layout=layout, key_mask=key_mask,
                            step=forward.step or 0, num_steps=forward.num_steps, state=state, layer=layer,
                            dense_fn=dense_bhsd)
        self.stats.count_call(ctx.info, size)
        out = out.to(q.dtype)
        if kwargs.get("skip_output_reshape", False):
            return out
        return out.transpose(1, 2).reshape(out.shape[0], out.shape[2], -1)

    def _dense(self, own, reason, q, heads, skip_reshape):
        self.stats.count_fallback(reason, _size(q, heads, skip_reshape))
        with self._lock:
            first = reason not in self._warned
            self._warned.add(reason)
        if first:
            warnings.warn(f"fastdit ComfyUI node ({self.method}): {reason}; running ComfyUI's attention", stacklevel=3)
        return own()


def _bhsd(t, heads, skip_reshape):
    """ComfyUI's attention input as ``(B, H, S, D)``: ``skip_reshape`` inputs already are; the
    others are ``(B, S, H * D)``."""
    if skip_reshape:
        return t
    batch, seq, width = t.shape
    return t.view(batch, seq, heads, width // heads).transpose(1, 2)


def _size(q, heads, skip_reshape):
    """Query-key scores of a self-attention call, ``B * H * S * S``."""
    seq = q.shape[2] if skip_reshape else q.shape[1]
    return q.shape[0] * heads * seq * seq
