"""NVIDIA ModelOpt's sparse-attention profile (``sparse_attention_config``), read and written.

ModelOpt (``nvidia-modelopt``, ``modelopt.torch.sparsity.attention_sparsity``) calibrates sparse
attention on a model and its HF / diffusers export writes the result into each component's
``config.json`` under ``sparse_attention_config``; TensorRT-LLM and vllm-omni read it
(``load_from_checkpoint_metadata`` in ``modelopt.torch.sparsity.attention_sparsity.plugins``
resolves it). The format, as ModelOpt 0.47 writes it::

    "sparse_attention_config": {
      "config_groups": {
        "group_0": {
          "algorithm": "skip_softmax",
          "targets": ["WanAttention"],            # attention classes the profile covers
          "ignore": ["blocks.0.attn2", ...],      # modules of those classes kept dense
          "initial_disabled_steps": 2,            # first denoising steps dense (written when > 0)
          "threshold_scale_factor": {"formula": "a * exp(b * target_sparsity)",
                                     "prefill": {"a": 431.8, "b": 1.01}, "decode": {...}},
          "target_sparsity": {"prefill": 0.5}     # or one number for both phases
        },
        "group_1": {"algorithm": "sparse_softmax", "sparsity_n": 2, "sparsity_m": 4, ...}
      },
      "producer": {"name": "modelopt", "version": "0.47.0"}
    }

Skip-softmax's threshold on a call with ``N_k`` keys is ``lambda = a * exp(b * target_sparsity) /
N_k``: a key tile whose scores all lie below the running row maximum plus ``ln(lambda)`` is
skipped (diffusion models run the ``prefill`` phase only). A group without calibrated ``a``, ``b``
means ModelOpt's default static ``lambda = 0.1``. Video Sparse Attention groups carry
``algorithm: "vsa"``, ``block_size_3d`` ``[t, h, w]`` and ``top_k_ratio`` (ModelOpt's
``VSAAttributeConfig``).

What fastdit runs for each algorithm (``ALGORITHMS``): ``skip_softmax`` -> the ``skip_softmax``
method (``fastdit/methods/skip_softmax.py``: every key block listed, the engine's in-kernel skip
rule at ``scale_factor = a * exp(b * target_sparsity)``; ``initial_disabled_steps`` ->
``dense_steps``; ``ignore`` -> those patched layers dense through ``layer_settings``), ``vsa`` ->
the ``vsa`` method when this fastdit has one. Any other algorithm (``sparse_softmax``: N:M
sparse softmax) raises ``ProfileError`` naming it and what fastdit has.

fastdit writes a ``skip_softmax`` calibration (``fastdit.calibrate(pipe, "skip_softmax", ...)``, or any
calibration file of that method) the same way, with ``"producer": {"name": "fastdit", ...}`` and a
``"fastdit"`` entry holding the model facts (family, transformer, layers, heads) so that reading it
back onto another model is refused naming both. fastdit's calibration picks one threshold, not a
curve: it writes ``b = FLAT_B`` (ModelOpt's runtime needs ``a, b > 0``) and ``a`` so that
``a * exp(b * target_sparsity)`` is its scale factor; changing ``target_sparsity`` at serving time
therefore barely moves the threshold. ModelOpt's profile has one threshold per component: where a
calibration's layers have their own thresholds (``fastdit.calibrate`` picks one per layer), the strictest
(smallest ``lambda``) is written, which keeps every layer within its calibrated error budget, and
the per-layer factors are recorded under ``"fastdit"``; a calibration with step buckets beyond the first,
or other per-layer options, is refused.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, fields

import torch
from torch.overrides import TorchFunctionMode

from fastdit.calibration.calibration_file import (CalibrationError, calibration_options_for, load_calibration,
                                                  model_facts)
from fastdit.jsonutil import read_json

__all__ = ["ALGORITHMS", "FLAT_B", "FORMULA", "Profile", "ProfileError", "ProfileGroup", "SoftmaxAttention",
           "apply_profile", "profile_options", "read_profile", "sparse_attention_config", "write_profile"]

#: ModelOpt algorithm -> the fastdit method that runs it.
ALGORITHMS = {"skip_softmax": "skip_softmax", "vsa": "vsa"}
FORMULA = "a * exp(b * target_sparsity)"
#: ModelOpt's static threshold for a skip_softmax group without calibration (SKIP_SOFTMAX_TRITON_DEFAULT).
DEFAULT_LAMBDA = 0.1
#: ``-ln(DEFAULT_LAMBDA)``: the skip_softmax method's threshold when none is given.
DEFAULT_THRESHOLD = -math.log(DEFAULT_LAMBDA)
#: The options that carry a skip_softmax threshold.
THRESHOLD_OPTIONS = ("skip_threshold", "scale_factor")
#: ModelOpt's target sparsity when a profile gives none.
DEFAULT_TARGET = 0.5
#: The ``b`` fastdit writes (a single calibrated threshold, no sparsity curve; must be > 0).
FLAT_B = 1e-6


class SoftmaxAttention(TorchFunctionMode):
    """Inside it, ``F.scaled_dot_product_attention`` runs as ``softmax(q k^T * scale + mask) v``
    through ``torch.nn.functional.softmax`` (looked up per call). ModelOpt's PyTorch skip-softmax
    path (``flash_skip_softmax``: calibration, and its masked inference) patches ``F.softmax``, which
    diffusers' SDPA attention never calls; run a diffusers pipeline or model under this mode to
    calibrate it with ModelOpt on any device (scores are materialised: small sizes only). Boolean
    or additive ``attn_mask``, ``is_causal`` and ``enable_gqa`` are honoured; dropout is refused."""

    ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is not torch.nn.functional.scaled_dot_product_attention:
            return func(*args, **(kwargs or {}))
        call = {**dict(zip(self.ARGS, args)), **(kwargs or {})}
        if call.get("dropout_p"):
            raise ValueError(f"SoftmaxAttention runs attention without dropout, got dropout_p={call['dropout_p']}")
        q, k, v = call["query"], call["key"], call["value"]
        if call.get("enable_gqa") and k.shape[-3] != q.shape[-3]:
            k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
            v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
        scale = call.get("scale") or 1.0 / math.sqrt(q.shape[-1])
        scores = (q @ k.transpose(-1, -2)) * scale
        mask = call.get("attn_mask")
        if call.get("is_causal"):
            mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
        return torch.nn.functional.softmax(scores, dim=-1) @ v


class ProfileError(CalibrationError):
    """A ``sparse_attention_config`` that cannot be read, run or written for this model."""


@dataclass
class ProfileGroup:
    """One config group: its ModelOpt ``algorithm``, the fastdit ``method`` and ``options`` that run
    it, the ``targets`` (attention class names) and ``ignore`` (module names kept dense)."""

    name: str
    algorithm: str
    method: str
    options: dict
    targets: tuple = ()
    ignore: tuple = ()


@dataclass
class Profile:
    """A read ``sparse_attention_config``: its groups, ``producer`` and (fastdit's own) model facts."""

    groups: list
    producer: dict = field(default_factory=dict)
    model: dict | None = None
    source: str = ""

    @property
    def group(self):
        """The one group fastdit runs (a profile with several runnable groups is refused on read)."""
        return self.groups[0]


def _where(source):
    return f"profile {source}" if source else "profile"


def _load(source):
    """``(sparse_attention_config dict, source name)`` from a dict, a config.json, a component folder
    or an object with a ``sparse_attention_config`` attribute (a transformers / diffusers config)."""
    if isinstance(source, dict):
        data, name = source, ""
    elif isinstance(source, (str, os.PathLike)):
        name = os.fspath(source)
        path = os.path.join(name, "config.json") if os.path.isdir(name) else name
        data = read_json(path, ProfileError, "profile", hint="a profile is a component's config.json")
        name = path
    else:
        config = getattr(source, "config", source)
        data = getattr(config, "sparse_attention_config", None)
        if data is None and isinstance(config, dict):
            data = config.get("sparse_attention_config")
        name = type(source).__name__
        if data is None:
            raise ProfileError(f"{type(source).__name__} has no sparse_attention_config (give a config.json, a "
                               f"component folder, or the dict)")
    if isinstance(data, dict) and "sparse_attention_config" in data:
        data = data["sparse_attention_config"]
    if not isinstance(data, dict) or "config_groups" not in data:
        raise ProfileError(f"{_where(name)}: no sparse_attention_config with config_groups (what ModelOpt's export "
                           f"writes into a component's config.json)")
    return data, name


def _number(value, what, where, positive=False):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or (
            positive and value <= 0):
        raise ProfileError(f"{where}: {what} must be a finite {'positive ' if positive else ''}number, got {value!r}")
    return float(value)


def _target_sparsity(value, where):
    """The prefill target of ``target_sparsity`` (one number for both phases, or per phase)."""
    if value is None:
        return DEFAULT_TARGET
    if isinstance(value, dict):
        value = value.get("prefill", DEFAULT_TARGET)
    value = _number(value, "target_sparsity", where)
    if not 0.0 <= value <= 1.0:
        raise ProfileError(f"{where}: target_sparsity must be in [0, 1], got {value}")
    return value


def _skip_softmax_options(group, where, target_sparsity):
    scale = group.get("threshold_scale_factor")
    params = scale.get("prefill") if isinstance(scale, dict) else None
    options = {}
    if isinstance(params, dict) and "a" in params and "b" in params:
        formula = scale.get("formula", FORMULA)
        if formula.replace(" ", "") != FORMULA.replace(" ", ""):
            raise ProfileError(f"{where}: threshold_scale_factor formula {formula!r} is not {FORMULA!r}")
        a = _number(params["a"], "threshold_scale_factor.prefill.a", where)
        b = _number(params["b"], "threshold_scale_factor.prefill.b", where)
        target = _target_sparsity(group.get("target_sparsity") if target_sparsity is None else target_sparsity, where)
        if a > 0 and b > 0:  # what ModelOpt's runtime requires of a calibration; else its static default
            options["scale_factor"] = a * math.exp(b * target)
    if "scale_factor" not in options:
        options["skip_threshold"] = DEFAULT_THRESHOLD
    steps = group.get("initial_disabled_steps", 0)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ProfileError(f"{where}: initial_disabled_steps must be an int >= 0, got {steps!r}")
    options["dense_steps"] = steps
    return options


def _vsa_options(group, where):
    from fastdit.methods import get_method

    names = {f.name for f in fields(get_method("vsa").config_cls)}
    options = {}
    for key in ("block_size_3d", "top_k_ratio"):
        if key in group:
            if key not in names:
                raise ProfileError(f"{where}: fastdit's vsa method has no option {key!r} "
                                   f"(its options: {sorted(names)})")
            value = group[key]
            options[key] = tuple(value) if isinstance(value, list) else value
    return options


def read_profile(source, *, target_sparsity=None):
    """Read a ``sparse_attention_config`` (see the module docstring) into a ``Profile``.

    ``source``: a component's ``config.json`` or its folder, the config dict (whole or just the
    ``sparse_attention_config``), or a config object carrying it. ``target_sparsity`` overrides the
    profile's (as ModelOpt lets a server change it without recalibrating). ``ProfileError`` names an
    algorithm fastdit does not have, and the ones it has.
    """
    from fastdit.methods import get_method, method_names

    data, name = _load(source)
    where = _where(name)
    groups = data.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ProfileError(f"{where}: config_groups must be a non-empty object of groups")
    read = []
    for key, group in groups.items():
        if not isinstance(group, dict) or not isinstance(group.get("algorithm"), str):
            raise ProfileError(f"{where}: config_groups.{key} must be an object with an 'algorithm' name")
        algorithm = group["algorithm"]
        here = f"{where}: config_groups.{key}"
        if algorithm not in ALGORITHMS:
            raise ProfileError(f"{here}: algorithm {algorithm!r} has no fastdit equivalent; fastdit runs the ModelOpt "
                               f"algorithms {sorted(ALGORITHMS)} (as its methods {sorted(set(ALGORITHMS.values()))}); "
                               f"its own methods are {method_names()}")
        method = ALGORITHMS[algorithm]
        try:
            get_method(method)
        except ValueError:
            raise ProfileError(f"{here}: algorithm {algorithm!r} runs as fastdit's method {method!r}, which this "
                               f"fastdit does not have yet; its methods are {method_names()}") from None
        options = (_skip_softmax_options(group, here, target_sparsity) if algorithm == "skip_softmax"
                   else _vsa_options(group, here))
        try:
            get_method(method).make_config(**options)
        except (ValueError, TypeError) as error:
            raise ProfileError(f"{here}: {error}") from None
        for entry in ("targets", "ignore"):
            value = group.get(entry, [])
            if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
                raise ProfileError(f"{here}: {entry} must be a list of names, got {value!r}")
        read.append(ProfileGroup(key, algorithm, method, options, tuple(group.get("targets", [])),
                                 tuple(group.get("ignore", []))))
    if len(read) > 1:
        raise ProfileError(f"{where}: groups {[g.name for g in read]} ({[g.algorithm for g in read]}) would each set "
                           f"the attention; fastdit runs one method per model")
    model = (data.get("fastdit") or {}).get("model")
    return Profile(read, dict(data.get("producer") or {}), model if isinstance(model, dict) else None, name)


def _transformer(target):
    transformer = getattr(target, "transformer", None) if hasattr(target, "transformer") else target
    return getattr(transformer, "_orig_mod", transformer)


def _patched(target):
    """``[(name, module)]`` of the attention modules fastdit patches in ``target``'s transformer."""
    from fastdit.pipelines import find_adapter

    transformer = _transformer(target)
    return find_adapter(transformer).attention_modules(transformer), transformer


def profile_options(profile, target):
    """``(method, options)`` that run ``profile`` on ``target`` (a pipeline or its transformer) with
    ``fastdit.patch``. ``ProfileError`` (a ``CalibrationError``) when the profile was made for another
    model: its attention classes, the modules it names or (fastdit's profiles) its layers and heads.
    A profile is one component's (``transformer``): on a pipeline with a second transformer (Wan 2.2)
    fastdit runs it on both, and ``ignore`` names modules of the first."""
    profile = profile if isinstance(profile, Profile) else read_profile(profile)
    where, group = _where(profile.source), profile.group
    patched, transformer = _patched(target)
    family, cls, layers, heads = model_facts(target)
    if profile.model:
        facts = (("family", family, "model family"), ("transformer", cls, "transformer class"),
                 ("layers", layers, "number of patched attention layers"),
                 ("heads", heads, "number of attention heads"))
        for key, actual, what in facts:
            made = profile.model.get(key)
            if made is not None and actual is not None and made != actual:
                raise ProfileError(f"{where} does not fit this model: {what} is {actual!r} but the profile was made "
                                   f"for {made!r}")
    classes = sorted({type(m).__name__ for _, m in patched})
    if group.targets and not set(group.targets) & set(classes):
        raise ProfileError(f"{where} does not fit this model: it targets attention classes {list(group.targets)} but "
                           f"this model's ({cls}) are {classes}")
    names = {name for name, _ in transformer.named_modules()}
    unknown = [name for name in group.ignore if name not in names]
    if unknown:
        raise ProfileError(f"{where} does not fit this model: it names module {unknown[0]!r}, which {cls} does not "
                           f"have (its {layers} patched attention layers are {patched[0][0]} .. {patched[-1][0]}); "
                           f"the profile was made for another model")
    options = dict(group.options)
    dense = [index for index, (name, _) in enumerate(patched) if name in group.ignore]
    if dense:
        options["layer_settings"] = {f"0_{index}": None for index in dense}
    return group.method, options


def apply_profile(target, profile, **options):
    """``fastdit.patch(target, ...)`` running ``profile`` (see ``profile_options``); ``options``
    apply on top (e.g. ``backend``), except those the profile sets (``ProfileError`` names them)."""
    from fastdit.apply import patch

    method, planned = profile_options(profile, target)
    clash = sorted(set(planned) & set(options))
    if clash:
        raise ProfileError(f"the profile sets option(s) {clash}; they cannot be passed beside it")
    return patch(target, method, **planned, **options)


def sparse_attention_config(calibration, target, *, keys=None, steps=None, target_sparsity=None):
    """The ``sparse_attention_config`` (dict) of a fastdit ``skip_softmax`` calibration for ``target``.

    ``calibration``: a calibration file or dict (checked against ``target`` like ``fastdit.patch(..., calibration=)``).
    ``keys``: the key count a fixed ``skip_threshold`` was meant for (``scale_factor = keys *
    exp(-skip_threshold)``); default the token count of the calibration's one grid. ``steps``: the run's
    steps when ``dense_steps`` is a fraction. ``target_sparsity``: what to record (default: the
    calibration's measured skipped share, else 0.5).
    """
    from fastdit import __version__

    source = calibration if isinstance(calibration, (str, os.PathLike)) else ""
    calibration = load_calibration(calibration)
    where = f"calibration file {source}" if source else "calibration file"
    writable = sorted(m for m in set(ALGORITHMS.values()) if m == "skip_softmax")
    if calibration["method"] not in writable:
        raise ProfileError(f"{where} is for method {calibration['method']!r}; ModelOpt's sparse_attention_config "
                           f"carries {sorted(ALGORITHMS)}, which fastdit writes from calibrations of {writable}")
    options = calibration_options_for(calibration, target, calibration["method"])
    patched, transformer = _patched(target)
    settings = options.pop("layer_settings", None) or {}
    dense = set(range(options.get("dense_layers") or 0))
    own = {}  # layer -> its threshold option, where its setting gives one
    for key, value in settings.items():
        step, layer = map(int, key.split("_"))
        if step != 0:
            raise ProfileError(f"{where}: settings entry {key!r} starts at step {step}; ModelOpt's "
                               f"sparse_attention_config has no step buckets (only initial_disabled_steps)")
        if value is None:
            dense.add(layer)
            continue
        other = sorted(k for k in value if k not in THRESHOLD_OPTIONS and value[k] != options.get(k))
        if other:
            raise ProfileError(f"{where}: settings entry {key!r} sets {other}; ModelOpt's sparse_attention_config "
                               f"carries one threshold per component and nothing else per layer")
        own[layer] = {k: value[k] for k in THRESHOLD_OPTIONS if value.get(k) is not None}

    def key_count():
        if keys is not None:
            return keys
        grids = calibration["model"].get("grids") or []
        if len(grids) != 1:
            raise ProfileError(f"{where}: a fixed skip_threshold becomes ModelOpt's scale factor for one key count; "
                               f"the calibration has grids {grids}: pass keys=")
        return math.prod(grids[0])

    def factor(chosen):
        if chosen.get("scale_factor") is not None:
            return float(chosen["scale_factor"])
        threshold = chosen.get("skip_threshold")
        return key_count() * math.exp(-(DEFAULT_THRESHOLD if threshold is None else threshold))

    shared = {k: options.get(k) for k in THRESHOLD_OPTIONS}
    factors = {layer: factor(own.get(layer) or shared) for layer in range(len(patched)) if layer not in dense}
    scale = min(factors.values()) if factors else factor(shared)  # the strictest: every layer within its budget
    dense_steps = options.get("dense_steps") or 0
    if isinstance(dense_steps, float):
        if steps is None:
            raise ProfileError(f"{where}: dense_steps is a fraction ({dense_steps}); pass steps= (the run's steps) to "
                               f"write ModelOpt's initial_disabled_steps")
        dense_steps = math.ceil(dense_steps * steps)
    if target_sparsity is None:
        measured = (calibration.get("measured") or {}).get("skipped")
        target_sparsity = measured if isinstance(measured, (int, float)) else DEFAULT_TARGET
    classes = sorted({type(m).__name__ for _, m in patched})
    patched_names = [name for name, _ in patched]
    ignore = [patched_names[i] for i in sorted(dense)]
    ignore += [name for name, module in transformer.named_modules()
               if type(module).__name__ in classes and name not in patched_names]  # e.g. cross-attention
    group = {"algorithm": "skip_softmax", "targets": classes}
    if ignore:
        group["ignore"] = ignore
    if dense_steps:
        group["initial_disabled_steps"] = int(dense_steps)
    group["threshold_scale_factor"] = {"formula": FORMULA,
                                       "prefill": {"a": scale / math.exp(FLAT_B * target_sparsity), "b": FLAT_B}}
    group["target_sparsity"] = {"prefill": float(target_sparsity)}
    family, cls, layers, heads = model_facts(target)
    return {"config_groups": {"group_0": group}, "producer": {"name": "fastdit", "version": __version__},
            "fastdit": {"method": calibration["method"],
                        "scale_factors": {str(k): v for k, v in sorted(factors.items())},
                        "model": {"family": family, "transformer": cls, "layers": layers, "heads": heads}}}


def write_profile(calibration, path, target, **kwargs):
    """Write ``sparse_attention_config(calibration, target, **kwargs)`` into ``path``: a ``.json`` file or a
    component folder (its ``config.json``; the folder is made when missing), merged into what is
    there, else a new file. Returns the dict."""
    config = sparse_attention_config(calibration, target, **kwargs)
    path = os.fspath(path)
    if os.path.isdir(path) or not path.endswith(".json"):  # a component folder (made when missing)
        os.makedirs(path, exist_ok=True)
        path = os.path.join(path, "config.json")
    data = {}
    if os.path.exists(path):
        data = read_json(path, ProfileError, "the component config to merge the profile into")
        if not isinstance(data, dict):
            raise ProfileError(f"{path}: a config.json holds a JSON object, got {type(data).__name__}")
    data["sparse_attention_config"] = config
    temporary = f"{path}.tmp{os.getpid()}"
    with open(temporary, "w", encoding="utf-8") as handle:
        json.dump(data, handle, indent=2)
    os.replace(temporary, path)
    return config
