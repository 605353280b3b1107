"""``fastdit.patch``: replace the attention of a diffusers DiT pipeline in one line, reversibly.

Everything is instance-level: forward hooks on the transformer and on each patched attention
module, the processors' ``_attention_backend`` pinned to ``"native"`` on those instances, and
instance attributes wrapping the scheduler's ``set_timesteps`` / ``step``. No class attribute
changes and no upstream ``forward`` is copied; ``remove()`` undoes each of these.

Per attention call: the layout (video grid from the transformer's input, text tokens from the
sequence length), the key mask (from the model's attention mask), then either the model's own
dense attention (dense steps, dense layers, the ``"dense"`` method) or the method's block plan run
through ``fastdit.kernels.block_sparse_attention``.
"""
from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass, field

import torch

from fastdit.intercept import ModuleInterceptor
from fastdit.layout import TokenLayout
from fastdit.methods import get_method
from fastdit.plan import run_plan
from fastdit.steps import StepTracker

_MARK = "_fastdit_patch"


class AlreadyPatchedError(RuntimeError):
    """The model is already patched by fastdit; call ``remove()`` on the existing patch first."""


@dataclass
class LayerRecord:
    """What one patched layer did in its latest call."""

    layout: TokenLayout
    dense: bool
    plan: object = None
    key_mask: torch.Tensor | None = None
    num_heads: int = 0
    query_mask: torch.Tensor | None = None


@dataclass
class PatchStats:
    """Counters over the patch's lifetime (reset with ``Patch.reset_stats``)."""

    dense_calls: int = 0
    sparse_calls: int = 0
    fallback_calls: int = 0
    plans_built: int = 0
    plan_names: set = field(default_factory=set)
    density_sum: float = 0.0
    padding_fraction: float = 0.0  # the largest padding of any plan used

    @property
    def mean_density(self):
        """Block density averaged over sparse calls (1.0 when none ran)."""
        return self.density_sum / self.sparse_calls if self.sparse_calls else 1.0

    def count_sparse_call(self, plan):
        self.sparse_calls += 1
        self.density_sum += plan.density
        self.padding_fraction = max(self.padding_fraction, plan.padding_fraction)
        self.plan_names.add(plan.name)


def key_mask_from_attn_mask(attn_mask, batch, q_len, k_len):
    """Read the model's attention mask as key (and query) validity.

    Returns ``(key_mask, query_mask, ok)``: bool ``(B, Nk)`` / ``(B, Nq)`` or None when all
    True. Two forms are understood: a key mask broadcast over queries (``(B, 1, 1, Nk)``, e.g.
    HunyuanVideo's text padding) and an outer product ``valid[q] & valid[k]`` (HunyuanVideo 1.5),
    whose fully masked query rows come out as 0, as in torch's attention. ``ok`` is False for any
    other mask (one that varies with the head, a float bias other than 0 / -inf-like, a
    block-causal mask): the block engine does not express it and the call runs the model's own
    attention.
    """
    if attn_mask is None:
        return None, None, True
    mask = attn_mask
    if mask.dtype != torch.bool:
        if not torch.is_floating_point(mask):
            return None, None, False
        zero, blocked = mask == 0, mask <= -1e4
        if not bool((zero | blocked).all()):
            return None, None, False
        mask = zero
    while mask.dim() < 4:
        mask = mask.unsqueeze(0) if mask.dim() < 2 else mask.unsqueeze(1)
    if mask.shape[1] > 1:
        if not bool((mask == mask[:, :1]).all()):
            return None, None, False
        mask = mask[:, :1]
    mask = mask[:, 0].expand(batch, mask.shape[2], k_len)  # (B, Nq or 1, Nk)
    if mask.shape[1] == 1:
        key_mask, query_mask = mask[:, 0], None
    else:
        key_mask, query_mask = mask.any(dim=1), mask.any(dim=2)
        if not bool((mask == (query_mask[:, :, None] & key_mask[:, None, :])).all()):
            return None, None, False
    key_mask = None if bool(key_mask.all()) else key_mask.contiguous()
    query_mask = None if query_mask is None or bool(query_mask.all()) else query_mask.contiguous()
    return key_mask, query_mask, True


