"""Candidate settings per method (a small registry) and the choice of settings against a budget.

``candidates_for(method, layout)`` gives the option sets ``fastdit.calibrate`` tries by default:
windows for ``sta`` (per axis 1, 3, 5 tiles below the axis' tile count and 0, the whole axis),
``cdf`` / ``topk`` for ``sparge``, ``density`` for ``svg``, ``top_p`` for ``svg2``, ratios / factors for the token methods
and windows for ``window``; a method registers its own with ``register_candidates``. Only methods
registered when this module is imported get defaults, and only options their config has.

``select_plan`` turns the measured errors into choices: per (step bucket, layer, head) for ``sta``
(the least dense candidate whose worst relative error over the prompts is within the budget;
none - dense - when no candidate is), per (step bucket, layer) for the other methods (their options
hold for all heads of a call; applied through the ``layer_settings`` option every method has).
"""
from __future__ import annotations

import dataclasses

import torch

from fastdit.methods.base import get_method

__all__ = ["candidates_for", "has_candidates", "register_candidates", "select_plan", "sta_candidates"]

_CANDIDATES = {}


def register_candidates(method, function):
    """Register ``function(layout) -> [options, ...]``: the default candidate settings of ``method``."""
    _CANDIDATES[method] = function


def has_candidates(method):
    """Whether ``method`` has registered default candidates."""
    return method in _CANDIDATES


def candidates_for(method, layout=None):
    """The default candidate option sets of ``method`` that its config accepts (empty when unknown)."""
    function = _CANDIDATES.get(method)
    if function is None:
        return []
    fields = {f.name for f in dataclasses.fields(get_method(method).config_cls)}
    return [c for c in function(layout) if set(c) <= fields]


def sta_candidates(layout, tile=(6, 8, 8)):
    """Windows from 1 tile up to the whole axis: per axis the odd widths 1, 3, 5 below the axis' tile
    count, and 0 (the whole axis)."""
    import itertools

    if layout is None:
        per_axis = [[1, 3, 0]] * 3
    else:
        n_tiles = [-(-g // t) for g, t in zip(layout.grid, tile)]
        per_axis = [[w for w in (1, 3, 5) if w < n] + [0] for n in n_tiles]
    return [{"window": w} for w in itertools.product(*per_axis)]


def _register_defaults():
    """Candidates of the methods that exist now (a method added later registers its own)."""
    from fastdit.methods.base import method_names

    defaults = {
        "sta": sta_candidates,
        "sparge": lambda layout: [{"cdf": c, "topk": None} for c in (0.99, 0.95, 0.9, 0.8)] + [{"topk": t} for t in (0.5, 0.3, 0.1)],
        "svg": lambda layout: [{"density": d} for d in (0.5, 0.3, 0.2, 0.1)],
        # svg2 (Sparse VideoGen 2): the predicted-mass threshold of its key clusters
        "svg2": lambda layout: [{"top_p": p} for p in (0.95, 0.9, 0.8, 0.7, 0.5)],
        "todo": lambda layout: [{"factor": f} for f in (2, 3, 4)],
        "tome": lambda layout: [{"ratio": r} for r in (0.25, 0.5, 0.75)],
        "prune": lambda layout: [{"ratio": r} for r in (0.25, 0.5, 0.75)],
        "window": lambda layout: [{"window": w} for w in ((1, 1, 1), (1, 3, 3), (3, 3, 3))],
    }
    names = set(method_names())
    for name, function in defaults.items():
        if name in names:
            register_candidates(name, function)


_register_defaults()


# -- choosing ---------------------------------------------------------------------------------
def _errors(prompt_results, key):
    """Worst relative error over the prompts, per (head, candidate), and the mean density."""
    errors, density = None, None
    for result in prompt_results:
        entry = result.get(key)
        if entry is None:
            continue
        err2 = torch.tensor(entry["err2"], dtype=torch.float64)
        ref2 = torch.tensor(entry["ref2"], dtype=torch.float64).clamp_min(1e-300)
        relative = (err2 / ref2[:, None]).sqrt()
        errors = relative if errors is None else torch.maximum(errors, relative)
        density = torch.tensor(entry["density"], dtype=torch.float64)
    return errors, density


def select_plan(prompt_results, candidates, budget, per_head=True):
    """Choose per (bucket, layer, head) (``per_head``, sta's windows) or per (bucket, layer) (the
    other methods, whose options hold for every head of a call): the least dense candidate whose
    worst relative error over the prompts (and, per layer, over the heads) is within ``budget``;
    None (dense) when none is. Ties in density go to the smaller error. Returns
    ``(choice, measured)``: ``choice["b_l_h"]`` (or ``["b_l"]``) a candidate index or None, and
    per ``"b_l"`` the chosen error and density per head."""
    keys = sorted({k for result in prompt_results for k in result}, key=lambda k: tuple(map(int, k.split("_"))))
    choice, measured = {}, {}
    table = {key: _errors(prompt_results, key) for key in keys}
    if per_head:
        for key, (errors, density) in table.items():
            for head in range(errors.shape[0]):
                ok = [c for c in range(errors.shape[1]) if errors[head, c] <= budget and density[head, c] < 1.0]
                best = min(ok, key=lambda c: (float(density[head, c]), float(errors[head, c])), default=None)
                choice[f"{key}_{head}"] = best
    else:
        # one setting per (bucket, layer): the options of these methods apply to all heads of a call
        for key, (errors, density) in table.items():
            ok = [c for c in range(errors.shape[1]) if bool((errors[:, c] <= budget).all())
                  and float(density[:, c].mean()) < 1.0]
            choice[key] = min(ok, key=lambda c: (float(density[:, c].mean()), float(errors[:, c].max())), default=None)
    for key, (errors, density) in table.items():
        chosen = [choice[f"{key}_{h}"] if per_head else choice[key] for h in range(errors.shape[0])]
        head_errors = [0.0 if c is None else float(errors[h, c]) for h, c in enumerate(chosen)]
        head_density = [1.0 if c is None else float(density[h, c]) for h, c in enumerate(chosen)]
        measured[key] = {"error": max(head_errors), "density": sum(head_density) / len(head_density),
                         "head_error": head_errors, "head_density": head_density}
    return choice, measured


