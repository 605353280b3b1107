"""``fastdit.calibrate``: search a method's settings per (step bucket, layer, head) against an error budget.

After STA's mask search (Zhang et al., 2025: a window per step, layer and head, chosen from the
attention error against full attention on a few prompts), SpargeAttn's per-layer threshold tuning
and DiTFastAttn's greedy choice of the cheapest technique within an error threshold.

The pipeline runs densely on each calibration prompt, patched with a probe method: every patched
attention call returns the model's own (dense) attention, so the run is the dense run, and on the
side evaluates every candidate setting on the same ``q, k, v``. Errors are measured on a sample of
``rows`` video query rows per call (default 256): the whole rows would not fit at real sizes (at
HunyuanVideo 720p, S = 115,456 keys, one head's scores for 256 rows are 256 x S float32 = 118 MB,
for all S rows 53 GB), and 256 rows estimate a relative L2 error to about 1/sqrt(256) = 6% of
itself, enough to compare against a budget. Nothing is stored between calls but sums per
(step bucket, layer, head, candidate) (squared error, squared reference, density); k and v are never kept.

For ``sta`` the candidates are windows (``{"window": (wt, wh, ww)}``, 0 = the whole axis) and
each is evaluated exactly on the sampled rows (the window's key mask of those rows, text keys
always kept); other methods run whole on the call through ``fastdit.attention`` (options from the
candidate registry, ``register_candidates``) and are compared on the same rows.

Choice: the relative error of a candidate is ``sqrt(sum err^2 / sum ref^2)`` over the sampled rows,
batch and CFG branches of a prompt, and its worst value over the prompts counts. ``sta`` takes per
(bucket, layer, head) the candidate of least density (computed query-key pairs / dense pairs of the
call) whose error is within ``budget``; ``dense`` is always a candidate (error 0), so a head that
cannot meet the budget stays dense. The other methods' options hold for every head of a call, so
they are chosen per (bucket, layer): the least dense candidate (mean over heads) whose error is
within ``budget`` in every head, else dense (a null setting); the calibration's ``settings`` become the
method's ``layer_settings`` option when applied.

Progress bars per prompt and per layer; finished prompts are kept in ``OUT.partial.json`` so an
interrupted run resumes without redoing them.
"""
from __future__ import annotations

import hashlib
import inspect
import json
import math
import os
import warnings
from dataclasses import dataclass

import torch

from fastdit.methods.base import Method, MethodConfig, get_method, option
from fastdit.methods.sta import SlidingTile
from fastdit.calibration.candidates import (auto_candidates, candidates_for, has_candidates, register_candidates,
                                            select_auto, select_settings, sta_candidates)
from fastdit.calibration.calibration_file import CALIBRATION_FORMAT, CALIBRATION_VERSION, model_facts, write_calibration
from fastdit.costmodel import DEFAULT_GPU, gpu_named, head_times

__all__ = ["calibrate", "candidates_for", "register_candidates", "select_settings"]

DEFAULT_ROWS = 256


# -- the probe: dense attention, with every candidate measured on the side ---------------------
@dataclass
class DenseProbeConfig(MethodConfig):
    """The probe's only option: the observer that measures settings on the side."""

    observer: object = option(None, "an object with observe(ctx, q, k, v, dense_out) (internal)")


class DenseProbe(Method):
    """A method that keeps the run dense (the model's own attention, counted as dense) and hands
    every call's ``q, k, v`` and dense output to ``config.observer.observe(ctx, q, k, v, out)``:
    calibration and ``eval/bench/calibration.py`` measure their settings this way."""

    name = "dense-probe"
    config_cls = DenseProbeConfig

    def attend(self, ctx, q, k, v):
        out = ctx.dense()
        ctx.info["dense"] = True
        self.config.observer.observe(ctx, q, k, v, out)
        return out


def _sample_rows(layout, rows, seed):
    """``rows`` video query positions (sorted), the same for every call of a layout and seed."""
    generator = torch.Generator().manual_seed(seed)
    video = layout.video_len
    chosen = torch.randperm(video, generator=generator)[: min(rows, video)].sort().values
    return layout.video_start + chosen


