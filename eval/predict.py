"""Predicted GPU time of dense attention vs fastdit's methods (``fastdit.costmodel``), no GPU needed.

    python -m fastdit.eval.predict                           # Wan 480p and HunyuanVideo 720p, 4 GPUs
    python -m fastdit.eval.predict --gpus H200 --models wan --json pred.json
    python -m fastdit.eval.predict --compare bench_results/transformer_wan_*.json   # beside a GPU run

For each model (Wan2.1-T2V-1.3B at 480p x 81 frames: 21x30x52 = 32760 tokens; HunyuanVideo 13B at
720p x 129 frames: 33x45x80 = 118800 video + 256 text tokens) and GPU (A100, H100, H200, RTX 4090),
per method: the plan's density (computed score entries over dense's, kernel-tile rounding and
padding included), one self / joint attention call (kernel + outside: permutation, selection), its
speedup over dense SDPA, one transformer forward with every attention call sparse
(``dense_steps=0``), the attention share of that forward, and the end-to-end speedup.

Plans: static methods (``sta``, ``radial``) are the plans the methods build (``prepare`` on the
model's token layout, with the family's defaults, on the CPU). Dynamic methods (``sparge``,
``svg``) choose blocks from q and k, so their density is an input: by default sta's plan density
on the same model (as the ``@sta`` companions of ``fastdit.eval.bench.methods``),
``--dynamic-density`` to set it; they add the selection cost (see ``fastdit.costmodel``). Token methods
(``tome``, ``todo``, ``prune``) are not modelled.

``--compare FILE`` reads benchmark JSON written by ``scripts/gpu_check.sh``
(``fastdit.eval.bench.attention --path kernel`` and ``fastdit.eval.bench.transformer`` rows) and
prints each measured time beside the model's prediction for this machine's GPU (``--gpu`` to name one), so
the first GPU run checks the model.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from fastdit import costmodel
from fastdit.costmodel import GPUS, ModelShape

MODELS = ("wan", "hunyuan")


def modelled_methods():
    """The methods the cost model predicts (``Method.cost_model`` set), in rank order."""
    from fastdit.methods.base import methods_with

    return methods_with("cost_model")


def is_static(method):
    """Whether ``method``'s plan is the one its ``prepare`` builds (``Method.cost_model == "plan"``)."""
    from fastdit.methods.base import get_method

    return method != "dense" and get_method(method).cost_model == "plan"


def model_shape(name, hy_frames=None, elt=2):
    """``ModelShape`` of ``wan`` (Wan2.1-T2V-1.3B, 480p x 81 frames) or ``hunyuan`` (HunyuanVideo
    13B, 720p x 129 frames) from the benchmark's published configs, batch 1."""
    from fastdit.eval.bench.transformer_models import MODELS as SPECS
    from fastdit.eval.bench.transformer_models import model_spec, token_grid

    config, latent, text, text_valid, video = model_spec(name, "full", hy_frames)
    grid = token_grid(config, latent)
    heads, d = config["num_attention_heads"], config["attention_head_dim"]
    dim = heads * d
    n = math.prod(grid)
    label = f"{SPECS[name]['name']} {video}"
    passes = costmodel.ELEMENTWISE_PASSES
    if name == "wan":
        layers, ffn = config["num_layers"], config["ffn_dim"]
        # self-attn q k v o, cross-attn q o (video) and k v (text), FFN up and down: 2 FLOPs a MAC
        per_block = 2.0 * (4 * n * dim * dim + 2 * n * dim * dim + 2 * text * dim * dim + 2 * n * dim * ffn)
        cross = 4.0 * n * text * dim
        return ModelShape(label, "wan", grid, 0, "none", heads, d, layers, layers * per_block, layers * cross,
                          layers * passes * n * dim * elt)
    double, single = config["num_layers"], config["num_single_layers"]
    mlp = config["mlp_ratio"]
    # double-stream: q k v o + MLP per stream (video and text); single-stream: linear1 (3 dim +
    # mlp dim outputs) and linear2 (dim + mlp dim inputs -> dim) over the joint sequence
    double_flops = 2.0 * (n + text) * (4 + 2 * mlp) * dim * dim
    single_flops = 2.0 * (n + text) * ((3 + mlp) + (1 + mlp)) * dim * dim
    return ModelShape(label, "hunyuan_video", grid, text, "suffix", heads, d, double + single,
                      double * double_flops + single * single_flops, 0.0,
                      (double + single) * passes * (n + text) * dim * elt,
                      key_mask=text_valid is not None and text_valid < text)


def static_plan(method, shape):
    """The plan ``method`` builds for ``shape``'s attention calls (CPU; family defaults)."""
    from fastdit.layout import TokenLayout
    from fastdit.methods.base import get_method

    cls = get_method(method)
    instance = cls(cls.resolve(cls.make_config(dense_steps=0, dense_layers=0), shape.family))
    layout = TokenLayout(shape.grid, shape.text_len, shape.text_position)
    return instance.prepare(layout, shape.heads, "cpu")


