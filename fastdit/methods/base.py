"""The method protocol (version 2): what every attention method shares, and the method registry.

A method is a config dataclass plus a ``Method`` subclass that implements what it needs of

* ``prepare(layout, heads, device)`` - the static part of a plan (token permutation, static block
  lists) for a token layout; cached per (layout, heads, device) in a bounded LRU cache;
* ``select(ctx, q, k)`` - the block plan of one call; the default returns the prepared plan
  (sliced to the call's heads). Dynamic methods choose blocks from ``q`` and ``k`` here, on the
  tensors' device, in kernel order, with no host synchronisation;
* ``attend(ctx, q, k, v)`` - the whole call; the default runs ``select``, the engine (which also
  returns the log-sum-exp) and ``finalize``. Token methods override it and may change the number
  of keys and queries inside the call;
* ``finalize(ctx, out, lse)`` - a correction that needs the log-sum-exp (default: none);
* ``attend_dense(ctx, q, k, v)`` - a dense step or dense layer (default: the model's own
  attention); methods that cache dense results (refresh steps) override it.

Per-call information comes in the ``AttentionContext`` (``fastdit/context.py``): layer, step and
steps actually run, CFG branch, layout, key/query masks, head offset and count, and ``ctx.state``,
a dict per (layer, branch) that is reset at the start of every pipeline call. A method instance
holds only its resolved config and its plan cache, so one instance serves every thread.

Per (step bucket, layer) settings: every method takes ``layer_settings`` (``MethodConfig``), what
``fastdit.calibrate`` writes for methods other than sta. ``__call__`` runs such a call on an
instance of the same class built (once, at construction) with that entry's options, or dense for
a None entry; settings are per call, so every head of a layer shares them (sta's ``strategy``
chooses per head).

Methods know nothing of diffusers: model families change their defaults only through the
adapters' ``method_defaults`` (``fastdit/pipelines/adapters.py``).
"""
from __future__ import annotations

import collections
import dataclasses
import json
import threading

from fastdit.plan import run_plan

from .config import (NOT_PER_LAYER, MethodConfig, OptionError, bucket_start, check_int, check_number,  # noqa: F401
                     index_key, normalize_layer_settings, option)
from .guard import GuardHooks

_REGISTRY = {}
#: The quality guard's default bound (relative L2 error of a head's output on sampled rows) for
#: the methods that have it on by default (dynamic and token methods); see ``guard.py``.
GUARD_DEFAULT = 0.1

#: ``ctx.state`` key of the ``layer_settings`` entry a layer last ran with.
_SETTING_KEY = "fastdit.layer_setting"

#: ``family name -> adapter or None``, registered by ``fastdit.pipelines`` (methods know no models:
#: the dependency points from the model adapters down to the methods, not the other way).
_FAMILY_SOURCE = []


#: Defaults of where a method runs, above the method's and the family's (``Method.resolve``):
#: ``"call"``: ``fastdit.attention`` outside a pipeline, where no step or layer position exists to
#: make a default ``dense_steps`` / ``dense_layers`` mean anything (only what the caller asks applies);
#: ``"engine"``: a serving engine whose calls carry no layer identity (vllm-omni), so no state per
#: layer; ``"candidate"``: a candidate of ``auto`` or a calibration, run where the plan puts it and
#: measured by its own error (no guard unless it sets one).
WHERE_DEFAULTS = {
    "pipeline": {},
    "call": {"dense_steps": 0, "dense_layers": 0},
    "engine": {"dense_layers": 0, "warm_start": False},
    "candidate": {"dense_steps": 0, "dense_layers": 0, "guard": False},
}


def step_inputs_needed(config):
    """``(step, total)``: whether a call of ``config`` must be told its step index (``dense_steps``
    not 0) and the run's number of steps (``dense_steps`` a fraction), where no pipeline counts them
    (``fastdit.attention``, the vllm-omni plugins ask this, and word their own errors)."""
    steps = getattr(config, "dense_steps", 0) or 0
    return bool(steps), isinstance(steps, float) and steps > 0


def set_family_defaults_source(lookup):
    """Register ``lookup(family) -> object with method_defaults | None`` (done by fastdit.pipelines)."""
    _FAMILY_SOURCE[:] = [lookup]


