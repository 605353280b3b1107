"""Benchmark: variable-size blocks (``block_sparse_attention_varlen``) against fixed-size blocks
(``block_sparse_attention``) at equal token-pair density.

Run ``python -m fastdit.eval.bench.varlen`` (``--quick`` for a seconds-long CPU run). Prints a
table and writes JSON (``--out``, default ``bench_results/varlen_<device>_<timestamp>.json``).

Per fixed block size ``b`` (``--blocks``, default 64 and 128) and one set of q, k, v
(``(1, H, N, D)``, random normal; CPU default N=12288, D=64, H=8, float32; CUDA default N=32768,
D=64, H=24, bfloat16), three forms, each with a per-head plan of random key-block lists:

* ``fixed``: ``N / b`` blocks of ``b`` tokens; each query block lists ``round(density * Mk)``
  distinct random key blocks (token-pair density = the listed fraction exactly);
* ``varlen_same``: the same boundaries written as offsets (``m * b``) and the same lists, run by
  the variable-size engine: what the offsets form costs by itself;
* ``varlen_random``: ``N / b`` blocks per head with random boundaries (sorted uniform cuts: sizes
  spread like exponential ones, mean ``b``, some empty), each query block listing random key
  blocks until their tokens reach ``density * Nk`` (density within a block of the target).

Backend ``--backend`` (default ``auto``: Triton on CUDA, the torch fallback on the CPU), plans
valid by construction (``validate=False``). Columns: density (attended token pairs / N * Nk,
measured from the plan), ms (median of ``--runs`` timed calls after ``--warmup`` untimed ones;
the three forms timed in turn, round robin, so that a change of machine load hits each alike;
CUDA events or ``time.perf_counter``; every call in ``ms_runs`` of the JSON), ratio (per round,
this form's time / the fixed form's at the same ``b``; the median over rounds), peak
memory of one untimed call above the inputs (MiB; CUDA allocator or process RSS), and for
``varlen_same`` the relative error against the fixed form's output (same plan: ~0).

``--check`` first runs a small case (N=300, Nk=260, D=72, 2 x 3 heads, per-head random boundaries
with empty and one-token blocks, a ``kv_valid`` with holes) on the chosen backend against the
float64 reference ``varlen_reference``; the run fails (exit 1) when the relative error is over
1e-4 (float32) / 2e-2 (half types) or any output is not finite.
"""
from __future__ import annotations

import argparse
import statistics
import sys

import torch

from fastdit.kernels import block_sparse_attention, block_sparse_attention_varlen, varlen_reference

from .common import BenchReport, default_out_path, fmt, machine, peak_memory_mb, pick_device, rel_error, time_once

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def fixed_lists(gen, heads, n_blocks, count):
    """``(idx, cnt)`` int32 ``(1, H, n_blocks, count)`` / ``(1, H, n_blocks)``: per head and query
    block ``count`` distinct random key blocks."""
    idx = torch.stack([torch.stack([torch.randperm(n_blocks, generator=gen)[:count] for _ in range(n_blocks)])
                       for _ in range(heads)]).unsqueeze(0)
    return idx.to(torch.int32), torch.full((1, heads, n_blocks), count, dtype=torch.int32)


def random_offsets(gen, heads, total, n_blocks):
    """``(1, H, n_blocks + 1)`` int64 boundaries: sorted uniform cuts of ``[0, total]`` per head."""
    cuts = torch.sort(torch.randint(0, total + 1, (heads, n_blocks - 1), generator=gen), dim=-1).values
    zeros, ends = torch.zeros(heads, 1, dtype=torch.int64), torch.full((heads, 1), total, dtype=torch.int64)
    return torch.cat([zeros, cuts, ends], dim=-1).unsqueeze(0)


def density_lists(gen, k_offsets, n_qblocks, density):
    """Per head and query block: the prefix of a random order of the key blocks whose tokens come
    closest to ``density * Nk``."""
    heads, n_kblocks = k_offsets.shape[1], k_offsets.shape[2] - 1
    sizes = (k_offsets[0, :, 1:] - k_offsets[0, :, :-1])
    target = density * int(k_offsets[0, 0, -1])
    idx = torch.zeros(1, heads, n_qblocks, n_kblocks, dtype=torch.int32)
    cnt = torch.zeros(1, heads, n_qblocks, dtype=torch.int32)
    for h in range(heads):
        for m in range(n_qblocks):
            order = torch.randperm(n_kblocks, generator=gen)
            c = int((torch.cumsum(sizes[h, order], 0) - target).abs().argmin()) + 1  # the prefix closest to it
            idx[0, h, m, :c] = order[:c].to(torch.int32)
            cnt[0, h, m] = c
    return idx[..., : int(cnt.max())].contiguous(), cnt


