"""Where fastdit meets the model: every attention call of a patched module, in one place.

All intercepted calls end in one custom op, ``fastdit::patched_attention`` (``torch.library``,
with a fake implementation): ``torch.compile`` sees one opaque node per attention call, and
everything else (the per-call context, the method, plan caches, the kernel, the statistics) runs
inside the op, outside any traced graph. Per-call information reaches the op through
``contextvars`` (``fastdit/context.py``), set by a forward pre-hook of the transformer that
``torch.compile`` does not trace (``torch.compiler.disable``: at most one graph break per
transformer call).

Diffusers has two attention styles, and each gets the route that costs ``torch.compile`` least:

* processors that call ``dispatch_attention_fn(..., backend=self._attention_backend)`` (Wan,
  HunyuanVideo, Flux, LTX, Cosmos, Qwen-Image, ...) get, on the processor instance, a backend of
  fastdit's own (``BackendRoute``): a private member of diffusers' backend enum registered for that
  one layer, whose function calls the op. No mode is active while the processor runs, so a
  compiled model has **no graph break per layer**. The route is feature-tested once per process
  (a diffusers that cannot dispatch to it gets the mode below);
* legacy processors that call ``torch.nn.functional.scaled_dot_product_attention`` directly
  (CogVideoX, Mochi, Allegro, PixArt, SD3) run inside ``with SDPAIntercept(...)``, a
  ``TorchFunctionMode`` entered by the module's instance-level ``forward`` (``AttentionForward``).
  A ``with`` block, not hooks that push and pop, so any exception (``KeyboardInterrupt``
  included) leaves the mode stack as it was. ``torch.compile`` traces it, but an active mode makes
  dynamo trace Python-level tensor methods (``Tensor.unflatten`` and friends), where it breaks the
  graph: about 4 breaks per layer (measured in BENCHMARKS.md).
"""
from __future__ import annotations

import contextvars
import math
import functools
import itertools
import weakref

import torch
from torch.overrides import TorchFunctionMode

_SDPA = torch.nn.functional.scaled_dot_product_attention
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")

#: patch id -> live Patch (the op finds its patch by this id; removed patches disappear).
_PATCHES = weakref.WeakValueDictionary()
_IDS = itertools.count(1)


def register_patch(patch):
    """Give ``patch`` an id the op can find it by."""
    patch_id = next(_IDS)
    _PATCHES[patch_id] = patch
    return patch_id


def unregister_patch(patch_id):
    _PATCHES.pop(patch_id, None)


def is_sdpa(func):
    return func is _SDPA or getattr(func, "__name__", "") == "scaled_dot_product_attention"


def sdpa_arguments(args, kwargs):
    """Normalise an SDPA call's arguments to a dict keyed by ``_SDPA_ARGS``."""
    call = dict(zip(_SDPA_ARGS, args))
    call.update(kwargs or {})
    call.setdefault("attn_mask", None)
    call.setdefault("dropout_p", 0.0)
    call.setdefault("is_causal", False)
    call.setdefault("scale", None)
    call.setdefault("enable_gqa", False)
    return call


def plain_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """``F.scaled_dot_product_attention`` with the call's own arguments (``enable_gqa`` passed only
    when set, for torch versions without it)."""
    extra = {"enable_gqa": True} if enable_gqa else {}
    return _SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, **extra)


