"""The transformer benchmark's measurements: one model, every (mode, method), under a time budget.

Per model (``ModelBench``): build it once, then for each mode (eager, compiled) and method (dense,
then the requested ones) patch it (``dense_steps=0``), count dynamo's graphs and breaks
(``explain_breaks``), compile it afresh when compiled, warm up, time ``reps`` forwards and record
time, density (``pair_density``), peak memory and the patch's statistics; undo everything before
the next. What is timed and what each column means: ``fastdit.eval.bench.transformer``.
"""
from __future__ import annotations

import dataclasses
import gc
import math
import statistics
import time
import warnings
from contextlib import contextmanager

import torch

from fastdit.jsonutil import to_json

from .common import RSSPeak, first_line, sync, time_calls
from .transformer_models import (
    MODELS, build_model, count_parameters, first_blocks_only, make_inputs, model_spec, token_grid,
)

OOM = getattr(torch, "OutOfMemoryError", getattr(torch.cuda, "OutOfMemoryError", MemoryError))


def pair_density(patch):
    """Query-key score computations of the latest call of every patched layer / dense attention's
    (dense layers 1.0), averaged over layers (every layer of one forward has the same length)."""
    values = []
    for layer in range(len(patch.layers)):
        try:
            plan = patch.last_plan(layer)
            layout = patch.last_layout(layer)
        except RuntimeError:  # the layer did not run
            continue
        if plan is None:
            values.append(1.0)
        else:
            values.append(float(plan.pair_counts().double().mean()) / float(layout.seq_len) ** 2)
    return sum(values) / len(values) if values else None


def explain_breaks(model, inputs):
    """``torch._dynamo.explain`` of one call: ``(graph_count, graph_break_count, [reasons])``."""
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            explanation = torch._dynamo.explain(model)(**inputs)
        reasons = []
        for r in explanation.break_reasons:
            text = str(getattr(r, "reason", r)).splitlines()[0][:160]
            if text not in reasons:
                reasons.append(text)
        return explanation.graph_count, explanation.graph_break_count, reasons[:5]
    finally:
        torch._dynamo.reset()


@contextmanager
def quiet_size_warnings():
    """Silence fastdit's one-time "is predicted to gain ... at this size" warning (``costmodel.worth_warning``)
    inside the graph-break probe: the probe runs a small copy of the model (192 tokens for Wan), where sparse
    attention cannot pay, and its warning (seen in the first H200 run) spoke of a call nobody times. Every
    other warning passes."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*is predicted to gain .* over dense attention on this call")
        yield


def dynamo_counts():
    """Dynamo's counters since they were last cleared: unique graphs and graph breaks."""
    from torch._dynamo.utils import counters

    return {"unique_graphs": int(counters["stats"].get("unique_graphs", 0)),
            "graph_breaks": int(sum(counters["graph_break"].values()))}


def set_recompile_limit(n):
    """Raises dynamo's recompile limit to at least ``n`` (its name differs across torch versions)."""
    cfg = torch._dynamo.config
    for attr in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, attr):
            setattr(cfg, attr, max(getattr(cfg, attr), n))


class Budget:
    """Seconds left of ``--budget-s`` (infinite without one)."""

    def __init__(self, seconds):
        self.end = None if not seconds else time.monotonic() + seconds

    def left(self):
        return math.inf if self.end is None else self.end - time.monotonic()


def tiny_method_options(method):
    """The method's preset for fastdit's tiny models (its class's ``tiny_options``, e.g. sta's 4x4x8
    tile fitted per grid: 4x4x8 on the tiny scale's 4x16x24 grid), as ``fastdit compare`` uses."""
    from fastdit.methods import tiny_presets

    return dict(tiny_presets().get(method, {}))