class Patch:
    """A live patch of one pipeline (or transformer). Use ``remove()`` or a ``with`` block.

    Attributes:
        method: the method name. config: its resolved config. family: the adapter's family.
        layers: names of the patched attention modules, in model order.
        stats: ``PatchStats`` counters.
    """

    def __init__(self, target, method, config, adapter, transformers, scheduler, record_masks, backend):
        self.target = target
        self._method = method
        self.method = method.name
        self.config = config
        self.adapter = adapter
        self.family = adapter.family
        self.record_masks = record_masks
        self.backend = backend
        self.tracker = StepTracker()
        self.stats = PatchStats()
        self.layers = []
        self._transformers = transformers
        self._scheduler = scheduler
        self._records = {}
        self._plans = {}
        self._grid = {}
        self._undo = []
        self._warned = set()
        self._removed = False

    # -- installation -----------------------------------------------------------------------
    def _install(self):
        multi = len(self._transformers) > 1
        for attr_name, transformer in self._transformers:
            modules = self.adapter.attention_modules(transformer)
            if not modules:
                raise ValueError(
                    f"{type(transformer).__name__}: found no attention module matching "
                    f"{self.adapter.attention_pattern!r} for family {self.family!r}"
                )
            setattr(transformer, _MARK, self)
            self._undo.append(lambda t=transformer: t.__dict__.pop(_MARK, None))
            handle = transformer.register_forward_pre_hook(
                lambda module, args, kwargs, t=transformer: self._on_transformer_call(t, args, kwargs), with_kwargs=True
            )
            self._undo.append(handle.remove)
            for local_index, (name, module) in enumerate(modules):
                global_index = len(self.layers)
                self.layers.append(f"{attr_name}.{name}" if multi else name)
                self._pin_native_backend(module)
                interceptor = ModuleInterceptor(
                    module,
                    lambda call, original, g=global_index, i=local_index, t=transformer: self._attend(g, i, t, call, original),
                )
                self._undo.append(interceptor.remove)
        if self._scheduler is not None:
            self._wrap_scheduler(self._scheduler)

    def _pin_native_backend(self, module):
        processor = getattr(module, "processor", None)
        if processor is None or not hasattr(processor, "_attention_backend"):
            return  # legacy processor: calls SDPA directly
        missing = object()
        previous = processor.__dict__.get("_attention_backend", missing)
        processor._attention_backend = "native"

        def restore(p=processor, prev=previous):
            if prev is missing:
                p.__dict__.pop("_attention_backend", None)
            else:
                p._attention_backend = prev

        self._undo.append(restore)

    def _wrap_scheduler(self, scheduler):
        tracker = self.tracker
        original_set, original_step = scheduler.set_timesteps, scheduler.step

        # functools.wraps keeps the signatures: pipelines inspect them (e.g. HunyuanVideo checks
        # that `set_timesteps` accepts `sigmas`).
        @functools.wraps(original_set)
        def set_timesteps(*args, **kwargs):
            result = original_set(*args, **kwargs)
            order = getattr(scheduler, "order", 1) or 1
            tracker.begin_call(len(scheduler.timesteps) // order, order)
            return result

        @functools.wraps(original_step)
        def step(*args, **kwargs):
            result = original_step(*args, **kwargs)
            tracker.on_scheduler_step()
            return result

        for name, wrapper in (("set_timesteps", set_timesteps), ("step", step)):
            setattr(scheduler, name, wrapper)

            def restore(n=name, w=wrapper):
                if scheduler.__dict__.get(n) is w:
                    del scheduler.__dict__[n]

            self._undo.append(restore)

    # -- per call -----------------------------------------------------------------------------
    def _on_transformer_call(self, transformer, args, kwargs):
        self._grid[id(transformer)] = self.adapter.grid(transformer, args, kwargs)
        if self._scheduler is None:
            self.tracker.on_transformer_call(self.adapter.timestep(args, kwargs))

    def _warn_once(self, key, message):
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(f"fastdit: {message}", stacklevel=3)

    def _attend(self, layer, local_layer, transformer, call, original):
        q, k, v = call["query"], call["key"], call["value"]
        unusual = (call["dropout_p"] or call["is_causal"] or call["enable_gqa"] or q.dim() != 4
                   or q.shape[-2] != k.shape[-2] or q.shape[1] != k.shape[1])
        grid = self._grid.get(id(transformer))
        if unusual:
            self.stats.fallback_calls += 1
            self._warn_once(("unusual", layer), f"layer {self.layers[layer]}: attention call not handled "
                            "(causal, dropout, GQA or cross-attention); running it dense")
            return original()
        if grid is None:
            self.stats.fallback_calls += 1
            self._warn_once(("grid", layer), f"layer {self.layers[layer]}: the adapter gives no single token "
                            "grid for this call (e.g. reference images of another size); running it dense")
            return original()
        batch, heads, seq, _ = q.shape
        video_len = math.prod(grid)
        text_len = seq - video_len
        if text_len < 0 or (text_len > 0 and self.adapter.text_position == "none"):
            raise RuntimeError(
                f"fastdit ({self.family}): layer {self.layers[layer]} got {seq} tokens but the latent grid "
                f"{grid} has {video_len}; the adapter's layout does not fit this model"
            )
        layout = TokenLayout(grid, text_len, self.adapter.text_position if text_len else "none")
        key_mask, query_mask, mask_ok = key_mask_from_attn_mask(call["attn_mask"], batch, seq, seq)
        if not mask_ok:
            self.stats.fallback_calls += 1
            self._warn_once(("mask", layer), f"layer {self.layers[layer]}: the model's attention mask is not a "
                            "key mask; running this call dense")
            return original()

        dense = (self._method.name == "dense" or local_layer < self.config.dense_layers
                 or self.tracker.is_dense(self.config.dense_steps))
        plan = None if dense else self._plan(layout, heads, q)
        if plan is None:  # dense step or layer, or a layout the method computes densely anyway
            self.stats.dense_calls += 1
            self._record(layer, LayerRecord(layout, True, None, key_mask, heads, query_mask))
            return original()
        self.stats.count_sparse_call(plan)
        self._record(layer, LayerRecord(layout, False, plan, key_mask, heads, query_mask))
        return run_plan(q, k, v, plan, key_mask=key_mask, scale=call["scale"], backend=self.backend,
                        query_mask=query_mask)

    def _plan(self, layout, heads, q):
        if self._method.dynamic:
            self.stats.plans_built += 1
            return self._method.plan(layout, self.config, heads, q.device, q=q)
        key = (layout, heads, str(q.device))
        if key not in self._plans:
            self._method.check_layout(layout, self.config)
            self._plans[key] = self._method.plan(layout, self.config, heads, q.device)
            self.stats.plans_built += 1
        return self._plans[key]

    def _record(self, layer, record):
        if self.record_masks:
            self._records[layer] = record

    # -- public -------------------------------------------------------------------------------
    def set_num_steps(self, num_steps):
        """Tell a bare-transformer patch how many steps the coming call has (for fractions)."""
        self.tracker.reset(int(num_steps))

    @property
    def step(self):
        return self.tracker.step

    def layer_index(self, layer):
        if isinstance(layer, str):
            if layer not in self.layers:
                raise ValueError(f"unknown layer {layer!r}; patched layers: {self.layers}")
            return self.layers.index(layer)
        if not -len(self.layers) <= layer < len(self.layers):
            raise ValueError(f"layer index {layer} out of range: {len(self.layers)} patched layers")
        return layer % len(self.layers)

    def mask(self, layer, head=0):
        """Token-level boolean mask ``(S, S)`` that ``layer`` used in its latest call, in the model's
        token order (text tokens included), for ``head``. Needs ``record_masks=True``."""
        if not self.record_masks:
            raise RuntimeError("masks are recorded only with fastdit.patch(..., record_masks=True)")
        index = self.layer_index(layer)
        record = self._records.get(index)
        if record is None:
            raise RuntimeError(f"layer {self.layers[index]} has not run since the patch was applied")
        if not 0 <= head < max(record.num_heads, 1):
            raise ValueError(f"head {head} out of range: the layer has {record.num_heads} heads")
        seq = record.layout.seq_len
        if record.dense:
            mask = torch.ones(seq, seq, dtype=torch.bool)
            if record.key_mask is not None:
                mask &= record.key_mask[0].cpu()[None, :]
        else:
            mask = record.plan.token_mask(head, record.key_mask).cpu()
        if record.query_mask is not None:
            mask &= record.query_mask[0].cpu()[:, None]
        return mask

    def last_plan(self, layer):
        """The ``BlockPlan`` of ``layer``'s latest call (None when it ran dense); needs record_masks."""
        record = self._records.get(self.layer_index(layer))
        return None if record is None else record.plan

    def reset_stats(self):
        self.stats = PatchStats()

    def remove(self):
        """Undo everything; outputs are then identical to the unpatched model's. Idempotent."""
        if self._removed:
            return
        while self._undo:
            self._undo.pop()()
        self._records.clear()
        self._plans.clear()
        self._removed = True

    @property
    def active(self):
        return not self._removed

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()
        return False

    def __repr__(self):
        state = "active" if self.active else "removed"
        return f"<fastdit.Patch {self.method} on {self.family}, {len(self.layers)} layers, {state}>"


def _targets(target):
    """``([(attr_name, transformer)], scheduler)`` of a pipeline or a bare transformer."""
    if isinstance(target, torch.nn.Module) and not hasattr(target, "transformer"):
        return [("transformer", target)], None
    transformer = getattr(target, "transformer", None)
    if transformer is None:
        unet = " (it has a UNet: fastdit patches DiT transformers only)" if getattr(target, "unet", None) is not None else ""
        raise ValueError(f"{type(target).__name__} has no `transformer`{unet}; pass a diffusers DiT pipeline or its transformer")
    found = [("transformer", transformer)]
    second = getattr(target, "transformer_2", None)
    if second is not None:
        found.append(("transformer_2", second))
    return found, getattr(target, "scheduler", None)


def patch(target, method="sta", config=None, *, record_masks=False, backend="auto", **options):
    """Replace the DiT attention of a diffusers pipeline (or transformer) with ``method``.

    Args:
        target: a diffusers pipeline (its ``transformer``, and ``transformer_2`` for Wan 2.2, are
            patched with one step counter) or a transformer.
        method: a name from ``fastdit.methods()``.
        config: the method's config dataclass (e.g. ``fastdit.STAConfig(...)``); keyword
            ``options`` override its fields.
        record_masks: keep each layer's latest plan so ``Patch.mask(layer, head)`` can draw it.
        backend: kernel backend, ``"auto"``, ``"triton"`` or ``"torch"``.

    Returns:
        a ``Patch``; ``remove()`` restores the model (also on leaving a ``with`` block).

    Example::

        p = fastdit.patch(pipe, "sta", tile=(6, 8, 8), window=(3, 3, 3), dense_steps=0.25)
        video = pipe(prompt).frames
        p.remove()
    """
    from fastdit.kernels.block_sparse import BACKENDS
    from fastdit.pipelines import find_adapter

    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    method_obj = get_method(method)
    config = method_obj.make_config(config, **options)
    transformers, scheduler = _targets(target)
    adapters = [find_adapter(t) for _, t in transformers]
    adapter = adapters[0]
    for _, transformer in transformers:
        existing = getattr(transformer, _MARK, None)
        if existing is not None:
            raise AlreadyPatchedError(
                f"{type(transformer).__name__} is already patched by fastdit ({existing!r}); call remove() on that patch first"
            )
    config = method_obj.resolve(config, adapter.family)
    method_obj.check_family(adapter, config)
    result = Patch(target, method_obj, config, adapter, transformers, scheduler, record_masks, backend)
    try:
        result._install()
    except BaseException:
        result.remove()
        raise
    return result


class _CallableModule(type(math)):
    """``fastdit.patch`` is both this module and the ``patch`` function: calling the module patches,
    while ``fastdit.patch.Patch`` and friends stay reachable (the package attribute would otherwise
    shadow one with the other)."""

    def __call__(self, *args, **kwargs):
        return patch(*args, **kwargs)


import sys as _sys  # noqa: E402

_sys.modules[__name__].__class__ = _CallableModule
