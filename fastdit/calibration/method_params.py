"""A method's own trainable parameters (gates, projections): train, save and load them with the LoRA.

Some methods learn parameters of their own besides the model's (VSA's gates, SLA's projection). A
method declares them with ``Method.layer_module(heads, head_dim)``: one ``torch.nn.Module`` per
patched attention layer, built by the patch (instance-level, on the ``Patch`` as
``patch.method_modules``, never set on the model: ``remove()`` leaves the model unchanged) and
handed to each call as ``ctx.params``. Their initial values are the method's training-free form.

* ``method_parameters(patch)``: the parameters, in layer order (``fastdit.train`` adds them to the
  optimiser beside the LoRA's, with ``patch(..., trainable=True)`` they require grad).
* ``save_method_params(patch, folder)``: ``fastdit_method_params.safetensors`` (tensors keyed
  ``<layer name>::<parameter name>``, float32) with a record in the file's metadata: method, model
  class and family, the method's ``layer_module_key()`` (options the parameters depend on, e.g. a
  block size), every layer's parameter shapes and the latent grids they were trained on.
* ``load_method_params(patch, source)`` (also ``fastdit.patch(..., method_params=source)``): the
  file (or its folder, or ``(record, state)``) checked against the patch before anything is
  copied: a method, model class, option key, layer set or shape that differs raises ``CalibrationError``
  naming both sides; the grids are checked at the first call on each new latent grid (CalibrationError
  naming the trained grids and the call's), as a calibrated plan's are.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

FILE = "fastdit_method_params.safetensors"
FORMAT, VERSION = "fastdit-method-params", 1
_SEP = "::"


def method_parameters(patch):
    """The trainable parameters of ``patch``'s method modules, in layer order (empty: none)."""
    return [p for name in patch.layers if name in patch.method_modules
            for p in patch.method_modules[name].parameters()]


def method_state(patch):
    """``{"<layer>::<parameter>": float32 CPU tensor}`` of every method module of ``patch``."""
    return {f"{layer}{_SEP}{key}": value.detach().float().cpu().contiguous()
            for layer, module in patch.method_modules.items() for key, value in module.state_dict().items()}


def method_record(patch, grids=None):
    """What the parameters were made for (module docstring); ``grids``: default the patch's
    ``grids_seen``."""
    model = patch.model_class
    grids = sorted(patch.grids_seen if grids is None else {tuple(g) for g in grids})
    return {"format": FORMAT, "version": VERSION, "method": patch.method, "model": model, "family": patch.family,
            "key": patch.layer_module_key(), "grids": [list(g) for g in grids],
            "layers": {layer: {k: list(v.shape) for k, v in module.state_dict().items()}
                       for layer, module in patch.method_modules.items()}}


def save_method_params(patch, folder, grids=None):
    """Write ``folder/fastdit_method_params.safetensors``; returns its path, or None when the method
    has no parameters of its own (nothing is written)."""
    if not patch.method_modules:
        return None
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / FILE
    partial = path.with_name(path.name + ".partial")
    save_file(method_state(patch), str(partial), metadata={"fastdit": json.dumps(method_record(patch, grids))})
    os.replace(partial, path)
    return path


def read_method_params(source):
    """``(record, state, where)`` of a saved file, its folder, or a ``(record, state)`` pair."""
    from fastdit.calibration.calibration_file import CalibrationError

    if isinstance(source, (tuple, list)) and len(source) == 2 and isinstance(source[0], dict):
        return source[0], source[1], "(given record)"
    if not isinstance(source, (str, os.PathLike)):
        raise CalibrationError(f"method_params must be a {FILE} path, its folder or a (record, state) pair, got "
                               f"{type(source).__name__}")
    path = Path(source)
    if path.is_dir():
        path = path / FILE
    if not path.is_file():
        raise CalibrationError(f"method_params: {path} is not a file (fastdit.train writes {FILE} beside the LoRA)")
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            record = json.loads((handle.metadata() or {}).get("fastdit", "null"))
            state = {key: handle.get_tensor(key) for key in handle.keys()}
    except Exception as error:  # noqa: BLE001 - surfaced with the file's name
        raise CalibrationError(f"method_params: cannot read {path}: {error}") from error
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise CalibrationError(f"method_params: {path} is not a fastdit method-parameter file (no {FORMAT!r} record)")
    return record, state, str(path)


def check_method_params(patch, record, state, where=""):
    """CalibrationError naming both sides when ``record`` / ``state`` do not fit ``patch`` (module docstring)."""
    from fastdit.calibration.calibration_file import CalibrationError

    mine = method_record(patch, grids=())
    if record.get("version") != VERSION:
        raise CalibrationError(f"method parameters {where}: version {record.get('version')!r}, this fastdit reads "
                               f"{VERSION}")
    for field, what in (("method", "method"), ("model", "model class"), ("key", "options")):
        if record.get(field) != mine[field]:
            raise CalibrationError(f"method parameters {where} were trained for {what} {record.get(field)!r}; this "
                                   f"patch is {what} {mine[field]!r}")
    if not mine["layers"]:
        raise CalibrationError(f"method parameters {where}: method {patch.method!r} adds no parameters of its own")
    if set(record.get("layers", {})) != set(mine["layers"]):
        theirs, ours = sorted(record.get("layers", {})), sorted(mine["layers"])
        raise CalibrationError(f"method parameters {where} name {len(theirs)} layers ({', '.join(theirs[:3])}, ...); "
                               f"this model's patch has {len(ours)} ({', '.join(ours[:3])}, ...)")
    for layer, shapes in mine["layers"].items():
        saved = record["layers"][layer]
        if saved != shapes:
            raise CalibrationError(f"method parameters {where}: layer {layer} has shapes {saved} there, {shapes} in "
                                   "this model (another head count or head size)")
        missing = [k for k in shapes if f"{layer}{_SEP}{k}" not in state]
        if missing:
            raise CalibrationError(f"method parameters {where}: layer {layer} lacks tensor(s) {missing}")


def load_method_params(patch, source):
    """Copy saved parameters into ``patch``'s method modules after ``check_method_params``; the grids
    they were trained on are checked at each call (``Patch._on_transformer_call``)."""
    record, state, where = read_method_params(source)
    check_method_params(patch, record, state, where)
    with torch.no_grad():
        for layer, module in patch.method_modules.items():
            for key, value in module.state_dict().items():
                value.copy_(state[f"{layer}{_SEP}{key}"].to(value))
    patch.set_param_grids(record.get("grids") or [], where)
    return record
