"""``fastdit.attention``: one method on one attention call, outside any model.

The same code path as a patched layer (``Method.__call__`` with an ``AttentionContext``), so the
result equals what the patch computes for the same call. For users with their own models, the
attention benchmark and tests.
"""
from __future__ import annotations

import torch

from fastdit.context import new_context
from fastdit.intercept import plain_sdpa
from fastdit.methods.base import OptionError, get_method, method_names, step_inputs_needed

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
              backend="auto", return_info=False, scale=None, layer=0, timestep=None, **options):
    """Run ``method`` on one attention call.

    Args:
        q, k, v: ``(B, H, S, D)`` in model token order. ``k``/``v`` may have another length than
            ``q`` only for methods that take it (``dense``, ``prune``: ``Method.any_key_length``);
            the others lay keys out on the queries' grid and refuse it with a ValueError.
        method: a method name (``fastdit.method_names()``); ``config`` / ``options`` as for
            ``fastdit.patch`` (no model family: the method's generic defaults apply).
        layout: the ``TokenLayout`` of the call (``layout.seq_len == S``).
        key_mask: optional bool ``(B, S)``: False keys are never attended.
        step, num_steps: the denoising step of this call and the steps of the run; ``dense_steps``
            applies as in a patched pipeline when passed (a fraction needs ``num_steps``).
            Outside a pipeline the defaults that need a step or layer position do not apply:
            ``dense_steps`` and ``dense_layers`` left unset are 0 here (the call runs sparse), not
            the method's or a family's pipeline defaults.
        state: a dict kept by the caller across the calls of one layer (methods with per-layer
            state, e.g. caches across steps); None: a fresh dict.
        backend: ``"auto"``, ``"triton"`` or ``"torch"``.
        return_info: ``True`` or ``"mass"``: also return a dict: ``density`` (query-key score computations performed /
            dense attention's, over all heads), ``head_density`` (per head, a list), ``dense``
            (whether the call ran dense), ``plan`` (the block plan, or None) and, for block-sparse
            methods run with ``skip_threshold``, ``skipped_subtiles`` / ``walked_subtiles`` (int
            tensors per (batch, head): key sub-tiles the in-kernel skip rule skipped / looked at),
            ``guard``: what the quality guard saw and did (when it ran; see ``fastdit/methods/guard.py``):
            per head ``error`` (estimated relative L2 error), ``kept_mass``, ``action`` (``"pass"``,
            ``"widened"``, ``"dense"``, ``"nonfinite"``) and ``levels``, plus ``rows`` (sampled per
            head), ``bound``, ``promise``, ``extra_density`` (the guard's own work over the call's dense
            work) and ``seconds``; ``head_density`` counts a head the guard ran dense as 1,
            ``lse``: float32 ``(B, H, S)``, per query row in model token order the log-sum-exp
            ``log sum_j exp(scale q . k_j)`` over the keys the call computed (every valid key on a
            dense call; ``-inf`` for a row with none), None for token methods (they attend reduced
            or cached tokens, not a subset of the scores), and ``kept_mass``: None, or with
            ``return_info="mass"`` a float list per head, the mean over batch and query rows (rows
            with a valid key) of the fraction of the true softmax mass the call kept,
            ``exp(lse - lse_dense)``, with ``lse_dense`` computed exactly (float32, or float64 for
            float64 inputs) by ``dense_lse``: a dense pass of scores, so only when asked.
        scale: the softmax scale (default ``1/sqrt(D)``). layer: the layer index (``dense_layers``).
        timestep: the call's denoising timestep (a number or tensor, as the transformer gets it), for
            methods whose per-step randomness is keyed to it (optiprune); None: keyed to ``step``.

    Returns:
        ``(B, H, S, D)``, or ``(out, info)`` with ``return_info=True``.

    Example::

        layout = fastdit.TokenLayout((8, 30, 52))
        out, info = fastdit.attention(q, k, v, "sta", layout=layout, window=(3, 3, 3), return_info=True)
    """
    from fastdit.layout import TokenLayout

    if return_info not in (False, True, "mass"):
        raise ValueError(f"return_info must be False, True or 'mass' (also report the kept softmax mass), "
                         f"got {return_info!r}")
    if not isinstance(layout, TokenLayout):
        raise OptionError(f"layout must be a fastdit.TokenLayout, got {type(layout).__name__}")
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 4:
            raise ValueError(f"{name} must be a (B, H, S, D) tensor, got "
                             f"{tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__}")
    batch, heads, seq, _ = q.shape
    if seq != layout.seq_len:
        raise ValueError(f"q has {seq} tokens but the layout {layout.describe()} has {layout.seq_len}")
    method_cls = get_method(method)
    if k.shape[:3] != v.shape[:3] or k.shape[:2] != q.shape[:2]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} must share batch and heads, "
                         "and k and v their length")
    if k.shape[2] != seq and not method_cls.any_key_length:
        takes = sorted(name for name in method_names() if get_method(name).any_key_length)
        raise ValueError(f"method {method_cls.name!r} needs as many keys as queries (it lays keys out on the queries' "
                         f"token grid): got {seq} queries and {k.shape[2]} keys; methods that take another key "
                         f"length: {takes}")
    if key_mask is not None and (key_mask.dtype != torch.bool or tuple(key_mask.shape) != (batch, k.shape[2])):
        raise ValueError(f"key_mask must be a bool tensor of shape ({batch}, {k.shape[2]}), got "
                         f"{key_mask.dtype} {tuple(key_mask.shape)}")
    if return_info == "mass" and not method_cls.reports_lse:
        why = ("its output adds another branch to the block-sparse one, so it is not one softmax over the "
               "computed scores") if method_cls.block_sparse else "a token method: it attends reduced or cached tokens"
        raise ValueError(f"return_info='mass' needs the log-sum-exp of the computed scores, which method "
                         f"{method_cls.name!r} does not have ({why}); use return_info=True")
    # No pipeline here: a default dense_steps (a fraction of a run) or dense_layers (a layer position)
    # would silently make the call dense or fail; only what the caller asks for applies (where="call").
    config = method_cls.resolve(config, None, options=options, where="call")
    if step_inputs_needed(config)[1] and num_steps is None:
        raise OptionError(f"dense_steps={config.dense_steps} is a fraction of the denoising steps: pass num_steps= "
                          "(and step=) to fastdit.attention, or dense_steps as an int count")
    out, ctx = run_call(q, k, v, method, config, layout=layout, key_mask=key_mask, step=step, num_steps=num_steps,
                        state=state, backend=backend, scale=scale, layer=layer, timestep=timestep)
    if not return_info:
        return out
    info = call_info(ctx, batch, heads, seq, k.shape[2])
    info["lse"] = info["kept_mass"] = None
    if method_cls.reports_lse:
        dense = None
        if "lse" in ctx.info:
            info["lse"] = ctx.info["lse"]
        else:  # a dense call (dense step / layer, or a layout the method runs densely)
            info["lse"] = dense = dense_lse(q, k, key_mask, scale)
        if return_info == "mass":
            dense = dense_lse(q, k, key_mask, scale) if dense is None else dense
            info["kept_mass"] = kept_mass(info["lse"], dense)
    return out, info


