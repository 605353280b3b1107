"""Accuracy of quantised attention (``quant=``): per block-sparse method and mode, on structured inputs.

    python scripts/bench_quant.py                          # CPU, ~1 min: grid 4x12x16, D=64, bf16
    python scripts/bench_quant.py --grid 8 16 24 --json quant.json

Inputs: ``fastdit.eval.bench.structured.structured_qkv``, one input set per head kind (spatial,
temporal, global, semantic), one head each, cast to bfloat16 (the models' dtype). Reference:
dense attention in float64 on the same bfloat16 values. Per method (options: the defaults, every
call sparse) and quant mode, the relative L2 error of the output against the reference, split in

* ``sparsity``: the method without quantisation against the reference;
* ``quant``: the quantised method against the unquantised one (what quantisation adds), and
* ``total``: the quantised method against the reference,

beside the figures SageAttention reports for quantisation alone (cosine similarity and relative
L1 ``sum |o' - o| / sum |o|`` of the quantised against the unquantised output). Row ``dense``: a
dense plan of 64 x 64 blocks, i.e. quantisation alone. ``int8-fp8`` needs FP8 tensor cores, so off
an sm_89+ GPU it is measured on the dense row only, through the PyTorch emulation
(``fastdit.kernels.quant.quant_attention_emulated``, the same formulas). Errors are deterministic
(seeded inputs).

``--speed`` (a GPU; ``scripts/gpu_check.sh``'s opt-in ``quant`` part): bf16, D=64, 24 heads; the
engine at N=32768 on a random plan of 128 x 128 blocks (each query block keeps its diagonal block
and others at random, density ``--density``) and sta through ``fastdit.attention`` at Wan 480p's
21x30x52 grid, each with ``quant`` None / int8 / int8-fp8 (sm_89+), beside dense SDPA (flash) on
the same q, k, v: one warm-up, then the median of ``--runs`` CUDA-event timed calls, and
``torch.cuda.max_memory_allocated`` per row. With the ``sageattention`` package importable, its
``sageattn`` on the dense inputs is timed too and its error against float64 dense attention (on
head 0's first 2048 rows) printed beside ours.
"""
from __future__ import annotations

import argparse
import json
import math

import torch

import fastdit
from fastdit.eval.bench.structured import structured_qkv
from fastdit.kernels import block_sparse_attention
from fastdit.kernels.quant import allowed_blocks, fixed_blocks, fp8_supported, quant_attention_emulated
from fastdit.methods.base import methods_taking

KINDS = ("spatial", "temporal", "global", "semantic")


def dense_reference(q, k, v, scale):
    s = torch.matmul(q.double(), k.double().transpose(-1, -2)) * scale
    return torch.matmul(torch.softmax(s, -1), v.double())


def dense_quant(q, k, v, scale, mode, block=64):
    """Dense attention on a full plan of ``block`` x ``block`` blocks, quantised."""
    n = q.shape[2]
    blocks = -(-n // block)
    idx = torch.arange(blocks, dtype=torch.int32).expand(1, 1, blocks, blocks).contiguous()
    cnt = torch.full((1, 1, blocks), blocks, dtype=torch.int32)
    if mode is None or mode == "int8" or fp8_supported(q.device):
        return block_sparse_attention(q, k, v, idx, cnt, block, block, scale=scale, quant=mode, return_lse=False)
    ids = fixed_blocks(n, block, q.device)
    out, _ = quant_attention_emulated(q, k, v, ids, ids, allowed_blocks(idx, cnt, 1, q.shape[1], blocks), scale,
                                      None, mode)
    return out


def rel_l2(a, b, ref):
    return ((a.double() - b.double()).norm() / ref.double().norm()).item()


def sage_metrics(quantised, plain):
    """SageAttention's accuracy metrics of ``quantised`` against ``plain``: cosine similarity, relative L1."""
    a, b = quantised.double().flatten(), plain.double().flatten()
    return (torch.dot(a, b) / (a.norm() * b.norm())).item(), ((a - b).abs().sum() / b.abs().sum()).item()


def run(args):
    rows = []
    modes = ("int8", "int8-fp8")
    for kind in args.kinds:
        inputs = structured_qkv(grid=tuple(args.grid), heads=1, head_dim=args.head_dim, kinds=[kind], seed=args.seed)
        q, k, v = (t.to(args.device, torch.bfloat16) for t in (inputs.q, inputs.k, inputs.v))
        scale = 1.0 / math.sqrt(args.head_dim)
        ref = dense_reference(q, k, v, scale)
        plain_dense = dense_quant(q, k, v, scale, None)
        for mode in modes:
            out = dense_quant(q, k, v, scale, mode)
            cos, l1 = sage_metrics(out, plain_dense)
            rows.append(dict(kind=kind, method="dense", mode=mode, density=1.0, sparsity=rel_l2(plain_dense, ref, ref),
                             quant=rel_l2(out, plain_dense, ref), total=rel_l2(out, ref, ref), cos=cos, rel_l1=l1))
        for method in args.methods:
            plain, info = fastdit.attention(q, k, v, method=method, layout=inputs.layout, return_info=True)
            for mode in modes:
                if mode == "int8-fp8" and not fp8_supported(q.device):
                    continue
                out = fastdit.attention(q, k, v, method=method, layout=inputs.layout, quant=mode)
                cos, l1 = sage_metrics(out, plain)
                rows.append(dict(kind=kind, method=method, mode=mode, density=info["density"],
                                 sparsity=rel_l2(plain, ref, ref), quant=rel_l2(out, plain, ref),
                                 total=rel_l2(out, ref, ref), cos=cos, rel_l1=l1))
    return rows


def table(rows):
    lines = ["| kind | method | quant | density | rel. L2 sparsity | rel. L2 quant | rel. L2 total | cos sim "
             "| rel. L1 |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['kind']} | {r['method']} | {r['mode']} | {r['density']:.3f} | {r['sparsity']:.4f} | "
                     f"{r['quant']:.4f} | {r['total']:.4f} | {r['cos']:.6f} | {r['rel_l1']:.4f} |")
    return "\n".join(lines)


def _timed(fn, runs):
    fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2], torch.cuda.max_memory_allocated() / 2**30


