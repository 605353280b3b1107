"""Calibration files (called "plan files" before; ``plan=`` / ``--plan`` still work as aliases of
``calibration=`` / ``--calibration``, so that "plan" means ``BlockPlan``, the mask, only): per (step bucket,
layer, head) method settings, saved as versioned JSON and applied.

``fastdit.calibrate`` writes them and ``fastdit.methods.sta.load_strategy`` imports FastVideo's STA
mask strategies as them. A calibration (``"format": "fastdit-calibration"``, ``"version": 2``; version 1, which
had no ``auto``, still loads) holds

* ``method``: the method it configures;
* ``model``: ``family``, ``transformer`` (class name), ``layers`` (patched attention layers) and
  ``heads`` (per layer), and ``grids``: the latent token grids ``(T, H, W)`` it was calibrated
  for (None / empty where the source does not say, e.g. an imported strategy);
* ``options``: the method's options shared by every layer (for ``sta`` the exact tile, so that
  windows in tiles mean the same token extents on every grid);
* ``step_buckets``: the first step of each bucket (step ``i`` uses the bucket with the largest
  start ``<= i``; later steps than the last start use the last bucket);
* ``strategy`` (``sta``): ``"s_l_h" -> [wt, wh, ww]`` per (bucket start, layer, head), 0 = the
  whole axis; or ``settings`` (other methods): ``"s_l" -> {options}`` per (bucket start, layer),
  null for a (bucket, layer) that runs dense; applied as the method's ``layer_settings`` option
  (``fastdit/methods/base.py``); or (``auto``, version 2) ``candidates``, ``[{"method": name,
  option: value}, ...]``, and ``choices``: ``"s_l_h" -> candidate index`` or null (dense) per
  (bucket start, layer, head), every head of a named (bucket, layer) given, and ``gpu``, the cost
  model's GPU the choice minimised the predicted time on;
* ``budget``, ``prompts``, ``measured`` (error and density per layer), ``candidates``.

``calibration_options(calibration, method, family=..., transformer=..., layers=..., heads=..., grids=...)``
checks that the calibration fits the model and returns the options for ``fastdit.patch(pipe, method,
**options)``; ``calibration_options_for(calibration, target, method)`` reads those facts off a pipeline.
"""
from __future__ import annotations

import json
import os

from fastdit.jsonutil import read_json
from fastdit.methods.base import (  # noqa: F401 (index_key: the calibration-key rule, re-exported)
    get_method, index_key)
from fastdit.methods.sta import (CALIBRATION_FORMAT, CALIBRATION_VERSION, READABLE_FORMATS, choose_tile,
                                 normalize_strategy)

#: Calibration versions this fastdit reads (2 added method ``auto``; a version 1 calibration means what it meant).
READABLE_VERSIONS = (1, 2)

__all__ = ["CALIBRATION_FORMAT", "CALIBRATION_VERSION", "CalibrationError", "calibration_argument",
           "calibration_options", "calibration_options_for", "check_calibration", "grid_reason", "load_calibration",
           "options_set_by", "split_calibration", "with_calibration", "write_calibration"]


class CalibrationError(ValueError):
    """A calibration file that cannot be read, or that does not fit the model it is applied to."""


def calibration_argument(calibration, plan, name="calibration"):
    """The calibration passed as ``name`` (``calibration=`` / ``--calibration``) or by its earlier name
    ``plan`` (an alias that keeps working, without a warning); both at once is refused."""
    if calibration is not None and plan is not None:
        raise CalibrationError(f"{name} and its alias plan were both given; pass one of them")
    return calibration if calibration is not None else plan


def split_calibration(options):
    """``(calibration, other options)`` of an options dict that may name a calibration file under
    ``"calibration"`` or its alias ``"plan"`` (a preset, a ``--set``-built dict); both is refused."""
    rest = {k: v for k, v in options.items() if k not in ("calibration", "plan")}
    return calibration_argument(options.get("calibration"), options.get("plan")), rest


def _where(source):
    return f"calibration file {source}" if source else "calibration file"


def write_calibration(calibration, path):
    """Write ``calibration`` (checked first) as JSON to ``path``, atomically (a temporary file, then rename)."""
    check_calibration(calibration, path)
    path = os.fspath(path)
    temporary = f"{path}.tmp{os.getpid()}"
    with open(temporary, "w", encoding="utf-8") as handle:
        json.dump(calibration, handle, indent=1)
    os.replace(temporary, path)
    return path


