"""Benchmark: one transformer forward, dense against fastdit's methods, eager and ``torch.compile``d.

Run ``python -m fastdit.eval.bench.transformer`` (CUDA: full size) or ``--scale tiny`` (CPU, about
a minute). Prints a table and writes JSON (``--out``, default
``bench_results/transformer_<device>_<timestamp>.json``).

Models, built from their published configs with random weights (nothing is downloaded):

* ``wan``: Wan2.1-T2V-1.3B (``WanTransformer3DModel``: 30 layers, 12 heads of 128, ffn 8960,
  text_dim 4096, freq_dim 256, patch (1, 2, 2), 16 channels in and out, qk_norm
  rms_norm_across_heads, cross_attn_norm, eps 1e-6, rope_max_seq_len 1024; 1.42B parameters) at
  480p x 81 frames: latents (1, 16, 21, 60, 104) -> 21x30x52 = 32760 tokens; 512 text tokens
  (cross-attention, not patched);
* ``hunyuan``: HunyuanVideo 13B (``HunyuanVideoTransformer3DModel`` with its published config,
  diffusers' defaults: 20 double- and 40 single-stream blocks, 24 heads of 128, mlp_ratio 4, 2
  refiner layers, text_embed_dim 4096, pooled 768, patch 2 / 1, rope axes 16/56/56; 12.8B
  parameters) at 720p x 129 frames: latents (1, 16, 33, 90, 160) -> 33x45x80 = 118800 video
  tokens + 256 text tokens (64 valid, the rest padding under the model's key mask) in every
  joint attention. ``--hy-frames`` picks another length (``(frames - 1) / 4 + 1`` latent frames).

The big models are built directly on the GPU (float32 init there, then cast to bfloat16: no host
RAM is used for weights); the parameter count comes from a build on the meta device first.
``--scale tiny`` shrinks layers, heads and the grid (Wan: 2 layers, 2 heads of 64, latents
4x32x48 -> 4x16x24 = 1536 tokens; HunyuanVideo: 1 + 1 blocks, 2 heads of 64, 4x32x48 -> 4x16x24 =
1536 tokens + 32 text, 12 valid) and runs in float32 on the CPU; there each method uses its tiny
preset (``fastdit.methods.tiny_presets()``, as ``fastdit compare`` does on the tiny models: sta's
4x4x8 tile, fitted per grid), elsewhere the method's defaults, and ``torch.compile`` uses the
``aot_eager`` backend on the CPU by default (dynamo and AOT tracing as with inductor, no code
generation: inductor's C++ compile of each method would take minutes on a 2-core CPU;
``--compile-backend inductor`` to use it).

Per model, for ``mode`` in eager, compiled and ``method`` in dense, sta, radial: the bare
transformer, patched with ``fastdit.patch(transformer, method, dense_steps=0)`` (the family's
other defaults: Wan radial keeps its first layer dense), or unpatched for dense; compiled =
``torch.compile(transformer)`` of the whole model (``--compile regional``: diffusers'
``compile_repeated_blocks``), compiled afresh per method (``torch._dynamo.reset()`` between).

What is timed: one ``transformer(**inputs)`` call under ``torch.no_grad()`` (the whole forward:
embeddings, every block, the fastdit pre-hook and per-call plan lookups, the output projection),
median of ``--reps`` runs, CUDA events on the GPU (``time.perf_counter`` on the CPU). Before them,
untimed: for eager (at full size) a forward of the model cut to its first block of each kind
(warms cuBLAS, Triton autotuning and fastdit's plan cache on the same shapes) then ``--warmup``
full forwards; for compiled ``--warmup`` (at least 1) full forwards, the first of which compiles
(its wall time is ``compile_s``). Excluded: model build, input creation, warm-up, compilation.
Defaults: 3 timed after 1 warm-up; HunyuanVideo at full size 1 timed after the first-block
forward alone (a dense forward there is tens of seconds).

Columns: time_ms, speedup = dense time / method time in the same mode (the JSON's
``speedup_vs_eager`` = the eager time of the same method / the compiled time), density = query-key
score computations performed / dense attention's over all patched layers of the timed calls (dense
layers count 1.0), peak = peak allocated GPU memory during the timed calls (weights included; CPU:
the resident set's peak during the timed calls above its level before them, sampled every 5 ms by
a thread), graph breaks = ``torch._dynamo.explain`` of the patched (or unpatched) model; at full
size of a copy with only its first blocks (Wan 2 layers, HunyuanVideo 1 + 1) at a small grid, from
the same config (every block runs the same code: a break inside a block would show there once per
block, one outside the blocks once). The JSON also has dynamo's counters of the real compilation
(``dynamo``: unique graphs, graph breaks).

``--compile regional`` compiles each repeated block (``compile_repeated_blocks``) instead. The
unpatched model then needs one graph per block class, but a patched one one graph per patched
layer: each layer's attention reaches fastdit through its own backend member and layer index,
constants that dynamo guards on (measured at tiny scale: Wan's 2 layers give 1 graph unpatched, 2
patched). The benchmark raises dynamo's recompile limit to the block count so that no layer falls
back to eager silently; expect long compiles.

``--budget-s`` caps the run: each measurement is skipped (a row with the reason) when its
estimated time exceeds what is left; rows are written as they come, so a kill keeps them.

Modules: ``transformer_models`` (configs, builds, inputs), ``transformer_run`` (the
measurements of one model), ``common`` (timing, memory, the report); this module parses the
command line and prints the table.
"""
from __future__ import annotations

import argparse
import sys

import torch

