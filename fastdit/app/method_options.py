"""Method options, read from each method's config dataclass: one ``OptionSpec`` per field.

Nothing here is written per method. A field's widget kind comes from its type annotation, its
default from the dataclass, its help from ``field.metadata["help"]`` or else the class docstring's
``Attributes:`` entry; ``field.metadata`` may also give ``"widget"`` (a kind below, or ``triple``, ``checkbox``,
``dropdown``, ``number``, ``slider``), ``"range"`` (``(low, high)``, either may be None),
``"choices"``, ``"label"`` and ``"advanced"`` (True: an expert option, shown in the app's collapsed
"Advanced" group); None values count as absent. A newly registered method shows
up in the app with its options and no change here.

Kinds: ``int``, ``float``, ``number`` (an int or a float: integral values become ints, as
``dense_steps`` counts steps or gives a fraction), ``tuple`` (``6,8,8``; a list of tuples as
``1,3,3; 3,3,3``), ``bool``, ``choice``, ``text``.
"""
from __future__ import annotations

import dataclasses
import inspect
import math
import re
import types
import typing
from dataclasses import dataclass

from fastdit.options import format_value, parse_value

from .errors import AppError

__all__ = ["DEFAULT_CHOICE", "KINDS", "WIDGET_KINDS", "OptionSpec", "attribute_docs", "calibration_only",
           "method_choices", "option_specs", "options_text", "parse_option", "parse_options"]

KINDS = ("int", "float", "number", "tuple", "bool", "choice", "text")
#: ``field.metadata["widget"]`` -> kind (None: the kind follows the type; ``slider`` draws a
#: number with a ``range`` as a slider).
WIDGET_KINDS = {**{kind: kind for kind in KINDS}, "triple": "tuple", "checkbox": "bool", "dropdown": "choice",
                "number": None, "slider": None}
#: The choice that leaves an optional bool / choice option at None (the model family's default).
DEFAULT_CHOICE = "model default"
HELP_CHARS = 240


@dataclass(frozen=True)
class OptionSpec:
    """One option of one method, as the app shows and reads it."""

    method: str
    name: str
    kind: str
    default: object
    optional: bool  # None is a valid value (the method or model family fills it in)
    label: str
    help: str = ""
    choices: tuple = ()
    range: tuple | None = None
    widget: str | None = None  # field.metadata["widget"] as given (e.g. "slider")
    fallback: object = None  # what None becomes when the model family sets nothing (Method.default_options)
    literal: bool = True  # text is read as a Python literal (``parse_value``); False: kept as a string
    family_defaults: tuple = ()  # ((model family, value), ...) where an adapter sets this option
    advanced: bool = False  # field.metadata["advanced"]: the app shows it in the collapsed "Advanced" group

    def default_text(self):
        """What a blank box means, e.g. ``0.95 (wan 0.2, hunyuan_video 0.95)``."""
        base = "the method chooses" if self.fallback is None else format_value(self.fallback)
        families = ", ".join(f"{family} {format_value(value)}" for family, value in self.family_defaults)
        return f"{base} ({families})" if families else base

    @property
    def api_name(self):
        """The option's parameter name in the app's API (``sta_window``)."""
        return f"{self.method}_{self.name}"

    def display(self, value):
        """A config value as the widget shows it."""
        if value is None:
            return DEFAULT_CHOICE if self.kind in ("bool", "choice") else ""
        if self.kind == "bool":
            return "on" if value else "off"
        if self.kind == "tuple":
            return format_value(value)
        return value


def method_choices():
    """The methods the app compares against dense: every method ``fastdit.method_names()`` lists but
    ``dense``, then those that run only from a calibration (``auto``; see :func:`calibration_only`)."""
    import fastdit

    return [name for name in fastdit.methods.runnable_method_names() if name != "dense"]


def calibration_only(method):
    """Whether ``method`` takes its settings from a calibration file only (``auto``: a per-head plan
    made by ``fastdit calibrate``): the one shipped with a trained model, or one the user gives."""
    import fastdit

    return bool(fastdit.methods.get_method(method).calibration_only)