def load_calibration(path):
    """Read and check a calibration file; a dict passes through (checked). CalibrationError names the file and
    the entry for a missing, truncated or malformed file."""
    if isinstance(path, dict):
        return check_calibration(path, "")
    path = os.fspath(path)
    calibration = read_json(path, CalibrationError, "calibration file",
                            hint="a calibration is a JSON file written by fastdit calibrate")
    return check_calibration(calibration, path)


def _int(value, low=0):
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def check_calibration(calibration, source=""):
    """Raise CalibrationError (naming ``source`` and the entry) unless ``calibration`` is a well-formed
    calibration; returns it."""
    where = _where(source)
    if not isinstance(calibration, dict):
        raise CalibrationError(f"{where}: a calibration is a JSON object, got {type(calibration).__name__}")
    if calibration.get("format") not in READABLE_FORMATS:
        raise CalibrationError(f"{where}: entry 'format' must be {CALIBRATION_FORMAT!r}, "
                               f"got {calibration.get('format')!r}")
    if (calibration.get("version") not in READABLE_VERSIONS
            or isinstance(calibration.get("version"), bool)):
        raise CalibrationError(f"{where}: entry 'version' is {calibration.get('version')!r}; this fastdit reads "
                               f"versions {list(READABLE_VERSIONS)}")
    method = calibration.get("method")
    try:
        method_cls = get_method(method)
    except (ValueError, TypeError) as error:
        raise CalibrationError(f"{where}: entry 'method': {error}") from None
    model = calibration.get("model")
    if not isinstance(model, dict):
        raise CalibrationError(f"{where}: entry 'model' must be an object with family, transformer, layers, "
                               f"heads, grids")
    for key in ("layers", "heads"):
        if not _int(model.get(key), 1):
            raise CalibrationError(f"{where}: entry 'model.{key}' must be an int >= 1, got {model.get(key)!r}")
    for key in ("family", "transformer"):
        if model.get(key) is not None and not isinstance(model.get(key), str):
            raise CalibrationError(f"{where}: entry 'model.{key}' must be a string or null, got {model.get(key)!r}")
    grids = model.get("grids") or []
    if not isinstance(grids, list) or not all(isinstance(g, list) and len(g) == 3 and all(_int(x, 1) for x in g)
                                              for g in grids):
        raise CalibrationError(f"{where}: entry 'model.grids' must be a list of [T, H, W] (ints >= 1), got {grids!r}")
    options = calibration.get("options", {})
    if not isinstance(options, dict):
        raise CalibrationError(f"{where}: entry 'options' must be an object of method options")
    buckets = calibration.get("step_buckets")
    well_formed = isinstance(buckets, list) and bool(buckets) and all(_int(b) for b in buckets)
    if not well_formed or buckets != sorted(set(buckets)):
        raise CalibrationError(f"{where}: entry 'step_buckets' must be a non-empty increasing list of step indices, "
                               f"got {buckets!r}")
    if method_cls.name == "auto":
        _check_auto(calibration, where, buckets, model)
    elif method_cls.name == "sta":
        strategy = calibration.get("strategy")
        if not isinstance(strategy, dict) or not strategy:
            raise CalibrationError(f"{where}: entry 'strategy' must be a non-empty object "
                                   f"{{'step_layer_head': [wt, wh, ww]}}")
        try:
            normalized = normalize_strategy(strategy)
        except ValueError as error:
            raise CalibrationError(f"{where}: {error}") from None
        for key in normalized:
            step, layer, head = map(int, key.split("_"))
            if step not in buckets or layer >= model["layers"] or head >= model["heads"]:
                raise CalibrationError(f"{where}: strategy entry {key!r} is outside the calibration's step buckets "
                                       f"{buckets}, {model['layers']} layers or {model['heads']} heads")
        # a calibration says every head's window: a missing one would silently run the default window
        named = {}
        for key in normalized:
            step, layer, head = map(int, key.split("_"))
            named.setdefault((step, layer), set()).add(head)
        for (step, layer), heads in sorted(named.items()):
            missing = sorted(set(range(model["heads"])) - heads)
            if missing:
                raise CalibrationError(f"{where}: strategy has no entry for head(s) {missing} of step bucket {step}, "
                                       f"layer {layer} (e.g. '{step}_{layer}_{missing[0]}'); a calibration gives every "
                                       f"head of a layer it names a window ([0, 0, 0]: dense)")
        if "tile" not in (calibration.get("options") or {}):
            raise CalibrationError(f"{where}: an sta calibration's entry 'options' must give the 'tile' its windows "
                                   f"count in (without it the windows would mean other token extents)")
    else:
        settings = calibration.get("settings")
        if not isinstance(settings, dict) or not settings:
            raise CalibrationError(f"{where}: entry 'settings' must be a non-empty object "
                                   f"{{'step_layer': {{options}}}}")
        for key, value in settings.items():
            parts = index_key(key, 2)
            if parts is None or not (value is None or isinstance(value, dict)):
                raise CalibrationError(f"{where}: settings entry {key!r}: keys are 'step_layer' (two ints) and values "
                                       f"objects of options, or null (dense)")
            if int(parts[0]) not in buckets or int(parts[1]) >= model["layers"]:
                raise CalibrationError(f"{where}: settings entry {key!r} is outside the calibration's step buckets "
                                       f"or layers")
    try:
        method_cls.make_config(**_decoded(options, calibration))
    except (ValueError, TypeError) as error:
        entry = "'settings'" if "layer_settings entry" in str(error) else "'options'"
        raise CalibrationError(f"{where}: entry {entry}: {error}") from None
    return calibration


