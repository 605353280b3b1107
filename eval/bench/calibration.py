"""Calibration evidence on the embedded tiny model: a calibration against every single global setting.

    python -m fastdit.eval.bench.calibration [--model tiny-wan|tiny-shapes] [--methods sta,sparge] [--quick]
                                             [--json FILE]

For each method, ``fastdit.calibrate`` makes a calibration on the calibration prompts at an error
``budget`` (per (step bucket, layer, head) for sta, per (step bucket, layer) for the others),
choosing from a candidate list. The calibration and every candidate applied globally (one setting for
every layer and step) are then measured on the calibration prompts and on held-out prompts:

* teacher-forced attention error: the pipeline runs dense; every attention call also runs each
  setting on the same ``q, k, v`` (``fastdit.attention``, all query rows) and sums
  ``||out - dense||^2`` and ``||dense||^2``. Reported as the relative L2 error over all calls
  (``attn_err``), and as the worst per-(bucket, layer, head) error of any prompt (``worst``,
  the quantity the budget bounds);
* effective density: query-key pairs computed / dense over all calls (dense calls count as 1),
  from the same teacher-forced calls;
* output PSNR: the patched pipeline's frames against the dense frames (free-running: errors
  compound through the steps), from the mean squared error over the prompts.

The comparison at equal effective density: the global settings (and dense, density 1 and error
0) form a curve error(density); it is interpolated linearly at the calibration's density (``@calibration``: the
error, and the PSNR from the interpolated mean squared error). A calibration wins when its error is below
the interpolated one. Random weights give nearly uniform attention (no head or layer is much more
local than another), so per-layer choices have little to exploit there; ``--model tiny-shapes``
(trained in this repository, learned spatial and wide-local heads; its native call and held-out
captions of its grammar) is the model where they can. The numbers are reported as they come.
"""
from __future__ import annotations

import argparse
import math
import os
import tempfile
import time

import numpy as np
import torch

import fastdit
from fastdit.calibration.search import DenseProbe, calibrate
from fastdit.cpu_load import LoadWatch
from fastdit.eval.bench.common import warn_if_shared
from fastdit.jsonutil import dump_json
from fastdit.calibration.calibration_file import calibration_options_for

CAL_PROMPTS = ["a red fox runs through fresh snow", "a paper boat drifts down a rainy street",
               "waves break on a black sand beach"]
HELD_PROMPTS = ["a corgi floats inside a space station", "a hot air balloon rises over a canyon"]
#: Per method: base options, the candidate list, and the default budget.
SETUPS = {
    "sta": dict(options={"tile": (1, 2, 2)}, budget=0.8,
                # tile grid 4 x 4 x 4 at the full size: a window of 5 tiles covers the whole axis
                candidates=[{"window": w} for w in ((1, 1, 1), (1, 3, 3), (3, 1, 1), (3, 3, 3), (5, 1, 1), (1, 5, 5),
                                                    (5, 3, 3))]),
    "sparge": dict(options={"tile": (1, 2, 4), "simthresh": -1.0}, budget=0.3,
                   candidates=[{"topk": t} for t in (0.6, 0.4, 0.25, 0.15)] + [{"cdf": c, "topk": None}
                                                                               for c in (0.9, 0.7)]),
}
#: tiny-shapes (trained; latent 9 x 16 x 16, tile grid 9 x 8 x 8 at tile (1, 2, 2)): its local heads
#: are wider than the random model's (fastdit.eval.bench.head_kinds), so wider windows (up to the
#: whole axis: 17 tiles in time, 15 in space, from any tile) and a budget that keeps its outputs
#: recognisable.
SHAPES_SETUPS = {"sta": dict(options={"tile": (1, 2, 2)}, budget=0.3,
                             candidates=[{"window": w} for w in ((3, 3, 3), (5, 3, 3), (3, 5, 5), (5, 5, 5), (17, 3, 3),
                                                                 (17, 5, 5), (3, 15, 15))])}