@torch.library.custom_op("fastdit::patched_attention", mutates_args=())
def patched_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None,
                      dropout_p: float, is_causal: bool, scale: float | None, enable_gqa: bool, patch_id: int,
                      layer: int, head_offset: int = 0, shards: int = 1) -> torch.Tensor:
    """One intercepted attention call of patched layer ``layer`` of patch ``patch_id``.

    Under Ulysses context parallelism (``shards`` > 1) the call holds the heads ``head_offset ..``
    of the layer over the whole sequence, its tokens in shard order (see ``Patch.handle_call``)."""
    call = {"query": query, "key": key, "value": value, "attn_mask": attn_mask, "dropout_p": dropout_p,
            "is_causal": is_causal, "scale": scale, "enable_gqa": enable_gqa}
    _SEEN.set(_SEEN.get() + 1)
    patch = _PATCHES.get(patch_id)
    if patch is None:  # removed since this graph was compiled: the model's own attention
        out = plain_sdpa(**call)
    else:
        out = patch.handle_call(layer, call, lambda: plain_sdpa(**call), head_offset=head_offset, shards=shards)
    # Outputs of a custom op must be fresh, contiguous tensors (the fake says so).
    return out.contiguous()


@patched_attention.register_fake
def _patched_attention_fake(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, patch_id, layer,
                            head_offset=0, shards=1):
    return query.new_empty((*query.shape[:-1], value.shape[-1]))


class SDPAIntercept(TorchFunctionMode):
    """Routes SDPA calls to ``fastdit::patched_attention`` for one patched layer."""

    def __init__(self, patch_id, layer):
        super().__init__()
        self.patch_id = patch_id
        self.layer = layer

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not is_sdpa(func):
            return func(*args, **kwargs)
        call = sdpa_arguments(args, kwargs)
        q, k, v = call["query"], call["key"], call["value"]
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            return _with_grad(call, self.patch_id, self.layer)  # the op has no backward
        scale = call["scale"]
        return torch.ops.fastdit.patched_attention(
            q, k, v, call["attn_mask"], float(call["dropout_p"]), bool(call["is_causal"]),
            None if scale is None else float(scale), bool(call["enable_gqa"]), self.patch_id, self.layer,
        )


GRAD_FALLBACK = "gradients requested (patch with trainable=True to run the method with gradients)"


@torch.compiler.disable
def _with_grad(call, patch_id, layer, head_offset=0, shards=1):
    """A call that needs gradients: on a trainable patch the op's body without the op (custom ops
    are opaque to autograd; eager even under torch.compile, one graph break), else the model's own
    attention, one counted fallback. Either way the call reached fastdit (``_SEEN``)."""
    _SEEN.set(_SEEN.get() + 1)
    patch = _PATCHES.get(patch_id)
    if patch is None or not patch.trainable:
        if patch is not None:
            patch.stats.count_fallback(GRAD_FALLBACK)
        return plain_sdpa(**call)
    return patch.handle_call(layer, call, lambda: plain_sdpa(**call), head_offset=head_offset, shards=shards)


@torch.compiler.disable
def _note_fallback(patch_id, layer, reason):
    patch = _PATCHES.get(patch_id)
    if patch is not None:
        patch.stats.count_fallback(reason)


#: Attention calls that reached the op in this context (to notice calls that went around it).
_SEEN = contextvars.ContextVar("fastdit_seen_calls", default=0)


