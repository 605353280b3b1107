"""Settings (a method with one set of options), samples (setting x prompt x seed) and the
fingerprints a stored sample must match to be reused."""
from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
from dataclasses import dataclass, field

from fastdit.calibration.calibration_file import split_calibration
from fastdit.eval.runner.config import EvalError
from fastdit.eval.runner.prompts import Prompt
from fastdit.jsonutil import to_json

__all__ = ["Sample", "Setting", "build_samples", "build_settings", "fingerprint", "format_option_value",
           "tiny_method_presets"]


@dataclass(frozen=True)
class Setting:
    name: str
    method: str
    options: dict = field(default_factory=dict, hash=False, compare=False)
    #: the cache-dit cache this setting runs with (``EvalConfig.cache``), or None
    cache: str | None = None

    @property
    def is_reference(self):
        """The unpatched, uncached dense setting: every fidelity metric's reference."""
        return self.method == "dense" and self.cache is None

    @property
    def slug(self):
        """The setting's folder name under ``samples/``."""
        return re.sub(r"[^A-Za-z0-9._=+-]+", "_", self.name.replace("[", "-").replace("]", "")).strip("_")


@dataclass(frozen=True)
class Sample:
    setting: Setting
    prompt_index: int
    prompt: Prompt
    seed: int

    @property
    def key(self):
        return (self.setting.name, self.prompt_index, self.seed)

    def stem(self, out):
        """``OUT/samples/<setting>/<prompt>_<seed>``: the sample's files are this plus a suffix."""
        return os.path.join(out, "samples", self.setting.slug, f"{self.prompt_index}_{self.seed}")


def format_option_value(value):
    """An option value in a setting's name: tuples of numbers as ``4x4x8``."""
    if isinstance(value, (tuple, list)):
        return "x".join(str(v) for v in value) if all(isinstance(v, (int, float)) for v in value) else str(list(value))
    return str(value)


def method_presets(model, grid=None):
    """``(presets, label)``: the method presets of one of fastdit's own models. A trained model
    (``tiny-shapes``) uses the presets calibrated on it and shipped beside its weights
    (``presets.json``; methods it does not name run at their defaults; ``grid``, the run's latent
    grid: calibrated plans that do not carry over to it give way to the file's options, see
    ``trained_presets``); the random-weight tiny models use each method's ``tiny_options`` (chosen
    for near-uniform attention); other models none."""
    from fastdit.methods import tiny_presets
    from fastdit.pipelines.loading import builtin_model, trained_grid, trained_name, trained_presets

    if trained_name(model):
        label = f"calibrated for {model} (presets.json beside its weights)"
        if grid is not None and tuple(grid) != tuple(trained_grid(model)):
            label += (f"; on the latent grid {tuple(grid)} the plans calibrated for {tuple(trained_grid(model))} "
                      f"give way to the file's options, except those that carry over")
        return trained_presets(model, grid=grid), label
    if builtin_model(model):
        return tiny_presets(), "random-weight tiny-model presets"
    return {}, "none"


def tiny_method_presets(model, methods, options, grid=None):
    """``options`` (method -> options) with the built-in model's method presets underneath
    (see :func:`method_presets`; ``grid``: the run's latent grid); else unchanged. A preset that is
    a calibration file (``{"calibration": path}``) gives way to the user's ``--calibration``, and to
    user options that the calibration sets (``--set sta.tile=...`` on tiny-shapes: the preset
    file's options for that method run instead of its calibration, with a note)."""
    options = {method: dict(values) for method, values in options.items()}
    presets, _ = method_presets(model, grid)
    if presets:
        for method, preset in presets.items():
            if method in methods:
                given = options.get(method, {})
                calibrated, rest = split_calibration(preset)
                if calibrated is not None and split_calibration(given)[0] is not None:
                    preset = rest  # the user's own calibration replaces the preset's
                elif calibrated is not None:
                    preset = _unless_calibrated_options_given(model, method, preset, calibrated, given)
                options[method] = {**preset, **given}
    return options