from .common import BenchReport, default_out_path, fmt, machine, pick_device
from .transformer_models import MODELS
from .transformer_run import Budget, bench_model

HEADER = (f"{'model':<17} {'mode':<8} {'method':<7} {'tokens':>7} {'time_ms':>10} {'speedup':>8} {'density':>7} "
          f"{'peak':>8} {'compile_s':>9} {'breaks':>6}")


def format_row(r):
    start = f"{r['model']:<17} {r['mode']:<8} {r['method']:<7} {r['tokens']:>7}"
    if r.get("skipped") or r.get("error"):
        return f"{start} {'skipped' if r.get('skipped') else 'FAILED'}: {r.get('skipped') or r.get('error')}"
    return (f"{start} {fmt(r['time_ms'], '10.1f')} {fmt(r['speedup'], '8.2f')} {fmt(r['density'], '7.3f')} "
            f"{_peak(r):>8} {fmt(r.get('compile_s'), '9.1f')} {fmt(r.get('graph_breaks'), '6d')}")


def _peak(r):
    if r.get("peak_gib") is not None:
        return f"{r['peak_gib']:.2f}G"
    if r.get("peak_rss_mib_above_start") is not None:
        return f"+{r['peak_rss_mib_above_start']:.0f}M"
    return "-"


def parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="wan,hunyuan", help="comma-separated: wan, hunyuan")
    p.add_argument("--scale", choices=("full", "tiny"), default=None,
                   help="full: the published sizes (default on CUDA); tiny: a CPU-sized model (default on the CPU)")
    p.add_argument("--methods", default="sta,radial", help="methods besides dense (comma-separated)")
    p.add_argument("--modes", default="eager,compiled", help="eager, compiled (comma-separated)")
    p.add_argument("--compile", choices=("full", "regional"), default="full",
                   help="full: torch.compile(transformer); regional: transformer.compile_repeated_blocks()")
    p.add_argument("--compile-backend", default=None,
                   help="torch.compile backend (default inductor on CUDA, aot_eager on the CPU: no code generation)")
    p.add_argument("--no-explain", dest="explain", action="store_false", help="skip torch._dynamo.explain")
    p.add_argument("--reps", type=int, default=None, help="timed runs (default 3; HunyuanVideo full size 1)")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed full forwards before timing (default 1; HunyuanVideo full size 0 in eager mode, "
                        "after the first-blocks warm-up)")
    p.add_argument("--hy-frames", type=int, default=None, help="HunyuanVideo video frames (default 129)")
    p.add_argument("--budget-s", type=float, default=None, help="skip measurements that would end past this")
    p.add_argument("--compile-estimate-s", type=float, default=None,
                   help="expected compile time for the budget check (default 90 at full size, 20 tiny)")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None,
                   help="default bfloat16 on CUDA, float32 on the CPU")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=None,
                   help="JSON path (default bench_results/transformer_<device>_<timestamp>.json)")
    p.add_argument("--table", default=None, help="also write the printed table to this path")
    return p


def main(argv=None):
    p = parser()
    args = p.parse_args(argv)
    if args.reps is not None and args.reps < 1:
        p.error("--reps must be at least 1")
    if args.warmup is not None and args.warmup < 0:
        p.error("--warmup must be >= 0")
    device = pick_device(args.device, args.threads)
    cuda = device.type == "cuda"
    args.scale = args.scale or ("full" if cuda else "tiny")
    args.compile_backend = args.compile_backend or ("inductor" if cuda else "aot_eager")
    if args.compile_estimate_s is None:
        args.compile_estimate_s = 90.0 if args.scale == "full" else 20.0
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if cuda else torch.float32)
    meta = dict(machine(device), scale=args.scale, dtype=str(dtype).replace("torch.", ""), modes=args.modes,
                methods=args.methods, compile=args.compile, compile_backend=args.compile_backend,
                budget_s=args.budget_s)
    report = BenchReport(args.out or default_out_path("transformer", meta), meta, args.table,
                         stamp=("timestamp", "gpu", "cpu", "torch", "triton", "diffusers"))
    log = report.log

    def emit(row):
        report.add(row)
        log(format_row(row))
        report.write()

    log(f"fastdit transformer benchmark  device={device} gpu={meta['gpu']} cpu={meta['cpu']}")
    log(f"torch {meta['torch']}  triton {meta['triton']}  diffusers {meta['diffusers']}  "
        f"threads {meta['cpu_threads']}  scale {args.scale}  {meta['dtype']}  "
        f"compile {args.compile}/{args.compile_backend}"
        + (f"  budget {args.budget_s:.0f}s" if args.budget_s else ""))
    if args.scale == "tiny":
        log("tiny scale: layers, heads and grids shrunk (see each model); methods use their tiny presets "
            "(fastdit.methods.tiny_presets(): sta a 4x4x8 tile)")
    log("time = median of the timed forwards (" + ("CUDA events" if cuda else "perf_counter") + "); speedup = dense / "
        "method in the same mode; density = score computations performed / dense's, over all patched layers")
    log(HEADER)
    log("-" * len(HEADER))
    budget = Budget(args.budget_s)
    status = 0
    try:
        for name in [m.strip() for m in args.models.split(",") if m.strip()]:
            if name not in MODELS:
                raise SystemExit(f"unknown model {name!r}; choose from {sorted(MODELS)}")
            bench_model(name, args, device, dtype, budget, log, emit)
    except KeyboardInterrupt:
        log("interrupted: the rows so far are kept")
        meta["interrupted"] = True
        status = 130
    report.write()
    log(f"wrote {report.out_path}")
    return status


if __name__ == "__main__":
    sys.exit(main())
