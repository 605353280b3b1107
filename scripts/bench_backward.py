"""Forward + backward of the block-sparse engine against dense SDPA's, and a tiny LoRA step's memory.

    python scripts/bench_backward.py --tokens 8192 --runs 2          # CPU, short
    python scripts/bench_backward.py --tokens 8192 32768 --device cuda --json out.json

Per sequence length ``N``: q, k, v ``(1, H, N, D)`` requiring grad, a plan of 128 x 128 blocks in
which every query block keeps its diagonal block and ``round(density * blocks) - 1`` others drawn
at random (so the plan density is ``density`` up to rounding, printed as measured). Timed: the
forward and ``backward()`` of ``(out * g).sum()`` with a fixed random ``g``, dense
(``F.scaled_dot_product_attention``) and sparse (``block_sparse_attention``, backend as asked), one
warm-up then the median of ``--runs`` runs; the ratio dense / sparse beside the ideal
``1 / density``. Peak memory: ``torch.cuda.max_memory_allocated`` on a GPU; on the CPU the
process's peak resident set (``ru_maxrss``, whole process, monotone: an upper bound only).

``--lora``: one LoRA distillation step (``fastdit.train``) on the tiny Wan (256 tokens), sparse
(sta, trainable patch) and dense, time and peak memory as above.
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import time

import torch
import torch.nn.functional as F


def _plan(n_blocks, density, gen, device):
    keep = max(1, round(density * n_blocks))
    idx = torch.zeros(1, 1, n_blocks, keep, dtype=torch.int32)
    for m in range(n_blocks):
        others = [j for j in torch.randperm(n_blocks, generator=gen).tolist() if j != m][: keep - 1]
        idx[0, 0, m] = torch.tensor([m] + others, dtype=torch.int32)
    cnt = torch.full((1, 1, n_blocks), keep, dtype=torch.int32)
    return idx.to(device), cnt.to(device), keep / n_blocks


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB -> MiB (Linux)


def _time(fn, runs, device):
    fn()  # warm-up (and Triton compile)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(runs):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), _peak(device)


def engine_rows(tokens, heads, dim, density, runs, device, dtype, backend):
    from fastdit.kernels import block_sparse_attention

    rows = []
    for n in tokens:
        gen = torch.Generator().manual_seed(n)
        q, k, v = (torch.randn(1, heads, n, dim, generator=gen).to(device, dtype).requires_grad_() for _ in range(3))
        g = torch.randn(1, heads, n, dim, generator=gen).to(device, dtype)
        idx, cnt, real = _plan(-(-n // 128), density, gen, device)

        def dense():
            (F.scaled_dot_product_attention(q, k, v) * g).sum().backward()

        def sparse():
            out = block_sparse_attention(q, k, v, idx, cnt, 128, 128, return_lse=False, backend=backend,
                                         validate=False)
            (out * g).sum().backward()

        t_dense, m_dense = _time(dense, runs, device)
        t_sparse, m_sparse = _time(sparse, runs, device)
        rows.append({"tokens": n, "heads": heads, "dim": dim, "dtype": str(dtype), "density": real,
                     "dense_s": t_dense, "sparse_s": t_sparse, "speedup": t_dense / t_sparse,
                     "ideal": 1 / real, "dense_peak_mib": m_dense, "sparse_peak_mib": m_sparse})
        print(f"N={n:6d} density {real:.3f}: dense fwd+bwd {t_dense:.3f} s, sparse {t_sparse:.3f} s, "
              f"x{t_dense / t_sparse:.2f} (ideal x{1 / real:.1f}); peak MiB {m_dense:.0f} / {m_sparse:.0f}", flush=True)
    return rows


def lora_rows(runs, device):
    import fastdit
    from fastdit.pipelines.tiny import tiny
    from fastdit.train.recipe import LoraTrainConfig, add_lora, make_samples, train_steps

    call = {"num_frames": 13, "height": 128, "width": 128, "num_inference_steps": 2, "guidance_scale": 1.0,
            "max_sequence_length": 16}
    rows = []
    for method in ("dense", "sta"):
        pipe = tiny("wan").to(device)
        pipe.set_progress_bar_config(disable=True)
        config = LoraTrainConfig(prompts=("a cat",), seeds=(0,), samples=1, steps=runs + 1, call_kwargs=call)
        samples = make_samples(pipe, config)
        params = add_lora(pipe.transformer, config)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        options = {"tile": (2, 4, 4), "window": (1, 1, 1), "dense_steps": 0, "dense_layers": 0}
        with (fastdit.patch(pipe.transformer, "sta", trainable=True, **options) if method == "sta"
              else _nothing()):
            _, times, _ = train_steps(pipe.transformer, params, samples, config, progress=False)
        rows.append({"lora_step": method, "step_s": statistics.median(times[1:]), "peak_mib": _peak(device)})
        print(f"tiny LoRA step ({method}): {rows[-1]['step_s']:.3f} s, peak {rows[-1]['peak_mib']:.0f} MiB", flush=True)
    return rows


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192])
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--density", type=float, default=0.125)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (GPU default)")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--lora", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    load = None
    try:
        import os
        load = os.getloadavg()
    except OSError:
        pass
    print(f"device {device}, threads {torch.get_num_threads()}, load average {load}")
    result = {"device": str(device), "threads": torch.get_num_threads(), "load_average": load,
              "engine": engine_rows(args.tokens, args.heads, args.dim, args.density, args.runs, device, dtype,
                                    args.backend)}
    if args.lora:
        result["lora"] = lora_rows(args.runs, device)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
