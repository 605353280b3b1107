"""Benchmark: dense SDPA against fastdit's block-sparse attention (and FlexAttention on CUDA).

Run ``python -m fastdit.eval.bench.attention`` (``--quick`` for a short CPU smoke run). Prints a
table and writes JSON (``--out``, default ``bench_results/attention_<device>_<timestamp>.json``).
``--path kernel`` (default) times the engine on synthetic plans (below); ``--path patched`` times
what a patched layer runs, with each method's own plan (section "Patched path"); ``--path both``
does both in one run. ``--path methods``, which ``--methods`` without ``--path`` implies, compares
every method on structured video-like inputs per head kind (spatial, temporal, global): density,
relative L2 error against dense attention, selection and attention time, and the time token
methods spend outside attention (``fastdit.eval.bench.methods``, which takes the remaining flags).

Cases
  * everywhere: B=1, H=2, D=64, float32, N in {8192, 32768}, plans at densities
    {1.0, 0.5, 0.25, 0.1}: 128-token blocks in tile order of a 3-D tile grid, each query tile
    attending a window of neighbouring tiles (clamped at the borders, like sliding-tile
    attention) sized to hit the density; the torch fallback on the CPU, Triton on CUDA;
  * CUDA only: Wan2.1-1.3B 480p (N=32760, H=12) and HunyuanVideo 720p (N=115200, H=24), D=128,
    bfloat16, Triton, against SDPA (flash and cuDNN backends) and compiled FlexAttention with a
    BlockMask of the same plan; HunyuanVideo includes the real sliding-tile plan (latent grid
    30x48x80, tiles 6x8x8 = 384 tokens, window 3x3x3 tiles clamped at the borders, density 0.09);
  * CUDA only, the block-size / key-validity A/B (``ab_sta_*``, no FlexAttention): one sliding-tile
    plan (3x5x6 tiles, window 3x3x3, density 0.3, H=12, D=128, bfloat16) on 384-token blocks, on
    sta's Wan 378-token blocks, and on 378-token blocks with an all-true ``kv_valid`` (backend
    ``fastdit_triton+kv_valid``): which of the two made sta's Wan plan half as fast per entry.

Columns: time_ms (one call; the median of ``--reps`` timed calls after ``--warmup`` untimed ones,
default 10 after 2 on CUDA, 3 after 1 on the CPU, and 2 after none for CPU cases over 2 x 8192^2
pairs per head; CUDA events on the GPU, ``time.perf_counter`` on the CPU; the engine runs with
``validate=False``, the plans being valid by construction; inputs, plans and FlexAttention's
BlockMask are built before timing, and FlexAttention's compilation falls in the warm-up), TFLOP/s
counted on the computed pairs (4 * B * H * D * pairs / t), speedup over dense SDPA (the fastest
dense SDPA measured for the case) and efficiency = speedup / (1 / density).

Patched path (``--path patched``)
  The methods' own plans (``sta``, ``radial`` with the model family's settings, ``dense_steps=0``
  and ``dense_layers=0`` so every call is sparse) on the token layouts of real models, text tokens
  and the text key mask included:

  * ``wan480``: Wan2.1 480p x 81 frames, 21x30x52 = 32760 video tokens, no text (self-attention);
  * ``hunyuan720``: HunyuanVideo 768x1280 x 117 frames, 30x48x80 = 115200 video tokens + 256 text
    tokens after them, of which the first 64 are valid (the key mask of a padded prompt).

  On CUDA: H=12 (Wan) / 24 (HunyuanVideo), D=128, bfloat16, Triton. On the CPU the grids are
  scaled down to real but shorter or smaller videos so the run takes a couple of minutes (Wan
  480p x 25 frames: 7x30x52, the same 7x6x9 sliding tile and density as at 81 frames;
  HunyuanVideo 544x960 x 21 frames: 6x34x60 + 256 text), H=2, D=64, float32,
  the torch fallback; ``--quick`` shrinks them further (5x16x32; 4x24x40 + 256 text). The output
  says which sizes ran. Per case and method, on the same q, k, v (model token order):

  * ``sdpa``: ``F.scaled_dot_product_attention`` with the key mask as the model passes it (the
    dense call the patch replaces); with a key mask also ``sdpa_nomask`` (the same call without
    it: a lower bound for dense, not the same result);
  * ``kernel``: ``block_sparse_attention`` alone on tensors already permuted into the plan's
    kernel order, with the plan's key validity precomputed and ``validate=False`` (the permutation
    and the validity vector are built before timing: excluded);
  * ``run_plan``: ``fastdit.run_plan`` from model order: gathers into kernel order, key-validity of
    the key mask, plan validation, the kernel, the un-permuting gather back;
  * ``attention``: ``fastdit.attention(...)``, everything a patched layer does per call (context,
    dense-step check, plan-cache lookup, ``run_plan``, finalize).

  Time: one call, the median of ``--reps`` timed calls after ``--warmup`` untimed ones (default
  10 after 2 on CUDA, 3 after 1 on the CPU), as above. ``density`` is ``info["density"]`` of
  ``fastdit.attention``: query-key score computations performed / dense attention's (padding
  slots excluded); ``block_density`` the plan's fraction of block pairs; ``speedup`` = the
  ``sdpa`` time / the time; ``x kernel`` = the time / the ``kernel`` time of the same method.
  ``peak_mem_mb``: measured on one more, untimed call: on CUDA the peak allocated memory above
  what was allocated before it (inputs excluded), on the CPU the peak resident memory of the
  process, sampled every 2 ms, above its level before the call (freed memory that the allocator
  keeps is not seen again, so CPU figures are lower bounds).

``--check`` (default on with a GPU) first runs a correctness pass: Triton (or the torch fallback
where Triton cannot run) against the float64 reference on small shapes, and on CUDA the large
shapes against the torch fallback on a subset of query blocks; prints PASS/FAIL and exits non-zero
on any failure.

Modules: ``attention_kernel`` (the kernel mode: plans, cases, dense and FlexAttention baselines),
``attention_check`` (the correctness pass), ``attention_patched`` (the patched path),
``common`` (timing, memory, the report); this module parses the command line and runs them.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

from fastdit.kernels import available_backends

from .common import BenchReport, default_out_path, machine, pick_device
from .attention_kernel import run_kernel
from .attention_check import run_checks
from .attention_patched import HEADER as PATCHED_HEADER
from .attention_patched import format_row as format_patched_row
from .attention_patched import run_patched


def parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="CPU smoke run: N=8192 only, fewer repetitions")
    p.add_argument("--check", dest="check", action="store_true", default=None,
                   help="run the correctness pass first (default: on with a GPU)")
    p.add_argument("--no-check", dest="check", action="store_false")
    p.add_argument("--check-only", action="store_true", help="run the correctness pass and exit")
    p.add_argument("--path", choices=("kernel", "patched", "both", "methods"), default="kernel",
                   help="kernel: the engine on synthetic plans (default); patched: fastdit.attention / run_plan "
                        "with the methods' own plans next to the kernel alone and dense SDPA; both: one run of each")
    p.add_argument("--methods", default="sta,radial", help="methods of the patched path (comma-separated)")
    p.add_argument("--no-flex", action="store_true", help="skip FlexAttention")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions (median)")
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's); 1 is steadier on a shared, busy machine")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--out", default=None, help="JSON path (default bench_results/attention_<device>_<timestamp>.json)")
    p.add_argument("--table", default=None, help="also write the printed table to this path")
    return p


def _methods_mode(argv):
    """``--path methods``, or ``--methods`` without a ``--path``: the per-method table on structured inputs."""
    paths = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--path"]
    paths += [a.split("=", 1)[1] for a in argv if a.startswith("--path=")]
    has_methods = any(a == "--methods" or a.startswith("--methods=") for a in argv)
    return "methods" in paths or (has_methods and not paths)


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if _methods_mode(argv):
        from .methods import main as methods_main

        rest = [a for i, a in enumerate(argv) if a not in ("--path", "--path=methods")
                and not (i and argv[i - 1] == "--path")]
        methods_main(rest)
        return 0
    try:
        return _main(parser().parse_args(argv))
    except KeyboardInterrupt:  # e.g. a time cap's SIGINT: the JSON holds every row written so far
        print("interrupted: the rows written so far are kept", flush=True)
        return 130


def _main(args):
    device = pick_device(args.device, args.threads)
    cuda = device.type == "cuda"
    triton_ok = "triton" in available_backends(device)
    do_check = (args.check if args.check is not None else cuda) or args.check_only
    reps = args.reps or (2 if args.quick else (10 if cuda else 3))
    warmup = args.warmup if args.warmup is not None else (2 if cuda else 1)
    meta = dict(machine(device), reps=reps, warmup=warmup, quick=args.quick, path=args.path,
                autotune=os.environ.get("FASTDIT_TRITON_AUTOTUNE", "1"))
    kind = "attention" if args.path == "kernel" else f"attention_{args.path}"
    report = BenchReport(args.out or default_out_path(kind, meta), meta, args.table)
    log = report.log
    log(f"fastdit attention benchmark  device={device} gpu={meta['gpu']} cpu={meta['cpu']}")
    log(f"torch {meta['torch']}  triton {meta['triton']}  threads {meta['cpu_threads']}  reps {reps}  warmup {warmup}")

    report.sections["check"] = []
    failed = False
    if do_check:
        log("correctness pass:")
        checks = report.sections["check"] = run_checks(device, triton_ok, log)
        failed = not all(r["pass"] for r in checks)
        log(f"correctness: {'FAIL' if failed else 'PASS'} ({sum(r['pass'] for r in checks)}/{len(checks)})")
    if failed or args.check_only:
        return finish(report, 1 if failed else 0)

    if args.path in ("patched", "both"):
        methods = [m.strip() for m in args.methods.split(",") if m.strip()]
        log("")
        log(f"patched path: {', '.join(methods)} with their own plans; "
            f"{'full sizes' if cuda else 'CPU: grids scaled down (see each case)'}; median of {reps} timed runs "
            f"after {warmup} warm-up runs ({meta['timer']}); peak memory from one more call")
        log(PATCHED_HEADER)
        log("-" * len(PATCHED_HEADER))

        def emit(row):
            report.add(row)
            log(format_patched_row(row))
            report.write()

        run_patched(device, methods, reps, warmup, args.quick, log, emit)
        log("speedup = dense SDPA time (the model's masked call) / time; x kernel = time / the kernel alone on "
            "pre-permuted inputs (the cost of gathers, masks, validation and dispatch)")
        if args.path == "patched":
            return finish(report, 0)
        if cuda:
            torch.cuda.empty_cache()

    # CPU: long dense runs take seconds each; fewer calls there unless --reps / --warmup say otherwise
    run_kernel(device, args.quick, reps, warmup, report, fixed_reps=args.reps, fixed_warmup=args.warmup,
               flex=not args.no_flex)
    return finish(report, 0)


def finish(report, status):
    report.write()
    report.log(f"wrote {report.out_path}")
    return status


if __name__ == "__main__":
    sys.exit(main())
