"""``fastdit.attention``: one method on one attention call, outside any model.

The same code path as a patched layer (``Method.__call__`` with an ``AttentionContext``), so the
result equals what the patch computes for the same call. For users with their own models, the
attention benchmark and tests.
"""
from __future__ import annotations

import torch

from fastdit.context import AttentionContext, CallState
from fastdit.intercept import plain_sdpa
from fastdit.methods.base import OptionError, get_method

#: Method instances by (method, config): their plan caches survive across calls.
_INSTANCES = {}
_MAX_INSTANCES = 32


def _instance(method_cls, config):
    key = (method_cls, repr(config))
    method = _INSTANCES.get(key)
    if method is None:
        if len(_INSTANCES) >= _MAX_INSTANCES:
            _INSTANCES.pop(next(iter(_INSTANCES)))
        method = _INSTANCES[key] = method_cls(config)
    return method


def attention(q, k, v, method, config=None, *, layout, key_mask=None, step=0, num_steps=None, state=None,
              backend="auto", return_info=False, scale=None, layer=0, **options):
    """Run ``method`` on one attention call.

    Args:
        q, k, v: ``(B, H, S, D)`` in model token order (``k``/``v`` may have another length for
            token methods that allow it).
        method: a method name (``fastdit.method_names()``); ``config`` / ``options`` as for
            ``fastdit.patch`` (no model family: the method's generic defaults apply).
        layout: the ``TokenLayout`` of the call (``layout.seq_len == S``).
        key_mask: optional bool ``(B, S)``: False keys are never attended.
        step, num_steps: the denoising step of this call and the steps of the run; ``dense_steps``
            applies as in a patched pipeline (a fraction needs ``num_steps``).
        state: a dict kept by the caller across the calls of one layer (methods with per-layer
            state, e.g. caches across steps); None: a fresh dict.
        backend: ``"auto"``, ``"triton"`` or ``"torch"``.
        return_info: also return a dict: ``density`` (query-key score computations performed /
            dense attention's, over all heads), ``head_density`` (per head, a list), ``dense``
            (whether the call ran dense), ``plan`` (the block plan, or None) and, for block-sparse
            methods run with ``skip_threshold``, ``skipped_subtiles`` / ``walked_subtiles`` (int
            tensors per (batch, head): key sub-tiles the in-kernel skip rule skipped / looked at).
        scale: the softmax scale (default ``1/sqrt(D)``). layer: the layer index (``dense_layers``).

    Returns:
        ``(B, H, S, D)``, or ``(out, info)`` with ``return_info=True``.

    Example::

        layout = fastdit.TokenLayout((8, 30, 52))
        out, info = fastdit.attention(q, k, v, "sta", layout=layout, window=(3, 3, 3), return_info=True)
    """
    from fastdit.layout import TokenLayout

    if not isinstance(layout, TokenLayout):
        raise OptionError(f"layout must be a fastdit.TokenLayout, got {type(layout).__name__}")
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 4:
            raise ValueError(f"{name} must be a (B, H, S, D) tensor, got "
                             f"{tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__}")
    batch, heads, seq, _ = q.shape
    if seq != layout.seq_len:
        raise ValueError(f"q has {seq} tokens but the layout {layout.describe()} has {layout.seq_len}")
    if key_mask is not None and (key_mask.dtype != torch.bool or tuple(key_mask.shape) != (batch, k.shape[2])):
        raise ValueError(f"key_mask must be a bool tensor of shape ({batch}, {k.shape[2]}), got "
                         f"{key_mask.dtype} {tuple(key_mask.shape)}")
    out, ctx = run_call(q, k, v, method, config, layout=layout, key_mask=key_mask, step=step, num_steps=num_steps,
                        state=state, backend=backend, scale=scale, layer=layer, **options)
    if not return_info:
        return out
    return out, call_info(ctx, batch, heads, seq, k.shape[2])


def run_call(q, k, v, method, config=None, *, layout, key_mask=None, step=0, num_steps=None, state=None,
             backend="auto", scale=None, layer=0, **options):
    """``fastdit.attention`` without the argument checks: ``(out, ctx)``, the finished
    ``AttentionContext`` (``ctx.info`` says what ran, for counting without a host synchronisation).
    Shared with the vllm-omni plugin (``fastdit.integrations.vllm_omni``), so both compute the same."""
    heads = q.shape[1]
    method_cls = get_method(method)
    config = method_cls.resolve(method_cls.make_config(config, **options), None)
    instance = _instance(method_cls, config)
    instance.check_heads(heads)
    call = CallState(num_steps)
    call.rounds = int(step)
    if key_mask is not None and bool(key_mask.all()):
        key_mask = None
    attn_mask = None if key_mask is None else key_mask[:, None, None, :]
    ctx = AttentionContext(
        layer=layer, layer_name=f"layer{layer}", step=int(step), num_steps=num_steps, branch=0, layout=layout,
        call=call, local_layer=layer, key_mask=key_mask, query_mask=None, head_offset=0, num_heads=heads,
        total_heads=heads, scale=scale, state={} if state is None else state, backend=backend,
        dense_fn=lambda: plain_sdpa(q, k, v, attn_mask=attn_mask, scale=scale),
    )
    return instance(ctx, q, k, v), ctx


def call_info(ctx, batch, heads, seq, keys):
    """The ``info`` dict of ``fastdit.attention(..., return_info=True)`` for a finished call context."""
    plan = ctx.info.get("plan")
    total = float(seq) * keys
    if ctx.info.get("dense") or (plan is None and "performed" not in ctx.info):
        head_density = [1.0] * heads
    elif "performed" in ctx.info:  # token methods: whole-call counts (and per head, when they know them)
        density = float(ctx.info["performed"]) / float(ctx.info["total"])
        head_density = list(ctx.info.get("head_density") or [density] * heads)
    else:
        pairs = plan.pair_counts().double()  # (1|B, 1|H)
        head_density = (pairs.expand(batch, heads).mean(0) / total).tolist()
    info = {"density": sum(head_density) / heads, "head_density": head_density,
            "dense": bool(ctx.info.get("dense")), "plan": plan}
    for name in ("skipped_subtiles", "walked_subtiles"):
        if name in ctx.info:
            info[name] = ctx.info[name]
    return info