def run_call(q, k, v, method, config=None, *, layout, key_mask=None, step=0, num_steps=None, state=None,
             backend="auto", scale=None, layer=0, timestep=None, dense_fn=None, **options):
    """``fastdit.attention`` without the argument checks: ``(out, ctx)``, the finished
    ``AttentionContext`` (``ctx.info`` says what ran, for counting without a host synchronisation).
    Shared with the vllm-omni plugin (``fastdit.integrations.vllm_omni``) and the ComfyUI node
    (``fastdit.integrations.comfyui``), so all compute the same; defaults are resolved by
    ``Method.resolve`` for one call (``where="call"``: a config the caller resolved passes through
    unchanged). ``dense_fn``: what a dense layer / step / ``layer_settings`` entry runs, ``() ->
    (B, H, S, D)`` (the host's own attention); default: dense SDPA with ``key_mask``."""
    heads = q.shape[1]
    method_cls = get_method(method)
    config = method_cls.resolve(config, None, options=options, where="call")
    instance = _instance(method_cls, config)
    instance.check_heads(heads)
    if key_mask is not None and bool(key_mask.all()):
        key_mask = None
    attn_mask = None if key_mask is None else key_mask[:, None, None, :]
    ctx = new_context(
        layer=layer, step=step, num_steps=num_steps, layout=layout, key_mask=key_mask, num_heads=heads,
        scale=scale, state={} if state is None else state, backend=backend,
        dense_fn=dense_fn or (lambda: plain_sdpa(q, k, v, attn_mask=attn_mask, scale=scale)), timestep=timestep,
    )
    return instance(ctx, q, k, v), ctx


#: Score entries (float32) one chunk of ``dense_lse`` holds at once.
LSE_BUDGET = 1 << 25


def dense_lse(q, k, key_mask=None, scale=None):
    """Exact log-sum-exp of dense attention's scaled scores, ``(B, H, S)`` float32 (float64 for
    float64 inputs), in chunks of query rows; keys with ``key_mask`` False are left out."""
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    scale = 1.0 / (q.shape[-1] ** 0.5) if scale is None else scale
    batch, heads, seq, _ = q.shape
    keys = k.to(dtype).transpose(-1, -2)
    bias = None
    if key_mask is not None:
        bias = torch.zeros(batch, 1, 1, k.shape[2], dtype=dtype, device=q.device).masked_fill(
            ~key_mask.to(device=q.device, dtype=torch.bool)[:, None, None, :], float("-inf"))
    out = torch.empty(batch, heads, seq, dtype=dtype, device=q.device)
    chunk = max(1, LSE_BUDGET // max(1, batch * heads * k.shape[2]))
    for start in range(0, seq, chunk):
        scores = (q[:, :, start:start + chunk].to(dtype) @ keys) * scale
        if bias is not None:
            scores = scores + bias
        out[:, :, start:start + chunk] = torch.logsumexp(scores, dim=-1)
    return out


def kept_mass(lse, lse_dense):
    """Per head (a float list): the mean over batch and query rows of ``exp(lse - lse_dense)``,
    the fraction of the true softmax mass a call kept; rows without a valid key are left out."""
    live = torch.isfinite(lse_dense)
    fraction = torch.exp(lse.to(lse_dense.dtype) - torch.where(live, lse_dense, torch.zeros_like(lse_dense)))
    fraction = torch.where(live, fraction.nan_to_num(0.0), torch.zeros_like(fraction)).double()
    rows = live.double().sum((0, 2)).clamp_min(1.0)
    return (fraction.sum((0, 2)) / rows).tolist()


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
    guard = ctx.info.get("guard")
    if guard is not None and not guard["nonfinite"]:  # heads the guard re-ran: what was computed in the end
        head_density = [d if final is None else final for final, d in zip(guard["head_density"], head_density)]
    info = {"density": sum(head_density) / heads, "head_density": head_density,
            "dense": bool(ctx.info.get("dense")), "plan": plan}
    for name in ("skipped_subtiles", "walked_subtiles", "guard", "reuse"):
        if name in ctx.info:
            info[name] = ctx.info[name]
    return info
