"""Prompt sets: ``.txt`` and ``.json`` prompt files and the two shipped with fastdit."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from importlib import resources

from fastdit.eval.runner.config import EvalError

__all__ = ["SHIPPED_PROMPTS", "Prompt", "load_prompts", "shipped_prompt_file"]

SHIPPED_PROMPTS = {"coco": "coco_captions.txt", "vbench": "vbench_subset.json", "shapes": "shapes_heldout.txt"}


@dataclass(frozen=True)
class Prompt:
    text: str
    dimension: tuple = ()


def shipped_prompt_file(name):
    """Path of a prompt file shipped with fastdit: ``coco``, ``vbench`` or ``shapes`` (tiny-shapes captions)."""
    return str(resources.files("fastdit.eval.runner").joinpath("prompts", SHIPPED_PROMPTS[name]))


def load_prompts(path):
    """Prompts from a ``.txt`` (one per line, ``#`` comments and blank lines skipped) or ``.json``
    file (a list of strings, or of objects with ``prompt_en`` or ``prompt`` and an optional
    ``dimension`` string or list, as in VBench's ``VBench_full_info.json``).

    ``path`` may also be ``coco``, ``vbench`` or ``shapes`` (the shipped files). Raises ``EvalError`` for a
    missing, empty or malformed file.
    """
    if path in SHIPPED_PROMPTS:
        path = shipped_prompt_file(path)
    path = os.path.expanduser(str(path))
    if not os.path.isfile(path):
        raise EvalError(f"prompt file {path} does not exist (shipped prompt sets: {', '.join(SHIPPED_PROMPTS)})")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if path.endswith(".json"):
        prompts = _json_prompts(path, text)
    else:
        prompts = [Prompt(line.strip()) for line in text.splitlines()
                   if line.strip() and not line.lstrip().startswith("#")]
    if not prompts:
        raise EvalError(f"prompt file {path} holds no prompts")
    return prompts


def _json_prompts(path, text):
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise EvalError(f"prompt file {path} is not valid JSON: {error}") from None
    if not isinstance(data, list):
        raise EvalError(f"prompt file {path}: expected a JSON list of prompts, got {type(data).__name__}")
    prompts = []
    for i, item in enumerate(data):
        if isinstance(item, str):
            prompts.append(Prompt(item.strip()))
            continue
        if not isinstance(item, dict):
            raise EvalError(f"prompt file {path}: entry {i} is {type(item).__name__}, expected a string or an object")
        value = item.get("prompt_en", item.get("prompt"))
        if not isinstance(value, str):
            raise EvalError(f"prompt file {path}: entry {i} has no string 'prompt_en' or 'prompt' field")
        dims = item.get("dimension", ())
        dims = (dims,) if isinstance(dims, str) else dims
        if not isinstance(dims, (list, tuple)) or not all(isinstance(d, str) for d in dims):
            raise EvalError(f"prompt file {path}: entry {i} has a 'dimension' that is not a string or list of strings")
        prompts.append(Prompt(value.strip(), tuple(dims)))
    empty = [i for i, p in enumerate(prompts) if not p.text]
    if empty:
        raise EvalError(f"prompt file {path}: entry {empty[0]} is an empty prompt")
    return prompts