class AttentionForward:
    """Instance-level ``forward`` of one patched attention module: the module's own forward, run
    with ``SDPAIntercept`` entered (``mode=True``) or as it is (the processor routes to fastdit's
    backend). In eager mode it also notices a forward whose attention never reached fastdit (a
    processor that went around both routes) and counts it as a fallback. ``remove()`` puts the
    previous ``forward`` back."""

    def __init__(self, module, patch_id, layer, mode=True):
        self.module_ref = weakref.ref(module)
        missing = object()
        self._previous = module.__dict__.get("forward", missing)
        self._missing = missing
        self.original = module.forward
        self.patch_id = patch_id
        self.layer = layer
        self.mode = mode
        functools.update_wrapper(self, self.original)
        module.forward = self

    def __call__(self, *args, **kwargs):
        if torch.compiler.is_compiling():
            if self.mode:
                with SDPAIntercept(self.patch_id, self.layer):
                    return self.original(*args, **kwargs)
            return self.original(*args, **kwargs)
        seen = _SEEN.get()
        if self.mode:
            with SDPAIntercept(self.patch_id, self.layer):
                result = self.original(*args, **kwargs)
        else:
            result = self.original(*args, **kwargs)
        if _SEEN.get() == seen and not self._cache_hooked():
            _note_fallback(self.patch_id, self.layer, "the layer's attention did not go through SDPA or fastdit's "
                           "backend (another attention backend or a custom processor)")
        return result

    def _cache_hooked(self):
        """A diffusers hook on the module (``enable_cache``: PyramidAttentionBroadcast, FasterCache)
        may skip the attention and reuse its cached output: no call then is no fallback."""
        module = self.module_ref()
        registry = None if module is None else module.__dict__.get("_diffusers_hook")
        return bool(getattr(registry, "hooks", None))

    def remove(self):
        module = self.module_ref()
        if module is None:
            return
        if module.__dict__.get("forward") is not self:
            # Wrapped since by a diffusers hook (``enable_cache`` with PyramidAttentionBroadcast or
            # FasterCache hooks attention modules): unlink from its chain, so that removing the hook
            # later restores the module's own forward, not this one.
            self._unlink_from_diffusers_hooks(module)
            return
        if self._previous is self._missing:
            del module.__dict__["forward"]
        else:
            module.forward = self._previous

    def _unlink_from_diffusers_hooks(self, module):
        registry = module.__dict__.get("_diffusers_hook")
        for ref in getattr(registry, "_fn_refs", ()):
            for name in ("forward", "original_forward"):
                if getattr(ref, name, None) is self:
                    setattr(ref, name, self.original)


# ---------------------------------------------------------------------------------------------
# The backend route (processors that dispatch through diffusers' attention backends)
# ---------------------------------------------------------------------------------------------

def _backend_registry():
    try:
        from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry
    except ImportError:
        return None, None
    return AttentionBackendName, _AttentionBackendRegistry


def ring_refusal(where, reason):
    """The error for a method that does not run under ring attention (``reason`` says why)."""
    return ValueError(f"fastdit under ring attention ({where}): {reason}")


def _routed(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, patch_id, layer, head_offset=0,
            shards=1):
    """``(B, S, H, D)`` tensors in, through the op (or the model's own attention with gradients)."""
    q, k, v = (x.permute(0, 2, 1, 3) for x in (query, key, value))
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        out = _with_grad(dict(zip(_SDPA_ARGS, (q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa))),
                         patch_id, layer, head_offset, shards)
    else:
        out = torch.ops.fastdit.patched_attention(
            q, k, v, attn_mask, float(dropout_p), bool(is_causal), None if scale is None else float(scale),
            bool(enable_gqa), patch_id, layer, int(head_offset), int(shards),
        )
    return out.permute(0, 2, 1, 3)


def _ulysses_attention(patch_id, layer, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                       parallel_config):
    """Ulysses context parallelism through diffusers' own all-to-all (``TemplatedUlyssesAttention``):
    it hands each rank ``H / N`` heads over the whole sequence, whose tokens arrive in shard order
    (rank 0's local sequence, then rank 1's, ...); fastdit runs the method there, knowing which
    heads (``head_offset``) and how the sequence was sharded (``shards``)."""
    from diffusers.models.attention_dispatch import _native_attention_backward_op, _templated_context_parallel_attention

    cp = parallel_config.context_parallel_config
    if cp.ring_degree > 1:
        return _ring_attention(patch_id, layer, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                               cp)
    if getattr(cp, "ulysses_anything", False):
        raise ValueError("fastdit runs under Ulysses context parallelism with heads that divide evenly "
                         "(ulysses_anything=False); ulysses_anything=True is not supported")
    degree = cp.ulysses_degree
    if query.shape[2] % degree:
        raise ValueError(f"Ulysses degree {degree} does not divide the {query.shape[2]} attention heads")
    local_heads = query.shape[2] // degree
    offset = cp._ulysses_local_rank * local_heads

    def forward_op(_ctx, q, k, v, mask, p, causal, s, gqa, return_lse, _save_ctx=True, _parallel_config=None):
        if return_lse:
            raise ValueError("fastdit's Ulysses attention does not return the log-sum-exp")
        return _routed(q, k, v, mask, p, causal, s, gqa, patch_id, layer, offset, degree)

    return _templated_context_parallel_attention(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, False,
        forward_op=forward_op, backward_op=_native_attention_backward_op, _parallel_config=parallel_config,
    )