class Method(GuardHooks):
    """Base class of attention methods (see the module docstring for the protocol).

    Subclasses set ``name``, ``config_cls`` and ``default_options`` (values for options left at
    None, after the model family's defaults) and implement ``prepare`` and/or ``select``,
    ``attend``, ``finalize``.
    """

    name = ""
    config_cls = MethodConfig
    #: Defaults for options left at None when the model family gives none.
    default_options = {}
    #: Prepared plans kept per method instance (layouts change with resolution and frame count).
    cache_size = 16
    #: Options used on fastdit's tiny built-in models (compare, eval and the app apply them there):
    #: block and tile sizes that fit their small token grids.
    tiny_options = {}
    #: Whether ``k`` / ``v`` may have another length than ``q`` (``fastdit.attention``). Methods that
    #: lay the keys out on the queries' token grid (tiles, clusters, pools, windows) cannot: the
    #: functional API refuses such a call, naming both lengths, rather than dropping keys.
    any_key_length = False

    #: Whether a call records the log-sum-exp of the scores it computed (``ctx.info["lse"]``):
    #: methods that attend through a block plan do; token methods (which attend reduced or cached
    #: tokens) do not, so ``fastdit.attention`` reports ``lse=None`` and refuses ``"mass"`` for them.
    reports_lse = False

    #: The guard's bound when ``guard`` is left at None (False: off by default; see ``guard.py``).
    #: On for the dynamic and token methods, whose thresholds can fail on heads they never saw.
    guard_default = False

    #: Whether ``fastdit.method_names()`` lists it (``auto`` is not: it runs only from a calibrated plan).
    listed = True

    # -- capabilities: what the rest of fastdit asks the registry (``methods_with``), never a list of
    # names (docs/adding_a_method.md). A new method declares them here and is offered everywhere.
    #: Where the method sorts in lists of methods (help texts, auto's candidates, plugins): lower first.
    rank = 100
    #: Its calls run the block-sparse engine on a ``BlockPlan`` it selects, so the block-sparse options
    #: (``skip_threshold``, ``correction``, ``quant``) mean something (set by ``BlockSparseMethod``).
    block_sparse = False
    #: It runs under ring attention (``methods/parallel/ring.py`` cuts its plans into (query shard,
    #: key shard) parts): block-sparse methods and dense; token methods attend pooled, merged or cached
    #: tokens of the whole sequence, which one ring shard does not hold.
    ring = False
    #: ``method="auto"`` chooses it per head (its error on one call says how a run goes: not a method
    #: that reuses results across steps). Its grid: ``auto_candidates``, else ``candidates``.
    auto_candidate = False
    #: Offered to serving engines whose calls carry no layer identity (the vllm-omni plugins
    #: ``fastdit_<name>``), and the geometry it needs: ``"grid"`` (a frame's ``(H, W)`` split) or
    #: ``"frames"`` (frame counts do); None: not offered (it keeps per-layer state across steps).
    engine_geometry = None
    #: It takes its settings from a calibration file only (``auto``: per-head choices made by
    #: ``fastdit calibrate``); the app offers it where a calibration is shipped or given.
    calibration_only = False
    #: How ``python -m fastdit.eval.predict`` models it: ``"plan"`` (the plan ``prepare`` builds),
    #: ``"density"`` (a dynamic plan at an assumed block density) or None (not modelled).
    cost_model = None

    @classmethod
    def candidates(cls, layout):
        """The option sets ``fastdit.calibrate`` tries by default (``[{option: value}, ...]``), or None:
        no default grid (calibrate then needs ``candidates=``). ``layout`` may be None."""
        return None

    @classmethod
    def auto_candidates(cls, layout, base):
        """``auto``'s candidate option sets (``base``: the user's options of this method), or None for
        ``candidates``' grid. Called only when ``auto_candidate`` is set."""
        return None

    @classmethod
    def outside_work(cls, options, batch, tokens, head_dim, elt):
        """``(flops, bytes)`` one call does per head besides attention (a token method's matching or
        pooling), for the cost model's per-head times (``fastdit.costmodel.head_times``)."""
        return 0.0, 0.0

    #: Why gradients through this method are not defined (``patch(..., trainable=True)`` refuses
    #: it with this reason), or None: the method is differentiable in q, k, v, with its selection
    #: (blocks, clusters, matchings) taken as constants.
    untrainable = None

    def trainable_refusal(self):
        """None when ``trainable=True`` can run this method with gradients, else the reason: the
        class's ``untrainable``, or an option whose result depends on another call (a correction
        cached at an earlier step) or whose backward is not exact (the in-kernel skip rule, whose
        skipped sub-tiles are not saved)."""
        if self.untrainable:
            return self.untrainable
        if getattr(self.config, "correction", "none") == "cached":
            return "correction='cached' reuses a correction computed at an earlier step"
        if getattr(self.config, "skip_threshold", None) is not None:
            return "skip_threshold has no backward (which key sub-tiles the kernel skipped is not saved)"
        if getattr(self.config, "quant", None) is not None:
            return "quant has no backward (the quantised engine is for inference)"
        return None

    def __init__(self, config=None, **options):
        self.config = self.make_config(config, **options) if (config is None or options
                                                              or not isinstance(config, self.config_cls)) else config
        self._cache = collections.OrderedDict()
        self._lock = threading.Lock()
        self.plans_built = 0
        self._build_layer_methods()

    # -- configuration (class level: usable before an instance exists) ------------------------
    @classmethod
    def make_config(cls, config=None, **options):
        """Build and validate the config from a config object and/or keyword options."""
        if config is not None and not isinstance(config, cls.config_cls):
            raise ValueError(f"method {cls.name!r} takes a {cls.config_cls.__name__}, got {type(config).__name__}")
        valid = [f.name for f in dataclasses.fields(cls.config_cls)]
        unknown = sorted(set(options) - set(valid))
        if "quant" in unknown:
            takers = ", ".join(methods_taking("quant"))
            raise OptionError(f"quant is an option of the block-sparse methods ({takers}), which run the block-sparse "
                              f"engine; method {cls.name!r} does not")
        if unknown:
            raise ValueError(f"unknown option(s) {unknown} for method {cls.name!r}; valid options: {valid}")
        config = dataclasses.replace(config, **options) if config is not None else cls.config_cls(**options)
        config.validate()
        return config

    @classmethod
    def resolve(cls, config=None, adapter=None, *, options=None, where="pipeline"):
        """The validated config with every default filled: the one place defaults are resolved.

        The order, later winning: ``0`` for ``dense_steps`` / ``dense_layers`` and ``guard_default``
        < the method's ``default_options`` < the model family's (``adapter.method_defaults``) <
        the defaults of ``where`` the method runs (``WHERE_DEFAULTS``: one call outside a pipeline,
        an engine without layer identity, an auto candidate) < the user's ``config`` / ``options``
        < a plan file's options (``fastdit.patch`` merges them into ``options`` first and refuses an
        option set by both). Family and method defaults fill options left at None; a ``where``
        default applies to an option ``options`` leaves unset (absent or None) whose ``config``
        value is None (or that no config was given for). ``adapter`` may be an ``Adapter``, a family name (looked up
        through ``set_family_defaults_source``) or None."""
        options = dict(options or {})
        given = cls.make_config(config, **options)
        fields = {f.name for f in dataclasses.fields(given)}
        placed = {name: value for name, value in WHERE_DEFAULTS[where].items() if name in fields
                  and options.get(name) is None and (config is None or getattr(config, name) is None)}
        if placed:
            given = dataclasses.replace(given, **placed)
        family_defaults = {}
        if isinstance(adapter, str):
            adapter = _FAMILY_SOURCE[0](adapter) if _FAMILY_SOURCE else None
        if adapter is not None:
            family_defaults = dict(getattr(adapter, "method_defaults", {}).get(cls.name, {}))
        defaults = {"dense_steps": 0, "dense_layers": 0, "guard": cls.guard_default, **cls.default_options,
                    **family_defaults}
        filled = {name: value for name, value in defaults.items() if name in fields and getattr(given, name) is None}
        config = dataclasses.replace(given, **filled)
        config.validate()
        return config

    def layer_module(self, heads, head_dim):
        """Trainable parameters this method adds to one patched attention layer of ``heads`` heads of
        ``head_dim`` (gates, projections): a ``torch.nn.Module``, or None (the default: none).

        The patch builds one per attention layer at patch time (instance-level: kept on the patch,
        never set on the model, so ``remove()`` leaves the model as it was) and hands it to the calls
        as ``ctx.params``. ``fastdit.train`` adds their parameters to the optimiser and saves them
        beside the LoRA adapter (``fastdit/calibration/method_params.py``); ``fastdit.patch(...,
        method_params=...)`` loads them back. The initial values must be the method's training-free
        behaviour (a call without the module, ``ctx.params`` None, must give the same output)."""
        return None

    def layer_module_key(self):
        """What the meaning of ``layer_module``'s parameters depends on besides the model (options
        such as a block size): a JSON-able dict saved with them and compared when they are loaded."""
        return {}

    @classmethod
    def check_family(cls, adapter, config):
        """Raise ValueError when the method does not apply to the adapter's model family."""

    def check_heads(self, num_heads):
        """Raise ValueError when an option cannot be honoured on a layer of ``num_heads`` heads
        (called at patch time with the model's head count)."""

    def check_layers(self, num_layers):
        """Raise ValueError when an option names a layer the model does not have (called at patch
        time with the number of patched attention layers, over all patched transformers)."""
        settings = getattr(self.config, "layer_settings", None) or {}
        outside = [key for key in settings if int(key.split("_")[1]) >= num_layers]
        if outside:
            raise ValueError(f"layer_settings entry {outside[0]!r} names layer {outside[0].split('_')[1]} but the "
                             f"model has {num_layers} patched attention layers (0 to {num_layers - 1})")

    # -- the protocol --------------------------------------------------------------------------
    def prepare(self, layout, heads, device):
        """The static ``BlockPlan`` of ``layout`` for ``heads`` heads, or None (run dense)."""
        return None

    def prepared(self, layout, heads, device):
        """``prepare`` through the bounded per-instance cache (keyed by layout, heads, device)."""
        return self.cached_plan((layout, int(heads), str(device)), lambda: self.prepare(layout, heads, device))

    def cached_plan(self, key, build):
        """The plan under ``key`` in the bounded per-instance LRU cache, built by ``build()`` (and
        validated once) when missing; ``build`` may return None (run dense), which is cached too."""
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        plan = build()
        if plan is not None:
            plan.validate()  # once per plan: calls then skip the engine's per-call validation
        with self._lock:
            self._cache[key] = plan
            self.plans_built += 1
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return plan

    def select(self, ctx, q, k):
        """The block plan of this call (default: the prepared plan, sliced to the call's heads)."""
        total = ctx.total_heads or ctx.num_heads
        plan = self.prepared(ctx.layout, total, q.device)
        if plan is not None and (ctx.head_offset or ctx.num_heads != total):
            plan = plan.select_heads(ctx.head_offset, ctx.num_heads)
        return plan

    def attend(self, ctx, q, k, v):
        """The whole attention call (``q, k, v``: ``(B, H, S, D)`` in model token order)."""
        plan = self.select(ctx, q, k)
        if plan is None:  # a layout the method computes densely anyway (e.g. radial on one frame)
            ctx.info["dense"] = True
            return ctx.dense()
        ctx.record(plan=plan)
        out, lse = run_plan(q, k, v, plan, key_mask=ctx.key_mask, query_mask=ctx.query_mask, scale=ctx.scale,
                            backend=ctx.backend, return_lse=True)
        ctx.info["lse"] = lse
        return self.finalize(ctx, out, lse)

    def finalize(self, ctx, out, lse):
        """Correct ``out`` using the log-sum-exp ``lse`` ``(B, H, S)`` of the computed keys."""
        return out

    def attend_dense(self, ctx, q, k, v):
        """A dense step or dense layer: the model's own attention."""
        return ctx.dense()

    def is_dense_call(self, ctx):
        """Dense layers and dense steps run the model's own attention."""
        return ctx.local_layer < self.config.dense_layers or ctx.call.is_dense_step(self.config.dense_steps)

    # -- per (step bucket, layer) settings -------------------------------------------------------
    def _build_layer_methods(self):
        """One instance of this class per distinct ``layer_settings`` value (built here, once: an
        instance holds only its config and plan cache, so calls need no lock)."""
        settings = getattr(self.config, "layer_settings", None) or {}
        self._layer_table, self._layer_starts, self._layer_variants = {}, [], []
        index = {}
        for key, value in settings.items():
            step, layer = map(int, key.split("_"))
            text = json.dumps(value, sort_keys=True, default=repr)
            if text not in index:
                index[text] = len(self._layer_variants)
                config = None if value is None else dataclasses.replace(self.config, layer_settings=None, **value)
                self._layer_variants.append(None if value is None else type(self)(type(self).make_config(config)))
            self._layer_table[step, layer] = index[text]
        self._layer_starts = sorted({step for step, _ in self._layer_table})

    def layer_method(self, step, layer):
        """``(key, method)`` that runs ``layer`` at ``step`` under ``layer_settings``: the instance with
        the (bucket, layer)'s options, None for a dense entry, or ``self`` (key None) where the
        settings name nothing (no settings, an unnamed layer, or a step before the first bucket)."""
        start = bucket_start(self._layer_starts, step)
        variant = self._layer_table.get((start, layer)) if start is not None else None
        if variant is None:
            return None, self
        return variant, self._layer_variants[variant]

    def variants(self):
        """This method and its per-layer instances (each checked against the model at patch time)."""
        return [self] + [m for m in self._layer_variants if m is not None]

    def __call__(self, ctx, q, k, v):
        """One attention call: a dense layer / step, or the method (with the options that
        ``layer_settings`` gives this call's (step bucket, layer), when it names them).

        A layer's state (``ctx.state``: caches across steps) is cleared when its setting changes at
        a bucket boundary, so no cache made under one setting is read under another; methods treat
        an empty state as their first step (a full / refresh computation)."""
        if self.is_dense_call(ctx):
            ctx.info["dense"] = True
            return self.attend_dense(ctx, q, k, v)
        if not self._layer_table:
            return self.run_checked(ctx, q, k, v)
        key, method = self.layer_method(ctx.step, ctx.layer)
        if ctx.state.get(_SETTING_KEY, key) != key:
            ctx.state.clear()
        ctx.state[_SETTING_KEY] = key
        if method is None:
            ctx.info["dense"] = True
            return self.attend_dense(ctx, q, k, v)
        return method.run_checked(ctx, q, k, v)

    def __repr__(self):
        return f"<fastdit method {self.name} {self.config}>"


