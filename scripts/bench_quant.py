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
(seeded inputs); no timing here (``scripts/gpu_check.sh`` times the modes on a GPU).
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

METHODS = ("sta", "radial", "sparge", "svg", "svg2")
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
    lines = ["| kind | method | quant | density | rel. L2 sparsity | rel. L2 quant | rel. L2 total | cos sim | rel. L1 |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['kind']} | {r['method']} | {r['mode']} | {r['density']:.3f} | {r['sparsity']:.4f} | "
                     f"{r['quant']:.4f} | {r['total']:.4f} | {r['cos']:.6f} | {r['rel_l1']:.4f} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--grid", type=int, nargs=3, default=(4, 12, 16), help="video token grid (T, H, W)")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--kinds", default=",".join(KINDS), type=lambda s: s.split(","))
    parser.add_argument("--methods", default=",".join(METHODS), type=lambda s: s.split(","))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    rows = run(args)
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args={k: v for k, v in vars(args).items()}, rows=rows), f, indent=1)
    return rows


if __name__ == "__main__":
    main()