def _gather(tensor, group, dim):
    """Every rank's ``tensor`` of ``group``, joined along ``dim`` in rank order."""
    parts = [torch.empty_like(tensor) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts, dim)


def _ring_attention(patch_id, layer, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, cp):
    """Ring attention (``ring_degree > 1``), after diffusers' Ulysses all-to-all when
    ``ulysses_degree > 1`` too (USP, as ``_templated_unified_attention``): fastdit's own ring
    (``fastdit.methods.parallel.ring``) over the rank's heads, ``(B, S, H, D)`` in and out."""
    from diffusers.models.attention_dispatch import SeqAllToAllDim

    patch = _PATCHES.get(patch_id)
    if patch is None or dropout_p or is_causal or enable_gqa:
        raise ValueError("fastdit under ring attention runs the patched layers' own calls (no dropout, causal or GQA)")
    local_len, ulysses = query.shape[1], cp.ulysses_degree
    if ulysses > 1:
        if query.shape[2] % ulysses:
            raise ValueError(f"Ulysses degree {ulysses} does not divide the {query.shape[2]} attention heads")
        group = cp._ulysses_mesh.get_group()
        query, key, value = (SeqAllToAllDim.apply(group, x, 2, 1) for x in (query, key, value))
    if attn_mask is not None and attn_mask.shape[-1] == local_len:  # each rank's mask covers its own keys
        attn_mask = _gather(attn_mask, cp._flattened_mesh.get_group(), -1)
    q, k, v = (x.permute(0, 2, 1, 3) for x in (query, key, value))
    out = _ring_call(patch, layer, q, k, v, attn_mask, scale, cp._ulysses_local_rank * q.shape[1], cp)
    out = out.permute(0, 2, 1, 3)
    return SeqAllToAllDim.apply(group, out, 1, 2) if ulysses > 1 else out