STRUCTURED_BUDGET = {"sta": 0.2, "sparge": 0.2}
FULL = dict(num_frames=13, height=128, width=128, num_inference_steps=4, guidance_scale=5.0, max_sequence_length=16)
QUICK = dict(num_frames=9, height=80, width=112, num_inference_steps=2, guidance_scale=5.0, max_sequence_length=16)


# -- teacher-forced measurement of many settings in one dense run (through calibration's DenseProbe)


class Meter:
    """Per setting: error sums per (bucket, layer) and head, and density per call."""

    def __init__(self, method, settings, buckets, backend):
        self.method, self.settings, self.buckets, self.backend = method, settings, buckets, backend
        self.sums = [{} for _ in settings]
        self.density = [[] for _ in settings]

    def bucket(self, step):
        return max(s for s in self.buckets if s <= step)

    def observe(self, ctx, q, k, v, dense):
        reference = dense.double()
        ref2 = reference.pow(2).sum(dim=(0, 2, 3))
        key = (self.bucket(ctx.step), ctx.layer)
        for index, options in enumerate(self.settings):
            out, info = fastdit.attention(q, k, v, self.method, layout=ctx.layout, key_mask=ctx.key_mask,
                                          step=ctx.step, num_steps=ctx.num_steps, scale=ctx.scale, layer=ctx.layer,
                                          backend=self.backend, return_info=True, **options)
            err2 = (out.double() - reference).pow(2).sum(dim=(0, 2, 3))
            entry = self.sums[index].setdefault(key, [0.0, 0.0])
            entry[0], entry[1] = entry[0] + err2, entry[1] + ref2
            self.density[index].append(float(info["density"]))

    def results(self):
        """Per setting: total err2 and ref2, the worst per-(bucket, layer, head) relative error, density."""
        rows = []
        for sums, density in zip(self.sums, self.density):
            err2 = sum(float(e.sum()) for e, _ in sums.values())
            ref2 = sum(float(r.sum()) for _, r in sums.values())
            worst = max(float((e / r.clamp_min(1e-300)).sqrt().max()) for e, r in sums.values())
            rows.append({"err2": err2, "ref2": ref2, "worst": worst, "density": sum(density) / len(density)})
        return rows


def teacher_forced(pipe, method, settings, prompt, call, seed, buckets, backend):
    meter = Meter(method, settings, buckets, backend)
    probe = fastdit.patch(pipe, DenseProbe, observer=meter, dense_steps=0, dense_layers=0)
    try:
        with torch.inference_mode():
            pipe(prompt=prompt, generator=torch.Generator().manual_seed(seed), output_type="latent", **call)
    finally:
        probe.remove()
    return meter.results()


def frames(pipe, prompt, call, seed, method=None, options=None, backend="auto"):
    """The decoded frames (numpy, [0, 1]) of one run, dense or patched."""
    patch = None if method is None else fastdit.patch(pipe, method, backend=backend, **options)
    try:
        with torch.inference_mode():
            out = pipe(prompt=prompt, generator=torch.Generator().manual_seed(seed), output_type="np", **call)
    finally:
        if patch is not None:
            patch.remove()
    return np.asarray(out.frames[0], dtype=np.float64)


def psnr_of(mse):
    return None if mse is None else (math.inf if mse <= 0 else 10 * math.log10(1.0 / mse))


def interpolate(points, density, key):
    """``key`` of the global curve (points sorted by density, dense at 1.0) at ``density``; None
    outside the measured range."""
    xs = [p["density"] for p in points]
    if not xs or density < min(xs) - 1e-12 or density > max(xs) + 1e-12:
        return None
    order = np.argsort(xs)
    return float(np.interp(density, np.asarray(xs)[order], np.asarray([p[key] for p in points])[order]))