def density_method_call(gpu, shape, method, density, options=None, dynamic=True):
    """``CallPrediction`` of one of ``shape``'s attention calls by ``method`` at block ``density``
    (``costmodel.density_call``: selection cost when ``dynamic``), plus the work the method does
    besides the engine (sla's linear branch: its ``outside_work`` with ``options``, every head)."""
    import dataclasses

    from fastdit.methods.base import get_method

    n = shape.tokens
    call = costmodel.density_call(gpu, density, 1, shape.heads, n, shape.head_dim, dynamic=dynamic, label=method,
                                  key_mask=shape.key_mask)
    extra = shape.heads * costmodel.token_outside_ms(gpu, get_method(method), options or {}, 1, n, shape.head_dim)
    return dataclasses.replace(call, outside_ms=call.outside_ms + extra) if extra else call


def predict_model(shape, gpus, methods, dynamic_density=None):
    """Rows ``{model, gpu, method, density, attention_ms, ...}`` for one model."""
    plans = {m: static_plan(m, shape) for m in methods if is_static(m)}
    if dynamic_density is None and any(not is_static(m) for m in methods):
        sta = plans.get("sta") or static_plan("sta", shape)
        dynamic_density = sta.density
    rows = []
    n = shape.tokens
    for gpu in gpus:
        dense = costmodel.dense_call(gpu, 1, shape.heads, n, n, shape.head_dim, key_mask=shape.key_mask)
        dense_fwd = costmodel.model_forward(gpu, shape, dense.total_ms, "dense")
        calls = [("dense", dense, "")]
        for m in methods:
            if m in plans:
                calls.append((m, costmodel.plan_call(gpu, plans[m], 1, shape.heads, shape.head_dim, label=m,
                                                     key_mask=shape.key_mask), plans[m].name))
            else:
                calls.append((m, density_method_call(gpu, shape, m, dynamic_density),
                              f"density {dynamic_density:.3f} (assumed)"))
        for method, call, plan_name in calls:
            fwd = costmodel.model_forward(gpu, shape, call.total_ms, method)
            rows.append({
                "model": shape.name, "gpu": gpu.name, "method": method, "plan": plan_name,
                "density": call.density, "tile": list(costmodel.kernel_tile(gpu, shape.head_dim)) if method != "dense"
                else None,
                "attention_ms": call.total_ms, "kernel_ms": call.kernel_ms, "outside_ms": call.outside_ms,
                "attention_speedup": dense.total_ms / call.total_ms,
                "forward_ms": fwd.total_ms, "attention_share": fwd.attention_share,
                "forward_speedup": dense_fwd.total_ms / fwd.total_ms,
            })
    return rows


def format_rows(rows):
    lines = []
    last = None
    for r in rows:
        if (r["model"], r["gpu"]) != last:
            last = (r["model"], r["gpu"])
            lines += ["", f"{r['model']} on {r['gpu']}",
                      f"  {'method':8} {'density':>8} {'attn ms':>9} {'(outside)':>9} {'attn x':>7} "
                      f"{'fwd ms':>9} {'attn share':>10} {'fwd x':>6}  plan"]
        lines.append(f"  {r['method']:8} {r['density']:8.3f} {r['attention_ms']:9.2f} {r['outside_ms']:9.2f} "
                     f"{r['attention_speedup']:7.2f} {r['forward_ms']:9.0f} {r['attention_share']:10.0%} "
                     f"{r['forward_speedup']:6.2f}  {r['plan']}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# Beside a measurement
# --------------------------------------------------------------------------------------------------

def compare(paths, gpu):
    """Lines: each measured row of ``paths`` with the prediction for ``gpu``."""
    lines = [f"prediction for {gpu.name} (fastdit.costmodel) beside the measurement:"]
    shapes = {}
    for path in paths:
        data = json.loads(Path(path).read_text())
        rows = data.get("rows", data if isinstance(data, list) else [])
        for r in rows:
            if not isinstance(r, dict) or r.get("time_ms") is None:
                continue
            pred = None
            if r.get("path") == "kernel" and r.get("N"):
                n, h, d = int(r["N"]), int(r["H"]), int(r["D"])
                elt = 4 if r.get("dtype") == "float32" else 2
                if str(r.get("backend", "")).startswith("fastdit"):
                    pred = costmodel.density_call(gpu, float(r["density"]), 1, h, n, d, elt, dynamic=False,
                                                  block=int(r.get("block", 128)),
                                                  key_mask="+kv_valid" in str(r["backend"])).total_ms
                elif r.get("density") == 1.0:
                    pred = costmodel.dense_call(gpu, 1, h, n, n, d, elt).total_ms
                what = f"kernel {r['case']} {r['backend']}"
            elif r.get("model_key") in MODELS and r.get("scale") == "full" and r.get("method"):
                key = r["model_key"]
                if key not in shapes:
                    frames = None
                    if key == "hunyuan" and r.get("latent"):
                        frames = (int(r["latent"][0]) - 1) * 4 + 1
                    shapes[key] = model_shape(key, frames)
                shape = shapes[key]
                method = r["method"]
                key_mask = shape.key_mask  # joint text with padding (HunyuanVideo's 64 valid of 256)
                if method == "dense":
                    call = costmodel.dense_call(gpu, 1, shape.heads, shape.tokens, shape.tokens, shape.head_dim,
                                                key_mask=key_mask)
                elif method in modelled_methods() and is_static(method):
                    call = costmodel.plan_call(gpu, static_plan(method, shape), 1, shape.heads, shape.head_dim,
                                               key_mask=key_mask)
                else:
                    call = None
                if call is not None:
                    pred = costmodel.model_forward(gpu, shape, call.total_ms).total_ms
                what = f"forward {key} {r.get('mode', '')} {method}"
            else:
                continue
            ratio = f"measured/predicted {r['time_ms'] / pred:5.2f}" if pred else "no prediction"
            pred_text = f"{pred:10.2f}" if pred else f"{'-':>10}"
            lines.append(f"  {what:48s} measured {r['time_ms']:10.2f} ms  predicted {pred_text} ms  {ratio}")
    return lines


#: The most HunyuanVideo frames ``--hy-frames`` takes: 4x the published 129 (129 latent frames,
#: 464k tokens); 100000 frames tried to allocate 250 GB for the plans on the CPU.
MAX_HY_FRAMES = 513


def _density(text):
    """``--dynamic-density``: a finite fraction of the dense pairs, in (0, 1] (2 printed 296x speedups,
    nan a traceback)."""
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not math.isfinite(value) or not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"expects a density in (0, 1] (the fraction of dense attention's pairs "
                                         f"computed), got {text!r}")
    return value


