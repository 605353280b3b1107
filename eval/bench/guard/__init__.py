"""Benchmark: does the quality guard's estimate hold, and what does it cost? (issue 39)

Run ``python -m fastdit.eval.bench.guard`` (options below). Per head set, method entry and seed,
one call with the guard off (the method alone) and one with the guard at its bound (``--bound``,
default the shipped 0.1), both every call sparse, compared per head with float64 dense attention:

* ``est`` / ``true``: the guard's estimate of the method's error (``info["guard"]["first_error"]``,
  on its sampled rows) and the method's true relative L2 error over all rows;
* ``missed``: the guard passed the head (``action == "pass"``) while its true error exceeds the
  bound or its true kept mass is below the promise minus 0.05 (target: at most 5% of head-calls);
* ``kept``: the true kept mass of the guarded call per head (float64 log-sum-exps; needs the
  method's lse: block-sparse methods); ``err``: the guarded call's true error;
* ``oracle``: the error of the best block mask at the guarded call's density (128-token tiles,
  ``eval.bench.selection``'s construction), and whether ``err <= 2 * oracle`` or within 0.01;
* ``density`` before / after the guard (after: the method's plan, widened and dense heads as
  computed, the guard's own sampled rows not included).

Head sets: every kind of ``eval.bench.structured`` (``--kinds``) and ``offset_norms``: logits
with a position-dependent offset (a distance bias) and keys whose norms span three orders of
magnitude (what an attention sink or an unnormalised projection gives), at ``--sizes`` tokens;
with ``--model tiny-shapes`` also every self-attention call of one dense run of the trained model
(real learned attention; ``--model-steps`` steps).

Cost (``--cost-tokens``, default 32768, one call of 2 heads x 64): the check alone (sampled rows
attended exactly, estimate, finiteness test) against dense SDPA of the same call on this machine
(median of ``--runs`` after one warm-up, load average recorded), and the cost model's predicted
share on each GPU (``fastdit.costmodel.guard_share``, Wan-like 24 heads x 128).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

import fastdit
from fastdit.costmodel import GPUS, guard_share
from fastdit.eval.bench import common
from fastdit.eval.bench.selection import Reference
from fastdit.eval.bench.structured import KINDS, structured_qkv
from fastdit.jsonutil import dump_json
from fastdit.layout import TokenLayout
from fastdit.methods import guard as guard_module
from fastdit.methods.base import GUARD_DEFAULT

#: ``name:option=value`` entries; the threshold options are the promises the guard checks.
DEFAULT_METHODS = ("sparge:cdf=0.9", "sparge:cdf=0.95", "svg2:top_p=0.9", "svg2:top_p=0.95", "todo", "optiprune")
SIZES = {2048: (2, 32, 32), 4096: (4, 32, 32), 8192: (8, 32, 32)}
MASS_TOLERANCE = guard_module.MASS_TOLERANCE


def offset_norm_heads(grid, heads=2, dim=64, seed=0):
    """q, k, v with position-dependent logit offsets and key norms over three orders of magnitude
    (``torch.Generator`` seeded with ``seed``; the benchmark draws seed ``1000 + --seeds``)."""
    gen = torch.Generator().manual_seed(seed)
    seq = grid[0] * grid[1] * grid[2]
    q, k, v = (torch.randn(1, heads, seq, dim, generator=gen) for _ in range(3))
    norms = 10 ** (torch.rand(1, heads, seq, 1, generator=gen) * 3 - 1.5)
    k = k / k.norm(dim=-1, keepdim=True) * norms * dim ** 0.25
    q[..., 0] = 4.0
    k[..., 0] = k[..., 0] + torch.linspace(0, 3, seq)
    return q, k, v, TokenLayout(grid)


def parse_entry(entry):
    name, *parts = entry.split(":")
    options = {}
    for part in parts:
        key, _, value = part.partition("=")
        options[key] = float(value) if value.replace(".", "", 1).isdigit() else value
    return name, options


def promise_of(name, options):
    cls = fastdit.methods.get_method(name)
    method = cls(cls.resolve(cls.make_config(**{**options, "dense_steps": 0, "dense_layers": 0, "guard": False})))
    return method.guard_promise()


def true_heads(out, reference):
    """Per head: relative L2 error of ``out`` (batch 0) against the float64 dense output."""
    diff = out[0].double() - reference.ref
    return (diff.norm(dim=(-1, -2)) / reference.ref.norm(dim=(-1, -2))).tolist()


def evaluate(inputs, reference, dense_lse, entry, bound):
    q, k, v, layout = inputs
    name, options = parse_entry(entry)
    cls = fastdit.methods.get_method(name)
    mass = "mass" if cls.reports_lse else True
    common_opts = {**options, "dense_steps": 0, "dense_layers": 0}
    with torch.no_grad():
        out0, info0 = fastdit.attention(q, k, v, name, layout=layout, return_info=True, guard=False, **common_opts)
        out1, info1 = fastdit.attention(q, k, v, name, layout=layout, return_info=mass, guard=bound, **common_opts)
    report = info1["guard"]
    promise = promise_of(name, options)
    true0 = true_heads(out0, reference)
    true1 = true_heads(out1, reference)
    kept = None
    if info1.get("lse") is not None:
        kept = torch.exp(info1["lse"][0].double() - dense_lse).mean(-1).tolist()
    kept0 = None
    if info0.get("lse") is not None:
        kept0 = torch.exp(info0["lse"][0].double() - dense_lse).mean(-1).tolist()
    heads = q.shape[1]
    missed = []
    for h in range(heads):
        short_of_promise = promise is not None and kept0 is not None and kept0[h] < promise - MASS_TOLERANCE
        violates = true0[h] > bound or short_of_promise
        missed.append(bool(report["action"][h] == "pass" and violates))
    row = {"method": entry, "heads": heads, "est": report["first_error"], "true": true0, "err": true1,
           "kept_before": kept0, "kept": kept, "promise": promise, "action": report["action"], "missed": missed,
           "density_before": info0["head_density"], "density_after": info1["head_density"], "rows": report["rows"]}
    if cls.reports_lse:
        row["oracle"], _ = reference.oracle(info1["head_density"])
        row["oracle_ok"] = sum(true1) / heads <= max(2 * row["oracle"], row["oracle"] + 0.01)
        row["mass_ok"] = promise is None or all(m >= promise - MASS_TOLERANCE for m in kept)
    return row


def head_sets(args):
    for tokens in args.sizes:
        grid = SIZES[tokens]
        for seed in args.seeds:
            for kind in args.kinds:
                if kind == "offset_norms":
                    yield kind, tokens, seed, offset_norm_heads(grid, args.heads, args.head_dim, 1000 + seed)
                else:
                    x = structured_qkv(grid, heads=args.heads, head_dim=args.head_dim, kinds=[kind] * args.heads,
                                       seed=seed)
                    yield kind, tokens, seed, (x.q, x.k, x.v, x.layout)


def model_calls(args):
    """Every self-attention call (q, k, v, layout) of one dense tiny-shapes run (CFG branch 0)."""
    from fastdit.methods.base import register_method, unregister_method
    from fastdit.pipelines.loading import TRAINED_DEFAULTS, load_pipeline
    from fastdit.pipelines.shapes_data import DEMO_CAPTION

    pipe = load_pipeline(args.model, "cpu")
    _Capture.store, _Capture.limit = [], args.max_calls
    register_method(_Capture)
    call = {**TRAINED_DEFAULTS[args.model], "num_inference_steps": args.model_steps, "output_type": "latent"}
    patch = fastdit.patch(pipe, _Capture.name, dense_steps=0, dense_layers=0)
    try:
        with torch.no_grad():
            pipe(prompt=DEMO_CAPTION, generator=torch.Generator().manual_seed(0), **call)
    finally:
        patch.remove()
        unregister_method(_Capture.name)
    return _Capture.store


class _Capture(fastdit.methods.base.Method):
    """Records each call's q, k, v (CFG branch 0, batch element 0) and runs the model's own attention."""

    name = "_guard_bench_capture"
    listed = False
    store, limit = [], 0

    def attend(self, ctx, q, k, v):
        if len(self.store) < self.limit and ctx.branch == 0:
            self.store.append((q[:1].clone(), k[:1].clone(), v[:1].clone(), ctx.layout))
        ctx.info["dense"] = True
        return ctx.dense()


def cost(args):
    """The check alone against dense SDPA at ``args.cost_tokens`` tokens (CPU, this machine)."""
    seq = args.cost_tokens
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, seq, 64, generator=gen) for _ in range(3))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v)

    def check():
        rows = guard_module.sample_rows(seq, 0.005, (0, 0, 0, 0), "cpu")
        ref_out, ref_lse = guard_module.exact_rows(q, k, v, rows)
        guard_module.estimate(out.index_select(2, rows), ref_out, ref_lse)  # noqa: the timed work
        return guard_module.all_finite(q, k, v)

    dense = common.time_fn(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v), args.runs, 1, False)
    checked = common.time_fn(check, args.runs, 1, False)
    rows = guard_module.row_count(seq, 0.005)
    predicted = {name: guard_share(gpu, seq, 128, rows, heads=24)[0] for name, gpu in GPUS.items()}
    rows_75k = guard_module.row_count(75600, 0.005)
    predicted_75k = {name: guard_share(gpu, 75600, 128, rows_75k, heads=24)[0] for name, gpu in GPUS.items()}
    return {"tokens": seq, "dense_ms": dense, "check_ms": checked, "share": checked / dense,
            "rows": guard_module.row_count(seq, 0.005), "load": os.getloadavg()[0],
            "gpu_predicted_share": predicted, "gpu_predicted_share_75600": predicted_75k}


def summarize(rows):
    head_calls = sum(r["heads"] for r in rows)
    missed = sum(sum(r["missed"]) for r in rows)
    block = [r for r in rows if "mass_ok" in r and r["promise"] is not None]
    return {"head_calls": head_calls, "missed": missed, "missed_share": missed / max(head_calls, 1),
            "mass_ok": sum(r["mass_ok"] for r in block), "mass_rows": len(block),
            "oracle_ok": sum(r["oracle_ok"] for r in rows if "oracle_ok" in r),
            "oracle_rows": sum(1 for r in rows if "oracle_ok" in r)}


def fmt(values, digits=3):
    return "/".join(f"{x:.{digits}f}" for x in values) if values is not None else "-"


def run(args):
    torch.set_num_threads(args.threads)
    rows = []
    sets = list(head_sets(args))
    if args.model:
        for index, (q, k, v, layout) in enumerate(model_calls(args)):
            sets.append(("tiny-shapes", q.shape[2], index, (q, k, v, layout)))
    print(f"{'set':<28} {'method':<17} {'est':<13} {'true':<13} {'action':<15} {'kept':<13} {'err':<13} "
          f"{'oracle':<7} {'dens before->after'}")
    for kind, tokens, seed, inputs in sets:
        q, k, v, layout = inputs
        reference = Reference(inputs)
        dense_lse = torch.logsumexp((q[0].double() @ k[0].double().transpose(-1, -2)) / math.sqrt(q.shape[-1]), -1)
        for entry in args.methods:
            row = evaluate(inputs, reference, dense_lse, entry, args.bound)
            row.update(kind=kind, tokens=tokens, seed=seed)
            rows.append(row)
            print(f"{f'{kind} {tokens} s{seed}':<28} {entry:<17} {fmt(row['est']):<13} {fmt(row['true']):<13} "
                  f"{'/'.join(row['action']):<15} {fmt(row['kept']):<13} {fmt(row['err']):<13} "
                  f"{row.get('oracle', float('nan')):<7.3f} {fmt(row['density_before'], 2)} -> "
                  f"{fmt(row['density_after'], 2)}{'  MISSED' if any(row['missed']) else ''}", flush=True)
    result = {"bound": args.bound, "rows": rows, "summary": summarize(rows)}
    if args.cost_tokens:
        result["cost"] = cost(args)
    s = result["summary"]
    print(f"\nmissed violations: {s['missed']} of {s['head_calls']} head-calls ({100 * s['missed_share']:.1f}%); "
          f"kept mass >= promise - 0.05 on every head: {s['mass_ok']} of {s['mass_rows']} rows; "
          f"error within 2x the block oracle (or +0.01): {s['oracle_ok']} of {s['oracle_rows']} rows")
    if "cost" in result:
        c = result["cost"]
        print(f"cost at {c['tokens']} tokens (CPU, {c['rows']} rows per head): check {c['check_ms']:.1f} ms, "
              f"dense SDPA {c['dense_ms']:.1f} ms: {100 * c['share']:.2f}% (load {c['load']:.1f}); "
              "predicted GPU share (24 heads x 128): "
              + ", ".join(f"{n} {100 * v:.1f}%" for n, v in c["gpu_predicted_share"].items()))
    if args.json:
        dump_json(args.json, result)
        print(f"wrote {args.json}")
    return result


def build_parser():
    parser = argparse.ArgumentParser(prog="python -m fastdit.eval.bench.guard", description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", default=",".join(DEFAULT_METHODS))
    parser.add_argument("--kinds", default=",".join(KINDS + ("offset_norms",)))
    parser.add_argument("--sizes", default="2048,4096")
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--bound", type=float, default=GUARD_DEFAULT)
    parser.add_argument("--model", default="", help="also every self-attention call of this trained model")
    parser.add_argument("--model-steps", type=int, default=4)
    parser.add_argument("--max-calls", type=int, default=16)
    parser.add_argument("--cost-tokens", type=int, default=32768, help="0: skip the cost measurement")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default="guard_bench.json")
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    args.methods = [m for m in args.methods.split(",") if m]
    args.kinds = [k for k in args.kinds.split(",") if k]
    args.sizes = [int(s) for s in args.sizes.split(",") if s]
    args.seeds = [int(s) for s in args.seeds.split(",") if s]
    bad = [s for s in args.sizes if s not in SIZES]
    if bad:
        print(f"--sizes: {bad} not among {sorted(SIZES)}", file=sys.stderr)
        return 2
    run(args)
    return 0

