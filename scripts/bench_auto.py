"""method="auto" on structured inputs of mixed head kinds: auto against every single method at equal budgets.

    python scripts/bench_auto.py [--grid 4,32,32] [--per-kind 1] [--budgets 0.05,0.1,0.2,0.3] [--gpu H100]
                                 [--quick] [--json FILE]
    python scripts/bench_auto.py --grouping     # auto's group calls against one call with per-head windows

One layer of ``4 x per-kind`` heads (spatial, temporal, semantic, global; ``fastdit.eval.bench.
structured``) on a grid of at least 4096 tokens. Every candidate of ``auto_candidates`` (sta windows
in tiles of 1 x 8 x 8, radial, sparge, svg, svg2, ToDo, ToMe; ``--quick``: two a method) runs on the
same ``q, k, v`` through ``fastdit.attention`` (as ``fastdit.calibrate(pipe, "auto")`` scores them:
every video query row here), giving per (head, candidate) the relative L2 error against dense and
the predicted time on ``--gpu`` (``fastdit.costmodel.head_times``). For each budget:

* ``auto``: per head the candidate of least predicted time within the budget (dense if none, or
  if dense is predicted faster); each single method: the same choice among its own candidates
  (its own per-head settings), dense where none meets the budget. Predicted attention time of the
  layer (sum over heads), speedup over dense, heads per method;
* ``measured``: the auto choice run as method ``"auto"`` (mixed methods in one call) on the
  calibration inputs and on held-out inputs (another seed), worst per-head relative error against
  float64 dense attention, and the CPU wall time of that call against dense SDPA (median of 3 after
  a warm-up; CPU only, shared cores: the load average is printed).
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

import torch

import fastdit
from fastdit.calibration.auto_report import compare_single, score_call
from fastdit.calibration.candidates import auto_candidates
from fastdit.eval.bench.structured import structured_qkv
from fastdit.jsonutil import dump_json

KINDS = ("spatial", "temporal", "semantic", "global")
QUICK = ([{"method": "sta", "tile": (1, 8, 8), "window": w} for w in ((1, 3, 3), (5, 1, 1))]
         + [{"method": "radial", "decay": 0.5}, {"method": "sparge", "topk": 0.3}, {"method": "svg", "density": 0.2},
            {"method": "svg2", "top_p": 0.9}, {"method": "todo", "factor": 2}, {"method": "tome", "ratio": 0.5}])


def worst_error(q, k, v, out):
    expected = torch.softmax(q.double() @ k.double().transpose(-1, -2) / math.sqrt(q.shape[-1]), -1) @ v.double()
    err = ((out.double() - expected).pow(2).sum((0, 2, 3)) / expected.pow(2).sum((0, 2, 3))).sqrt()
    return err.tolist()


def wall(function, runs=3):
    function()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def grouping(runs=5):
    """Mixed windows in one layer: auto's one engine call per group against one call of sta with a
    per-head window ``strategy`` (one engine call over all heads, per-head block lists): 8 spatial
    heads, 4096 tokens, windows (1, 1, 1), (1, 3, 3), (3, 3, 3), (5, 3, 3) in turn, torch backend."""
    q, k, v, layout, _ = structured_qkv((4, 32, 32), heads=8, head_dim=64, kinds=("spatial",) * 8, seed=0)
    windows = [(1, 1, 1), (1, 3, 3), (3, 3, 3), (5, 3, 3)]
    candidates = [{"method": "sta", "tile": (1, 8, 8), "window": w, "fit_tile": False} for w in windows]
    choices = {f"0_0_{h}": h % 4 for h in range(8)}
    strategy = {f"0_0_{h}": windows[h % 4] for h in range(8)}
    one = lambda: fastdit.attention(q, k, v, "sta", layout=layout, tile=(1, 8, 8), fit_tile=False,  # noqa: E731
                                    strategy=strategy, backend="torch")
    groups = lambda: fastdit.attention(q, k, v, "auto", layout=layout, candidates=candidates,  # noqa: E731
                                       choices=choices, backend="torch")
    difference = float((one() - groups()).abs().max())
    result = {"one_call_s": wall(one, runs), "groups_s": wall(groups, runs), "max_difference": difference,
              "load_average": os.getloadavg()[0]}
    print(f"8 heads, 4 windows: one sta call with per-head windows {1e3 * result['one_call_s']:.0f} ms, auto's 4 group "
          f"calls {1e3 * result['groups_s']:.0f} ms (median of {runs} after a warm-up; outputs differ by at most "
          f"{difference:.1e}; load average {result['load_average']:.1f})")
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--grid", default="4,32,32")
    parser.add_argument("--per-kind", type=int, default=1, help="heads of each kind")
    parser.add_argument("--budgets", default="0.05,0.1,0.2,0.3")
    parser.add_argument("--gpu", default="H100")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="two candidates a method (the test's list)")
    parser.add_argument("--grouping", action="store_true", help="only: group calls against one per-head call")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.grouping:
        result = grouping()
        if args.json:
            dump_json(args.json, result, indent=1)
        return result
    grid = tuple(int(x) for x in args.grid.split(","))
    kinds = [kind for kind in KINDS for _ in range(args.per_kind)]
    budgets = [float(b) for b in args.budgets.split(",")]
    q, k, v, layout, _ = structured_qkv(grid, heads=len(kinds), head_dim=64, kinds=kinds, seed=args.seed)
    held = structured_qkv(grid, heads=len(kinds), head_dim=64, kinds=kinds, seed=args.seed + 1000)
    candidates = QUICK if args.quick else auto_candidates(layout, {"sta": {"tile": (1, 8, 8)}})
    load = os.getloadavg()[0]
    print(f"structured inputs: grid {grid} ({layout.seq_len} tokens), heads {kinds}, {len(candidates)} candidates, "
          f"predicted on {args.gpu}; load average {load:.1f} on {os.cpu_count()} cores")
    start = time.perf_counter()
    results = [score_call(q, k, v, layout, candidates, args.gpu, backend="torch", seed=args.seed)]
    print(f"scored in {time.perf_counter() - start:.1f} s")
    dense_s = wall(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v))
    report = {"grid": grid, "kinds": kinds, "gpu": args.gpu, "candidates": candidates, "load_average": load,
              "budgets": {}}
    print("| budget | method | predicted us | speedup | worst error (calibration) | heads |")
    print("|---:|---|---:|---:|---:|---|")
    for budget in budgets:
        rows = compare_single(results, candidates, budget)
        for row in rows:
            heads = ", ".join(f"{name} {n}" for name, n in sorted(row["heads"].items()))
            print(f"| {budget} | {row['label']} | {1e3 * row['predicted_ms']:.1f} | {row['speedup']:.2f} | "
                  f"{row['worst_error']:.3f} | {heads} |")
        auto = rows[0]
        choices = auto["choice"]
        used = sorted({c for c in choices.values() if c is not None})
        measured = {}
        for group, (qq, kk, vv) in (("calibration", (q, k, v)), ("held-out", held[:3])):
            out = fastdit.attention(qq, kk, vv, "auto", layout=layout, candidates=candidates, choices=choices,
                                    backend="torch")
            measured[group] = max(worst_error(qq, kk, vv, out))
        auto_s = wall(lambda: fastdit.attention(q, k, v, "auto", layout=layout, candidates=candidates,
                                                choices=choices, backend="torch"))
        best = min(rows[1:], key=lambda r: r["predicted_ms"])
        print(f"  measured through method auto: worst error {measured['calibration']:.3f} (calibration), "
              f"{measured['held-out']:.3f} (held-out seed); {len(used)} candidates in use; CPU {1e3 * auto_s:.0f} ms "
              f"vs dense SDPA {1e3 * dense_s:.0f} ms; best single method {best['label']} "
              f"{best['speedup']:.2f}x vs auto {auto['speedup']:.2f}x")
        report["budgets"][str(budget)] = {"rows": [{k: v for k, v in r.items() if k != "choice"} for r in rows],
                                          "choices": choices, "measured_worst_error": measured,
                                          "cpu_auto_s": auto_s, "cpu_dense_s": dense_s, "best_single": best["label"]}
    if args.json:
        dump_json(args.json, report, indent=1)
        print(f"wrote {args.json}")
    return report


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