class _Recorder:
    """Per (bucket, layer): sums of squared error (heads x candidates), of the dense reference
    (heads) and of densities, over the calls of one prompt."""

    def __init__(self, method, base_options, candidates, buckets, rows, seed, progress, gpu=None):
        self.method, self.base_options, self.gpu = method, dict(base_options), gpu
        self.candidates, self.buckets, self.rows, self.seed = candidates, buckets, rows, seed
        self.progress = progress
        self.sums = {}
        self.tile = None
        self.grids = set()
        self.states = {}
        self._densities = {}

    def bucket_of(self, step, num_steps):
        starts = self.bucket_starts(num_steps)
        return max(s for s in starts if s <= step)

    def bucket_starts(self, num_steps):
        if isinstance(self.buckets, int):
            n = max(int(num_steps or self.buckets), 1)
            return sorted({int(i * n // self.buckets) for i in range(self.buckets)})
        return list(self.buckets)

    def observe(self, ctx, q, k, v, dense_out):
        self.grids.add(tuple(ctx.layout.grid))
        if self.candidates is None:  # defaults resolved on the first call (they depend on the grid)
            self.candidates = (sta_candidates(ctx.layout, self._tile(ctx.layout)) if self.method == "sta"
                               else auto_candidates(ctx.layout, self.base_options) if self.method == "auto"
                               else candidates_for(self.method, ctx.layout))
        rows = _sample_rows(ctx.layout, self.rows, self.seed + ctx.layer).to(q.device)
        with torch.no_grad():
            if self.method == "sta":
                err2, ref2, dens = self._sta(ctx, q, k, v, rows)
            else:
                err2, ref2, dens = self._generic(ctx, q, k, v, rows, dense_out)
        key = (self.bucket_of(ctx.step, ctx.num_steps), ctx.layer)
        entry = self.sums.setdefault(key, {"err2": 0.0, "ref2": 0.0, "density": 0.0, "calls": 0})
        if self.method == "auto":  # predicted time per (head, candidate) on the target GPU, and dense's
            for name in ("time", "dense_time"):
                entry[name] = entry.get(name, 0.0) + self._times.pop(name)
        entry["err2"] = entry["err2"] + err2
        entry["ref2"] = entry["ref2"] + ref2
        entry["density"] = entry["density"] + dens
        entry["calls"] += 1
        if self.progress is not None:
            self.progress.update(1)

    # -- sta: window masks on the sampled rows --------------------------------------------------
    def _tile(self, layout):
        if self.tile is None:
            self.tile = SlidingTile(**self.base_options).tile_for(layout)
        return self.tile

    def _sta_density(self, layout, window):
        key = (layout, tuple(window))
        if key not in self._densities:
            method = SlidingTile(**{**self.base_options, "tile": self.tile, "fit_tile": False, "window": (1, 1, 1)})
            plan = method.windows_plan(layout, [tuple(window)], "cpu")
            if plan is None:
                self._densities[key] = 1.0
            else:
                self._densities[key] = float(plan.pair_counts().double().mean()) / layout.seq_len ** 2
        return self._densities[key]

    def _sta(self, ctx, q, k, v, rows):
        layout = ctx.layout
        tile = self._tile(layout)
        n_tiles = [-(-g // t) for g, t in zip(layout.grid, tile)]
        t_, h_, w_ = layout.grid
        index = torch.arange(layout.video_len, device=q.device)
        coords = (torch.stack([index // (h_ * w_), index // w_ % h_, index % w_], 1)
                  // torch.tensor(tile, device=q.device))
        row_coords = coords[rows - layout.video_start]
        batch, heads, seq, dim = q.shape
        key_valid = torch.ones(batch, seq, dtype=torch.bool, device=q.device) if ctx.key_mask is None else ctx.key_mask
        scale = ctx.scale if ctx.scale is not None else 1.0 / math.sqrt(dim)
        scores = torch.einsum("bhrd,bhsd->bhrs", q[:, :, rows].double(), k.double()) * scale
        scores = scores.masked_fill(~key_valid[:, None, None, :], float("-inf"))
        # exp once (float64: a window that leaves out the row maximum must not underflow); each
        # candidate then only zeroes its dropped keys: softmax over the kept keys = p / sum(p kept)
        weights = torch.exp(scores - scores.amax(-1, keepdim=True))
        values = v.double()
        reference = (weights @ values) / weights.sum(-1, keepdim=True)
        ref2 = reference.pow(2).sum(dim=(0, 2, 3))
        err2 = torch.zeros(heads, len(self.candidates), dtype=torch.float64, device=q.device)
        dens = torch.zeros(heads, len(self.candidates), dtype=torch.float64)
        video = slice(layout.video_start, layout.video_start + layout.video_len)
        axis_masks = {}  # (axis, width) -> (rows, video keys): candidates share their per-axis widths
        for c, candidate in enumerate(self.candidates):
            allowed = torch.ones(len(rows), seq, dtype=torch.float64, device=q.device)
            inside = None
            for axis, (w, n) in enumerate(zip(candidate["window"], n_tiles)):
                w = n if w == 0 else min(w, n)
                if (axis, w) not in axis_masks:
                    start = (row_coords[:, axis] - w // 2).clamp(0, n - w)
                    key_axis = coords[:, axis]
                    axis_masks[axis, w] = (key_axis[None] >= start[:, None]) & (key_axis[None] < start[:, None] + w)
                inside = axis_masks[axis, w] if inside is None else inside & axis_masks[axis, w]
            allowed[:, video] = inside
            kept = weights * allowed
            out = (kept @ values) / kept.sum(-1, keepdim=True)
            err2[:, c] = (out - reference).pow(2).sum(dim=(0, 2, 3))
            dens[:, c] = self._sta_density(layout, candidate["window"])
        return err2.cpu(), ref2.cpu(), dens

    # -- other methods: the whole call through fastdit.attention ------------------------------
    def _generic(self, ctx, q, k, v, rows, dense_out):
        from fastdit.functional import attention

        batch, heads, seq, dim = q.shape
        reference = dense_out[:, :, rows].double()  # the probe's own dense output: not computed twice
        ref2 = reference.pow(2).sum(dim=(0, 2, 3)).cpu()
        err2 = torch.zeros(heads, len(self.candidates), dtype=torch.float64)
        dens = torch.zeros(heads, len(self.candidates), dtype=torch.float64)
        times = torch.zeros(heads, len(self.candidates), dtype=torch.float64)
        for c, candidate in enumerate(self.candidates):
            state = self.states.setdefault((ctx.layer, ctx.branch, c), {})
            if self.method == "auto":  # a candidate names its method; its base options are in it already
                name, options = candidate["method"], {k: v for k, v in candidate.items() if k != "method"}
            else:
                name, options = self.method, {**self.base_options, **candidate}
            out, info = attention(q, k, v, name, layout=ctx.layout, key_mask=ctx.key_mask, step=ctx.step,
                                  num_steps=ctx.num_steps, state=state, backend=ctx.backend, return_info=True,
                                  scale=ctx.scale, layer=ctx.layer,
                                  # the candidate's own error: the quality guard would hide it
                                  **{"guard": False, **options, "dense_steps": 0, "dense_layers": 0})
            err2[:, c] = (out[:, :, rows].double() - reference).pow(2).sum(dim=(0, 2, 3)).cpu()
            dens[:, c] = torch.tensor(info["head_density"], dtype=torch.float64)
            if self.method == "auto":
                times[:, c] = torch.tensor(head_times(self.gpu, info, batch, heads, seq, k.shape[2], dim,
                                                      method=get_method(name), options=options))
        if self.method == "auto":
            dense = head_times(self.gpu, {"dense": True}, batch, heads, seq, k.shape[2], dim)
            self._times = {"time": times, "dense_time": torch.tensor(dense, dtype=torch.float64)}
        return err2, ref2, dens

    def results(self):
        """JSON-ready sums of this prompt: ``"bucket_layer" -> {err2, ref2, density, calls}``."""
        return {f"{b}_{layer}": {"err2": e["err2"].tolist(), "ref2": e["ref2"].tolist(),
                                 "density": (e["density"] / e["calls"]).tolist(), "calls": e["calls"],
                                 **{name: (e[name] / e["calls"]).tolist()
                                    for name in ("time", "dense_time") if name in e}}
                for (b, layer), e in sorted(self.sums.items())}


# -- the entry point --------------------------------------------------------------------------
def _check_arguments(method, prompts, budget, steps, candidates, rows):
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not math.isfinite(budget) or budget <= 0:
        raise ValueError(f"budget must be a number > 0 (the largest relative L2 error against dense attention), "
                         f"got {budget!r}")
    if isinstance(prompts, str):
        prompts = [prompts]
    prompts = list(prompts) if prompts is not None else []
    if not prompts:
        raise ValueError("prompts is empty: calibration needs at least one prompt")
    bad = [p for p in prompts if not isinstance(p, str) or not p.strip()]
    if bad:
        raise ValueError(f"prompts must be non-empty strings, got {bad[0]!r}")
    if steps is None:
        steps = 1
    if isinstance(steps, bool) or not (isinstance(steps, int) and steps >= 1 or isinstance(steps, (list, tuple))):
        raise ValueError("steps must be a number of step buckets (int >= 1) or a list of bucket start steps, "
                         f"got {steps!r}")
    if isinstance(steps, (list, tuple)):
        if not steps or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in steps):
            raise ValueError(f"steps as a list gives the first step of each bucket (ints >= 0), got {steps!r}")
        steps = sorted(set(steps)) if 0 in steps else [0] + sorted(set(steps))
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
        raise ValueError(f"rows must be an int >= 1, got {rows!r}")
    method_cls = get_method(method)
    if candidates is not None:
        candidates = [_as_candidate(method_cls.name, c) for c in candidates]
        if not candidates:
            raise ValueError("candidates is empty; give None for the method's defaults")
    elif method_cls.name not in ("sta", "auto") and not has_candidates(method_cls.name):
        raise ValueError(f"method {method_cls.name!r} has no default candidates; "
                         "pass candidates=[{option: value}, ...]")
    return method_cls, prompts, steps, candidates


def _sta_window_entry(w):
    """An sta candidate window entry: an odd positive int, or 0 for the whole axis."""
    return isinstance(w, int) and not isinstance(w, bool) and (w == 0 or (w > 0 and w % 2))


def _as_candidate(method, candidate):
    if method == "sta" and isinstance(candidate, (list, tuple)):
        candidate = {"window": tuple(candidate)}
    if not isinstance(candidate, dict) or not candidate:
        raise ValueError(f"a candidate is a dict of options (or, for sta, a window triple), got {candidate!r}")
    if method == "auto":  # {"method": name, option: value}: checked as that method's options
        options = {k: v for k, v in candidate.items() if k != "method"}
        if candidate.get("method") in (None, "auto"):
            raise ValueError(f"an auto candidate names another method under 'method', got {candidate!r}")
        get_method(candidate["method"]).make_config(**options)
        return {**candidate, **{k: tuple(v) for k, v in options.items() if isinstance(v, list)}}
    if "window" in candidate and method == "sta":
        window = candidate["window"]
        if not isinstance(window, (list, tuple)) or len(window) != 3 or not all(_sta_window_entry(w) for w in window):
            raise ValueError(f"sta candidate window must be three odd ints or 0 (the whole axis), got {window!r}")
        candidate = {**candidate, "window": tuple(window)}
    else:
        get_method(method).make_config(**candidate)
    return candidate


def _signature(method, base_options, steps, candidates, rows, seed, call_kwargs, facts):
    text = json.dumps([method, base_options, steps, candidates, rows, seed, call_kwargs, facts], sort_keys=True,
                      default=repr)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _read_partial(path, signature):
    try:
        with open(path, encoding="utf-8") as handle:
            partial = json.load(handle)
    except (OSError, json.JSONDecodeError):
        return {}
    if not isinstance(partial, dict) or partial.get("signature") != signature:
        warnings.warn(f"fastdit calibrate: {path} is from another calibration (other method, options, candidates or "
                      "sizes); starting afresh", stacklevel=3)
        return {}
    return partial


def _write_json(path, data):
    temporary = f"{path}.tmp{os.getpid()}"
    with open(temporary, "w", encoding="utf-8") as handle:
        json.dump(data, handle)
    os.replace(temporary, path)


def _bar(total, desc, enabled, position=0, leave=True):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, position=position, leave=leave, dynamic_ncols=True)


def calibrate(pipe, method, prompts, *, budget, steps=None, candidates=None, out="calibration.json",
              call_kwargs=None, options=None, rows=DEFAULT_ROWS, seed=0, progress=True, gpu=None):
    """Calibrate ``method`` on ``pipe`` against an error budget and write the calibration file ``out``.

    Args:
        pipe: a diffusers DiT pipeline (fastdit must support its family).
        method: a method name; ``sta`` is chosen per (step bucket, layer, head), other methods per
            (step bucket, layer) (dense where no candidate meets the budget).
        prompts: the calibration prompts (a list of strings, at least one).
        budget: the largest relative L2 error ``||out - dense|| / ||dense||`` allowed per head,
            on the sampled query rows, worst over the prompts (a number > 0).
        steps: step buckets: None (one for all steps), an int (that many equal buckets of the run's
            steps) or a list of first steps of the buckets.
        candidates: option dicts to try (``sta``: window triples also), or None for the method's
            defaults (``candidates_for``); dense is always a candidate.
        out: the calibration file (JSON); ``OUT.partial.json`` keeps finished prompts for a resume.
        call_kwargs: extra pipeline call arguments (sizes, steps, guidance); options: base method
            options (e.g. the tile; for ``auto`` per method, ``{"sta": {"tile": ...}, ...}``); rows:
            sampled query rows per call; seed: the generation seed.
        gpu: ``auto`` only: the GPU whose predicted time (``fastdit.costmodel``) is minimised, a
            name of ``fastdit.costmodel.GPUS`` (default ``DEFAULT_GPU``, H100).

    ``method="auto"`` scores the candidates of every method (``auto_candidates``: sta windows,
    radial, sparge, svg, svg2, ToDo, ToMe) on the same calls and chooses per (step bucket, layer,
    head) the one of least predicted time on ``gpu`` within the budget (``select_auto``), dense
    where none is or dense is predicted as fast; ``fastdit.patch(pipe, "auto", calibration=out)`` runs it.

    Returns:
        the calibration (a dict, as written to ``out``).
    """
    from fastdit.apply import patch

    method_cls, prompts, steps, candidates = _check_arguments(method, prompts, budget, steps, candidates, rows)
    name = method_cls.name
    base_options = dict(options or {})
    if gpu is not None and name != "auto":
        raise ValueError(f"gpu= chooses by predicted time, which only method 'auto' does (got method {name!r})")
    gpu = gpu_named(DEFAULT_GPU if gpu is None else gpu) if name == "auto" else None
    if name == "auto":  # options per method: checked here, before any model work
        auto_candidates(None, base_options)
        for method_name, method_options in base_options.items():
            get_method(method_name).make_config(**method_options)
    elif name == "sta":
        base_options.pop("strategy", None)
        SlidingTile.make_config(**base_options)
    else:
        method_cls.make_config(**base_options)
    from fastdit.pipelines.tiny import native_call

    call_kwargs = native_call(pipe, call_kwargs)  # a built-in model's own sizes and steps where none are given
    family, transformer, layers, heads = model_facts(pipe)
    out = os.fspath(out)
    partial_path = f"{out}.partial.json"
    signature = _signature(name, base_options, steps, candidates, rows, seed, call_kwargs,
                           [family, transformer, layers, heads, gpu and gpu.name])
    partial = _read_partial(partial_path, signature) if os.path.exists(partial_path) else {}
    finished = dict(partial.get("prompts", {}))
    state = {"candidates": partial.get("candidates", candidates), "tile": partial.get("tile"),
             "grids": partial.get("grids", []), "num_steps": partial.get("num_steps")}
    if state["candidates"] is not None:
        state["candidates"] = [_as_candidate(name, c) for c in state["candidates"]]
    accepts = inspect.signature(pipe.__call__).parameters
    prompt_bar = _bar(len(prompts), "prompts", progress)
    if prompt_bar is not None:
        prompt_bar.update(sum(p in finished for p in prompts))
    for prompt in prompts:
        if prompt in finished:
            continue
        layer_bar = _bar(None, "layer calls", progress, position=1, leave=False)
        recorder = _Recorder(name, base_options, state["candidates"], steps, rows, seed, layer_bar, gpu)
        recorder.tile = tuple(state["tile"]) if state["tile"] else None
        probe = patch(pipe, DenseProbe, observer=recorder, dense_steps=0, dense_layers=0)
        try:
            kwargs = dict(call_kwargs)
            if "output_type" in accepts:
                kwargs.setdefault("output_type", "latent")
            device = getattr(pipe, "device", "cpu")
            kwargs.setdefault("generator", torch.Generator(device=device).manual_seed(seed))
            pipe(prompt=prompt, **kwargs)
            num_steps = probe.call_state.num_steps
        finally:
            probe.remove()
            if layer_bar is not None:
                layer_bar.close()
        if not recorder.sums:
            raise RuntimeError(f"no attention call of {type(pipe).__name__} reached the probe: nothing to calibrate")
        state["candidates"], state["tile"] = recorder.candidates, list(recorder.tile) if recorder.tile else None
        state["grids"] = sorted({tuple(g) for g in state["grids"]} | recorder.grids)
        state["num_steps"] = num_steps
        finished[prompt] = recorder.results()
        _write_json(partial_path, {"signature": signature, "prompts": finished, **state,
                                   "grids": [list(g) for g in state["grids"]]})
        if prompt_bar is not None:
            prompt_bar.update(1)
    if prompt_bar is not None:
        prompt_bar.close()
    calibration = _build_calibration(name, base_options, state, [finished[p] for p in prompts], budget, prompts,
                                     (family, transformer, layers, heads), steps, gpu)
    write_calibration(calibration, out)
    if os.path.exists(partial_path):
        os.remove(partial_path)
    return calibration


def _build_calibration(name, base_options, state, results, budget, prompts, facts, steps, gpu=None):
    family, transformer, layers, heads = facts
    candidates = state["candidates"]
    if name == "auto":
        choice, measured = select_auto(results, candidates, budget)
    else:
        choice, measured = select_settings(results, candidates, budget, per_head=(name == "sta"))
    keys = sorted(measured, key=lambda k: tuple(map(int, k.split("_"))))
    buckets = sorted({int(k.split("_")[0]) for k in keys})
    calibration = {
        "format": CALIBRATION_FORMAT, "version": CALIBRATION_VERSION, "method": name,
        "model": {"family": family, "transformer": transformer, "layers": layers, "heads": heads,
                  "grids": [list(g) for g in state["grids"]]},
        "step_buckets": buckets, "num_steps": state["num_steps"], "steps": steps,
        "budget": budget, "prompts": list(prompts),
        "candidates": [{k: list(v) if isinstance(v, tuple) else v for k, v in c.items()} for c in candidates],
    }
    # dense_steps / dense_layers the user set (e.g. --set dense_steps=0.5) apply when the calibration runs;
    # unset, the calibration runs its calibrated settings from the first step and layer
    dense = {key: base_options.get(key) or 0 for key in ("dense_steps", "dense_layers")}
    if name == "auto":
        calibration["options"] = {}
        calibration["gpu"] = gpu.name
        calibration["choices"] = {key: choice[key]
                                  for key in sorted(choice, key=lambda k: tuple(map(int, k.split("_"))))}
    elif name == "sta":
        options = {k: list(v) if isinstance(v, tuple) else v for k, v in base_options.items()
                   if k not in ("window", "strategy", "tile", "fit_tile")}
        calibration["options"] = {**options, "tile": state["tile"], "fit_tile": False, **dense}
        in_order = sorted(choice.items(), key=lambda kv: tuple(map(int, kv[0].split("_"))))
        calibration["strategy"] = {key: (list(candidates[c]["window"]) if c is not None else [0, 0, 0])
                                   for key, c in in_order}
    else:  # per (bucket, layer): the sparsest candidate within budget, null (dense) where none is
        calibration["options"] = {**{k: list(v) if isinstance(v, tuple) else v for k, v in base_options.items()},
                                  **dense}
        calibration["settings"] = {
            key: None if choice[key] is None
            else {k: list(v) if isinstance(v, tuple) else v for k, v in candidates[choice[key]].items()}
            for key in keys}
    calibration["measured"] = {
        "layers": [{"bucket": int(k.split("_")[0]), "layer": int(k.split("_")[1]), **measured[k]} for k in keys],
        "error": max(m["error"] for m in measured.values()),
        "density": sum(m["density"] for m in measured.values()) / len(measured),
    }
    if name == "auto":  # predicted attention time of the calibrated calls, auto against dense
        predicted = sum(sum(m["head_time"]) for m in measured.values())
        dense_time = sum(sum(m["dense_time"]) for m in measured.values())
        calibration["measured"].update(predicted_ms=predicted, dense_ms=dense_time,
                                       predicted_speedup=dense_time / predicted)
    return calibration