def option_specs(method):
    """The ``OptionSpec`` of every field of ``method``'s config dataclass, in field order."""
    import fastdit

    method_cls = fastdit.methods.get_method(method)
    config_cls = method_cls.config_cls
    try:
        hints = typing.get_type_hints(config_cls)
    except (NameError, TypeError):
        hints = {}
    docs = attribute_docs(config_cls)
    family = _family_defaults(method_cls.name)
    specs = []
    for f in dataclasses.fields(config_cls):
        meta = {key: value for key, value in (f.metadata or {}).items() if value is not None}
        default = _field_default(f)
        annotation = hints.get(f.name, f.type)
        kind, choices, optional, is_str = _kind_of(annotation)
        choices = tuple(meta.get("choices", choices))
        widget = meta.get("widget")
        if WIDGET_KINDS.get(widget):
            kind = WIDGET_KINDS[widget]
        elif choices and kind != "bool":
            kind = "choice"
        value_range = meta.get("range")
        specs.append(OptionSpec(
            method=method_cls.name, name=f.name, kind=kind, default=default, optional=optional or default is None,
            label=meta.get("label", f.name.replace("_", " ")), help=_short(meta.get("help") or docs.get(f.name, "")),
            choices=choices, range=tuple(value_range) if value_range is not None else None, widget=widget,
            fallback=method_cls.default_options.get(f.name) if default is None else default,
            literal=not (kind == "text" and is_str), family_defaults=family.get(f.name, ()) if default is None else (),
            advanced=bool(meta.get("advanced", False)),
        ))
    return specs


def _family_defaults(method):
    """``{option: ((family, value), ...)}`` of the registered adapters' ``method_defaults``."""
    from fastdit.pipelines import registered_adapters

    found = {}
    for adapter in registered_adapters():
        for name, value in (adapter.method_defaults or {}).get(method, {}).items():
            found.setdefault(name, []).append((adapter.family, value))
    return {name: tuple(pairs) for name, pairs in found.items()}


def _field_default(f):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _kind_of(annotation):
    """``(kind, choices, optional, is_str)`` of a type annotation (or its unresolved text)."""
    if isinstance(annotation, str):
        names = {part.strip() for part in annotation.split("|")}
        builtin = {"bool": bool, "int": int, "float": float, "str": str, "tuple": tuple, "list": list, "None": None}
        if names <= set(builtin):
            annotation = typing.Union[tuple(type(None) if n == "None" else builtin[n] for n in names)]
    args = typing.get_args(annotation) if _is_union(annotation) else (annotation,)
    optional = type(None) in args
    args = [a for a in args if a is not type(None)]
    if len(args) == 1 and typing.get_origin(args[0]) is typing.Literal:
        return "choice", typing.get_args(args[0]), optional, False
    origins = {typing.get_origin(a) or a for a in args}
    kinds = {frozenset({bool}): "bool", frozenset({int}): "int", frozenset({float}): "float",
             frozenset({int, float}): "number"}
    if frozenset(origins) in kinds:
        return kinds[frozenset(origins)], (), optional, False
    if origins and origins <= {tuple, list}:
        return "tuple", (), optional, False
    return "text", (), optional, origins == {str}


def _is_union(annotation):
    return typing.get_origin(annotation) in (typing.Union, types.UnionType)


def attribute_docs(cls):
    """``{field name: description}`` from the ``Attributes:`` sections of ``cls`` and its bases.

    A subclass entry that starts ``see ``Base``.`` is completed with the base's own description.
    """
    merged = {}
    for klass in reversed(cls.__mro__):  # bases first, subclasses override
        for name, text in _parse_attributes(inspect.cleandoc(klass.__dict__.get("__doc__") or "")).items():
            lead = re.match(r"see ``?\w+``?[.;]?\s*", text)
            if lead and name in merged:
                text = f"{_first_sentence(merged[name])} {text[lead.end():]}".strip()
            merged[name] = text
    return merged


def _parse_attributes(doc):
    entries, current, in_section = {}, None, False
    for line in doc.splitlines():
        if line.strip() == "Attributes:":
            in_section = True
            continue
        if not in_section:
            continue
        if line and not line.startswith(" "):  # the next section
            break
        match = re.match(r"^ {4}([\w, ]+):\s*(.*)$", line)
        if match:
            names = [n.strip() for n in match.group(1).split(",")]
            current = names
            for n in names:
                entries[n] = match.group(2).strip()
        elif current and line.strip():
            for n in current:
                entries[n] = f"{entries[n]} {line.strip()}"
    return entries