def _ring_call(patch, layer, q, k, v, attn_mask, scale, head_offset, cp):
    """One ring call on ``(B, H, L, D)`` local tensors (``L``: this ring rank's tokens): the method's
    plan over the whole sequence (dynamic methods select from the gathered q / k / v in model order,
    so exactly as in one process), then one ring step per key shard (``ring_attend``)."""
    from fastdit.layout import key_mask_from_attn_mask
    from fastdit.methods.base import Method
    from fastdit.methods.parallel import ring_attend, ring_refusal as refusal, ring_shards
    from fastdit.methods.parallel.ring_guard import RingCall, ring_guarded_call

    _SEEN.set(_SEEN.get() + 1)  # reached fastdit (not through the op: the ring's collectives run here)
    ring, rank, ulysses = cp.ring_degree, cp._ring_local_rank, cp.ulysses_degree
    where = f"ring_degree={ring}, ulysses_degree={ulysses}"
    method = patch.method_instance
    if refusal(method) is not None:
        raise ring_refusal(where, refusal(method))
    batch, heads, local, _ = q.shape
    seq = local * ring
    info = patch.transformer_call_of(layer)
    if info is None or info.grid is None:
        raise ValueError(f"fastdit under ring attention ({where}) needs the call's token grid, and this call has none")
    layout = patch.call_layout(layer, info, seq)
    shards = ring_shards(layout, ring, ulysses)
    if shards is None:
        raise ValueError(f"{where}: diffusers cuts each stream into ring_degree x ulysses_degree = {ring * ulysses} "
                         f"equal chunks, which {layout.describe()} does not allow (each stream's length must divide "
                         f"by {ring * ulysses})")
    key_mask, query_mask, ok = key_mask_from_attn_mask(attn_mask, batch, seq, seq)
    if not ok or query_mask is not None:
        raise ValueError(f"fastdit under ring attention ({where}) takes a key mask (B, 1, 1, S) only")
    group = cp._ring_mesh.get_group()
    k_all, v_all = _gather(k, group, 2), _gather(v, group, 2)  # call order: ring rank 0's tokens, then 1's, ...
    shard, position = (t.to(q.device) for t in shards)
    order = shard * local + position  # call position of each model-order token

    def dense():
        return plain_sdpa(q, k_all, v_all, None if key_mask is None else key_mask[:, None, None, :], scale=scale)

    ctx = patch.call_context(layer, info, layout, query_mask=None, scale=scale, dense_fn=dense,
                             key_mask=None if key_mask is None else key_mask.index_select(1, order),
                             head_offset=head_offset, num_heads=heads, total_heads=heads * ulysses)
    variant = None if method.is_dense_call(ctx) else method.layer_method(ctx.step, ctx.layer)[1]
    plan = q_all = None
    if variant is not None and type(variant).select is Method.select:  # a static plan
        plan = variant.select(ctx, q, k)
    elif variant is not None:  # a dynamic selection: from the whole sequence, in model order
        q_all, k_model = (t.index_select(2, order) for t in (_gather(q, group, 2), k_all))
        ctx.info["values"] = v_all.index_select(2, order)
        try:
            plan = variant.select(ctx, q_all, k_model)
        finally:
            ctx.info.pop("values", None)
    if plan is None:
        ctx.info["dense"] = True
        out = dense()
    else:
        ctx.record(plan=plan)

        def key_shard(s):
            part = slice(s * local, (s + 1) * local)
            return k_all[:, :, part], v_all[:, :, part], None if key_mask is None else key_mask[:, part]

        out, lse, steps, skipped, pairs = ring_attend(plan, q, key_shard, shard, position, rank, ring, scale,
                                                      patch.backend)
        out = out.to(q.dtype)
        patch.stats.count_ring(steps, skipped, pairs)
        if variant.guarded(ctx):  # the quality guard, deciding as one process (methods/parallel/ring_guard.py)
            call = RingCall(group, rank, ring, shard, position, k_all, v_all, key_mask, patch.backend,
                            patch.stats.count_ring, q_all)
            out = ring_guarded_call(variant, ctx, q, out, lse, call)
    patch.stats.count_call(ctx.info, batch * heads * local * seq)
    return out


def _route_function(patch_id, layer):
    """The backend function of one layer: diffusers passes ``(B, S, H, D)`` tensors."""

    def fastdit_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                          enable_gqa=False, _parallel_config=None):
        if _parallel_config is not None and _parallel_config.context_parallel_config is not None:
            return _ulysses_attention(patch_id, layer, query, key, value, attn_mask, dropout_p, is_causal, scale,
                                      enable_gqa, _parallel_config)
        return _routed(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, patch_id, layer)

    return fastdit_attention


class BackendRoute:
    """A backend of fastdit's own for one patched layer, set on its processor instance.

    Diffusers looks backends up by members of its ``AttentionBackendName`` enum; a private member
    (an instance of the enum that is not one of its named members, so no user can select it by
    name) keyed to this layer is registered with the layer's function and removed again by
    ``remove()``. The processor's ``_attention_backend`` is set to it (and restored by the patch).
    """

    def __init__(self, patch_id, layer):
        names, registry = _backend_registry()
        value = f"fastdit_p{patch_id}_l{layer}"
        member = str.__new__(names, value)
        member._name_, member._value_ = value.upper(), value
        # Context-parallel capable: under Ulysses the function runs the method on its rank's heads.
        registry.register(member, supports_context_parallel=True)(_route_function(patch_id, layer))
        self.member = member

    def remove(self):
        _, registry = _backend_registry()
        for table in (registry._backends, registry._constraints, registry._supported_arg_names):
            table.pop(self.member, None)
        registry._supports_context_parallel.discard(self.member.value)


