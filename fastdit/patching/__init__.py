"""The ``Patch`` that ``fastdit.patch`` (``fastdit/apply.py``) installs: replace the attention of a
diffusers DiT pipeline in one line, reversibly.

Everything is instance-level: on each patched attention module an instance ``forward`` and, for
processors that dispatch through diffusers' backends, a backend of fastdit's own set on the
processor instance (``fastdit/intercept.py``); a forward pre-hook on the transformer that publishes
the call's latent grid and step to the attention calls (``fastdit/context.py``); and
reference-counted step tracking on the scheduler (``fastdit/steps.py``; a scheduler swapped in
after patching, ``pipe.scheduler = type(s).from_config(s.config)``, is tracked from the next call
on and the old one released, so ``dense_steps`` holds across the swap). No class
attribute changes and no upstream ``forward`` is copied; ``remove()`` undoes each of these.

Per attention call (inside the custom op, outside any compiled graph): the layout (the video grid
from the transformer's input, text tokens from the sequence length), the key and query masks (from
the model's attention mask), an ``AttentionContext``, then the method: a dense layer or step runs
the model's own attention, anything else the method's ``attend``. Calls the patch cannot express
(cross-attention, causal or dropout calls, masks that are not key masks, float64, ...) run the
model's own attention and are counted as fallbacks with their reason.
"""
from __future__ import annotations

import math
import os
import threading
import warnings
import weakref

import torch

from fastdit import costmodel
from fastdit.context import (
    TransformerCall,
    active_call,
    bare_call_state,
    begin_pipeline_call,
    new_context,
    release_bare_call_state,
    reset_bare_call_state,
    set_transformer_call,
    transformer_call,
)
from fastdit.intercept import (AttentionForward, BackendRoute, backend_route_available, check_ring_split,
                               register_patch, unregister_patch)
from fastdit.layout import TokenLayout, key_mask_from_attn_mask, shard_order
from fastdit.methods.base import OptionError
from fastdit.stats import PatchStats
from fastdit.steps import track_scheduler

from .state import MISSING, PATCH_MARK, LayerRecord, UnpatchedState, LayerSpec, attention_geometry

_ENGINE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class AlreadyPatchedError(RuntimeError):
    """The model is already patched by fastdit; call ``remove()`` on the existing patch first."""


