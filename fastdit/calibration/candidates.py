"""Candidate settings per method and the choice of settings against a budget.

``candidates_for(method, layout)`` gives the option sets ``fastdit.calibrate`` tries by default: the
method's own grid (``Method.candidates``: windows for ``sta`` (per axis 1, 3, 5 tiles below the
axis' tile count and 0, the whole axis), ``cdf`` / ``topk`` for ``sparge``, ``density`` for
``svg``, ``top_p`` for ``svg2``, ratios / factors for the token methods, windows for ``window``),
or the one registered for it with ``register_candidates``; only options its config has.

``select_settings`` turns the measured errors into choices: per (step bucket, layer, head) for ``sta``
(the least dense candidate whose worst relative error over the prompts is within the budget;
none - dense - when no candidate is), per (step bucket, layer) for the other methods (their options
hold for all heads of a call; applied through the ``layer_settings`` option every method has).
"""
from __future__ import annotations

import dataclasses

import torch

from fastdit.methods.base import get_method, methods_with

__all__ = ["auto_candidates", "auto_methods", "candidates_for", "has_candidates", "register_candidates",
           "select_auto", "select_settings", "sta_candidates"]

#: Candidates registered with ``register_candidates`` (they replace the method's own grid).
_REGISTERED = {}


def register_candidates(method, function):
    """Register ``function(layout) -> [options, ...]``: the default candidate settings of ``method``
    (instead of its ``Method.candidates``)."""
    _REGISTERED[method] = function


def _grid(method):
    """``function(layout) -> [options, ...] | None`` of ``method`` (registered, else its own), or None."""
    if method in _REGISTERED:
        return _REGISTERED[method]
    try:
        return get_method(method).candidates
    except (ValueError, TypeError):  # no such method
        return None


def has_candidates(method):
    """Whether ``method`` has default candidates (its own grid or registered ones)."""
    function = _grid(method)
    return function is not None and function(None) is not None


def candidates_for(method, layout=None):
    """The default candidate option sets of ``method`` that its config accepts (empty when none)."""
    function = _grid(method)
    found = None if function is None else function(layout)
    if not found:
        return []
    fields = {f.name for f in dataclasses.fields(get_method(method).config_cls)}
    return [c for c in found if set(c) <= fields]


def sta_candidates(layout, tile=(6, 8, 8)):
    """sta's windows for ``tile`` (``SlidingTile.candidates``): per axis the odd widths 1, 3, 5 below
    the axis' tile count, and 0 (the whole axis)."""
    return get_method("sta").candidates(layout, tile)


def auto_methods():
    """The methods ``auto`` chooses from (``Method.auto_candidate``), in rank order (dense is always a
    choice; prune and window reuse results across steps, so their error on one call says little of a
    run: not candidates)."""
    return methods_with("auto_candidate")


#: options that schedule a method over steps and layers: auto's candidates take them from auto itself
SCHEDULE_OPTIONS = ("dense_steps", "dense_layers")


def auto_candidates(layout=None, options=None, methods=None):
    """The candidates of ``method="auto"``: ``{"method": name, **options}`` for each method of
    ``methods`` (default ``auto_methods()``) and each of its candidates (``Method.auto_candidates``,
    else its default candidates: sta gets a compact set of windows, none without a layout; radial
    its ``decay`` 0.95, 0.5, 0.25), with the method's base ``options[name]``.

    A base option the user set wins over the candidates' values of it (``todo.factor=1``: ToDo is
    scored at factor 1 only; the candidates that differed only in it collapse into one), so that
    the calibration holds what was asked for. ``dense_steps`` / ``dense_layers`` are refused per method:
    a candidate runs where the calibration's choices put it (set them on ``auto`` when patching)."""
    choosable = auto_methods()
    methods = choosable if methods is None else methods
    options = dict(options or {})
    unknown = sorted(set(options) - set(choosable))
    if unknown:
        raise ValueError(f"auto: options given for {unknown}, which auto does not choose from; its methods: "
                         f"{choosable}")
    for name, values in options.items():
        ignored = sorted(set(SCHEDULE_OPTIONS) & set(values or {}))
        if ignored:
            raise ValueError(f"auto: {name}.{ignored[0]}: a candidate runs on the steps and layers the calibration "
                             f"chooses it for; set {ignored[0]} on auto when patching (e.g. --set "
                             f"auto.{ignored[0]}=1 in fastdit compare)")
    out = []
    for name in methods:
        base = dict(options.get(name, {}))
        found = get_method(name).auto_candidates(layout, base)
        if found is None:
            found = candidates_for(name, layout)
        for c in found:
            candidate = {"method": name, **c, **base}  # the user's value of an option wins over the candidate's
            if candidate not in out:
                out.append(candidate)
    return out


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


def select_settings(prompt_results, candidates, budget, per_head=True):
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


#: Relative margin by which a candidate's predicted time must beat dense's (float rounding is no gain).
TIME_TOLERANCE = 1e-6


def select_auto(prompt_results, candidates, budget, allowed=None):
    """``method="auto"``'s choice per (bucket, layer, head): of the candidates (of the methods in
    ``allowed``, default all) whose worst relative error over the prompts is within ``budget``, the
    one of least predicted time (mean over the prompts of the per-head times the probe recorded);
    None (dense) when none is, or when dense is predicted as fast. Ties go to the smaller error.
    Returns ``(choice, measured)`` as ``select_settings``, ``measured`` with ``head_time`` and
    ``dense_time`` per head (ms) besides the chosen error and density."""
    keys = sorted({k for result in prompt_results for k in result}, key=lambda k: tuple(map(int, k.split("_"))))
    usable = [c for c, candidate in enumerate(candidates) if allowed is None or candidate["method"] in allowed]
    choice, measured = {}, {}
    for key in keys:
        errors, density = _errors(prompt_results, key)
        entries = [r[key] for r in prompt_results if key in r]
        time = sum(torch.tensor(e["time"], dtype=torch.float64) for e in entries) / len(entries)
        dense_time = sum(torch.tensor(e["dense_time"], dtype=torch.float64) for e in entries) / len(entries)
        head_error, head_density, head_time = [], [], []
        for head in range(errors.shape[0]):
            # dense is kept where predicted as fast: a candidate must compute fewer pairs and be
            # predicted faster by more than float rounding (a density-1 radial mask was chosen
            # over dense by a difference in the last digits of the predicted time)
            ok = [c for c in usable if errors[head, c] <= budget and float(density[head, c]) < 1.0
                  and float(time[head, c]) < float(dense_time[head]) * (1.0 - TIME_TOLERANCE)]
            best = min(ok, key=lambda c: (float(time[head, c]), float(errors[head, c])), default=None)
            choice[f"{key}_{head}"] = best
            head_error.append(0.0 if best is None else float(errors[head, best]))
            head_density.append(1.0 if best is None else float(density[head, best]))
            head_time.append(float(dense_time[head] if best is None else time[head, best]))
        measured[key] = {"error": max(head_error), "density": sum(head_density) / len(head_density),
                         "head_error": head_error, "head_density": head_density, "head_time": head_time,
                         "dense_time": dense_time.tolist()}
    return choice, measured
