"""Time the two forward variants of the block-sparse engine against dense attention, beside the
cost model (``scripts/gpu_check.sh``, part ``tma``; issue 44).

First both variants are checked against the float64 reference on a small odd case (exit 1, no
timing, when one is wrong). Then for each token count N, head dim D and density: a random
128 x 128 block plan keeping ``density`` of the key blocks of every query row (the diagonal block
always), bf16, 1 x ``--heads`` heads. Rows: dense SDPA with PyTorch's default backend (what a dense
run uses; cuDNN's on the H200 of the first GPU run, 1.6x faster than flash there), on CUDA also the
flash backend forced and FlashAttention's own kernel when ``flash_attn`` is installed; the classic
kernel (``FASTDIT_TRITON_VARIANT=cp_async``, autotuned as by default, and with its untuned
per-architecture default) and the TMA variant (``FASTDIT_TRITON_VARIANT=tma``, the offline table's
config). Each row: median time of ``--runs`` runs (CUDA events) after warm-up, the achieved fraction
of the GPU's peak tensor throughput (computed FLOPs: ``4 D`` times the kept score entries), and the
cost model's prediction for the call (``fastdit.costmodel``: ``dense_call`` / ``density_call``). The
end prints the measured efficiencies, the parameters the cost model should take for this GPU
(``sdpa_eff`` from the default-backend rows, ``kernel_eff`` per variant: medians over the cases), and
writes everything to ``--json``.

    python scripts/bench_tma.py --json bench_results/tma.json
    TRITON_INTERPRET=1 python scripts/bench_tma.py --device cpu --tokens 512 --head-dims 64 \
        --densities 0.5 --runs 1 --heads 1      # CPU dry run of the logic (the interpreter)
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fastdit import costmodel  # noqa: E402
from fastdit.kernels import block_sparse_attention  # noqa: E402
from fastdit.kernels.block_sparse_tma import VARIANT_ENV  # noqa: E402
from fastdit.kernels.triton_tuning import env_var  # noqa: E402

BLOCK = 128


def random_plan(n, density, heads, device, seed=0):
    """``(kv_indices, kv_counts)``: each query block keeps ``round(density * blocks)`` key blocks
    (at least 1), its own diagonal block among them."""
    blocks = -(-n // BLOCK)
    keep = max(1, round(density * blocks))
    gen = torch.Generator().manual_seed(seed)
    idx = torch.empty(1, heads, blocks, keep, dtype=torch.int32)
    for h in range(heads):
        for m in range(blocks):
            others = torch.randperm(blocks - 1, generator=gen)[: keep - 1]
            others = others + (others >= m).long()
            idx[0, h, m] = torch.cat([torch.tensor([m]), others]).int()
    cnt = torch.full((1, heads, blocks), keep, dtype=torch.int32)
    return idx.to(device), cnt.to(device), keep / blocks


def timed(fn, runs, device):
    """Median milliseconds of ``fn()`` over ``runs`` runs after two warm-up calls."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(runs):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def dense_rows(q, k, v, runs, device):
    """``dense sdpa``: PyTorch's default backend, the baseline a dense run has and the one ``sdpa_eff``
    describes; on CUDA also the flash backend forced and ``flash_attn``'s kernel, for reference."""
    rows = [("dense sdpa", timed(lambda: F.scaled_dot_product_attention(q, k, v), runs, device))]
    if device.type == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            rows.append(("dense sdpa (flash)", timed(lambda: F.scaled_dot_product_attention(q, k, v), runs, device)))
        try:
            from flash_attn import flash_attn_func
            qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
            rows.append(("dense flash_attn", timed(lambda: flash_attn_func(qt, kt, vt), runs, device)))
        except ImportError:
            pass
    return rows


def engine_rows(q, k, v, idx, cnt, runs, device):
    rows = []
    variants = [("cp_async autotuned", "cp_async", None), ("cp_async default", "cp_async", "0"),
                ("tma", "tma", None)]
    for label, variant, autotune in variants:
        with env_var(VARIANT_ENV, variant), env_var("FASTDIT_TRITON_AUTOTUNE", autotune):
            try:
                ms = timed(lambda: block_sparse_attention(q, k, v, idx, cnt, BLOCK, BLOCK, return_lse=False,
                                                          backend="triton", validate=False), runs, device)
            except Exception as error:  # noqa: BLE001 - a variant that cannot run is a row, not a crash
                rows.append((label, None, f"{type(error).__name__}: {str(error)[:160]}"))
                continue
        rows.append((label, ms, None))
    return rows