def _check_auto(calibration, where, buckets, model):
    """An auto calibration: version 2, ``candidates`` a list, ``choices`` per (bucket, layer, head) inside the
    model with every head of a named (bucket, layer) given (a missing head would run dense silently)."""
    if calibration.get("version") < 2:
        raise CalibrationError(f"{where}: method 'auto' needs calibration version 2, got version "
                               f"{calibration.get('version')}")
    candidates, choices = calibration.get("candidates"), calibration.get("choices")
    if not isinstance(candidates, list) or not candidates:
        raise CalibrationError(f"{where}: entry 'candidates' must be a non-empty list of "
                               f"{{'method': name, option: value}}")
    if not isinstance(choices, dict) or not choices:
        raise CalibrationError(f"{where}: entry 'choices' must be a non-empty object "
                               f"{{'step_layer_head': index or null}}")
    named = {}
    for key in choices:
        parts = index_key(key, 3)
        if parts is None:
            raise CalibrationError(f"{where}: choices entry {key!r}: keys are 'step_layer_head' (three ints, "
                                   f"ASCII digits)")
        step, layer, head = parts
        if step not in buckets or layer >= model["layers"] or head >= model["heads"]:
            raise CalibrationError(f"{where}: choices entry {key!r} is outside the calibration's step buckets "
                                   f"{buckets}, {model['layers']} layers or {model['heads']} heads")
        named.setdefault((step, layer), set()).add(head)
    for (step, layer), heads in sorted(named.items()):
        missing = sorted(set(range(model["heads"])) - heads)
        if missing:
            raise CalibrationError(f"{where}: choices has no entry for head(s) {missing} of step bucket {step}, "
                                   f"layer {layer}")


def _decoded(options, calibration):
    """Calibration options (JSON lists) as method options: triples as tuples, plus the per-head strategy
    (sta) or the per-(bucket, layer) ``layer_settings`` (other methods)."""
    decoded = {k: tuple(v) if isinstance(v, list) and all(isinstance(x, int) for x in v) else v
               for k, v in options.items()}
    if calibration.get("method") == "auto":
        decoded["candidates"] = [_decoded(c, {}) for c in calibration.get("candidates") or []]
        decoded["choices"] = dict(calibration.get("choices") or {})
    elif calibration.get("method") == "sta" and calibration.get("strategy"):
        decoded["strategy"] = {k: tuple(v) for k, v in calibration["strategy"].items()}
    elif calibration.get("method") != "sta" and calibration.get("settings"):
        decoded["layer_settings"] = {k: None if v is None else _decoded(v, {})
                                     for k, v in calibration["settings"].items()}
    return decoded


def grid_reason(calibration, grids):
    """None when the calibration's settings mean the same on ``grids``, else why not."""
    planned = [tuple(g) for g in calibration["model"].get("grids") or []]
    others = [tuple(g) for g in grids or [] if tuple(g) not in planned]
    if not others or not planned:
        return None
    options = calibration.get("options", {})
    if calibration["method"] == "sta":
        tile = options.get("tile")
        fitted = tile is None or options.get("fit_tile")
        if not fitted:
            return None  # windows count tiles of a fixed size: the same token extents on every grid
        target = tuple(tile) if tile is not None else (6, 8, 8)
        tiles = {choose_tile(g, target) for g in planned + others}
        if len(tiles) == 1:
            return None
        return (f"the tile is fitted per grid ({'fit_tile' if tile else 'tile chosen per resolution'}): grid "
                f"{others[0]} gets tile {choose_tile(others[0], target)} but the calibration was made for "
                f"{planned[0]} with tile {choose_tile(planned[0], target)}, so its windows in tiles would cover "
                f"other token extents")
    return (f"method {calibration['method']!r} settings were measured on grid(s) {planned}; on {others[0]} they "
            f"need not mean the same (only sta windows in fixed tiles carry over)")