def _frames(text):
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or not 1 <= value <= MAX_HY_FRAMES:
        raise argparse.ArgumentTypeError(f"expects a frame count from 1 to {MAX_HY_FRAMES} (HunyuanVideo's "
                                         f"published length is 129), got {text!r}")
    return value


def main(argv=None):
    from fastdit.options import ArgumentParser

    parser = ArgumentParser(prog="python -m fastdit.eval.predict", description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--gpus", default=",".join(GPUS), help=f"comma list of {', '.join(GPUS)}")
    parser.add_argument("--methods", default=",".join(modelled_methods()))
    parser.add_argument("--dynamic-density", type=_density, default=None,
                        help="density assumed for dynamic methods (default: sta's plan density on the model)")
    parser.add_argument("--hy-frames", type=_frames, default=None, help="HunyuanVideo frames (default 129)")
    parser.add_argument("--json", default=None, help="write the rows here")
    parser.add_argument("--compare", nargs="*", default=None, help="benchmark JSON files to compare with")
    parser.add_argument("--gpu", default=None, help="GPU for --compare (default: this machine's)")
    parser.add_argument("--efficiency", default=None,
                        help="scripts/bench_tma.py --json output measured on the GPU(s) of --gpus: its measured "
                             "sdpa / kernel efficiencies replace the assumed ones")
    args = parser.parse_args(argv)
    if args.compare is not None:
        gpu = GPUS.get(args.gpu) if args.gpu else costmodel.gpu_for()
        if gpu is None:
            print(f"[predict] no model of this machine's GPU (covered: {', '.join(GPUS)}); pass --gpu NAME")
            return 0
        if args.efficiency:
            gpu = costmodel.with_measured_efficiency(gpu, args.efficiency)
        print("\n".join(compare(args.compare, gpu)))
        return 0
    unknown = [g for g in args.gpus.split(",") if g not in GPUS]
    if unknown:
        raise SystemExit(f"unknown GPU(s) {unknown}; the model covers {', '.join(GPUS)}")
    modelled = modelled_methods()
    bad = [m for m in args.methods.split(",") if m not in modelled]
    if bad:
        raise SystemExit(f"method(s) {bad} are not modelled; modelled: {', '.join(modelled)} (token methods are not)")
    gpus = [GPUS[g] for g in args.gpus.split(",")]
    if args.efficiency:
        gpus = [costmodel.with_measured_efficiency(g, args.efficiency) for g in gpus]
    unknown = [name for name in args.models.split(",") if name not in MODELS]
    if unknown:  # all of them before the first model's plans are built
        raise SystemExit(f"unknown model(s) {unknown}; known: {', '.join(MODELS)}")
    rows = []
    for name in args.models.split(","):
        shape = model_shape(name, args.hy_frames)
        rows += predict_model(shape, gpus, args.methods.split(","), args.dynamic_density)
    print(format_rows(rows))
    print("\nattn: one self / joint attention call (kernel + outside); fwd: one transformer forward, every "
          "attention call sparse; x: speedup over dense. Assumptions and sources: fastdit/costmodel.py.")
    if args.json:
        Path(args.json).write_text(json.dumps({"gpus": {g.name: g.__dict__ for g in gpus}, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
