"""Method option values as text: what ``fastdit compare --set sta.tile=6,8,8`` and the app's option
boxes both read and write.

    parse_value("6,8,8")                 -> (6, 8, 8)
    parse_value("0.25")                  -> 0.25
    parse_value("true")                  -> True
    parse_value("[(1,3,3), (3,3,3)]")    -> [(1, 3, 3), (3, 3, 3)]
    format_value([(1, 3, 3), (3, 3, 3)]) -> "1,3,3; 3,3,3"
"""
from __future__ import annotations

import ast

__all__ = ["format_value", "parse_value"]


def parse_value(text):
    """``6,8,8`` -> (6, 8, 8); ``0.25`` -> 0.25; ``true`` -> True; ``none`` -> None; lists of
    triples as ``[(1,3,3),(3,3,3)]``; anything that is not a Python literal stays the text."""
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text
    return tuple(value) if isinstance(value, list) and all(isinstance(v, (int, float)) for v in value) else value


def format_value(value):
    """The text ``parse_value`` (or the app's tuple boxes) reads back: tuples as ``6,8,8``, lists of
    tuples as ``1,3,3; 3,3,3``, None as the empty string, anything else as ``str``."""
    if value is None:
        return ""
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, (list, tuple)) for v in value):
        return "; ".join(",".join(map(str, v)) for v in value)
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    return str(value)
