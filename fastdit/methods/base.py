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

import bisect
import collections
import dataclasses
import json
import math
import re
import threading
from dataclasses import dataclass, field

from fastdit.plan import run_plan

from .guard_hooks import GuardHooks

_REGISTRY = {}
#: The quality guard's default bound (relative L2 error of a head's output on sampled rows) for
#: the methods that have it on by default (dynamic and token methods); see ``guard.py``.
GUARD_DEFAULT = 0.1

#: ``ctx.state`` key of the ``layer_settings`` entry a layer last ran with.
_SETTING_KEY = "fastdit.layer_setting"


def option(default, help, *, range=None, choices=None, widget=None, advanced=False, **kwargs):
    """A config field with the metadata the CLI, the app and the docs show: ``help`` text, a
    ``range`` ``(low, high)`` for numbers, ``choices`` for strings, a ``widget`` kind
    (``"number"``, ``"slider"``, ``"triple"``, ``"checkbox"``, ``"dropdown"``, ``"text"``), and
    ``advanced``: an expert option the app keeps in its collapsed "Advanced" group (and the options
    tables mark). A new method's options then appear everywhere without editing the CLI or the app."""
    metadata = {"help": help, "range": range, "choices": choices, "widget": widget, "advanced": bool(advanced)}
    if isinstance(default, (list, dict, set)):
        return field(default_factory=lambda: type(default)(default), metadata=metadata, **kwargs)
    return field(default=default, metadata=metadata, **kwargs)


#: ``family name -> adapter or None``, registered by ``fastdit.pipelines`` (methods know no models:
#: the dependency points from the model adapters down to the methods, not the other way).
_FAMILY_SOURCE = []


def set_family_defaults_source(lookup):
    """Register ``lookup(family) -> object with method_defaults | None`` (done by fastdit.pipelines)."""
    _FAMILY_SOURCE[:] = [lookup]


def check_number(name, value, low=None, high=None, *, low_open=False, high_open=False, note=""):
    """``float(value)`` when ``value`` is a real number (not a bool, not NaN) between ``low`` and
    ``high`` (None: unbounded; ``*_open``: that end excluded), else a ``ValueError`` naming the
    option, the interval, what it means (``note``) and the value: how every method's ``validate``
    checks its numeric options."""
    if low is not None and high is not None:
        interval = f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    elif low is not None:
        interval = f"{'>' if low_open else '>='} {low:g}"
    else:
        interval = f"{'<' if high_open else '<='} {high:g}"
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    if not ok:
        raise ValueError(f"{name} must be a number {interval}{f' ({note})' if note else ''}, got {value!r}")
    return float(value)