def check_variants(device, n_q=1100, n_k=1000):
    """Both variants against the float64 reference on a small odd case (``n_q`` queries, ``n_k`` keys,
    plan blocks 128 x 96, a key mask, rows without keys, bf16, d 72 and 128): the errors, and
    whether each is within 2e-2 (relative) with the exact -inf pattern of lse."""
    from fastdit.kernels import dense_reference, plan_to_token_mask
    gen = torch.Generator().manual_seed(44)
    report = []
    for d in (72, 128):
        q = torch.randn(1, 2, n_q, d, generator=gen)
        k, v = (torch.randn(1, 2, n_k, d, generator=gen) for _ in range(2))
        nq, nk = -(-n_q // 128), -(-n_k // 96)
        cnt = torch.randint(0, nk + 1, (1, 2, nq), generator=gen).int()
        cnt[..., 1] = 0
        idx = torch.stack([torch.randperm(nk, generator=gen) for _ in range(2 * nq)]).view(1, 2, nq, nk).int()
        kv_valid = torch.rand(1, n_k, generator=gen) > 0.2
        ref, ref_lse = dense_reference(q.double(), k.double(), v.double(),
                                       plan_to_token_mask(idx, cnt, n_q, n_k, 128, 96, kv_valid))
        for variant in ("cp_async", "tma"):
            with env_var(VARIANT_ENV, variant):
                out, lse = block_sparse_attention(*(t.to(device, torch.bfloat16) for t in (q, k, v)),
                                                  idx.to(device), cnt.to(device), 128, 96,
                                                  kv_valid=kv_valid.to(device), backend="triton")
            rel = ((out.cpu().double() - ref).norm() / ref.norm()).item()
            same_inf = torch.equal(torch.isneginf(lse.cpu()), torch.isneginf(ref_lse))
            ok = rel < 2e-2 and same_inf and bool(torch.isfinite(out).all())
            report.append({"variant": variant, "head_dim": d, "rel_error": rel, "lse_inf_pattern": same_inf, "ok": ok})
            print(f"[bench_tma] check {variant:<8} d={d}: relative error {rel:.2e}, lse -inf pattern "
                  f"{'equal' if same_inf else 'DIFFERS'}: {'ok' if ok else 'FAILED'}", flush=True)
    return report


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[32768, 75600])
    p.add_argument("--head-dims", default="64,128")
    p.add_argument("--densities", default="0.1,0.2,0.3,0.5")
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--device", default="cuda")
    p.add_argument("--json", default=None)
    p.add_argument("--check-tokens", default="1100,1000", help="queries,keys of the correctness check")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here (use --device cpu with TRITON_INTERPRET=1)")
    gpu = costmodel.gpu_for(device) if device.type == "cuda" else None
    gpu_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    dtype = torch.bfloat16
    results, effs = [], {}
    check = check_variants(device, *(int(x) for x in args.check_tokens.split(",")))
    if not all(r["ok"] for r in check):
        if args.json:
            Path(args.json).write_text(json.dumps({"gpu": gpu_name, "check": check}, indent=1))
        print("[bench_tma] a variant is wrong: no timing")
        return 1
    print(f"[bench_tma] {gpu_name}; model: {gpu.name if gpu else 'none'}; bf16, 1 x {args.heads} heads, "
          f"{BLOCK}-token blocks, median of {args.runs}")
    print(f"{'N':>6} {'D':>4} {'dens':>5} {'row':<22} {'ms':>9} {'TFLOP/s':>8} {'eff':>6} {'model ms':>9}")
    for n in args.tokens:
        for d in (int(x) for x in args.head_dims.split(",")):
            gen = torch.Generator().manual_seed(n + d)
            q, k, v = (torch.randn(1, args.heads, n, d, generator=gen).to(device, dtype) for _ in range(3))
            dense_flops = 4.0 * args.heads * n * n * d
            for label, ms in dense_rows(q, k, v, args.runs, device):
                model = costmodel.dense_call(gpu, 1, args.heads, n, n, d).total_ms if gpu else None
                results.append(_row(n, d, 1.0, label, ms, dense_flops, gpu, model, None))
                effs.setdefault("sdpa_eff" if label == "dense sdpa" else label, []).append(results[-1]["eff"])
                _print(results[-1])
            for density in (float(x) for x in args.densities.split(",")):
                idx, cnt, real = random_plan(n, density, args.heads, device)
                flops = dense_flops * real  # whole 128 x 128 pairs (the last block's padding aside)
                model = costmodel.density_call(gpu, real, 1, args.heads, n, d, dynamic=False).kernel_ms if gpu \
                    else None
                for label, ms, error in engine_rows(q, k, v, idx, cnt, args.runs, device):
                    results.append(_row(n, d, real, label, ms, flops, gpu, model, error))
                    if ms is not None:
                        effs.setdefault(f"kernel_eff {label}", []).append(results[-1]["eff"])
                    _print(results[-1])
    summary = {key: statistics.median([e for e in vals if e is not None]) if any(e is not None for e in vals)
               else None for key, vals in effs.items()}
    print(f"[bench_tma] measured efficiencies on {gpu_name} (medians; the cost model assumes "
          f"sdpa_eff {gpu.sdpa_eff if gpu else '-'}, kernel_eff {gpu.kernel_eff if gpu else '-'}):")
    for key, value in summary.items():
        print(f"  {key:<32} {'-' if value is None else f'{value:.3f}'}")
    if args.json:
        Path(args.json).write_text(json.dumps({"gpu": gpu_name, "model": gpu.name if gpu else None, "check": check,
                                               "rows": results, "efficiency": summary}, indent=1))
        print(f"[bench_tma] the cost model takes them: python -m fastdit.eval.predict --gpus "
              f"{gpu.name if gpu else 'NAME'} --efficiency {args.json}")
    return 0


def _row(n, d, density, label, ms, flops, gpu, model_ms, error):
    tflops = None if ms is None else flops / (ms * 1e-3) / 1e12
    eff = None if (tflops is None or gpu is None) else tflops / gpu.peak_tflops
    return {"tokens": n, "head_dim": d, "density": round(density, 4), "row": label, "ms": ms, "tflops": tflops,
            "eff": eff, "model_ms": model_ms, "error": error}


def _print(r):
    def f(x, spec):
        return "-" if x is None else format(x, spec)
    print(f"{r['tokens']:>6} {r['head_dim']:>4} {r['density']:>5.2f} {r['row']:<22} {f(r['ms'], '9.3f')} "
          f"{f(r['tflops'], '8.1f')} {f(r['eff'], '6.3f')} {f(r['model_ms'], '9.3f')}"
          + (f"  {r['error']}" if r["error"] else ""), flush=True)


if __name__ == "__main__":
    sys.exit(main())
