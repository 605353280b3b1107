"""Every method at one density on one model, training-free and trained: speed, fidelity, adherence and
the GPU cost model's prediction, in one table (issue 42).

    python -m fastdit.eval.bench.equal_density --rows eval/bench/equal_density_tiny_shapes.json \\
        --trained-root /path/to/training/outputs [--height 64 --width 64 --steps 8] [--captions 8] \\
        [--seeds 0] [--gpu H100] [--json FILE]

``--rows``: a JSON list of rows ``{"label": str, "method": str, "options": {...}, "trained": folder or
null}``. ``trained`` is a ``python -m fastdit.train`` output folder (relative to ``--trained-root``):
its LoRA (``pytorch_lora_weights.safetensors``) is loaded into the pipeline for the row, fused into the
weights as one deploys it (``--unfused``: kept as a side branch, its matrix products timed too), and
removed after it (the original tensors put back), and its method parameters
(``fastdit_method_params.safetensors``: VSA's gates, SLA's projection), when it has some, go to the
patch (``fastdit.patch(..., method_params=)``).

Per row, over the first ``--captions`` held-out captions of tiny-shapes' grammar
(``load_prompts("shapes")``: none of them is a training or distillation caption) x ``--seeds``, each
video against the dense video (the base model: no adapter, no patch) of the same caption and seed:

* **time**: the sum of the videos' wall times (``fastdit.compare.generate``: the whole pipeline call,
  text encoder and VAE decode included), after one untimed 1-step run of the row (first-call
  costs). Dense is timed first and again last (its videos must come out bit-equal: the adapters were
  really unloaded); speed = the mean of the two dense sums / the row's sum.
* **peak memory**: the resident-set peak above the level before the row (CPU; a lower bound, see
  ``RSSPeak``) or the CUDA peak.
* **PSNR** (mean and lowest) and **SSIM** (mean) against dense; **adherence**
  (``fastdit.eval.metrics.adherence``, mean; dense's mean is printed above the table).
* **density**: the patch's effective density (all calls of the patched layers; dense steps,
  dense layers and fallbacks count as 1) and its sparse density (the sparse calls alone).
* **GPU prediction** (``fastdit.costmodel``, ``--gpu``): one attention call at the row's sparse density
  on Wan2.1-T2V-1.3B 480p (32760 tokens) and HunyuanVideo 720p (119056 tokens), its speedup over
  dense SDPA and the end-to-end speedup of a transformer forward with every attention call sparse.
  Methods the cost model covers (``Method.cost_model``): ``costmodel.density_call`` (selection cost
  for the dynamic ones; the static ones with ``dynamic=False``). Approximations (marked ``~``): svg2,
  a block-sparse method outside the cost model, as a dynamic one (its k-means priced as block
  scoring); token methods, window and prune as a dense kernel over the kept pairs (``dense_call``
  with ``density * n`` keys) plus their own ``outside_work``. A trained row costs what its training-free
  row costs on the GPU (a LoRA adds no attention work), so both get the same prediction.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys

import numpy as np
import torch

from fastdit.eval.bench.common import BenchReport, RSSPeak, default_out_path, fmt, machine, pick_device

LORA_FILE = "pytorch_lora_weights.safetensors"
PREDICTED_MODELS = ("wan", "hunyuan")


class RowsError(ValueError):
    """A rows file that cannot be measured (says which row and why)."""


def load_rows(path, trained_root=None):
    """The rows of ``path`` (module docstring), checked: registered methods, options a dict, trained
    folders that hold a LoRA. ``trained`` comes back resolved against ``trained_root`` (default: the
    rows file's folder)."""
    from fastdit.jsonutil import read_json
    from fastdit.methods.base import get_method

    rows = read_json(path, RowsError, "rows file", "a JSON list of rows")
    if not isinstance(rows, list) or not rows:
        raise RowsError(f"rows file {path}: expected a non-empty JSON list of rows, got {type(rows).__name__}")
    root = trained_root or os.path.dirname(os.path.abspath(path))
    checked, labels = [], set()
    for index, row in enumerate(rows):
        where = f"rows file {path}, row {index + 1}"
        if not isinstance(row, dict) or not isinstance(row.get("method"), str):
            raise RowsError(f"{where}: expected an object with a \"method\" name, got {row!r}")
        unknown = set(row) - {"label", "method", "options", "trained"}
        if unknown:
            raise RowsError(f"{where}: unknown keys {sorted(unknown)} (known: label, method, options, trained)")
        try:
            get_method(row["method"])
        except (KeyError, ValueError) as error:
            raise RowsError(f"{where}: {error}") from error
        options = row.get("options") or {}
        if not isinstance(options, dict):
            raise RowsError(f"{where}: \"options\" must be an object, got {options!r}")
        label = row.get("label") or row["method"]
        if label in labels:
            raise RowsError(f"{where}: label {label!r} is used twice (labels name the table's rows)")
        labels.add(label)
        trained = row.get("trained")
        if trained is not None:
            trained = os.path.join(root, os.path.expanduser(trained))
            if not os.path.isfile(os.path.join(trained, LORA_FILE)):
                raise RowsError(f"{where} ({label}): {trained} holds no {LORA_FILE}: make it with "
                                f"python -m fastdit.train --method {row['method']} --out {trained} (or fix "
                                f"--trained-root, now {root})")
        checked.append({"label": label, "method": row["method"], "options": options, "trained": trained})
    return checked


@contextlib.contextmanager
def trained_weights(pipe, folder, fuse=True):
    """The row's adapter loaded for the block (nothing for a training-free row); yields the
    ``method_params`` source for the patch (None when the folder has no method parameters).

    ``fuse``: the LoRA is merged into the weights (``pipe.fuse_lora()``), as one deploys a trained
    adapter: unfused, its extra matrix products per linear layer are timed too (at tiny-shapes'
    1.2 M parameters they cost as much as a sparse method saves). Afterwards the transformer's
    original tensors are put back exactly (a copy taken before; unfusing alone subtracts in
    floating point and is not bit-exact)."""
    if folder is None:
        yield None
        return
    from fastdit.calibration.method_params import FILE
    from fastdit.train.recipe import load_lora

    saved = {name: t.detach().clone() for name, t in pipe.transformer.state_dict().items()} if fuse else None
    load_lora(pipe, folder)
    try:
        if fuse:
            pipe.fuse_lora()
        yield folder if os.path.isfile(os.path.join(folder, FILE)) else None
    finally:
        if fuse:
            pipe.unfuse_lora()
        pipe.unload_lora_weights()
        if saved is not None:
            with torch.no_grad():
                for name, tensor in pipe.transformer.state_dict().items():
                    tensor.copy_(saved[name])


def run_row(pipe, row, prompts, seeds, call, backend, reference=None, fuse=True):
    """Every (prompt, seed) video of one row: ``(videos, record)``; ``record`` holds the sums and
    means of the module docstring (fidelity only when ``reference`` videos are given)."""
    from fastdit.compare import fidelity, generate, warm_up_options
    from fastdit.eval.metrics.adherence import adherence

    method = row["method"]
    with trained_weights(pipe, row["trained"], fuse) as method_params:
        options = dict(row["options"])
        if method_params is not None:
            options["method_params"] = method_params
        warm = warm_up_options(options) if method != "dense" else {}
        generate(pipe, prompts[0], seeds[0], {**call, "num_inference_steps": 1, "output_type": "latent"},
                 method, warm, backend)
        videos, times, effective, sparse, scores = [], [], [], [], []
        with RSSPeak() as peak:
            for prompt in prompts:
                for seed in seeds:
                    result = generate(pipe, prompt, seed, call, method, options, backend)
                    videos.append(result.frames)
                    times.append(result.latency_s)
                    effective.append(result.density)
                    sparse.append(result.extra.get("sparse_density"))
                    scores.append(adherence(result.frames, prompt).score)
    record = {"label": row["label"], "method": method, "options": row["options"], "trained": row["trained"],
              "lora": None if row["trained"] is None else ("fused" if fuse else "unfused"),
              "seconds": float(sum(times)), "videos": len(videos),
              "peak_memory_mb": peak.peak_mib if pipe.device.type == "cpu" else None,
              "effective_density": _mean(effective), "sparse_density": _mean(sparse),
              "adherence": float(np.mean(scores))}
    if reference is not None:
        values, similarity = zip(*(fidelity(a, b) for a, b in zip(videos, reference)))
        record.update(psnr_db=float(np.mean(values)), psnr_min_db=float(np.min(values)),
                      ssim=float(np.mean(similarity)))
    return videos, record


def _mean(values):
    values = [v for v in values if v is not None]
    return float(np.mean(values)) if values else None


def gpu_prediction(method, options, density, gpu_name):
    """``{model: {"attention_speedup", "forward_speedup", "approximate"}}`` of ``method`` at block
    ``density`` (module docstring); None for dense or without a density."""
    from fastdit import costmodel
    from fastdit.eval.predict import density_method_call, model_shape
    from fastdit.methods.base import get_method
    from fastdit.methods.block_sparse import BlockSparseMethod

    if method == "dense" or density is None:
        return None
    cls = get_method(method)
    gpu = costmodel.gpu_named(gpu_name)
    out = {}
    for name in PREDICTED_MODELS:
        shape = model_shape(name)
        n = shape.tokens
        dense = costmodel.dense_call(gpu, 1, shape.heads, n, n, shape.head_dim)
        if cls.cost_model is not None or issubclass(cls, BlockSparseMethod):  # svg2: k-means priced as scoring
            dynamic = cls.cost_model != "plan"
            call = density_method_call(gpu, shape, method, density, options, dynamic=dynamic)
        else:  # a token method, window, prune: a dense kernel over the kept pairs, plus its matching / pooling
            import dataclasses

            call = costmodel.dense_call(gpu, 1, shape.heads, n, max(1, round(density * n)), shape.head_dim)
            extra = shape.heads * costmodel.token_outside_ms(gpu, cls, options, 1, n, shape.head_dim)
            call = dataclasses.replace(call, outside_ms=call.outside_ms + extra)
        dense_fwd = costmodel.model_forward(gpu, shape, dense.total_ms)
        fwd = costmodel.model_forward(gpu, shape, call.total_ms)
        out[name] = {"attention_speedup": dense.total_ms / call.total_ms,
                     "forward_speedup": dense_fwd.total_ms / fwd.total_ms,
                     "approximate": cls.cost_model is None}
    return out


def table_lines(rows, dense_adherence, gpu_name):
    head = (f"| row | trained | effective / sparse density | speed vs dense | PSNR mean / min (dB) | SSIM | "
            f"adherence (dense {dense_adherence:.3f}) | peak MiB | {gpu_name} Wan 480p attn / e2e | "
            f"{gpu_name} HunyuanVideo 720p attn / e2e |")
    lines = [head, "|" + "---|" * 2 + "---:|" * 8]
    for r in rows:
        cells = []
        for name in PREDICTED_MODELS:
            p = (r.get("predicted") or {}).get(name)
            mark = "~" if p and p["approximate"] else ""
            cells.append("-" if p is None
                         else f"{mark}{p['attention_speedup']:.2f}x / {mark}{p['forward_speedup']:.2f}x")
        lines.append(f"| {r['label']} | {'yes' if r['trained'] else 'no'} | "
                     f"{fmt(r['effective_density'], '.3f')} / {fmt(r['sparse_density'], '.3f')} | "
                     f"{r['speed']:.2f}x | {fmt(r.get('psnr_db'), '.2f')} / {fmt(r.get('psnr_min_db'), '.2f')} | "
                     f"{fmt(r.get('ssim'), '.3f')} | {r['adherence']:.3f} | {fmt(r['peak_memory_mb'], '.0f')} | "
                     f"{cells[0]} | {cells[1]} |")
    return lines


def build_parser():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", required=True, help="JSON list of rows (module docstring)")
    parser.add_argument("--trained-root", default=None, help="folder the rows' \"trained\" paths are relative to "
                        "(default: the rows file's folder)")
    parser.add_argument("--model", default="tiny-shapes", help="a trained model of fastdit.pipelines.loading "
                        "(its captions' grammar is the adherence metric's)")
    parser.add_argument("--frames", type=int, default=17)
    parser.add_argument("--height", type=int, default=64)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--captions", type=int, default=8, help="first N held-out captions")
    parser.add_argument("--seeds", default="0", help="comma-separated seeds")
    parser.add_argument("--gpu", default="H100", help="the cost model's GPU for the prediction columns")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--device", default=None)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--unfused", action="store_true", help="keep trained rows' LoRA unfused (its matrix "
                        "products timed too; default: fused into the weights, as deployed)")
    parser.add_argument("--json", default=None)
    return parser