def speed(args):
    """Times of each quant mode against quant=None and dense SDPA (see the module docstring)."""
    import torch.nn.functional as F

    dev = torch.device("cuda")
    gen = torch.Generator(device="cpu").manual_seed(args.seed)
    modes = [None, "int8"] + (["int8-fp8"] if fp8_supported(dev) else [])
    rows = []
    n, heads, dim, block = 32768, 24, 64, 128
    q, k, v = (torch.randn(1, heads, n, dim, generator=gen).to(dev, torch.bfloat16) for _ in range(3))
    blocks = n // block
    keep = max(1, round(args.density * blocks))
    idx = torch.stack([torch.cat([torch.tensor([m]), torch.tensor([j for j in torch.randperm(blocks, generator=gen)
                                                                   .tolist() if j != m][:keep - 1])])
                       for m in range(blocks)]).int().view(1, 1, blocks, keep).to(dev)
    cnt = torch.full((1, 1, blocks), keep, dtype=torch.int32, device=dev)
    ms, gib = _timed(lambda: F.scaled_dot_product_attention(q, k, v), args.runs)
    rows.append(dict(case=f"engine N={n}", mode="dense SDPA", ms=ms, peak_gib=gib))
    for mode in modes:
        ms, gib = _timed(lambda: block_sparse_attention(q, k, v, idx, cnt, block, block, quant=mode,
                                                        validate=False), args.runs)
        rows.append(dict(case=f"engine N={n} density {keep / blocks:.3f}", mode=str(mode), ms=ms, peak_gib=gib))
    try:
        from sageattention import sageattn
    except Exception as error:  # not installed on the device image
        print(f"sageattention not importable ({type(error).__name__}): its rows are skipped")
    else:
        ms, gib = _timed(lambda: sageattn(q, k, v, tensor_layout="HND"), args.runs)
        rows.append(dict(case=f"engine N={n}", mode="sageattn (dense)", ms=ms, peak_gib=gib))
        rows_ref = slice(0, 2048)
        ref = dense_reference(q[:, :1, rows_ref], k[:, :1], v[:, :1], 1 / math.sqrt(dim))  # head 0
        full = torch.arange(blocks, dtype=torch.int32, device=dev).expand(1, 1, blocks, blocks).contiguous()
        full_cnt = torch.full((1, 1, blocks), blocks, dtype=torch.int32, device=dev)
        ours = block_sparse_attention(q, k, v, full, full_cnt, block, block, quant="int8", return_lse=False)
        theirs = sageattn(q, k, v, tensor_layout="HND")
        print(f"dense int8 against float64 (head 0, rows 0-2047): fastdit rel. L2 "
              f"{rel_l2(ours[:, :1, rows_ref], ref, ref):.4f}, "
              f"sageattn {rel_l2(theirs[:, :1, rows_ref], ref, ref):.4f}")
    layout = fastdit.TokenLayout(grid=(21, 30, 52))
    q, k, v = (torch.randn(1, 12, layout.seq_len, dim, generator=gen).to(dev, torch.bfloat16) for _ in range(3))
    ms, gib = _timed(lambda: F.scaled_dot_product_attention(q, k, v), args.runs)
    rows.append(dict(case="Wan 480p 21x30x52", mode="dense SDPA", ms=ms, peak_gib=gib))
    for mode in modes:
        ms, gib = _timed(lambda: fastdit.attention(q, k, v, method="sta", layout=layout, quant=mode), args.runs)
        rows.append(dict(case="Wan 480p 21x30x52 sta", mode=str(mode), ms=ms, peak_gib=gib))
    print("| case | mode | ms (median) | peak GiB |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['mode']} | {r['ms']:.2f} | {r['peak_gib']:.2f} |")
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--grid", type=int, nargs=3, default=(4, 12, 16), help="video token grid (T, H, W)")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--kinds", default=",".join(KINDS), type=lambda s: s.split(","))
    parser.add_argument("--methods", default=",".join(methods_taking("quant")), type=lambda s: s.split(","))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--speed", action="store_true", help="time the modes on a GPU instead")
    parser.add_argument("--density", type=float, default=0.15, help="--speed: plan density")
    parser.add_argument("--runs", type=int, default=5, help="--speed: timed runs per row")
    args = parser.parse_args(argv)
    if args.speed:
        if not torch.cuda.is_available():
            parser.error("--speed needs a CUDA GPU")
        rows = speed(args)
    else:
        rows = run(args)
        print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args={k: v for k, v in vars(args).items()}, rows=rows), f, indent=1)
    return rows


if __name__ == "__main__":
    main()