# -- one method -------------------------------------------------------------------------------
def run_method(pipe, name, setup, call, args, log):
    budget = args.budget.get(name, setup["budget"])
    candidates = setup["candidates"][: args.max_candidates] if args.max_candidates else setup["candidates"]
    base = {**setup["options"], "dense_steps": 0, "dense_layers": 0}
    cal, held = args.prompt_lists[0][: args.cal_prompts], args.prompt_lists[1][: args.held_prompts]
    buckets = sorted({int(i * call["num_inference_steps"] // args.buckets) for i in range(args.buckets)})
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, f"{name}_plan.json")
        plan = calibrate(pipe, name, cal, budget=budget, steps=buckets, candidates=candidates, out=path,
                         call_kwargs=call, options=setup["options"], rows=args.rows, seed=args.seed, progress=False)
        plan_opts = calibration_options_for(path, pipe, name)
    calibrate_s = time.perf_counter() - started
    histogram = {}
    for value in (plan.get("settings") or plan.get("strategy")).values():
        text = "dense" if value is None or value == [0, 0, 0] else str(value)
        histogram[text] = histogram.get(text, 0) + 1
    log(f"{name}: calibration at budget {budget} from {len(cal)} prompt(s), {calibrate_s:.0f} s; choices {histogram}")
    labels = ["plan"] + [",".join(f"{k}={v}" for k, v in c.items()) for c in candidates]
    settings = [plan_opts] + [{**base, **c} for c in candidates]
    groups = {"calibration": cal, "held-out": held}
    rows = []
    for group, prompts in groups.items():
        totals = [{"err2": 0.0, "ref2": 0.0, "worst": 0.0, "density": 0.0, "mse": 0.0} for _ in settings]
        for prompt in prompts:
            log(f"{name}: {group} prompt {prompt!r}: {len(settings)} settings")
            measured = teacher_forced(pipe, name, settings, prompt, call, args.seed, buckets, args.backend)
            reference = frames(pipe, prompt, call, args.seed)
            for total, m, options in zip(totals, measured, settings):
                total["err2"] += m["err2"]
                total["ref2"] += m["ref2"]
                total["worst"] = max(total["worst"], m["worst"])
                total["density"] += m["density"] / len(prompts)
                out = frames(pipe, prompt, call, args.seed, name, options, args.backend)
                total["mse"] += float(((out - reference) ** 2).mean()) / len(prompts)
        for label, total in zip(labels, totals):
            rows.append({"method": name, "group": group, "setting": label, "density": total["density"],
                         "attn_err": math.sqrt(total["err2"] / max(total["ref2"], 1e-300)), "worst": total["worst"],
                         "mse": total["mse"], "psnr_db": psnr_of(total["mse"]), "budget": budget})
    summary = {}
    for group in groups:
        mine = [r for r in rows if r["group"] == group]
        plan_row, curve = mine[0], mine[1:] + [{"density": 1.0, "attn_err": 0.0, "worst": 0.0, "mse": 0.0}]
        at_err = interpolate(curve, plan_row["density"], "attn_err")
        at_mse = interpolate(curve, plan_row["density"], "mse")
        within = [r for r in mine[1:] if r["worst"] <= budget]
        best = min(within, key=lambda r: r["density"], default=None)
        summary[group] = {
            "plan_density": plan_row["density"], "plan_attn_err": plan_row["attn_err"], "plan_worst": plan_row["worst"],
            "meets_budget": plan_row["worst"] <= budget, "global_attn_err_at_plan_density": at_err,
            "global_psnr_at_plan_density": psnr_of(at_mse), "plan_psnr": plan_row["psnr_db"],
            "attn_err_ratio": None if not at_err else plan_row["attn_err"] / at_err,
            "best_global_within_budget": None if best is None else {k: best[k] for k in ("setting", "density",
                                                                                         "attn_err", "worst")},
        }
    return {"budget": budget, "buckets": buckets, "choices": histogram, "calibrate_s": calibrate_s,
            "rows": rows, "summary": summary}


# -- the same choice on structured inputs (layers of known, different attention kinds) ---------
#: Per synthetic layer: the kinds of its two heads (``fastdit.eval.bench.structured``).
STRUCTURED_LAYERS = [("spatial", "spatial"), ("temporal", "temporal"), ("global", "global"),
                     ("spatial", "temporal"), ("spatial", "global"), ("temporal", "global")]


def _structured_table(name, setup, candidates, grid, seed, backend):
    """``{"0_l": {err2 (heads x candidates), ref2 (heads), density (heads x candidates)}}`` on
    structured inputs of ``seed``: every candidate run on every synthetic layer."""
    from fastdit.eval.bench.structured import structured_qkv

    table = {}
    for layer, kinds in enumerate(STRUCTURED_LAYERS):
        q, k, v, layout, _ = structured_qkv(grid, heads=len(kinds), head_dim=64, kinds=kinds, seed=seed + layer)
        scores = q.double() @ k.double().transpose(-1, -2) / 8.0
        reference = torch.softmax(scores, -1) @ v.double()
        err2 = torch.zeros(len(kinds), len(candidates), dtype=torch.float64)
        density = torch.zeros_like(err2)
        for c, candidate in enumerate(candidates):
            out, info = fastdit.attention(q, k, v, name, layout=layout, backend=backend, return_info=True,
                                          **{**setup["options"], "dense_steps": 0, **candidate})
            err2[:, c] = (out.double() - reference).pow(2).sum(dim=(0, 2, 3))
            density[:, c] = torch.tensor(info["head_density"], dtype=torch.float64)
        table[f"0_{layer}"] = {"err2": err2.tolist(), "ref2": reference.pow(2).sum(dim=(0, 2, 3)).tolist(),
                               "density": density.tolist(), "calls": 1}
    return table


def structured_evidence(name, setup, budget, args):
    """Calibrate (``select_settings``, as ``fastdit.calibrate`` chooses: per head for sta, per layer
    otherwise) on structured inputs of one seed, then measure the calibration and every global setting on
    those and on fresh inputs (another seed); heads are independent in both methods, so a calibration's
    error and density are its chosen entries of the per-(head, candidate) tables."""
    from fastdit.calibration.candidates import select_settings

    candidates = setup["candidates"][: args.max_candidates] if args.max_candidates else setup["candidates"]
    grid = (2, 4, 8) if args.quick else (4, 8, 8)
    calibration = _structured_table(name, setup, candidates, grid, args.seed, args.backend)
    choice, _ = select_settings([calibration], candidates, budget, per_head=(name == "sta"))
    summary = {}
    held_out = _structured_table(name, setup, candidates, grid, args.seed + 1000, args.backend)
    for group, table in (("calibration", calibration), ("held-out", held_out)):
        plan = {"err2": 0.0, "ref2": 0.0, "density": [], "worst": 0.0}
        curve = [{"err2": 0.0, "ref2": 0.0, "density": []} for _ in candidates]
        for key, entry in table.items():
            err2, ref2, density = (torch.tensor(entry[f], dtype=torch.float64) for f in ("err2", "ref2", "density"))
            for head in range(err2.shape[0]):
                c = choice[f"{key}_{head}"] if name == "sta" else choice[key]
                e = 0.0 if c is None else float(err2[head, c])
                plan["err2"] += e
                plan["ref2"] += float(ref2[head])
                plan["density"].append(1.0 if c is None else float(density[head, c]))
                plan["worst"] = max(plan["worst"], math.sqrt(e / float(ref2[head])))
                for index, point in enumerate(curve):
                    point["err2"] += float(err2[head, index])
                    point["ref2"] += float(ref2[head])
                    point["density"].append(float(density[head, index]))
        points = [{"density": sum(p["density"]) / len(p["density"]), "attn_err": math.sqrt(p["err2"] / p["ref2"])}
                  for p in curve] + [{"density": 1.0, "attn_err": 0.0}]
        plan_density = sum(plan["density"]) / len(plan["density"])
        at = interpolate(points, plan_density, "attn_err")
        plan_err = math.sqrt(plan["err2"] / plan["ref2"])
        summary[group] = {"plan_density": plan_density, "plan_attn_err": plan_err, "plan_worst": plan["worst"],
                          "meets_budget": plan["worst"] <= budget, "global_attn_err_at_plan_density": at,
                          "attn_err_ratio": None if not at else plan_err / at,
                          "global": [{"setting": ",".join(f"{k}={v}" for k, v in c.items()), **p}
                                     for c, p in zip(candidates, points)]}
    chosen = {}
    for value in choice.values():
        text = "dense" if value is None else ",".join(f"{k}={v}" for k, v in candidates[value].items())
        chosen[text] = chosen.get(text, 0) + 1
    return {"budget": budget, "grid": grid, "layers": [list(k) for k in STRUCTURED_LAYERS], "choices": chosen,
            "summary": summary}


def print_table(results, log):
    log(f"{'method':7} {'group':12} {'setting':30} {'density':>8} {'attn_err':>9} {'worst':>8} {'psnr_db':>8}")
    for name, result in results["methods"].items():
        for row in result["rows"]:
            psnr = "inf" if row["psnr_db"] == math.inf else f"{row['psnr_db']:.2f}"
            log(f"{name:7} {row['group']:12} {row['setting'][:30]:30} {row['density']:8.3f} {row['attn_err']:9.4f} "
                f"{row['worst']:8.4f} {psnr:>8}")
        for group, s in result["summary"].items():
            at = s["global_attn_err_at_plan_density"]
            psnr = s["global_psnr_at_plan_density"]
            log(f"{name} {group}: plan density {s['plan_density']:.3f}, attn_err {s['plan_attn_err']:.4f} vs global "
                f"{'-' if at is None else f'{at:.4f}'} at that density; worst head {s['plan_worst']:.4f} "
                f"(budget {result['budget']}: {'met' if s['meets_budget'] else 'NOT met'}); PSNR {s['plan_psnr']:.2f} "
                f"vs {'-' if psnr is None else f'{psnr:.2f}'} dB")
    for name, result in results.get("structured", {}).items():
        log(f"{name} on structured inputs (budget {result['budget']}, choices {result['choices']}):")
        for group, s in result["summary"].items():
            at = s["global_attn_err_at_plan_density"]
            log(f"  {group}: plan density {s['plan_density']:.3f}, attn_err {s['plan_attn_err']:.4f} vs global "
                f"{'-' if at is None else f'{at:.4f}'} at that density; worst head {s['plan_worst']:.4f} "
                f"({'met' if s['meets_budget'] else 'NOT met'})")


def _budgets(text):
    budgets = {}
    for part in filter(None, (text or "").split(",")):
        name, sep, value = part.partition("=")
        try:
            budgets[name.strip()] = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expects METHOD=BUDGET,..., got {text!r}") from None
        if not sep or not budgets[name.strip()] > 0:
            raise argparse.ArgumentTypeError(f"expects METHOD=BUDGET (a number > 0),..., got {text!r}")
    return budgets


def build_parser():
    parser = argparse.ArgumentParser(prog="python -m fastdit.eval.bench.calibration",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny-wan", choices=("tiny-wan", "tiny-shapes"),
                        help="tiny-wan (random weights) or tiny-shapes (trained; its native call, shapes captions)")
    parser.add_argument("--methods", default="sta,sparge", help=f"comma-separated, from {sorted(SETUPS)}")
    parser.add_argument("--budget", type=_budgets, default={}, help="per method, e.g. sta=0.5,sparge=0.4")
    parser.add_argument("--structured-budget", type=_budgets, default={},
                        help="per method, for the structured inputs, e.g. sta=0.2,sparge=0.2")
    parser.add_argument("--structured-only", action="store_true", help="only the structured inputs (seconds)")
    parser.add_argument("--buckets", type=int, default=2, help="step buckets of the plan")
    parser.add_argument("--cal-prompts", type=int, default=2)
    parser.add_argument("--held-prompts", type=int, default=2)
    parser.add_argument("--max-candidates", type=int, default=0, help="use the first N candidates (0: all)")
    parser.add_argument("--rows", type=int, default=4096, help="query rows sampled by the calibration (all when more)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", default="auto", choices=("auto", "triton", "torch"))
    parser.add_argument("--quick", action="store_true", help="the test size: 9 frames of 80x112, 2 steps, 1 + 1 "
                                                               "prompts, 3 candidates")
    parser.add_argument("--json", default=None, help="write the results here")
    return parser


def main(argv=None):
    from fastdit.pipelines.tiny import tiny

    args = build_parser().parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in SETUPS]
    if unknown or not methods:
        raise SystemExit(f"--methods: unknown {unknown}; choose from {sorted(SETUPS)}")
    if args.buckets < 1 or args.cal_prompts < 1 or args.held_prompts < 1:
        raise SystemExit("--buckets, --cal-prompts and --held-prompts must be >= 1")
    if args.model == "tiny-shapes":  # trained: its native size and captions of its grammar
        from fastdit.eval.runner.prompts import load_prompts
        from fastdit.pipelines.loading import TRAINED_DEFAULTS, load_pipeline

        pipe = load_pipeline("tiny-shapes")
        call = dict(TRAINED_DEFAULTS["tiny-shapes"], **({"num_inference_steps": 2} if args.quick else {}))
        captions = [p.text for p in load_prompts("shapes")]
        args.prompt_lists = (captions[:3], captions[3:5])  # held-out captions (not the training set's)
    else:
        pipe = tiny("wan")
        call = dict(QUICK if args.quick else FULL)
        args.prompt_lists = (CAL_PROMPTS, HELD_PROMPTS)
    if args.quick:
        args.cal_prompts, args.held_prompts = 1, 1
        args.max_candidates = args.max_candidates or 3
    lines = []

    def log(line=""):
        print(line, flush=True)
        lines.append(line)

    pipe.set_progress_bar_config(disable=True)
    if args.model == "tiny-shapes":  # VAE factors 4 (space) and 2 (time), patch 1
        grid = ((call["num_frames"] - 1) // 2 + 1, call["height"] // 4, call["width"] // 4)
    else:
        grid = ((call["num_frames"] - 1) // 4 + 1, call["height"] // 16, call["width"] // 16)
    log(f"{args.model} ({'trained' if args.model == 'tiny-shapes' else 'random weights'}), latent grid {grid}, "
        f"{call['num_inference_steps']} steps, CFG {call['guidance_scale']}; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads")
    results = {"meta": {"model": args.model, "call": call, "grid": grid, "torch": torch.__version__,
                        "args": {k: v for k, v in vars(args).items() if k != "prompt_lists"},
                        "prompts": {"calibration": list(args.prompt_lists[0][: args.cal_prompts]),
                                    "held-out": list(args.prompt_lists[1][: args.held_prompts])}}, "methods": {}}
    results["structured"] = {}
    for name in methods:
        if not args.structured_only:
            load = LoadWatch().start()  # calibrate_s is a time: say whether the cores were shared
            setup = SHAPES_SETUPS.get(name, SETUPS[name]) if args.model == "tiny-shapes" else SETUPS[name]
            results["methods"][name] = run_method(pipe, name, setup, call, args, log)
            results["methods"][name]["load"] = load.stop()
            warn_if_shared(results["methods"][name]["load"], f"{name}'s calibration")
        budget = args.structured_budget.get(name, STRUCTURED_BUDGET[name])
        results["structured"][name] = structured_evidence(name, SETUPS[name], budget, args)
    print_table(results, log)
    results["lines"] = lines
    if args.json:
        dump_json(args.json, results, indent=1)
        print(f"wrote {args.json}")
    return results


if __name__ == "__main__":
    main()