def _unless_calibrated_options_given(model, method, preset, path, given):
    """``preset`` (its calibration file at ``path``), or the preset file's options for ``method``
    when ``given`` sets an option the calibration sets (the user chose those options; the
    calibration would refuse them)."""
    from fastdit.calibration.calibration_file import calibration_options, options_set_by
    from fastdit.pipelines.loading import trained_name, trained_presets

    clash = sorted(set(given) & options_set_by(calibration_options(path, method)))
    if not clash or not trained_name(model):
        return preset
    print(f"note: {method}: {', '.join(clash)} given, so {model}'s calibration for {method} "
          f"({path}) is not used; its preset options run under yours")
    return trained_presets(model, calibrations=False).get(method, {})


def options_with_calibration(method, options):
    """``options`` as ``fastdit.patch(pipe, method, **options)`` will apply them: a calibration file
    (``calibration`` or its alias ``plan``, from ``--calibration`` or a trained model's presets)
    replaced by its own options with the others on top (the one rule of ``with_calibration``), so a
    setting is checked before any model loads exactly as the patch will check it."""
    from fastdit.calibration.calibration_file import calibration_options, with_calibration

    path, given = split_calibration(options)
    if path is None:
        return options
    return with_calibration(calibration_options(path, method), given, path)


def build_settings(cfg):
    """Settings in run order: dense, then each method (one per grid combination)."""
    import fastdit

    methods = ["dense"] + [m for m in cfg.methods if m != "dense"]
    runnable = fastdit.methods.runnable_method_names()
    unknown = [m for m in methods if m not in runnable]
    if unknown:
        raise EvalError(f"unknown method(s) {', '.join(unknown)}; available: {', '.join(runnable)}")
    for method in list(cfg.options) + list(cfg.grid):
        if method not in methods:
            raise EvalError(f"options given for method {method!r}, which is not in --methods {','.join(methods)}")
    if cfg.grid.get("dense"):
        raise EvalError("--grid on dense: dense is the reference and takes no options")
    settings = []
    for method in methods:
        base = dict(cfg.options.get(method, {}))
        grid = cfg.grid.get(method) or {}
        names = list(grid)
        for combo in itertools.product(*(grid[n] for n in names)) if names else [()]:
            options = {**base, **dict(zip(names, combo))}
            label = method if not names else (
                method + "[" + ",".join(f"{n}={format_option_value(v)}" for n, v in zip(names, combo)) + "]")
            try:
                fastdit.methods.get_method(method).make_config(None, **options_with_calibration(method, options))
            except (TypeError, ValueError) as error:  # CalibrationError is a ValueError
                raise EvalError(f"setting {label}: {error}") from None
            settings.append(Setting(label, method, options))
            if cfg.cache is not None:  # the same setting under cache-dit, right after it
                settings.append(Setting(f"{label}+{cfg.cache}", method, options, cache=cfg.cache))
    return settings


def build_samples(cfg, settings):
    """All samples in a fixed order: setting, then prompt, then seed."""
    return [Sample(s, i, p, int(seed)) for s in settings for i, p in enumerate(cfg.prompts) for seed in cfg.seeds]


def fingerprint(cfg, sample):
    """What a stored sample must match to be reused on resume: model, requested sizes, dtype,
    backend, method and options, prompt text and seed; for a calibration file its content too (a
    file re-calibrated in place must not reuse the samples of its earlier settings)."""
    data = {"model": cfg.model, "call": cfg.call, "dtype": cfg.dtype, "backend": cfg.backend,
            "method": sample.setting.method, "options": sample.setting.options,
            "prompt": sample.prompt.text, "seed": sample.seed}
    calibration = split_calibration(sample.setting.options)[0]
    if isinstance(calibration, (str, os.PathLike)) and os.path.isfile(calibration):
        with open(calibration, "rb") as handle:
            data["calibration_sha1"] = hashlib.sha1(handle.read()).hexdigest()
    if sample.setting.cache is not None:  # (absent otherwise: fingerprints of uncached runs are unchanged)
        data["cache"] = {"name": sample.setting.cache, "options": cfg.cache_options}
    return hashlib.sha1(json.dumps(to_json(data), sort_keys=True).encode()).hexdigest()[:16]