def register_method(cls):
    """Register a ``Method`` subclass under ``cls.name`` (usable as a class decorator)."""
    if not (isinstance(cls, type) and issubclass(cls, Method)):
        raise ValueError(f"register_method takes a Method subclass, got {cls!r}")
    if not cls.name:
        raise ValueError("a method needs a name")
    _REGISTRY[cls.name] = cls
    return cls


def unregister_method(name):
    """Remove ``name`` from the registry (a method a test or a plugin registered for a while)."""
    _REGISTRY.pop(name, None)


def get_method(name):
    """The ``Method`` subclass registered as ``name`` (a class or instance passes through)."""
    if isinstance(name, Method):
        return type(name)
    if isinstance(name, type) and issubclass(name, Method):
        return name
    if not isinstance(name, str):
        raise OptionError(f"method must be a method name (str), got {type(name).__name__}: {name!r}; "
                          f"available methods: {sorted(_REGISTRY)}")
    if name not in _REGISTRY:
        raise ValueError(f"unknown method {name!r}; available methods: {sorted(_REGISTRY)}")
    return _REGISTRY[name]


def method_names():
    """The registered methods a user picks by name (``auto``, which needs a plan, is left out)."""
    return sorted(name for name, cls in _REGISTRY.items() if cls.listed)


