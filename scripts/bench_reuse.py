"""End to end on tiny-shapes: what selection reuse across steps (``fastdit/methods/selection/reuse.py``) saves.

    python scripts/bench_reuse.py [--method svg2] [--thresholds 0.9,0.8@3] [--max-steps 4] [--audit]
                                  [--height 64 --width 64] [--seed 0] [--dense-cache dense.npy]

Runs the trained tiny-shapes pipeline at its native call (12 steps, CFG, 9 x 32 x 32 latents) once
dense and once per setting of ``--method`` at its tiny-shapes preset (svg2: the calibrated plan):
reuse off, then ``reuse_threshold`` at each of ``--thresholds`` (``reuse_max_steps`` =
``--max-steps``). Per run: end-to-end seconds, the seconds spent in the method's ``select`` (the
selection, and with reuse the similarity test; host time around each call, which on the CPU is the
work itself) and their share of the run, PSNR of the frames against dense, the reuse rate
(``PatchStats`` ``reuse``), the guard's actions, the effective density.

``--audit``: a second run of each setting where every sparse call's own output (before the guard
acts) is compared with exact dense attention over all rows (float32 SDPA, its log-sum-exp from
torch's CPU flash kernel): per head the true relative L2 error and kept mass, and whether the guard
passed a head whose true error is above its bound or whose kept mass is below the promise - 0.05
(``missed``, as ``eval.bench.guard`` counts it), split by reused and re-selected heads. Its times
include the audit and are not reported.

The timers and the audit wrap the patch's method instances (instance attributes, removed with the
patch); nothing in fastdit changes.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

import torch

import fastdit
from fastdit.compare import Generation, fidelity, generate, pipeline_frames
from fastdit.cli.common import call_arguments
from fastdit.eval.runner.settings import tiny_method_presets
from fastdit.methods.guard import MASS_TOLERANCE
from fastdit.pipelines.loading import latent_grid, load_pipeline
from fastdit.cli.compare import SHAPES_PROMPT

_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


class Timer:
    """Seconds spent in one bound method, summed over calls."""

    def __init__(self, fn):
        self.fn, self.seconds, self.calls = fn, 0.0, 0

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start
            self.calls += 1


class Audit:
    """Per sparse call and head: the method's true error and kept mass, and the guard's action."""

    def __init__(self, method):
        self.method, self.rows = method, []
        self.attend, self.run_checked = method.attend, method.run_checked

    def audited_attend(self, ctx, q, k, v):
        out = self.attend(ctx, q, k, v)
        if not ctx.info.get("dense") and ctx.key_mask is None and ctx.query_mask is None:
            ref, lse = _FLASH(q.float(), k.float(), v.float(), 0.0, False, scale=ctx.scale)[:2]
            err = ((out.float() - ref).pow(2).sum((0, 2, 3)) / ref.pow(2).sum((0, 2, 3))).sqrt()
            mine = ctx.info.get("lse")
            kept = torch.exp(mine.float() - lse.float()).mean((0, 2)) if mine is not None else torch.ones_like(err)
            ctx.info["audit"] = (err.tolist(), kept.tolist())
        return out

    def audited_run_checked(self, ctx, q, k, v):
        out = self.run_checked(ctx, q, k, v)
        audit, report = ctx.info.get("audit"), ctx.info.get("guard")
        if audit is None:
            return out
        selected = (ctx.info.get("reuse") or {}).get("selected")
        for h, (err, kept) in enumerate(zip(*audit)):
            reused = selected is not None and h not in selected
            action = None if report is None else report["action"][h]
            bound = None if report is None else report["bound"]
            promise = None if report is None else report["promise"]
            violates = bound is not None and (err > bound or (promise is not None and kept < promise - MASS_TOLERANCE))
            self.rows.append({"step": ctx.step, "layer": ctx.layer, "head": h, "error": err, "kept": kept,
                              "action": action, "violates": violates, "missed": bool(violates and action == "pass"),
                              "reused": reused})
        return out


def instrument(patch, audit):
    timers, audits = [], []
    for method in patch._method.variants():
        timer = Timer(method.select)
        method.select = timer  # instance attribute: BlockSparseMethod.attend looks it up on self
        timers.append(timer)
        if audit:
            watch = Audit(method)
            method.attend, method.run_checked = watch.audited_attend, watch.audited_run_checked
            audits.append(watch)
    return timers, audits


def run_setting(pipe, method, options, call_kwargs, prompt, seed, reference, audit=False):
    patch = fastdit.patch(pipe, method, backend="auto", **options)
    timers, audits = instrument(patch, audit)
    generator = torch.Generator(device="cpu").manual_seed(seed)
    call = {"output_type": "np", **call_kwargs}
    try:
        start = time.perf_counter()
        with torch.inference_mode():
            output = pipe(prompt=prompt, generator=generator, **call)
        seconds = time.perf_counter() - start
        stats = patch.stats.as_dict()
    finally:
        patch.remove()
    frames = pipeline_frames(output)
    psnr, _ = fidelity(frames, reference)
    row = {"options": {k: v for k, v in options.items() if k != "plan"}, "seconds": seconds,
           "select_seconds": sum(t.seconds for t in timers), "select_calls": sum(t.calls for t in timers),
           "psnr_db": psnr, "density": stats["effective_density"], "reuse": stats["reuse"], "guard": stats["guard"]}
    row["select_share"] = row["select_seconds"] / seconds
    if audit:
        rows = [r for a in audits for r in a.rows]
        for name, part in (("all", rows), ("reused", [r for r in rows if r["reused"]]),
                           ("selected", [r for r in rows if not r["reused"]])):
            checked = [r for r in part if r["action"] is not None]
            row[f"audit_{name}"] = {"head_calls": len(checked), "violations": sum(r["violates"] for r in checked),
                                    "missed": sum(r["missed"] for r in checked),
                                    "missed_share": sum(r["missed"] for r in checked) / max(len(checked), 1),
                                    "mean_error": sum(r["error"] for r in part) / max(len(part), 1)}
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(prog="scripts/bench_reuse.py", description=__doc__.split("\n")[0])
    parser.add_argument("--method", default="svg2")
    parser.add_argument("--thresholds", default="0.9,0.95", help="reuse_threshold values, each optionally "
                        "@reuse_max_steps (e.g. 0.8@3)")
    parser.add_argument("--no-baseline", dest="baseline", action="store_false", help="skip the run without reuse")
    parser.add_argument("--max-steps", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompt", default=SHAPES_PROMPT)
    parser.add_argument("--audit", action="store_true")
    parser.add_argument("--no-timing", dest="timing", action="store_false")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default=None)
    parser.add_argument("--steps", type=int, default=None, help="default: the model's native 12")
    parser.add_argument("--height", type=int, default=None)
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--dense-cache", default=None, help="an .npy file: the dense frames, read when present")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    pipe = load_pipeline("tiny-shapes", "cpu", None)
    call_kwargs = call_arguments(pipe, "tiny-shapes", args.height, args.width, None, args.steps)
    grid = latent_grid(pipe, call_kwargs)
    preset = tiny_method_presets("tiny-shapes", [args.method], {}, grid).get(args.method, {})
    if args.dense_cache and os.path.exists(args.dense_cache):
        cached = np.load(args.dense_cache, allow_pickle=True).item()
        dense = Generation("dense", {}, cached["frames"], cached["latency_s"])
    else:
        dense = generate(pipe, args.prompt, args.seed, call_kwargs, method="dense")
        if args.dense_cache:
            np.save(args.dense_cache, {"frames": dense.frames, "latency_s": dense.latency_s})
    print(f"dense: {dense.latency_s:.1f} s; {args.method} preset {preset}", flush=True)
    settings = [dict(preset)] if args.baseline else []
    for item in (t for t in args.thresholds.split(",") if t):  # THRESHOLD or THRESHOLD@MAX_STEPS
        threshold, _, steps = item.partition("@")
        settings.append(dict(preset, reuse_threshold=float(threshold), reuse_max_steps=int(steps or args.max_steps)))
    results = {"dense_seconds": dense.latency_s, "call": {k: v for k, v in call_kwargs.items()
                                                        if isinstance(v, (int, float, str))}, "rows": []}
    for options in settings:
        row = {}
        if args.timing:
            row = run_setting(pipe, args.method, options, call_kwargs, args.prompt, args.seed, dense.frames)
        if args.audit:
            audited = run_setting(pipe, args.method, options, call_kwargs, args.prompt, args.seed, dense.frames,
                                  audit=True)
            row = {**audited, **row, **{k: v for k, v in audited.items() if k.startswith("audit_")}}
        results["rows"].append(row)
        reuse = row["reuse"]
        rate = "-" if reuse["rate"] is None else f"{reuse['rate']:.2f}"
        line = (f"{json.dumps(row['options'])}: {row['seconds']:.1f} s (dense {dense.latency_s:.1f}), select "
                f"{row['select_seconds']:.2f} s ({100 * row['select_share']:.1f}%), PSNR {row['psnr_db']:.2f} dB, "
                f"reuse rate {rate}, density {row['density']:.3f}, guard widened/dense "
                f"{row['guard']['widened']}/{row['guard']['dense']} of {row['guard']['head_calls']}")
        for name in ("all", "reused", "selected"):
            part = row.get(f"audit_{name}")
            if part:
                line += (f"\n    audit {name}: {part['missed']} missed of {part['head_calls']} head-calls "
                         f"({100 * part['missed_share']:.1f}%), {part['violations']} violations, mean true error "
                         f"{part['mean_error']:.3f}")
        print(line, flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=1, default=str)


if __name__ == "__main__":
    main()
