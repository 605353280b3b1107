"""The ComfyUI nodes: "fastdit Sparse Attention" and one typed node per method.

Widgets are built from each method's option metadata (``option(...)`` in its config dataclass, read
by ``fastdit.app.method_options.option_specs``, as the Gradio app builds its widgets):

* every node: ``model`` (MODEL), ``dense_steps`` (FLOAT; -1: the method's / model family's default;
  a whole number >= 1 counts steps, a value in [0, 1) is a fraction of the sampler's steps),
  ``dense_blocks`` (INT, fastdit's ``dense_layers``; -1: the default), and optional
  ``calibration_file`` (a calibration file written by ``fastdit calibrate``; blank: none; a
  ``plan_file`` value, its earlier name, is still taken) and ``options`` (``name=value`` pairs, one
  per line or separated by spaces: any option of the method, advanced ones included; they win over
  the widgets);
* "fastdit Sparse Attention" adds a ``method`` dropdown (every registered method);
* "fastdit Sparse Attention (METHOD)" has that method's main (non-advanced) options as typed
  widgets: INT / FLOAT with the option's range, BOOLEAN, a dropdown for choices (with ``model
  default`` where the option may be left to the model family), STRING for triples, text and
  options whose default the method or family chooses (blank: that default). A widget left at its
  default is not passed (so calibration files, which fix some options, combine with the node's defaults).

``FastditSparseAttention.patch`` returns ``ModelPatcher.clone()`` with the attention override and
the diffusion-model wrapper of ``runtime.FastditAttention`` (the input model is untouched); a model
family the node does not support passes through unchanged, with one warning per model class.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import re
import warnings

from fastdit.app.method_options import DEFAULT_CHOICE, option_specs, parse_option
from fastdit.calibration.calibration_file import (calibration_argument, calibration_options, load_calibration,
                                                  with_calibration)
from fastdit.methods.base import get_method, method_names
from fastdit.methods.config import MethodConfig

from .families import find_family, supported_classes
from .runtime import WRAPPER_KEY, FastditAttention

__all__ = ["CATEGORY", "FastditSparseAttention", "NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "node_widgets",
           "widget_of"]

CATEGORY = "advanced/attention"
NAME = "fastdit Sparse Attention"
DEFAULT_METHOD = "sta"
_SHARED = {f.name for f in dataclasses.fields(MethodConfig)}
_INT_MAX = 2 ** 31 - 1
_WARNED = set()
_LOG = logging.getLogger("fastdit.comfyui")

COMMON_TOOLTIPS = {
    "dense_steps": "denoising steps that run dense attention first: -1 the method's / model family's default; "
                   "a whole number >= 1 counts steps; a value in [0, 1) is a fraction of the sampler's steps",
    "dense_blocks": "the first N transformer blocks always run dense attention (fastdit's dense_layers); "
                    "-1: the method's / model family's default",
    "calibration_file": "a calibration JSON written by `fastdit calibrate` for this model and method (blank: none)",
    "options": "more options as name=value (one per line or space-separated), advanced ones included; "
               "they win over the widgets",
}


def main_specs(method):
    """The ``OptionSpec``s a method's typed node shows: its own non-advanced options."""
    return [s for s in option_specs(method) if not s.advanced and s.name not in _SHARED]


def widget_of(spec):
    """A ComfyUI input type ``(type, params)`` for one ``OptionSpec``."""
    tooltip = spec.help
    if spec.kind in ("int", "float") and spec.default is not None:
        low, high = spec.range or (None, None)
        if spec.kind == "int":
            return "INT", {"default": spec.default, "min": -_INT_MAX if low is None else int(low),
                           "max": _INT_MAX if high is None else int(high), "tooltip": tooltip}
        return "FLOAT", {"default": spec.default, "min": -1e9 if low is None else float(low),
                         "max": 1e9 if high is None else float(high), "step": 0.01, "tooltip": tooltip}
    if spec.kind == "bool" and spec.default is not None:
        return "BOOLEAN", {"default": bool(spec.default), "tooltip": tooltip}
    if spec.kind == "bool":
        return [DEFAULT_CHOICE, "on", "off"], {"default": DEFAULT_CHOICE, "tooltip": tooltip}
    if spec.kind == "choice":
        choices = [str(c) for c in spec.choices]
        if spec.optional:
            choices = [DEFAULT_CHOICE] + choices
        return choices, {"default": str(spec.display(spec.default)), "tooltip": tooltip}
    shown = spec.display(spec.default)
    return "STRING", {"default": "" if shown is None else str(shown),
                      "tooltip": f"{tooltip} (blank: {spec.default_text()})"}