def pair_density(q_offsets, k_offsets, idx, cnt):
    """Attended (query, key) pairs / (N * Nk) of a variable-size plan (from block sizes)."""
    q_sizes = (q_offsets[..., 1:] - q_offsets[..., :-1]).double()
    k_sizes = (k_offsets[..., 1:] - k_offsets[..., :-1]).double()
    used = torch.arange(idx.shape[-1]) < cnt.unsqueeze(-1)
    blocks = torch.where(used, idx.long(), torch.zeros_like(idx.long()))  # entries past the count: any value
    lead = torch.broadcast_shapes(blocks.shape[:2], k_sizes.shape[:2])
    k_sizes = k_sizes.expand(*lead, -1).reshape(*lead, 1, -1).expand(*lead, blocks.shape[2], -1)
    listed = torch.where(used, k_sizes.gather(-1, blocks.expand(*lead, -1, -1)), 0.0).sum(-1)  # keys per list
    pairs = (q_sizes * listed).sum(-1)
    return (pairs / (q_offsets[..., -1].double() * k_offsets[..., -1].double())).mean().item()


def check_small(device, dtype, backend, seed=0):
    """Relative error of one small variable-size case against the float64 reference (see the
    module doc), and whether every output is finite."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 3, n, 72, generator=gen).to(dtype) for n in (300, 260, 260))
    q_off = random_offsets(gen, 3, 300, 17).expand(2, 3, -1).clone()
    q_off[1, :, 1:4] = torch.minimum(torch.tensor([0, 1, 1]), q_off[1, :, 4:5])  # empty / one-token blocks
    k_off = random_offsets(gen, 3, 260, 11)
    idx, cnt = density_lists(gen, k_off, 17, 0.3)
    kv_valid = torch.rand(2, 260, generator=gen) > 0.2
    args = [t.to(device) for t in (q, k, v, q_off, k_off, idx, cnt)]
    out, lse = block_sparse_attention_varlen(*args, kv_valid=kv_valid.to(device), backend=backend)
    ref, _ = varlen_reference(q, k, v, q_off, k_off, idx, cnt, kv_valid=kv_valid)
    return rel_error(out.cpu(), ref), bool(torch.isfinite(out).all()) and not bool(torch.isnan(lse).any())


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m fastdit.eval.bench.varlen", description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=None, help="tokens (default 12288 on the CPU, 32768 on CUDA)")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=None, help="B*H (default 8 on the CPU, 24 on CUDA)")
    p.add_argument("--blocks", default="64,128", help="fixed block sizes, comma-separated")
    p.add_argument("--density", type=float, default=0.25)
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default float32 (CPU), bfloat16 (CUDA)")
    p.add_argument("--backend", choices=("auto", "triton", "torch"), default="auto")
    p.add_argument("--runs", type=int, default=None, help="timed calls (default 3 on the CPU, 20 on CUDA)")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls first (default 1 CPU, 3 CUDA)")
    p.add_argument("--device", default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="N=1024, H=2, blocks 64, one timed call: seconds")
    p.add_argument("--check", action="store_true", help="first check a small case against the float64 reference")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if not 0 < args.density <= 1:
        p.error(f"--density must be in (0, 1], got {args.density}")
    return args


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    device = pick_device(args.device, args.threads)
    cuda = device.type == "cuda"
    n = args.n or (1024 if args.quick else 32768 if cuda else 12288)
    heads = args.heads or (2 if args.quick else 24 if cuda else 8)
    blocks = [64] if args.quick and args.blocks == "64,128" else [int(b) for b in args.blocks.split(",")]
    runs = args.runs or (1 if args.quick else 20 if cuda else 3)
    warmup = args.warmup if args.warmup is not None else (3 if cuda else 1)
    dtype = DTYPES[args.dtype or ("bfloat16" if cuda else "float32")]
    meta = machine(device)
    meta.update(n=n, dim=args.dim, heads=heads, dtype=str(dtype).replace("torch.", ""), density=args.density,
                backend=args.backend, runs=runs, warmup=warmup, blocks=blocks)
    report = BenchReport(args.out or default_out_path("varlen", meta), meta)
    gen = torch.Generator().manual_seed(args.seed)
    q, k, v = (torch.randn(1, heads, n, args.dim, generator=gen).to(device, dtype) for _ in range(3))
    report.log(f"variable vs fixed blocks: N={n} D={args.dim} B*H={heads} {meta['dtype']} density~{args.density} "
               f"backend={args.backend} on {meta['gpu'] or meta['cpu']} ({meta['cpu_threads']} threads)")
    if args.check:
        err, finite = check_small(device, dtype, args.backend, args.seed)
        ok = finite and err < (1e-4 if dtype == torch.float32 else 2e-2)
        report.sections["check"] = {"rel_error": err, "finite": finite, "passed": ok}
        report.log(f"check against the float64 reference: relative error {err:.2e}, finite {finite}: "
                   f"{'ok' if ok else 'FAILED'}")
        if not ok:
            report.write()
            return 1
    report.log(f"{'form':<14} {'block':>5} {'density':>8} {'ms':>10} {'ratio':>6} {'peak MiB':>9} {'err vs fixed':>12}")
    for b in blocks:
        n_blocks = -(-n // b)
        idx, cnt = fixed_lists(gen, heads, n_blocks, max(1, round(args.density * n_blocks)))
        grid = (torch.arange(n_blocks + 1) * b).clamp(max=n).view(1, 1, -1)
        r_off = random_offsets(gen, heads, n, n_blocks)
        r_idx, r_cnt = density_lists(gen, r_off, n_blocks, args.density)
        f_grid, f_idx, f_cnt = grid.to(device), idx.to(device), cnt.to(device)
        d_off, d_idx, d_cnt = r_off.to(device), r_idx.to(device), r_cnt.to(device)
        forms = {  # name: (plan on the host for its density, the call)
            "fixed": ((grid, grid, idx, cnt), lambda: block_sparse_attention(
                q, k, v, f_idx, f_cnt, b, b, backend=args.backend, validate=False)),
            "varlen_same": ((grid, grid, idx, cnt), lambda: block_sparse_attention_varlen(
                q, k, v, f_grid, f_grid, f_idx, f_cnt, backend=args.backend, validate=False)),
            "varlen_random": ((r_off, r_off, r_idx, r_cnt), lambda: block_sparse_attention_varlen(
                q, k, v, d_off, d_off, d_idx, d_cnt, backend=args.backend, validate=False)),
        }
        fixed_ms, fixed_out = None, None
        times = {form: [] for form in forms}
        with torch.no_grad():
            for _ in range(warmup):
                for _, fn in forms.values():
                    fn()
            for _ in range(runs):  # round robin: a change of machine load hits every form alike
                for form, (_, fn) in forms.items():
                    times[form].append(time_once(fn, cuda))
        fixed_ms, fixed_out = None, None
        for form, (plan, fn) in forms.items():
            with torch.no_grad():
                out = fn()[0]
                peak = peak_memory_mb(fn, cuda)
            ms = statistics.median(times[form])
            err = None
            if form == "fixed":
                fixed_ms, fixed_out = ms, out
            elif form == "varlen_same":
                err = rel_error(out.float(), fixed_out.float())
            # ratio within each round (the forms ran back to back), then the median: steadier than
            # a ratio of medians when the machine's load drifts
            ratio = statistics.median(t / t0 for t, t0 in zip(times[form], times["fixed"]))
            row = report.add({"form": form, "block": b, "density": pair_density(*plan), "ms": ms,
                              "ms_runs": times[form], "ratio_vs_fixed": ratio, "ratio_of_medians": ms / fixed_ms,
                              "peak_mib": peak, "rel_err_vs_fixed": err})
            report.log(f"{form:<14} {b:>5} {row['density']:>8.3f} {ms:>10.2f} {row['ratio_vs_fixed']:>6.2f} "
                       f"{fmt(peak, '>9.1f')} {fmt(err, '>12.1e')}")
            report.write()  # after every row: a run cut short keeps what it measured
    report.log(f"wrote {report.out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
