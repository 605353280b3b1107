"""The options every method shares (``MethodConfig``) and how options are declared and checked.

``option`` declares a config field with the metadata the CLI, the app and the docs show;
``check_number`` / ``check_int`` are how every method's ``validate`` checks its numbers;
``layer_settings`` (per step bucket and layer) is normalised here, and ``bucket_start`` finds a
step's bucket. Re-exported by ``fastdit.methods.base`` (the method protocol and the registry).
"""
from __future__ import annotations

import bisect
import dataclasses
import math
import re
from dataclasses import dataclass, field


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
                raise ValueError(f"dense_steps as a fraction must be in [0, 1), got {steps!r}; "
                                 "pass an int to count steps")
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