def runnable_method_names():
    """What a command or the app runs by name: :func:`method_names`, then the methods that run only
    from a calibration file (``calibration_only``: ``auto``), which the caller must supply or find shipped
    with a trained model's weights."""
    listed = method_names()
    return listed + [name for name in methods_with("calibration_only", listed=False) if name not in listed]


def tiny_presets():
    """``method name -> options`` for fastdit's tiny built-in models (each method's ``tiny_options``)."""
    return {name: dict(cls.tiny_options) for name, cls in sorted(_REGISTRY.items()) if cls.tiny_options}


def methods_with(*capabilities, listed=True):
    """Names of the registered methods with every one of ``capabilities`` (``Method`` attributes such
    as ``"ring"``, ``"auto_candidate"``, ``"engine_geometry"``) set, in ``rank`` order (then by name);
    ``listed``: only those ``method_names`` lists (not ``auto``). How consumers ask what a method
    supports (no list of method names outside this registry)."""
    found = [cls for cls in _REGISTRY.values() if (cls.listed or not listed)
             and all(getattr(cls, c, None) for c in capabilities)]
    return [cls.name for cls in sorted(found, key=lambda c: (c.rank, c.name))]


def methods_taking(option):
    """Names of the registered methods whose config has ``option`` (e.g. ``"quant"``), in ``rank`` order."""
    return [name for name in methods_with()
            if option in {f.name for f in dataclasses.fields(_REGISTRY[name].config_cls)}]