class Patch:
    """A live patch of one pipeline (or transformer). Use ``remove()`` or a ``with`` block.

    Attributes:
        method: the method name. config: its resolved config. family: the adapter's family.
        layers: names of the patched attention modules, in model order.
        stats: ``PatchStats`` over all calls of all patched layers.
    """

    def __init__(self, target, method, adapter, transformers, scheduler, record_masks, backend):
        self.target = target
        self._method = method
        self.method = method.name
        self.config = method.config
        self.adapter = adapter
        self.family = adapter.family
        self.record_masks = record_masks
        self.backend = backend
        self.stats = PatchStats(method)
        self.layers, self._layers = [], []
        self._transformers, self._scheduler = transformers, scheduler
        self._untrack, self._swap_lock = None, threading.Lock()
        self._pipeline = target if scheduler is not None else None
        self._records = {}
        self._undo = []
        self._pinned = []  # (processor, value fastdit set, value to restore)
        self._warned, self._warn_lock = set(), threading.Lock()
        self._worth_checked = False
        self._bare_num_steps = None
        #: transformer calls one denoising step can make (2: the two classifier-free guidance
        #: branches). On a bare transformer a repeated timestep past this starts a new call (fresh
        #: method state); set it higher for a loop that makes more calls per step.
        self.branches_per_step = 2
        self._calibration = None  # (loaded calibration, its file) applied with calibration=: grids checked
        self._calibration_grids = set()  # grids the calibration was found to fit
        self._removed = False
        self.trainable = False  # set by patch(..., trainable=True): calls with gradients run the method
        #: layer name -> the method's trainable parameters of that layer (``Method.layer_module``), held
        #: here, never on the model (fastdit/calibration/method_params.py saves and loads them)
        self.method_modules = {}
        self._param_grids = None  # grids the loaded method parameters were trained on (None: any)
        self._param_grids_source = ""
        self.grids_seen = set()  # latent grids of the calls so far (saved with the method parameters)
        self.id = register_patch(self)

    # -- installation -----------------------------------------------------------------------
    def _install(self, modules_per_transformer):
        multi = len(self._transformers) > 1
        for (attr_name, transformer), modules in zip(self._transformers, modules_per_transformer):
            setattr(transformer, PATCH_MARK, self)
            self._undo.append(lambda t=transformer: t.__dict__.pop(PATCH_MARK, None))
            for local_index, (name, module) in enumerate(modules):
                self.layers.append(f"{attr_name}.{name}" if multi else name)
                self._layers.append(LayerSpec(self.layers[-1], local_index, weakref.ref(transformer)))
                self._undo.append(self._intercept(module, len(self._layers) - 1))
                self._add_layer_module(self.layers[-1], module)
            # The hook runs eagerly even inside torch.compile: it reads Python-side state (grid,
            # step) that the compiled graph must not bake in.
            hook = torch.compiler.disable(self._on_transformer_call)
            handle = transformer.register_forward_pre_hook(hook, with_kwargs=True)
            self._undo.append(handle.remove)
            self._unpatched_state(transformer, {}, handle.id)
        if self._scheduler is not None:
            self._untrack = track_scheduler(self._scheduler)
            self._undo.append(self._untrack_scheduler)

    def _add_layer_module(self, name, module):
        """The method's trainable parameters of this layer (``Method.layer_module``), if it has any:
        built on the layer's device in float32, trainable only under ``trainable=True``."""
        heads, head_dim = attention_geometry(module)
        layer_module = self._method.layer_module(heads, head_dim) if heads else None
        if layer_module is None:
            return
        weight = next(module.parameters(), None)
        layer_module = layer_module.to(device=weight.device if weight is not None else "cpu", dtype=torch.float32)
        layer_module.requires_grad_(self.trainable)
        self.method_modules[name] = layer_module

    @property
    def model_class(self):
        """Class name of the (first) patched transformer."""
        return type(self._transformers[0][1]).__name__

    def layer_module_key(self):
        """The method's ``layer_module_key()``: what its per-layer parameters depend on."""
        return self._method.layer_module_key()

    def set_param_grids(self, grids, source=""):
        """Refuse, at the first call on it, a latent grid outside ``grids`` (the grids loaded method
        parameters were trained on; empty: any grid); ``source`` names them in the CalibrationError."""
        self._param_grids = {tuple(int(x) for x in g) for g in grids} or None
        self._param_grids_source = source

    def _untrack_scheduler(self):
        untrack, self._untrack = self._untrack, None
        if untrack is not None:
            untrack()

    def _follow_scheduler_swap(self):
        """``pipe.scheduler = ...`` since the patch was made (``type(s).from_config(s.config)``):
        release the old scheduler, track the new one, and start this pipeline call from the new
        scheduler's schedule (its ``set_timesteps`` for this call ran before it was tracked).
        Returns the new call's state, or None when the scheduler is the tracked one."""
        current = getattr(self._pipeline, "scheduler", None)
        if current is None or current is self._scheduler:
            return None
        with self._swap_lock:
            if current is not self._scheduler:
                self._untrack_scheduler()
                self._scheduler = current
                self._untrack = track_scheduler(current)
        order = getattr(current, "order", 1) or 1
        timesteps = getattr(current, "timesteps", None)
        count = None if timesteps is None else len(timesteps) // order
        return begin_pipeline_call(count, order, timesteps)

    def _intercept(self, module, layer):
        """Route the module's attention to fastdit (see ``fastdit/intercept.py``); returns the undo."""
        processor = getattr(module, "processor", None)
        if processor is None or not hasattr(processor, "_attention_backend"):
            forward = AttentionForward(module, self.id, layer, mode=True)  # legacy: calls SDPA directly
            self._unpatched_forward(module, forward)
            return forward.remove
        if backend_route_available():
            route = BackendRoute(self.id, layer)
            self._pin_backend(processor, route.member)
            forward = AttentionForward(module, self.id, layer, mode=False)
        else:  # an older diffusers: the native backend calls SDPA, which the mode catches
            route = None
            self._pin_backend(processor, "native")
            forward = AttentionForward(module, self.id, layer, mode=True)
        self._unpatched_forward(module, forward)

        def undo():
            forward.remove()
            if route is not None:
                route.remove()

        return undo

    def _unpatched_state(self, obj, changes, hook_id=None):
        """Give ``obj`` an instance ``__getstate__`` without the patch (``_UnpatchedState``); undone
        by ``remove()``."""
        getstate = UnpatchedState(obj, changes, hook_id)
        obj.__dict__["__getstate__"] = getstate

        def undo():
            if obj.__dict__.get("__getstate__") is getstate:
                del obj.__dict__["__getstate__"]

        self._undo.append(undo)

    def _unpatched_forward(self, module, forward):
        """A copy of ``module`` gets the ``forward`` it had before the patch (none, or the user's)."""
        previous = forward._previous
        self._unpatched_state(module, {"forward": (forward, lambda: MISSING if previous is forward._missing
                                                   else previous)})

    def _pin_backend(self, processor, value):
        missing = MISSING
        entry = [processor, value, processor.__dict__.get("_attention_backend", missing)]
        processor._attention_backend = value
        self._pinned.append(entry)
        self._unpatched_state(processor, {"_attention_backend": (value, lambda: entry[2])})

        def restore(entry=entry, missing=missing):
            processor, ours, previous = entry
            if processor.__dict__.get("_attention_backend", missing) is not ours:
                return  # changed by someone else since: theirs stays
            if previous is missing:
                processor.__dict__.pop("_attention_backend", None)
            else:
                processor._attention_backend = previous

        self._undo.append(restore)

    def _keep_backends_pinned(self):
        """``transformer.set_attention_backend(...)`` while patched would route the patched layers
        around SDPA and silently switch fastdit off: fastdit stays in charge, warns once, and
        restores the user's choice on ``remove()``."""
        for entry in self._pinned:
            processor, ours, _ = entry
            current = processor.__dict__.get("_attention_backend")
            if current is not ours:
                entry[2] = current
                processor._attention_backend = ours
                self._warn_once(("backend", str(current)), f"the attention backend was set to {current!r} while "
                                "fastdit is patched; fastdit keeps the patched layers and restores "
                                f"{current!r} on remove()")

    # -- per transformer call (eager, before the compiled graph) ------------------------------
    def _on_transformer_call(self, transformer, args, kwargs):
        self._keep_backends_pinned()
        state = self._follow_scheduler_swap() if self._pipeline is not None else None
        if state is None and self._scheduler is not None:
            state = active_call()
        if state is None:
            state = bare_call_state(self.id, self._bare_num_steps)
            branch = state.on_bare_timestep(self.adapter.timestep(args, kwargs), self.branches_per_step)
        else:
            branch = state.on_transformer_call()
        try:
            grid = self.adapter.grid(transformer, args, kwargs)
        except (ValueError, TypeError, KeyError, IndexError) as error:
            self._warn_once(("grid-error",), f"could not read the latent grid ({error}); those calls run dense")
            grid = None
        if grid is not None:
            check_ring_split(transformer, grid, kwargs)
        if grid is not None and self._calibration is not None and tuple(grid) not in self._calibration_grids:
            self._check_calibration_grid(tuple(grid))
        if grid is not None and self._param_grids is not None and tuple(grid) not in self._param_grids:
            from fastdit.calibration.calibration_file import CalibrationError

            raise CalibrationError(f"the method parameters {self._param_grids_source} were trained on grid(s) "
                                   f"{sorted(self._param_grids)}, this call's latent grid is {tuple(grid)}; "
                                   "train them on this grid (python -m fastdit.train) or call at the grid they "
                                   "were trained on")
        if grid is not None:
            self.grids_seen.add(tuple(int(g) for g in grid))
        cfg = None
        if self._pipeline is not None:
            try:
                cfg = bool(getattr(self._pipeline, "do_classifier_free_guidance"))
            except Exception:  # noqa: BLE001 - a property that needs state the pipeline has not set
                cfg = None
        set_transformer_call(transformer, TransformerCall(grid, branch, state, cfg, kwargs.get("timestep")))

    def _check_calibration_grid(self, grid):
        """The first call on a grid the calibration was not made for: CalibrationError naming both grids
        unless its settings mean the same there (``calibration_file.grid_reason``). Raised before any
        attention runs, from the transformer's pre-hook: the call stops, the patch stays removable."""
        from fastdit.calibration.calibration_file import CalibrationError, grid_reason

        calibration, source = self._calibration
        reason = grid_reason(calibration, [grid])
        if reason is not None:
            where = f"calibration file {os.fspath(source)}" if source else "calibration file"
            raise CalibrationError(f"{where} cannot be applied to grid {grid}: {reason}")
        self._calibration_grids.add(grid)

    # -- per attention call (inside the custom op) ------------------------------------------
    def _fallback(self, layer, reason, size, original):
        self.stats.count_fallback(reason, size)
        message = f"layer {self.layers[layer]}: {reason}; running the model's own attention"
        self._warn_once(("fallback", reason), message)
        return original()

    def _warn_once(self, key, message):
        if not message:
            return
        with self._warn_lock:
            if key in self._warned:
                return
            self._warned.add(key)
        warnings.warn(f"fastdit: {message}", stacklevel=3)

    def handle_call(self, layer, call, original, head_offset=0, shards=1):
        """Run one intercepted attention call of patched layer ``layer`` (under Ulysses context
        parallelism: heads ``head_offset ..`` of the layer, tokens in the order of ``shards``
        concatenated local sequences, see ``shard_order``)."""
        q, k, v = call["query"], call["key"], call["value"]
        if q.dim() != 4 or k.dim() != 4:
            return self._fallback(layer, f"attention input of rank {q.dim()} (expected (B, H, S, D))", 0, original)
        batch, heads, seq, _ = q.shape
        size = batch * heads * seq * k.shape[-2]
        if call["dropout_p"] or call["is_causal"] or call["enable_gqa"] or seq != k.shape[-2] or heads != k.shape[1]:
            return self._fallback(layer, "attention call not handled (causal, dropout, GQA or cross-attention)", size,
                                  original)
        if q.dtype not in _ENGINE_DTYPES:
            return self._fallback(layer, f"{q.dtype} attention (the kernels take float16, bfloat16 and float32)",
                                  size, original)
        info = self.transformer_call_of(layer)
        if info is None:
            return self._fallback(layer, "attention module called outside a forward of its transformer", size, original)
        if info.grid is None:
            return self._fallback(layer, "the adapter gives no single token grid for this call (e.g. reference "
                                  "images of another size)", size, original)
        layout = self.call_layout(layer, info, seq)
        key_mask, query_mask, mask_ok = key_mask_from_attn_mask(call["attn_mask"], batch, seq, seq)
        if not mask_ok:
            return self._fallback(layer, "the model's attention mask is not a key mask", size, original)
        order = None
        if shards > 1:  # Ulysses: back to the model's token order, and out again below
            order = shard_order(layout, shards)
            if order is None:
                return self._fallback(layer, f"a sequence of {layout.describe()} does not split evenly into {shards} "
                                      "context-parallel shards", size, original)
            order = order.to(q.device)
            q, k, v = (t.index_select(2, order) for t in (q, k, v))
            key_mask, query_mask = (None if m is None else m.index_select(1, order) for m in (key_mask, query_mask))
        ctx = self.call_context(layer, info, layout, key_mask=key_mask, query_mask=query_mask, head_offset=head_offset,
                                num_heads=heads, total_heads=heads * shards, scale=call["scale"],
                                dense_fn=original if order is None else _in_model_order(original, order))
        out = self._method(ctx, q, k, v)
        if not self._worth_checked and not ctx.info.get("dense"):  # once, on the first sparse call
            self._worth_checked = True
            self._warn_once(("worth",), costmodel.worth_warning(self.method, q, k, ctx.info))
        if order is not None:
            out = out.index_select(2, torch.argsort(order))
        self.stats.count_call(ctx.info, size)
        if self.record_masks:
            plan = ctx.info.get("plan")
            dense = bool(ctx.info.get("dense")) or plan is None
            self._records[layer] = LayerRecord(layout, dense, None if dense else plan, key_mask, heads, query_mask)
        return out

    # -- one attention call's context (the only builder: handle_call here, the ring path in intercept) --
    @property
    def method_instance(self):
        """The ``Method`` this patch runs (its ``layer_method``, ``select``, capabilities)."""
        return self._method

    def transformer_call_of(self, layer):
        """The ``TransformerCall`` info of the transformer forward that layer ``layer``'s call belongs
        to (grid, step, branch, per-layer state), or None outside a forward of its transformer."""
        transformer = self._layers[layer].transformer()
        return None if transformer is None else transformer_call(transformer)

    def call_layout(self, layer, info, seq):
        """The ``TokenLayout`` of a ``seq``-token call of layer ``layer`` on the grid of ``info``: the
        video tokens, then text where the adapter puts it; RuntimeError when they do not fit."""
        video_len = math.prod(info.grid)
        text_len = seq - video_len
        if text_len < 0 or (text_len > 0 and self.adapter.text_position == "none"):
            raise RuntimeError(
                f"fastdit ({self.family}): layer {self.layers[layer]} got {seq} tokens but the latent grid "
                f"{info.grid} has {video_len}; the adapter's layout does not fit this model"
            )
        return TokenLayout(info.grid, text_len, self.adapter.text_position if text_len else "none")

    def call_context(self, layer, info, layout, *, key_mask, query_mask, head_offset, num_heads, total_heads, scale,
                     dense_fn):
        """The ``AttentionContext`` of one call of layer ``layer`` (masks and heads as the caller runs
        them; ``dense_fn``: the exact attention of those tensors)."""
        return new_context(
            layer=layer, layer_name=self.layers[layer], step=info.call.step, num_steps=info.call.num_steps,
            branch=info.branch, layout=layout, call=info.call, local_layer=self._layers[layer].local_index,
            key_mask=key_mask, query_mask=query_mask, head_offset=head_offset, num_heads=num_heads,
            total_heads=total_heads, scale=scale, cfg=info.cfg, state=info.call.layer_state(layer, info.branch),
            backend=self.backend, dense_fn=dense_fn, timestep=info.timestep,
            params=self.method_modules.get(self.layers[layer]),
        )

    # -- public -------------------------------------------------------------------------------
    def set_num_steps(self, num_steps):
        """Tell a bare-transformer patch how many steps the coming call has (for fractions)."""
        self._bare_num_steps = int(num_steps)
        reset_bare_call_state(self.id, self._bare_num_steps)

    @property
    def call_state(self):
        """The ``CallState`` of the pipeline call in this context (None before any call)."""
        state = active_call() if self._scheduler is not None else None
        return state if state is not None else bare_call_state(self.id, self._bare_num_steps)

    @property
    def step(self):
        return self.call_state.step

    def layer_index(self, layer):
        if isinstance(layer, str):
            if layer not in self.layers:
                raise ValueError(f"unknown layer {layer!r}; patched layers: {self.layers}")
            return self.layers.index(layer)
        if isinstance(layer, bool) or not isinstance(layer, int):
            raise OptionError(f"layer must be an int index or a layer name, got {type(layer).__name__}: {layer!r}")
        if not -len(self.layers) <= layer < len(self.layers):
            raise ValueError(f"layer index {layer} out of range: {len(self.layers)} patched layers")
        return layer % len(self.layers)

    def _record_of(self, layer):
        if self._removed:
            raise RuntimeError("this patch was removed; its masks and plans were released with it")
        if not self.record_masks:
            raise RuntimeError("masks and plans are recorded only with fastdit.patch(..., record_masks=True)")
        index = self.layer_index(layer)
        record = self._records.get(index)
        if record is None:
            raise RuntimeError(f"layer {self.layers[index]} has not run since the patch was applied")
        return record

    def mask(self, layer, head=0):
        """Token-level boolean mask ``(S, S)`` that ``layer`` used in its latest call, in the model's
        token order (text tokens included), for ``head``. Needs ``record_masks=True``."""
        record = self._record_of(layer)
        if isinstance(head, bool) or not isinstance(head, int):
            raise OptionError(f"head must be an int, got {type(head).__name__}: {head!r}")
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
        return self._record_of(layer).plan

    def last_layout(self, layer):
        """The ``TokenLayout`` of ``layer``'s latest call; needs record_masks."""
        return self._record_of(layer).layout

    def reset_stats(self):
        self.stats = PatchStats(self._method)

    def remove(self):
        """Undo everything; outputs are then identical to the unpatched model's. Idempotent."""
        if self._removed:
            return
        self._removed = True
        unregister_patch(self.id)
        release_bare_call_state(self.id)  # this context's method state (caches) goes with the patch
        while self._undo:
            self._undo.pop()()
        self._records.clear()

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


def _in_model_order(original, order):
    """The model's own attention of a Ulysses call, returned in model token order."""
    return lambda: original().index_select(2, order)
