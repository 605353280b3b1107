"""Turning results into JSON: one helper for every report fastdit writes.

    to_json({"psnr": float("inf"), "tile": (4, 4, 8), "n": np.int64(3), "plans": {"b"}})
    -> {"psnr": None, "tile": [4, 4, 8], "n": 3, "plans": ["b"]}

JSON has no infinities or NaN (``json.dump`` would write the non-standard ``Infinity``), no
tuples, sets or numpy numbers; ``to_json`` maps them to what JSON has, recursively, so the
result can be written with ``allow_nan=False``. ``dump_json`` writes a file (atomically);
``read_json`` reads one, with an error that names the file and what is wrong with it.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import PurePath

import numpy as np

__all__ = ["dump_json", "dumps", "json_default", "read_json", "to_json"]


def read_json(path, error, what, hint=""):
    """The JSON value of the file at ``path``. A file that cannot be read, is not UTF-8 text or is
    not valid JSON raises ``error`` (an exception class) with one line naming ``what`` and the path
    (``"<what> <path>: not valid JSON (truncated or malformed): ..."``); ``hint`` is added to the
    not-UTF-8 message (what such a file should be)."""
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except json.JSONDecodeError as problem:
        raise error(f"{what} {path}: not valid JSON (truncated or malformed): {problem}") from None
    except UnicodeDecodeError as problem:
        raise error(f"{what} {path}: not UTF-8 text ({problem.reason} at byte {problem.start})"
                    + (f"; {hint}" if hint else "")) from None
    except OSError as problem:
        raise error(f"{what} {path}: cannot read it: {problem.strerror or problem}") from None


def to_json(value, nonfinite_as_text=False):
    """``value`` as plain JSON data, recursively.

    - non-finite floats -> None (``nonfinite_as_text=True``: the strings ``"inf"``, ``"-inf"``,
      ``"nan"``, for displays that should show them);
    - numpy scalars -> Python numbers and bools; arrays and tensors (anything with ``tolist``) ->
      nested lists; tuples and sets -> lists (sets sorted when their items allow it);
    - dataclass instances -> dicts; paths -> strings; dict keys -> strings unless they are
      already str, int, float, bool or None;
    - anything else that JSON cannot hold -> ``str(value)``.
    """
    def clean(v):
        if v is None or isinstance(v, (str, bool, int)):
            return v
        if isinstance(v, float):
            if math.isfinite(v):
                return v
            return ("inf" if v > 0 else str(v)) if nonfinite_as_text else None
        if isinstance(v, np.bool_):
            return bool(v)
        if isinstance(v, (np.integer, np.floating)):
            return clean(v.item())
        if isinstance(v, dict):
            return {(k if isinstance(k, (str, int, float, bool)) or k is None else str(k)): clean(x)
                    for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [clean(x) for x in v]
        if isinstance(v, (set, frozenset)):
            try:
                items = sorted(v)
            except TypeError:
                items = list(v)
            return [clean(x) for x in items]
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            return clean(dataclasses.asdict(v))
        if isinstance(v, PurePath):
            return str(v)
        if hasattr(v, "tolist"):  # numpy arrays, torch tensors
            return clean(v.tolist())
        return str(v)

    return clean(value)


def json_default(value):
    """A ``default=`` for ``json.dump``: what ``to_json`` makes of a value JSON cannot hold."""
    return to_json(value)


def dumps(value, **kwargs):
    """``json.dumps(to_json(value), allow_nan=False, **kwargs)``."""
    return json.dumps(to_json(value), allow_nan=False, **kwargs)


def dump_json(path, value, indent=2, atomic=True):
    """Write ``to_json(value)`` to ``path``; ``atomic``: through a temporary file and a rename, so
    a reader never sees half a file (and an interrupted write leaves the old one)."""
    path = os.fspath(path)
    text = dumps(value, indent=indent)
    target = f"{path}.tmp{os.getpid()}" if atomic else path
    with open(target, "w", encoding="utf-8") as f:
        f.write(text)
    if atomic:
        os.replace(target, path)
    return path
