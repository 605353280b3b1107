"""torch.compile and fastdit: graph breaks per family, and what the interception costs compiled.

For every tiny family of the test suite (random weights, CPU or CUDA), patched with sliding tile:

* the route each patched layer takes (``backend``: fastdit's private diffusers backend on the
  processor; ``mode``: the SDPA ``TorchFunctionMode`` around the module's forward);
* graph breaks of the unpatched and the patched model (``torch._dynamo.explain``), and the breaks
  fastdit adds per patched layer;
* whether ``fullgraph=True`` compiles;
* with ``--time``: median forward time compiled (``--backend``, default inductor) of the unpatched
  model, of the model patched with the ``dense`` method (same attention math, so the difference is
  the interception itself, graph breaks included) and with ``sta``; the overhead of the dense patch
  per layer is the cost of the route.

    python scripts/compile_report.py                       # break counts, all families
    python scripts/compile_report.py --time --families wan,mochi --out compile.json

Timing: ``--warmup`` untimed calls after compilation, then the median of ``--runs`` timed calls
(``perf_counter``; CUDA synchronised), all under ``torch.no_grad()``.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import fastdit  # noqa: E402
from tiny_models import TINY  # noqa: E402

STA = dict(tile=(1, 4, 4), window=(1, 1, 1), dense_steps=0)


def _route(patch, model):
    routes = set()
    for name, module in model.named_modules():
        forward = module.__dict__.get("forward")
        if forward is not None and hasattr(forward, "mode"):
            routes.add("mode" if forward.mode else "backend")
    return "+".join(sorted(routes))


def _time(fn, warmup, runs, device):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def report(family, device, timing, backend, warmup, runs):
    case = TINY[family]
    model = case.build(0).to(device)
    grid = (3, 8, 10) if case.video else (1, 8, 10)
    inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in case.inputs(model, grid, 0).items()}
    row = {"family": family}
    with torch.no_grad():
        torch._dynamo.reset()
        row["unpatched_graph_breaks"] = torch._dynamo.explain(model)(**inputs).graph_break_count
        with fastdit.patch(model, "sta", **STA) as p:
            row["route"] = _route(p, model)
            row["layers"] = len(p.layers)
            torch._dynamo.reset()
            explanation = torch._dynamo.explain(model)(**inputs)
            row["graph_breaks"] = explanation.graph_break_count
            # breaks fastdit adds, per patched layer (the model's own breaks left out)
            row["breaks_per_layer"] = (explanation.graph_break_count - row["unpatched_graph_breaks"]) / len(p.layers)
            reasons = sorted({str(b.reason).splitlines()[0][:120] for b in explanation.break_reasons})
            row["break_reasons"] = reasons
            torch._dynamo.reset()
            try:
                torch.compile(model, backend="eager", fullgraph=True)(**inputs)
                row["fullgraph"] = "ok"
            except Exception as error:  # noqa: BLE001 - reported, not raised
                row["fullgraph"] = f"fails: {str(error).splitlines()[0][:120]}"
        if timing:
            for label, method in (("unpatched", None), ("patched_dense", "dense"), ("patched_sta", "sta")):
                patch = None if method is None else fastdit.patch(model, method, **(STA if method == "sta" else {}))
                torch._dynamo.reset()
                compiled = torch.compile(model, backend=backend)
                row[f"{label}_ms"] = 1e3 * _time(lambda: compiled(**inputs), warmup, runs, device)
                if patch is not None:
                    patch.remove()
            row["dense_patch_overhead_ms_per_layer"] = (row["patched_dense_ms"] - row["unpatched_ms"]) / row["layers"]
    torch._dynamo.reset()
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", default=",".join(f for f in TINY if not f.startswith("sana")))
    parser.add_argument("--time", action="store_true", help="also time compiled forwards")
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    rows = []
    for family in args.families.split(","):
        row = report(family, device, args.time, args.backend, args.warmup, args.runs)
        rows.append(row)
        timing = ""
        if args.time:
            timing = (f"  unpatched {row['unpatched_ms']:.1f} ms, dense patch {row['patched_dense_ms']:.1f} ms, "
                      f"sta {row['patched_sta_ms']:.1f} ms, "
                      f"overhead {row['dense_patch_overhead_ms_per_layer']:.2f} ms/layer")
        print(f"{family:16s} route {row['route']:8s} layers {row['layers']}  breaks {row['graph_breaks']:3d} "
              f"(unpatched {row['unpatched_graph_breaks']}; added {row['breaks_per_layer']:.1f}/layer)  "
              f"fullgraph {row['fullgraph'][:40]}{timing}", flush=True)
    meta = {"torch": torch.__version__, "device": str(device), "machine": platform.processor() or platform.machine(),
            "timed_backend": args.backend if args.time else None, "warmup": args.warmup, "runs": args.runs,
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S")}
    if args.out:
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