def main(argv=None):
    from fastdit import costmodel
    from fastdit.eval.runner.prompts import load_prompts
    from fastdit.pipelines.loading import TRAINED_DEFAULTS, load_pipeline

    parser = build_parser()
    args = parser.parse_args(argv)
    if args.model not in TRAINED_DEFAULTS:
        parser.error(f"--model: {args.model!r} is not a trained model with a caption grammar; known: "
                     f"{sorted(TRAINED_DEFAULTS)}")
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
        costmodel.gpu_named(args.gpu)
        rows = load_rows(args.rows, args.trained_root)
    except ValueError as error:
        parser.error(str(error))
    if args.captions < 1 or not seeds or min(args.frames, args.height, args.width, args.steps) < 1:
        parser.error("--captions, --frames, --height, --width, --steps must be >= 1 and --seeds non-empty")
    device = pick_device(args.device, args.threads)
    pipe = load_pipeline(args.model, str(device))
    pipe.set_progress_bar_config(disable=True)
    call = {**TRAINED_DEFAULTS[args.model], "num_frames": args.frames, "height": args.height, "width": args.width,
            "num_inference_steps": args.steps}
    prompts = [p.text for p in load_prompts("shapes")][:args.captions]
    meta = {**machine(device), "model": args.model, "call": call, "prompts": prompts, "seeds": seeds,
            "backend": args.backend, "gpu_model": args.gpu}
    report = BenchReport(args.json or default_out_path("equal_density", meta), meta)
    report.log(f"{args.model}, {args.frames} x {args.height} x {args.width}, {args.steps} steps; "
               f"{len(prompts)} held-out captions x seeds {seeds}; {torch.get_num_threads()} threads")
    dense_row = {"label": "dense", "method": "dense", "options": {}, "trained": None}
    reference, first = run_row(pipe, dense_row, prompts, seeds, call, args.backend)
    report.log(f"dense: {first['seconds']:.2f} s for {first['videos']} videos, adherence {first['adherence']:.3f}")
    measured = []
    for index, row in enumerate(rows):
        _, record = run_row(pipe, row, prompts, seeds, call, args.backend, reference, fuse=not args.unfused)
        record["predicted"] = gpu_prediction(row["method"], row["options"], record["sparse_density"], args.gpu)
        measured.append(report.add(record))  # stamped with the machine's load while it ran
        report.log(f"[{index + 1}/{len(rows)}] {row['label']}: {record['seconds']:.2f} s, PSNR "
                   f"{fmt(record.get('psnr_db'), '.2f')} dB, adherence {record['adherence']:.3f}, density "
                   f"{fmt(record['effective_density'], '.3f')}")
    again, last = run_row(pipe, dense_row, prompts, seeds, call, args.backend)
    unchanged = all(np.array_equal(a, b) for a, b in zip(reference, again))
    dense_s = statistics.mean([first["seconds"], last["seconds"]])
    report.log(f"dense again: {last['seconds']:.2f} s; videos bit-equal to the first dense run: {unchanged}")
    for record in measured:
        record["speed"] = dense_s / record["seconds"]
    report.sections.update(dense={"first": first, "last": last, "seconds": dense_s, "bit_equal": unchanged})
    report.log("")
    for line in table_lines(measured, first["adherence"], args.gpu):
        report.log(line)
    report.write()
    print(f"wrote {report.out_path}")
    if not unchanged:
        print("error: the dense videos changed between the first and the last dense run (an adapter or patch "
              "was left on the pipeline); the table's fidelity columns are not trustworthy", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