def node_widgets(method=None):
    """``INPUT_TYPES()`` of the generic node (``method=None``) or of one method's typed node."""
    required = {"model": ("MODEL",)}
    if method is None:
        required["method"] = (list(method_names()), {"default": DEFAULT_METHOD,
                                                     "tooltip": "the fastdit attention method"})
    required["dense_steps"] = ("FLOAT", {"default": -1.0, "min": -1.0, "max": 1e4, "step": 0.05,
                                         "tooltip": COMMON_TOOLTIPS["dense_steps"]})
    required["dense_blocks"] = ("INT", {"default": -1, "min": -1, "max": 10000,
                                        "tooltip": COMMON_TOOLTIPS["dense_blocks"]})
    if method is not None:
        for spec in main_specs(method):
            required[spec.name] = widget_of(spec)
    optional = {"calibration_file": ("STRING", {"default": "", "tooltip": COMMON_TOOLTIPS["calibration_file"]}),
                "options": ("STRING", {"default": "", "multiline": True, "tooltip": COMMON_TOOLTIPS["options"]})}
    return {"required": required, "optional": optional}


# --------------------------------------------------------------------------------------------- #
# Reading the widgets
# --------------------------------------------------------------------------------------------- #


def _given(method, widgets, dense_steps, dense_blocks, options_text):
    """The options the widgets set (widgets left at their default are not set)."""
    specs = {s.name: s for s in option_specs(method)}
    given = {}
    for name, value in widgets.items():
        spec = specs.get(name)
        if spec is None:
            raise ValueError(f"{NAME}: {method!r} has no option {name!r}; its options: {sorted(specs)}")
        parsed = parse_option(spec, value)
        if parsed is not None and parsed != spec.default:
            given[name] = parsed
    if dense_steps is not None and float(dense_steps) != -1.0:
        steps = float(dense_steps)
        if steps < 0:
            raise ValueError(f"{NAME}: dense_steps must be -1 (default), a count >= 1 or a fraction in [0, 1), "
                             f"got {dense_steps!r}")
        given["dense_steps"] = int(steps) if steps.is_integer() else steps
    if dense_blocks is not None and int(dense_blocks) != -1:
        if int(dense_blocks) < 0:
            raise ValueError(f"{NAME}: dense_blocks must be -1 (default) or >= 0, got {dense_blocks!r}")
        given["dense_layers"] = int(dense_blocks)
    for pair in re.split(r"\s+", (options_text or "").strip()):
        if not pair:
            continue
        name, sep, value = pair.partition("=")
        name = "dense_layers" if name == "dense_blocks" else name
        if not sep or name not in specs:
            raise ValueError(f"{NAME}: options takes name=value pairs of {method!r} options, got {pair!r}; "
                             f"its options: {sorted(specs)}")
        given[name] = parse_option(specs[name], value)
    return given


def _adapter(family):
    from fastdit.pipelines import registered_adapters

    return next((a for a in registered_adapters() if a.family == family), None)


class FastditSparseAttention:
    """"fastdit Sparse Attention": MODEL in, a patched clone out (see the module docstring)."""

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "patch"
    CATEGORY = CATEGORY
    DESCRIPTION = ("Runs a fastdit sparse / token attention method in the model's self- and joint-attention "
                   "(Wan, HunyuanVideo, LTX-Video, Flux); other models pass through unchanged.")
    METHOD = None  # set on the typed per-method nodes

    @classmethod
    def INPUT_TYPES(cls):  # noqa: N802 (ComfyUI's name)
        return node_widgets(cls.METHOD)

    def patch(self, model, method=None, dense_steps=-1.0, dense_blocks=-1, calibration_file="", options="",
              plan_file="", **widgets):
        method = self.METHOD or method or DEFAULT_METHOD
        if method not in method_names():
            raise ValueError(f"{NAME}: unknown method {method!r}; available: {list(method_names())}")
        diffusion_model = getattr(getattr(model, "model", None), "diffusion_model", None)
        family = find_family(diffusion_model) if diffusion_model is not None else None
        if family is None:
            kind = type(diffusion_model).__name__ if diffusion_model is not None else type(model).__name__
            if kind not in _WARNED:
                _WARNED.add(kind)
                message = (f"{NAME}: model class {kind} is not supported (supported: {supported_classes()}); "
                           f"the model passes through unchanged")
                warnings.warn(message, stacklevel=2)
                _LOG.warning(message)
            return (model,)
        method_cls = get_method(method)
        given = _given(method, widgets, dense_steps, dense_blocks, options)
        layers, heads = family.layers(diffusion_model), family.heads(diffusion_model)
        calibration = None
        path = calibration_argument(str(calibration_file or "").strip() or None, str(plan_file or "").strip() or None,
                                    "calibration_file")
        if path is not None:
            path = os.path.expanduser(path)
            calibration = (load_calibration(path), path)
            calibrated = calibration_options(path, method, family=family.family, layers=layers, heads=heads)
            given = with_calibration(calibrated, given, path)
        try:
            config = method_cls.resolve(options=given, adapter=family.family)
            instance = method_cls(config)
            instance.check_heads(heads)
            instance.check_layers(layers)
            adapter = _adapter(family.family)
            if adapter is not None:
                method_cls.check_family(adapter, config)
        except (ValueError, TypeError) as error:
            raise ValueError(f"{NAME} ({method} on {family.label}): {error}") from None
        return (patched_clone(model, family, method, config, calibration),)


