"""``python -m fastdit.eval.bench.selection --reuse 0.9,0.95``: selection cost with and without reuse.

Per head kind and method entry (at the sweep's threshold nearest 0.9): ``--reuse-steps`` calls of
one layer on inputs that drift as denoising steps do: step ``s`` is the kind's structured
``q, k, v`` plus ``--drift * s`` times one fixed Gaussian direction per tensor (relative to each
tensor's RMS), so a step changes the inputs by ``--drift`` of their scale. Each call is
``method.select`` (timed alone: its host time, the work itself on the CPU) and then the plan on the
engine; one state is kept over the steps (svg2's warm start, and the stored selection). Once with
reuse off and once per ``reuse_threshold`` of ``--reuse`` (``reuse_max_steps`` =
``--reuse-max-steps``). Columns: ``select_ms`` (sum over the steps; the first, a cold start,
included), ``saving`` (reuse off's ``select_ms`` over this row's), ``reuse_rate`` (head-calls that
kept their selection), ``error`` (mean over the steps of ``||out - dense|| / ||dense||`` on the video
rows, dense in float64) and ``density`` (mean).
"""
from __future__ import annotations

import time

import torch

from fastdit.eval.bench.methods import build_method, make_call
from fastdit.eval.bench.structured import structured_qkv
from fastdit.plan import run_plan


def drifting(inputs, steps, drift, seed):
    """``[(q, k, v)]`` of ``steps`` steps: ``x + drift * s * rms(x) * n_x`` (``n_x`` one Gaussian draw)."""
    gen = torch.Generator().manual_seed(seed + 7919)
    base = (inputs.q, inputs.k, inputs.v)
    noise = [torch.randn(x.shape, generator=gen, dtype=x.dtype) * x.pow(2).mean().sqrt() for x in base]
    return [tuple(x + drift * s * n for x, n in zip(base, noise)) for s in range(steps)]


def dense64(q, k, v):
    scores = (q.double() @ k.double().transpose(-1, -2)) / q.shape[-1] ** 0.5
    return torch.softmax(scores, -1) @ v.double()


def run_steps(name, options, layout, steps, backend):
    """One pass over the steps: ``(select seconds, reused, head-calls, mean error, mean density)``."""
    method = build_method(name, options)
    state, seconds, reused, head_calls, errors, densities = {}, 0.0, 0, 0, [], []
    rows = layout.video_positions()
    for step, (q, k, v) in enumerate(steps):
        ctx, _ = make_call(method, layout, q, k, v, state=state, step=step, backend=backend)
        ctx.info = {}
        start = time.perf_counter()
        with torch.no_grad():
            plan = method.select(ctx, q, k, v)
        seconds += time.perf_counter() - start
        report = ctx.info.get("reuse")
        if report is not None:
            reused, head_calls = reused + report["reused"], head_calls + report["heads"]
        with torch.no_grad():
            out = run_plan(q, k, v, plan, backend=backend)
        ref = dense64(q, k, v)
        errors.append(float((out.double()[:, :, rows] - ref[:, :, rows]).norm() / ref[:, :, rows].norm()))
        densities.append(float(plan.pair_counts().double().mean()) / float(layout.seq_len) ** 2)
    return seconds, reused, head_calls, sum(errors) / len(errors), sum(densities) / len(densities)


def reuse_rows(args, specs, kinds, threshold_option, threshold):
    """The rows of the module docstring, printed as they come."""
    grid = (args.frames, args.height, args.width)
    thresholds = [float(t) for t in args.reuse.split(",") if t.strip()]
    rows = []
    for kind in kinds:
        inputs = structured_qkv(grid, heads=args.heads, head_dim=args.head_dim, kinds=(kind,) * args.heads,
                                text_len=args.text, seed=args.seed)
        steps = drifting(inputs, args.reuse_steps, args.drift, args.seed)
        for label, name, options in specs:
            base = {**options, threshold_option[name]: threshold}
            off = None
            for reuse in [None] + thresholds:
                opts = dict(base) if reuse is None else {**base, "reuse_threshold": reuse,
                                                        "reuse_max_steps": args.reuse_max_steps}
                seconds, reused, calls, error, density = run_steps(name, opts, inputs.layout, steps, args.backend)
                off = seconds if reuse is None else off
                row = {"kind": kind, "method": label, "threshold": threshold, "reuse_threshold": reuse,
                       "reuse_max_steps": None if reuse is None else args.reuse_max_steps, "steps": len(steps),
                       "drift": args.drift, "select_ms": 1000 * seconds, "saving": off / seconds,
                       "reuse_rate": reused / calls if calls else None, "error": error, "density": density}
                rows.append(row)
                rate = "-" if row["reuse_rate"] is None else f"{row['reuse_rate']:.2f}"
                print(f"reuse {kind:9s} {label:12s} reuse_threshold={reuse}: select {row['select_ms']:8.1f} ms "
                      f"(x{row['saving']:.2f}), reuse rate {rate}, error {error:.4f}, density {density:.3f}",
                      flush=True)
    return rows