def check_int(name, value, low=1, note=""):
    """``value`` when it is an int (not a bool) of at least ``low``, else a ``ValueError`` as
    ``check_number``'s."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}{f' ({note})' if note else ''}, got {value!r}")
    return value


class OptionError(ValueError, TypeError):
    """A bad method name or option (a ValueError, and a TypeError when the type is wrong)."""


@dataclass
class MethodConfig:
    """Options every method accepts.

    Attributes:
        dense_steps: denoising steps that run dense attention. An int counts steps; a float in
            [0, 1) is a fraction of the steps the pipeline call actually runs (an img2img call at
            strength 0.5 runs half the schedule). Steps are counted from 0 within each pipeline
            call and step ``i`` runs dense iff ``i < dense_steps`` (for a fraction,
            ``i < dense_steps * num_steps``). None: the method's default for the model family.
        dense_layers: the first N patched layers of each transformer always run dense. None: the
            family default.
        layer_settings: per (step bucket, layer) options, ``{"s_l": {option: value}}`` (``s`` the
            first step of the bucket, ``l`` the patched layer in model order), or ``{"s_l": None}``
            for a (bucket, layer) that runs dense. Step ``i`` uses the bucket with the largest start
            ``<= i``; earlier steps and layers the dict does not name use the other options. What
            ``fastdit.calibrate`` writes for methods other than ``sta`` (see ``Method.layer_method``).
    """

    dense_steps: int | float | None = option(
        None, "denoising steps that run dense first: an int count, or a fraction in [0, 1) of the steps the call runs",
        range=(0, None), widget="number")
    dense_layers: int | None = option(None, "the first N patched layers of each transformer always run dense",
                                      range=(0, None), widget="number")
    layer_settings: dict | None = option(
        None, "per (step bucket, layer) options: {'s_l': {option: value}} or {'s_l': None} (dense); step i uses "
        "the bucket with the largest start <= i; unnamed layers and earlier steps use the other options",
        widget="text", advanced=True)
    guard: float | bool | None = option(
        None, "quality guard: per head, the relative L2 error bound checked on sampled query rows against exact "
        "dense rows; a head above it (or below its promised mass) is widened, then run dense. false: off; "
        "empty: the method's default", range=(0, None), widget="number")
    guard_rows: float = option(0.005, "guard: sampled query rows per head as a fraction of the call's rows (at least "
                               "one per 128 tokens and 32 in all)", range=(0.0, 1.0), widget="number", advanced=True)
    guard_refresh: int = option(4, "guard: a head's widened or dense setting is kept for this many steps, then "
                                "tried again at the method's own", range=(1, None), widget="number", advanced=True)

    def validate(self):
        if self.guard is not None and self.guard is not False:
            if self.guard is True:
                raise ValueError("guard must be a number in (0, inf) (relative L2 error bound per head), False (off) "
                                 "or None (the method's default), got True")
            check_number("guard", self.guard, 0, math.inf, low_open=True, high_open=True,
                         note="relative L2 error bound per head; False: off")
        self.guard_rows = check_number("guard_rows", self.guard_rows, 0, 1, low_open=True,
                                       note="sampled query rows per head, a fraction of the call's rows")
        check_int("guard_refresh", self.guard_refresh, 1, note="steps a head keeps its guarded setting")
        steps = self.dense_steps
        if steps is not None:
            if isinstance(steps, bool) or not isinstance(steps, (int, float)):
                raise ValueError(f"dense_steps must be an int (count) or a float in [0, 1) (fraction), got {steps!r}")
            if isinstance(steps, float) and not 0.0 <= steps < 1.0:
                raise ValueError(f"dense_steps as a fraction must be in [0, 1), got {steps!r}; pass an int to count steps")
            if isinstance(steps, int) and steps < 0:
                raise ValueError(f"dense_steps must be >= 0, got {steps!r}")
        if self.dense_layers is not None and (
            isinstance(self.dense_layers, bool) or not isinstance(self.dense_layers, int) or self.dense_layers < 0
        ):
            raise ValueError(f"dense_layers must be an int >= 0, got {self.dense_layers!r}")
        if self.layer_settings is not None:
            self.layer_settings = normalize_layer_settings(self)


#: Options a ``layer_settings`` entry may not set: they are read once per call before the layer's
#: setting is looked up (``dense_steps``, ``dense_layers``), or they are the per-layer table itself.
#: A (bucket, layer) that should run dense is written as ``None``.
NOT_PER_LAYER = ("dense_steps", "dense_layers", "layer_settings", "guard_refresh")


def index_key(key, parts):
    """The ints of a ``'a_b[_c]'`` key of ``parts`` ASCII decimal numbers without leading zeros, or
    None (``'²_0_0'`` and ``'٠_0_0'`` are no keys: one would not parse, the other would repeat ``0_0_0``)."""
    if not isinstance(key, str) or not re.fullmatch(r"(0|[1-9][0-9]*)" + r"_(0|[1-9][0-9]*)" * (parts - 1), key):
        return None
    return tuple(int(x) for x in key.split("_"))


def _parse_layer_key(key):
    parts = key.split("_") if isinstance(key, str) else []
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise ValueError(f"layer_settings entry {key!r}: keys are 'step_layer' (two ints >= 0, e.g. '10_3': the "
                         f"first step of a bucket and a patched layer)")
    return int(parts[0]), int(parts[1])


def normalize_layer_settings(config):
    """``config.layer_settings`` checked and in canonical form (sorted by (step, layer), each entry
    validated as ``config`` with its options applied); ValueError names the entry."""
    settings = config.layer_settings
    if not isinstance(settings, dict):
        raise ValueError(f"layer_settings must be a dict {{'step_layer': {{option: value}} or None}}, got "
                         f"{type(settings).__name__}")
    names = [f.name for f in dataclasses.fields(config)]
    checked = {}
    for key, value in settings.items():
        step_layer = _parse_layer_key(key)
        if step_layer in checked:
            raise ValueError(f"layer_settings entry {key!r}: (step, layer) {step_layer} is given twice")
        if value is not None:
            if not isinstance(value, dict):
                raise ValueError(f"layer_settings entry {key!r}: a setting is a dict of options or None (dense), "
                                 f"got {value!r}")
            unknown = sorted(set(value) - set(names))
            if unknown:
                raise ValueError(f"layer_settings entry {key!r}: unknown option(s) {unknown}; valid options: "
                                 f"{[n for n in names if n not in NOT_PER_LAYER]}")
            fixed = sorted(set(value) & set(NOT_PER_LAYER))
            if fixed:
                raise ValueError(f"layer_settings entry {key!r}: option(s) {fixed} cannot be set per layer (they "
                                 f"apply to the whole patch); write None for a (bucket, layer) that runs dense")
            try:
                overridden = dataclasses.replace(config, layer_settings=None, **value)
                overridden.validate()
            except (ValueError, TypeError) as error:
                raise ValueError(f"layer_settings entry {key!r}: {error}") from None
            value = {name: getattr(overridden, name) for name in value}  # canonical form (e.g. tuples)
        checked[step_layer] = value
    return {f"{s}_{layer}": checked[s, layer] for s, layer in sorted(checked)}


def bucket_start(starts, step):
    """The step bucket ``step`` belongs to: the largest of the sorted ``starts`` that is ``<= step``
    (None before the first). Shared by ``layer_settings`` and sta's ``strategy``."""
    index = bisect.bisect_right(starts, step) - 1
    return starts[index] if index >= 0 else None


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
            raise OptionError(f"quant is an option of the block-sparse methods (sta, radial, sparge, svg, svg2), "
                              f"which run the block-sparse engine; method {cls.name!r} does not")
        if unknown:
            raise ValueError(f"unknown option(s) {unknown} for method {cls.name!r}; valid options: {valid}")
        config = dataclasses.replace(config, **options) if config is not None else cls.config_cls(**options)
        config.validate()
        return config

    @classmethod
    def resolve(cls, config, adapter=None):
        """Fill options left at None: the model family's defaults (``adapter.method_defaults``),
        then the method's ``default_options``, then 0 for ``dense_steps`` / ``dense_layers``.
        ``adapter`` may be an object with ``method_defaults`` (an ``Adapter``), a family name
        (looked up through the registered family source, see ``set_family_defaults_source``) or None."""
        family_defaults = {}
        if isinstance(adapter, str):
            adapter = _FAMILY_SOURCE[0](adapter) if _FAMILY_SOURCE else None
        if adapter is not None:
            family_defaults = dict(getattr(adapter, "method_defaults", {}).get(cls.name, {}))
        defaults = {"dense_steps": 0, "dense_layers": 0, "guard": cls.guard_default, **cls.default_options,
                    **family_defaults}
        filled = {name: value for name, value in defaults.items()
                  if hasattr(config, name) and getattr(config, name) is None}
        config = dataclasses.replace(config, **filled)
        config.validate()
        return config

    @classmethod
    def check_family(cls, adapter, config):
        """Raise ValueError when the method does not apply to the adapter's model family."""

    def check_heads(self, num_heads):
        """Raise ValueError when an option cannot be honoured on a layer of ``num_heads`` heads
        (called at patch time with the model's head count)."""

    def check_layers(self, num_layers):
        """Raise ValueError when an option names a layer the model does not have (called at patch
        time with the number of patched attention layers, over all patched transformers)."""
        outside = [key for key in getattr(self.config, "layer_settings", None) or {} if int(key.split("_")[1]) >= num_layers]
        if outside:
            raise ValueError(f"layer_settings entry {outside[0]!r} names layer {outside[0].split('_')[1]} but the model "
                             f"has {num_layers} patched attention layers (0 to {num_layers - 1})")

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


def tiny_presets():
    """``method name -> options`` for fastdit's tiny built-in models (each method's ``tiny_options``)."""
    return {name: dict(cls.tiny_options) for name, cls in sorted(_REGISTRY.items()) if cls.tiny_options}