def _first_sentence(text):
    return re.split(r"(?<=\.)\s", text, maxsplit=1)[0]


def _short(text):
    text = re.sub(r"``([^`]*)``", r"\1", " ".join(str(text).split()))
    if len(text) <= HELP_CHARS:
        return text
    cut = text.rfind(". ", 0, HELP_CHARS)
    return text[:cut + 1] if cut > 0 else text[:HELP_CHARS - 1] + "…"


# --------------------------------------------------------------------------------------------- #
# Reading widget values back
# --------------------------------------------------------------------------------------------- #


def parse_option(spec, value):
    """A widget (or API) value back to a config value. Blank keeps the dataclass default; values
    already of the right type pass through. Raises ``AppError`` naming the option."""
    if value is None or (isinstance(value, str) and value.strip() in ("", DEFAULT_CHOICE)):
        return spec.default
    try:
        parsed = _parse(spec, value)
    except (ValueError, SyntaxError, TypeError) as error:
        raise AppError(f"{spec.method} option {spec.name}: cannot read {value!r} ({error})") from None
    if spec.range is not None and isinstance(parsed, (int, float)) and not isinstance(parsed, bool):
        low, high = spec.range
        if (low is not None and parsed < low) or (high is not None and parsed > high):
            raise AppError(f"{spec.method} option {spec.name}: {parsed} is outside "
                           f"[{'-inf' if low is None else low}, {'inf' if high is None else high}]")
    return parsed


def _number(value):
    if isinstance(value, bool):
        raise ValueError("a number is needed, not on/off")
    number = float(value.strip()) if isinstance(value, str) else float(value)
    if not math.isfinite(number):
        raise ValueError("the number must be finite")
    return number


def _parse(spec, value):
    kind = spec.kind
    if kind == "int":
        number = _number(value)
        if not number.is_integer():
            raise ValueError("a whole number is needed")
        return int(number)
    if kind == "float":
        return _number(value)
    if kind == "number":
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float):
            return value
        number = _number(value)
        text = str(value).strip()
        return int(number) if number.is_integer() and not any(c in text for c in ".eE") else number
    if kind == "bool":
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("on", "true", "yes", "1"):
            return True
        if text in ("off", "false", "no", "0"):
            return False
        raise ValueError("on or off")
    if kind == "choice":
        for choice in spec.choices:
            if value == choice or str(value).strip() == str(choice):
                return choice
        raise ValueError(f"choose one of {', '.join(map(str, spec.choices))}")
    if kind == "tuple":
        return _parse_tuple(value)
    if isinstance(value, str):
        return parse_value(value) if spec.literal else value.strip()
    return value


def _parse_tuple(value):
    if isinstance(value, (list, tuple)):
        if value and all(isinstance(v, (list, tuple)) for v in value):
            return [tuple(v) for v in value]
        return tuple(value)
    text = str(value).strip()
    if ";" in text:
        return [_as_tuple(parse_value(part.strip())) for part in text.split(";") if part.strip()]
    parsed = parse_value(text)
    if isinstance(parsed, list):
        return [_as_tuple(v) for v in parsed]
    return _as_tuple(parsed)


def _as_tuple(value):
    if isinstance(value, (list, tuple)):
        return tuple(value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return (value,)
    raise ValueError("numbers separated by commas are needed, e.g. 3,3,3")


def parse_options(method, values):
    """``{option name: widget value}`` -> ``{option name: config value}`` for ``method``; unknown
    names raise ``AppError`` listing the valid ones."""
    specs = {spec.name: spec for spec in option_specs(method)}
    unknown = sorted(set(values) - set(specs))
    if unknown:
        raise AppError(f"unknown option(s) {unknown} for {method}; valid options: {sorted(specs)}")
    return {name: parse_option(specs[name], value) for name, value in values.items()}


def options_text(options):
    """``tile=4,4,8, window=1,1,1`` for a table cell (None values left out)."""
    return ", ".join(f"{k}={format_value(v)}" for k, v in options.items() if v is not None)