class ModelBench:
    """One model's measurements; ``run()`` emits a row per (mode, method) (see the module docstring)."""

    def __init__(self, name, args, device, dtype, budget, log, emit):
        self.name, self.args, self.device, self.dtype = name, args, device, dtype
        self.budget, self.log, self.emit = budget, log, emit
        self.cuda = device.type == "cuda"
        self.spec = MODELS[name]
        self.config, self.latent, self.text, self.text_valid, video = model_spec(name, args.scale, args.hy_frames)
        grid = token_grid(self.config, self.latent)
        full_hunyuan = name == "hunyuan" and args.scale == "full"  # a dense forward is tens of seconds
        self.reps = args.reps if args.reps is not None else (1 if full_hunyuan else 3)
        self.warmup = args.warmup if args.warmup is not None else (0 if full_hunyuan else 1)
        self.backend = "triton" if self.cuda else "torch"
        self.times = {}  # (mode, method) -> ms
        self.compile_estimate = args.compile_estimate_s
        self.model = self.inputs = None
        joint_text = self.text if name == "hunyuan" else 0
        self.base = {
            "model": self.spec["name"] + ("" if args.scale == "full" else f" ({args.scale})"), "model_key": name,
            "class": self.spec["class"], "family": self.spec["family"], "scale": args.scale,
            "model_config": self.config, "parameters": count_parameters(name, self.config), "video": video,
            "latent": list(self.latent), "grid": list(grid), "tokens": math.prod(grid) + joint_text,
            "text_tokens": self.text, "text_valid": self.text_valid, "joint_text": joint_text,
            "dtype": str(dtype).replace("torch.", ""), "reps": self.reps, "warmup": self.warmup,
            "backend": self.backend, "timer": "cuda_events" if self.cuda else "perf_counter",
            "compile_backend": args.compile_backend, "compile_kind": args.compile}

    def describe(self):
        b = self.base
        params = b["parameters"]
        count = f"{params / 1e9:.2f}B" if params >= 1e8 else f"{params / 1e6:.1f}M"
        text = (f" + {b['joint_text']} text ({b['text_valid']} valid)" if b["joint_text"]
                else f"; {b['text_tokens']} text tokens (cross-attention)")
        self.log(f"# {self.spec['name']}: {count} parameters, {b['video']}: latents {'x'.join(map(str, b['latent']))} "
                 f"-> {'x'.join(map(str, b['grid']))} = {b['tokens'] - b['joint_text']} video tokens{text}; "
                 f"{b['dtype']}, {self.reps} timed run(s) after {self.warmup} full warm-up run(s)")

    def inputs_for(self, config, latent):
        return make_inputs(self.name, config, latent, self.text, self.text_valid, self.device, self.dtype)

    def build(self):
        """Builds the model and its inputs, and what ``explain_breaks`` runs on: the model itself at
        tiny scale, else a copy with one block of each kind at a small grid. False when out of memory."""
        t0 = time.monotonic()
        try:
            self.model = build_model(self.name, self.config, self.device, self.dtype)
        except OOM as e:
            self.emit(dict(self.base, mode="-", method="-", error=f"build: out of memory ({first_line(e, 100)})"))
            return False
        self.inputs = self.inputs_for(self.config, self.latent)
        sync(self.cuda)
        weights_gib = torch.cuda.memory_allocated() / 2**30 if self.cuda else None
        self.log(f"  built in {time.monotonic() - t0:.1f}s"
                 + (f", {weights_gib:.2f} GiB allocated" if self.cuda else ""))
        self.base["weights_gib"] = weights_gib
        if self.args.scale == "tiny":
            self.explain_config, self.explain_inputs = self.config, self.inputs
            self.explain_scope = "the benchmarked model"
        else:
            reduced = self.spec["reduced"]
            self.explain_config = dict(self.config, **reduced)
            small_latent = (min(self.latent[0], 3), 16, 16)
            self.explain_inputs = self.inputs_for(self.explain_config, small_latent)
            self.explain_scope = (f"same config with {reduced} at latents {'x'.join(map(str, small_latent))} "
                                  "(breaks are per code path)")
        return True

    def estimate_s(self, mode, method):
        """Seconds this measurement should take, from what ran already."""
        times = self.times
        ref = times.get((mode, "dense")) or times.get(("eager", method)) or times.get(("eager", "dense"))
        runs = self.reps + max(self.warmup, 1 if mode == "compiled" else 0) + (0 if self.cuda else 1)
        return (ref or 0) / 1e3 * runs + (self.compile_estimate if mode == "compiled" else 0)

    def run(self):
        self.describe()
        if not self.build():
            return
        methods = ["dense"] + [m for m in self.args.methods.split(",") if m]
        for mode in [m for m in self.args.modes.split(",") if m]:
            for method in methods:
                row = dict(self.base, mode=mode, method=method)
                estimate, left = self.estimate_s(mode, method), self.budget.left()
                if left < estimate:
                    self.emit(dict(row, skipped=f"time budget: needs ~{estimate:.0f}s, {max(left, 0):.0f}s left"))
                    continue
                self.measure(row, mode, method)
        self.model = self.inputs = self.explain_inputs = None  # free the weights before the next model
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()

    def measure(self, row, mode, method):
        """One (mode, method): emits its row, or a row with the error; leaves the model as it was."""
        import fastdit

        options = tiny_method_options(method) if self.args.scale == "tiny" else {}
        patch = None
        try:
            if method != "dense":
                patch = fastdit.patch(self.model, method, dense_steps=0, record_masks=True, backend=self.backend,
                                      **options)
                row["method_config"] = to_json(dataclasses.asdict(patch.config))
            if mode == "compiled" and self.args.explain:  # before timing: explain resets dynamo
                self.explain(row, method, options)
            fn = self.compile() if mode == "compiled" else self.model

            def call():
                with torch.no_grad():
                    return fn(**self.inputs)

            self.time(row, mode, call, patch)
            t = row["time_ms"]
            self.times[(mode, method)] = t
            dense_t = self.times.get((mode, "dense"))
            row["speedup"] = dense_t / t if dense_t else None
            if mode == "compiled" and self.times.get(("eager", method)):
                row["speedup_vs_eager"] = self.times[("eager", method)] / t
            self.emit(row)
        except KeyboardInterrupt:
            raise
        except Exception as e:  # one failing measurement is reported, the rest goes on
            message = first_line(e, 200)
            if isinstance(e, OOM):
                message = "out of memory" + message[len(type(e).__name__):]
            self.emit(dict(row, error=message))
        finally:
            fn = None
            if patch is not None:
                patch.remove()
            if mode == "compiled":
                if self.args.compile == "regional":
                    for sub in self.model.modules():  # undo module.compile()
                        if getattr(sub, "_compiled_call_impl", None) is not None:
                            sub._compiled_call_impl = None
                torch._dynamo.reset()
            gc.collect()
            if self.cuda:
                torch.cuda.empty_cache()

    def explain(self, row, method, options):
        """Graph count and breaks of the (patched) model, on ``explain_config`` / ``explain_inputs``."""
        import fastdit

        tiny = self.args.scale == "tiny"
        target = self.model if tiny else build_model(self.name, self.explain_config, self.device, self.dtype)
        patch = None
        try:
            if method != "dense" and not tiny:
                patch = fastdit.patch(target, method, dense_steps=0, backend=self.backend, **options)
            with quiet_size_warnings():
                graphs, breaks, reasons = explain_breaks(target, self.explain_inputs)
            row.update(graph_count=graphs, graph_breaks=breaks, break_reasons=reasons, explain_scope=self.explain_scope)
        finally:
            if patch is not None:
                patch.remove()
            del target

    def compile(self):
        """The model compiled afresh (dynamo reset, counters cleared): whole, or its repeated blocks."""
        from torch._dynamo.utils import counters

        torch._dynamo.reset()
        counters.clear()
        if self.args.compile == "regional":
            n_blocks = sum(len(getattr(self.model, a, [])) for a in self.spec["block_lists"])
            set_recompile_limit(n_blocks + 8)
            self.model.compile_repeated_blocks(backend=self.args.compile_backend)
            return self.model
        return torch.compile(self.model, backend=self.args.compile_backend)

    def time(self, row, mode, call, patch):
        """Warm-up (eager at full size: first a forward of the first blocks; compiled: the compiling
        call, whose wall time is ``compile_s``), then the timed calls; fills the row's measurements."""
        cuda = self.cuda
        t_start = time.monotonic()
        if mode == "eager":
            if self.args.scale == "full":  # warms the same shapes for a fraction of a forward
                with first_blocks_only(self.model, self.spec["block_lists"]), torch.no_grad():
                    self.model(**self.inputs)
                sync(cuda)
            for _ in range(self.warmup):
                call()
        else:
            t_c = time.monotonic()
            call()
            sync(cuda)
            row["compile_s"] = self.compile_estimate = time.monotonic() - t_c
            for _ in range(max(self.warmup, 1) - 1):
                call()
        sync(cuda)
        if patch is not None:
            patch.reset_stats()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        with RSSPeak(enabled=not cuda) as rss:
            ts, out = time_calls(call, self.reps, cuda)
        if not cuda:
            row["peak_rss_mib_above_start"] = rss.peak_mib
        sample = out[0] if isinstance(out, (tuple, list)) else getattr(out, "sample", out)
        row.update(time_ms=statistics.median(ts), times_ms=ts, wall_s=time.monotonic() - t_start,
                   out_finite=bool(torch.isfinite(sample).all()),
                   peak_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else None)
        del out, sample
        if patch is not None:
            stats = patch.stats.as_dict()
            row.update(density=pair_density(patch), block_density=stats["effective_density"],
                       patch_stats={k: stats[k] for k in ("sparse_calls", "dense_calls", "fallback_calls",
                                                           "fallbacks", "plans", "padding_fraction")})
        else:
            row.update(density=1.0, block_density=1.0)
        if mode == "compiled":
            row["dynamo"] = dynamo_counts()


def bench_model(name, args, device, dtype, budget, log, emit):
    """Every (mode, method) of one model; ``emit(row)`` per row."""
    ModelBench(name, args, device, dtype, budget, log, emit).run()