def calibration_options(calibration, method, *, family=None, transformer=None, layers=None, heads=None, grids=None):
    """The options that apply ``calibration`` with ``fastdit.patch(target, method, **options)``.

    The calibration must be for ``method``, the model's ``family``, ``transformer`` class name, number of
    patched ``layers`` and ``heads`` per layer (a fact given as None is not checked; neither is one
    the calibration leaves null). ``grids``: the latent grids it will run on; another grid than the calibration's
    is accepted where the settings mean the same thing there (sta windows in a fixed tile) and
    refused otherwise. CalibrationError names the mismatch.
    """
    source = calibration if isinstance(calibration, (str, os.PathLike)) else ""
    calibration = load_calibration(calibration)
    where = _where(source)
    method_name = get_method(method).name
    if calibration["method"] != method_name:
        raise CalibrationError(f"{where} is for method {calibration['method']!r}, not {method_name!r}")
    model = calibration["model"]
    facts = (("family", family), ("transformer", transformer), ("layers", layers), ("heads", heads))
    for key, actual in facts:
        if actual is not None and model.get(key) is not None and model[key] != actual:
            what = {"family": "model family", "transformer": "transformer class", "layers": "number of patched "
                    "attention layers", "heads": "number of attention heads"}[key]
            raise CalibrationError(f"{where} does not fit this model: {what} is {actual!r} but the calibration was "
                                   f"made for {model[key]!r}")
    reason = grid_reason(calibration, grids)
    if reason is not None:
        raise CalibrationError(f"{where} cannot be applied to grid "
                               f"{tuple(grids[0]) if len(grids) == 1 else grids}: {reason}")
    options = _decoded(calibration.get("options", {}), calibration)
    get_method(method_name).make_config(**options)  # a calibration whose options no longer validate fails here
    return options


def options_set_by(options):
    """The option names a calibration fixes, given its ``calibration_options``: its shared ``options``, its
    per-head ``strategy`` (sta; it gives the windows, so ``window`` too) or its ``layer_settings``
    and every option those settings name. Passing one of these beside ``calibration=`` is refused."""
    names = set(options)
    if "choices" in options:  # auto: the calibration fixes every candidate's options
        names |= {k for c in options.get("candidates") or [] for k in c if k != "method"}
    for value in (options.get("layer_settings") or {}).values():
        names |= set(value or {})
    if "strategy" in options:
        names.add("window")
    return names


def with_calibration(planned, given, source=""):
    """``given`` options applied on top of a calibration's (``planned``, from ``calibration_options``): the one rule
    for options beside ``calibration=``. Options the calibration sets cannot be passed with it (CalibrationError naming
    them: changing them would change what the calibrated settings mean, or silently lose them);
    the others apply on top."""
    clash = sorted(set(given) & options_set_by(planned))
    if clash:
        raise CalibrationError(f"{_where(source)} sets option(s) {clash}: they cannot be passed beside calibration= "
                               f"(edit the calibration, or pass no calibration); options the calibration does not set "
                               f"apply on top of it")
    return {**planned, **given}


def model_facts(target):
    """``(family, transformer class, patched layers, heads)`` of a pipeline or transformer."""
    from fastdit.pipelines import find_adapter

    if hasattr(target, "transformer"):
        transformers = [t for t in (getattr(target, "transformer", None), getattr(target, "transformer_2", None))
                        if t is not None]
    else:
        transformers = [target]
    transformers = [getattr(t, "_orig_mod", t) for t in transformers]
    adapter = find_adapter(transformers[0])
    modules = [m for t in transformers for _, m in adapter.attention_modules(t)]
    heads = sorted({getattr(m, "heads", None) for m in modules} - {None})
    return adapter.family, type(transformers[0]).__name__, len(modules), heads[0] if len(heads) == 1 else None


def calibration_options_for(calibration, target, method, grids=None):
    """``calibration_options`` with the model facts read off ``target`` (a pipeline or its transformer)."""
    family, transformer, layers, heads = model_facts(target)
    return calibration_options(calibration, method, family=family, transformer=transformer, layers=layers, heads=heads,
                               grids=grids)