_ROUTE_WORKS = None


def backend_route_available():
    """Whether this diffusers dispatches to a private backend member (feature-tested once)."""
    global _ROUTE_WORKS
    if _ROUTE_WORKS is None:
        _ROUTE_WORKS = False
        names, registry = _backend_registry()
        if names is not None:
            try:
                from diffusers.models.attention_dispatch import dispatch_attention_fn

                route = BackendRoute(0, -1)
                try:
                    x = torch.zeros(1, 2, 1, 4)
                    out = dispatch_attention_fn(x, x, x, backend=route.member)
                    _ROUTE_WORKS = tuple(out.shape) == (1, 2, 1, 4)
                finally:
                    route.remove()
            except Exception:  # noqa: BLE001 - any failure means: use the mode instead
                _ROUTE_WORKS = False
    return _ROUTE_WORKS


def check_parallelism(transformer, method):
    """Refuse, at patch time, ring attention with a method that does not run under it."""
    from fastdit.methods.parallel import ring_refusal as reason

    parallel = getattr(transformer, "_parallel_config", None)
    cp = getattr(parallel, "context_parallel_config", None)
    if cp is not None and getattr(cp, "ring_degree", 1) > 1 and reason(method) is not None:
        raise ring_refusal(f"{type(transformer).__name__} has ring_degree={cp.ring_degree}", reason(method))


def check_ring_split(transformer, grid, kwargs):
    """Before a ring-parallel forward (``ring_degree > 1``): diffusers cuts each stream it splits into
    ``ring_degree * ulysses_degree`` equal chunks (``EquipartitionSharder`` asserts it); say so
    clearly, naming the stream, before any block runs."""
    cp = getattr(getattr(transformer, "_parallel_config", None), "context_parallel_config", None)
    if cp is None or getattr(cp, "ring_degree", 1) <= 1:
        return
    degree = cp.ring_degree * cp.ulysses_degree
    split = {name for entry in getattr(transformer, "_cp_plan", {}).values() if isinstance(entry, dict)
             for name in entry}
    text = kwargs.get("encoder_hidden_states") if "encoder_hidden_states" in split else None
    streams = [("video", math.prod(grid))] + ([("text", text.shape[1])] if isinstance(text, torch.Tensor) else [])
    for name, length in streams:
        if length % degree:
            raise ValueError(f"ring_degree={cp.ring_degree} x ulysses_degree={cp.ulysses_degree}: diffusers cuts every "
                             f"sequence stream into {degree} equal chunks, and the {length} {name} tokens of this call "
                             f"(grid {tuple(grid)}) do not divide by {degree}; choose degrees whose product divides it")


def check_backend(backend, transformers):
    """Refuse a ``backend`` that is unknown, or ``"triton"`` where Triton cannot run the models' device."""
    from fastdit.kernels import BACKENDS, available_backends
    from fastdit.methods.base import OptionError

    if not isinstance(backend, str) or backend not in BACKENDS:
        raise OptionError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend != "triton":
        return
    if "triton" not in available_backends():
        raise ValueError("backend='triton' needs the triton package (Linux); use backend='auto' or 'torch'")
    for _, transformer in transformers:
        param = next(transformer.parameters(), None)
        if param is not None and "triton" not in available_backends(param.device):
            raise ValueError(f"backend='triton' but the model is on {param.device.type}: Triton runs on CUDA GPUs "
                             "(or on the CPU with TRITON_INTERPRET=1 set before fastdit is imported); use "
                             "backend='auto' or 'torch'")
