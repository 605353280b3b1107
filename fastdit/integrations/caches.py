"""cache-dit's block caches around a fastdit run (``pip install "fastdit[cache]"``).

``fastdit compare --cache dbcache`` and ``fastdit eval --cache dbcache`` run every method with and
without cache-dit's DBCache (``cache_dit.enable_cache(pipe, cache_config=DBCacheConfig(...))``):
cache-dit skips whole transformer blocks on steps whose first blocks' residual changed little,
fastdit makes the attention of the blocks that do run sparse; the two compose (tested in
``tests/integrations/test_cache_dit.py``: fastdit counts only the attention calls that really ran, and removing
both restores the pipeline bit for bit).

DBCache settings fitted to the model (cache-dit's defaults compute 8 front blocks and warm up for
8 steps, which asserts on models of fewer blocks and caches nothing in a run of 8 steps):

* ``Fn_compute_blocks`` = ``clamp(n // 4, 1, 8)`` with ``n`` the blocks of the shortest block list
  (HunyuanVideo / Flux have two), ``Bn_compute_blocks`` = 0;
* ``max_warmup_steps`` = ``clamp(steps // 4, 1, 8)`` (the first steps always compute);
* ``residual_diff_threshold`` = 0.08, cache-dit's default.

``--cache-set NAME=VALUE`` overrides any ``DBCacheConfig`` field.
"""
from __future__ import annotations

import dataclasses
import re
from collections import Counter

#: Caches ``--cache`` accepts.
CACHES = ("dbcache",)
#: cache-dit's default residual threshold (a block's output is reused while the relative change of
#: the first blocks' residual stays below it).
DEFAULT_THRESHOLD = 0.08


def require_cache_dit():
    """The ``cache_dit`` module, or ValueError saying how to install it."""
    try:
        import cache_dit
    except ImportError as error:
        raise ValueError(f"--cache needs cache-dit, which is not installed ({error}); install it with "
                         f"pip install \"fastdit[cache]\"") from None
    return cache_dit


def check_cache(name, parallel=False):
    """Refuse a cache fastdit cannot run (ValueError with the reason)."""
    if name not in CACHES:
        raise ValueError(f"unknown cache {name!r}; available: {', '.join(CACHES)}")
    if parallel:
        raise ValueError("--cache with --cp is not supported: cache-dit brings its own context parallelism "
                         "(cache_dit.enable_cache(..., parallelism_config=...)), and its block caches under "
                         "diffusers' Ulysses attention with fastdit on every rank are untested; run one of them")
    require_cache_dit()


def block_lists(transformer):
    """Blocks per block list, from fastdit's adapter: ``{"transformer_blocks": 2, ...}``."""
    from fastdit.pipelines import find_adapter

    adapter = find_adapter(transformer)
    counts = Counter(re.sub(r"\.\d+\..*$", "", name) for name, _ in adapter.attention_modules(transformer))
    return dict(counts)


#: ``--cache-set`` fields fastdit checks before any run: (kind, least value). cache-dit's
#: ``DBCacheConfig`` takes any value and fails inside the first cached run (a TypeError on a text
#: threshold, an AssertionError on a negative block count), after the dense run has finished.
CHECKED_FIELDS = {
    "Fn_compute_blocks": ("int", 1), "Bn_compute_blocks": ("int", 0), "max_warmup_steps": ("int", 0),
    "warmup_interval": ("int", 1), "max_cached_steps": ("int", -1), "max_continuous_cached_steps": ("int", -1),
    "residual_diff_threshold": ("number", 0.0), "max_accumulated_residual_diff_threshold": ("number or None", 0.0),
    "cfg_compute_first": ("bool", None), "cfg_diff_compute_separate": ("bool", None),
    "enable_separate_cfg": ("bool or None", None),
}


def check_cache_values(overrides, num_steps=None):
    """Raise ValueError (``--cache-set FIELD: ...``, one line) for an unknown ``DBCacheConfig`` field
    or a value of the wrong kind or range (a block count below 1, a threshold that is text, NaN or
    negative, more warm-up steps than the run has); before any model work."""
    import math

    cache_dit = require_cache_dit()
    valid = {f.name for f in dataclasses.fields(cache_dit.DBCacheConfig)}
    unknown = sorted(set(overrides or {}) - valid)
    if unknown:
        raise ValueError(f"--cache-set: unknown DBCacheConfig field(s) {unknown}; valid: {sorted(valid)}")
    for name, value in (overrides or {}).items():
        if name not in CHECKED_FIELDS:
            continue
        kind, least = CHECKED_FIELDS[name]
        if value is None and kind.endswith("or None"):
            continue
        if kind.startswith("bool"):
            ok = isinstance(value, bool)
        elif kind == "int":
            ok = isinstance(value, int) and not isinstance(value, bool) and value >= least
        else:
            ok = (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
                  and value >= least)
        if not ok:
            what = {"int": f"an int >= {least}", "bool": "true or false", "bool or None": "true, false or none",
                    "number": f"a finite number >= {least:g}",
                    "number or None": f"a finite number >= {least:g} or none"}[kind]
            raise ValueError(f"--cache-set {name}: must be {what}, got {value!r}")
    warmup = (overrides or {}).get("max_warmup_steps")
    if num_steps is not None and warmup is not None and warmup > int(num_steps):
        raise ValueError(f"--cache-set max_warmup_steps: must be at most the run's {int(num_steps)} steps (the "
                         f"first max_warmup_steps steps always compute, so more caches nothing), got {warmup}")


def cache_settings(name, pipe, num_steps, overrides=None):
    """Keyword arguments for ``cache_dit.enable_cache(pipe, ...)``: a ``DBCacheConfig`` fitted to
    the model and the run (see the module docstring), with ``overrides`` (field -> value) applied."""
    cache_dit = require_cache_dit()
    check_cache(name)
    shortest = min(block_lists(pipe.transformer).values())
    fields = {"Fn_compute_blocks": min(max(shortest // 4, 1), 8), "Bn_compute_blocks": 0,
              "max_warmup_steps": min(max(int(num_steps) // 4, 1), 8), "residual_diff_threshold": DEFAULT_THRESHOLD}
    check_cache_values(overrides, num_steps)
    fields.update(overrides or {})
    if fields["Fn_compute_blocks"] + fields["Bn_compute_blocks"] > shortest:
        raise ValueError(f"--cache-set: Fn_compute_blocks + Bn_compute_blocks = "
                         f"{fields['Fn_compute_blocks'] + fields['Bn_compute_blocks']} but the model's shortest block "
                         f"list has {shortest} blocks")
    return {"cache_config": cache_dit.DBCacheConfig(**fields)}


class CacheRun:
    """``with CacheRun(pipe, settings):`` cache-dit enabled on ``pipe`` inside, disabled after;
    ``stats`` then holds ``cached_steps`` (the most steps any block list reused) and the config."""

    def __init__(self, pipe, settings):
        self.pipe, self.settings, self.stats = pipe, settings, {}

    def __enter__(self):
        require_cache_dit().enable_cache(self.pipe, **self.settings)
        return self

    def __exit__(self, *exc):
        cache_dit = require_cache_dit()
        try:
            summaries = cache_dit.summary(self.pipe, logging=False)
            cached = [len(getattr(s, "cached_steps", None) or []) for s in summaries]
            config = self.settings["cache_config"]
            self.stats = {"cached_steps": max(cached, default=0),
                          "config": {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
                                     if f.name in ("Fn_compute_blocks", "Bn_compute_blocks", "max_warmup_steps",
                                                   "residual_diff_threshold")}}
        finally:
            cache_dit.disable_cache(self.pipe)
        return False