def patched_clone(model, family, method, config, calibration=None):
    """``model.clone()`` with the node's attention override and diffusion-model wrapper (a fastdit
    node applied before is replaced, not stacked); ``calibration``: ``(contents, path)`` of a
    calibration file."""
    from comfy.patcher_extension import WrappersMP

    clone = model.clone()
    options = clone.model_options.setdefault("transformer_options", {})
    previous = options.get("optimized_attention_override")
    if isinstance(previous, FastditAttention):
        previous = previous.previous
        clone.remove_wrappers_with_key(WrappersMP.DIFFUSION_MODEL, WRAPPER_KEY)
    runtime = FastditAttention(family, method, config, previous, calibration)
    options["optimized_attention_override"] = runtime
    clone.add_wrapper_with_key(WrappersMP.DIFFUSION_MODEL, WRAPPER_KEY, runtime.wrapper)
    return clone


def _typed_node(method):
    return type(f"FastditSparseAttention_{method}", (FastditSparseAttention,), {
        "METHOD": method, "__doc__": f'"{NAME} ({method})": the node with {method}\'s options as widgets.'})


NODE_CLASS_MAPPINGS = {"FastditSparseAttention": FastditSparseAttention}
NODE_DISPLAY_NAME_MAPPINGS = {"FastditSparseAttention": NAME}
for _method in method_names():
    if _method != "dense":
        NODE_CLASS_MAPPINGS[f"FastditSparseAttention_{_method}"] = _typed_node(_method)
        NODE_DISPLAY_NAME_MAPPINGS[f"FastditSparseAttention_{_method}"] = f"{NAME} ({_method})"


# --------------------------------------------------------------------------------------------- #
# The widget tables of docs/comfyui.md
# --------------------------------------------------------------------------------------------- #

WIDGETS_START = "<!-- comfyui-widgets:start -->"
WIDGETS_END = "<!-- comfyui-widgets:end -->"


def _cell(text):
    return str(text).replace("|", "\\|").replace("\n", " ")


def _row(name, kind, params):
    kind_text = "dropdown" if isinstance(kind, list) else kind
    if isinstance(kind, list):
        span = ", ".join(f"`{c}`" for c in kind)
    elif "min" in params:
        low, high = params["min"], params["max"]
        span = f"{'' if abs(low) >= _INT_MAX or abs(low) >= 1e9 else low} .. " \
               f"{'' if abs(high) >= _INT_MAX or abs(high) >= 1e9 else high}".strip()
    else:
        span = ""
    default = params.get("default", "")
    default = f"`{default}`" if default not in ("", None) else "blank"
    return f"| `{name}` | {kind_text} | {default} | {_cell(span)} | {_cell(params.get('tooltip', ''))} |"


def widgets_markdown():
    """The widget tables of docs/comfyui.md (regenerate: ``python -m fastdit.integrations.comfyui``)."""
    head = "| widget | type | default | range / choices | what it does |\n|---|---|---|---|---|"
    generic = node_widgets(None)
    rows = [_row(name, *spec) if len(spec) > 1 else f"| `{name}` | {spec[0]} | | | the model to patch |"
            for part in ("required", "optional") for name, spec in generic[part].items()]
    lines = [f"### {NAME}", "", "Every node has these (the typed nodes all but `method`).", "", head, *rows]
    for method in method_names():
        specs = main_specs(method)
        if method == "dense" or not specs:
            continue
        lines += ["", f"### {NAME} ({method})", "", head]
        lines += [_row(spec.name, *widget_of(spec)) for spec in specs]
    return "\n".join(lines)
