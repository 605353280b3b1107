"""The attention benchmark's correctness pass (``--check``, ``--check-only``).

Small shapes: the engine (Triton, or the torch fallback where Triton cannot run) against the
float64 reference under the plan's token mask, output and log-sum-exp, on random plans with an
empty query block, odd sizes and key-validity holes (``SMALL_CHECKS``; on CUDA each with a forced
Triton config). On CUDA with Triton also the benchmark's large shapes against the torch fallback on
a sample of query blocks. Every check is a row ``{"check", "backend", "pass", "detail"}``; a crash
is a failure, reported, not raised.
"""
from __future__ import annotations

import contextlib

import torch

from fastdit.kernels import block_sparse_attention, dense_reference, plan_to_token_mask
from fastdit.kernels.triton_tuning import env_var

from .common import rel_error
from .attention_kernel import big_cases

SMALL_CHECKS = [
    ("d64_f16_pow2", 1, 2, 300, 300, 64, 128, 128, torch.float16, False, "128,64,8,3"),
    ("d72_bf16_npow2_valid", 2, 2, 250, 190, 72, 48, 40, torch.bfloat16, True, "64,32,4,4"),
    ("d128_f32_valid", 1, 2, 200, 260, 128, 64, 64, torch.float32, True, "64,64,4,3"),
    ("d128_bf16_384", 1, 1, 800, 800, 128, 384, 384, torch.bfloat16, True, "128,128,8,2"),
    ("d256_f16", 1, 1, 130, 140, 256, 64, 64, torch.float16, False, None),
]


def _random_plan(gen, n_qb, n_kb, density, zero_row=True):
    width = max(1, round(density * n_kb))
    idx = torch.stack([torch.randperm(n_kb, generator=gen)[:width] for _ in range(n_qb)]).to(torch.int32)
    cnt = torch.randint(1, width + 1, (n_qb,), generator=gen).to(torch.int32)
    if zero_row and n_qb > 1:
        cnt[1] = 0
    return idx.view(1, 1, n_qb, width), cnt.view(1, 1, n_qb)


def run_checks(device, triton_ok, log):
    """The correctness pass: a list of check rows, each logged as PASS / FAIL."""
    results = []
    backend = "triton" if triton_ok else "torch"
    tol = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 2e-2}
    for name, B, H, N, Nk, D, bm, bn, dtype, use_valid, cfg in SMALL_CHECKS:
        gen = torch.Generator().manual_seed(len(name) * 1009 + N)
        q, k, v = (torch.randn(B, H, n, D, generator=gen).to(dtype) for n in (N, Nk, Nk))
        idx, cnt = _random_plan(gen, -(-N // bm), -(-Nk // bn), 0.6)
        kv_valid = (torch.rand(B, Nk, generator=gen) > 0.2) if use_valid else None
        mask = plan_to_token_mask(idx, cnt, N, Nk, bm, bn, kv_valid)
        ref, ref_lse = dense_reference(q, k, v, mask)
        dev = [t.to(device) if t is not None else None for t in (q, k, v, idx, cnt, kv_valid)]
        try:
            pinned = env_var("FASTDIT_TRITON_CONFIG", cfg) if device.type == "cuda" else contextlib.nullcontext()
            with pinned:
                out, lse = block_sparse_attention(*dev[:5], bm, bn, kv_valid=dev[5], backend=backend)
            out, lse = out.cpu(), lse.cpu()
            rel = rel_error(out, ref)
            inf_ok = torch.equal(torch.isneginf(lse), torch.isinf(ref_lse))
            fin = torch.isfinite(ref_lse)
            lse_err = (lse.double()[fin] - ref_lse[fin]).abs().max().item() if fin.any() else 0.0
            ok = bool(torch.isfinite(out).all()) and rel < tol[dtype] and inf_ok and lse_err < 1e-2
            msg = f"rel={rel:.2e} lse_err={lse_err:.1e} inf_pattern={'ok' if inf_ok else 'BAD'}"
        except Exception as e:  # a crash is a failure, reported, not raised
            ok, msg = False, f"{type(e).__name__}: {e}"
        results.append({"check": f"small/{name}", "backend": backend, "pass": ok, "detail": msg})
        log(f"  {'PASS' if ok else 'FAIL'}  small/{name:<24} {backend:<6} {msg}")

    if device.type == "cuda" and triton_ok:
        # the tuned configs of the benchmark's shapes (same autotune keys), then the kv_valid path
        # on Wan with the default config (no extra autotuning)
        for case in big_cases():
            if case["name"] in ("wan480_d0.1", "hunyuan720_sta"):
                results.append(_check_big(case, device, log))
            if case["name"] == "wan480_d0.1":
                wan = case
        with env_var("FASTDIT_TRITON_AUTOTUNE", "0"):
            results.append(_check_big(wan, device, log, with_kv_valid=True))
    else:
        log("  skip  large shapes vs torch fallback (CUDA only)")
    return results


def _check_big(case, device, log, with_kv_valid=False):
    gen = torch.Generator(device=device).manual_seed(1234)
    B, H, N, D, dtype = 1, case["H"], case["N"], 128, torch.bfloat16
    bm = bn = case["block"]
    q, k, v = (torch.randn(B, H, N, D, generator=gen, device=device, dtype=dtype) for _ in range(3))
    idx, cnt = case["plan"](device)
    kv_valid = torch.rand(B, N, generator=gen, device=device) > 0.02 if with_kv_valid else None
    name = f"large/{case['name']}" + ("+kv_valid" if kv_valid is not None else "")
    try:
        out, lse = block_sparse_attention(q, k, v, idx, cnt, bm, bn, kv_valid=kv_valid, backend="triton")
        n_qb = idx.shape[2]
        picks = sorted({0, 1, n_qb // 2, n_qb - 2, n_qb - 1, int(torch.randint(0, n_qb, (1,)))})
        worst, lse_err, inf_ok = 0.0, 0.0, True
        for m in picks:
            r0, r1 = m * bm, min((m + 1) * bm, N)
            o_ref, l_ref = block_sparse_attention(
                q[:, :, r0:r1], k, v, idx[:, :, m : m + 1], cnt[:, :, m : m + 1], bm, bn,
                kv_valid=kv_valid, backend="torch",
            )
            worst = max(worst, rel_error(out[:, :, r0:r1].float(), o_ref.float()))
            fin = torch.isfinite(l_ref)
            inf_ok &= torch.equal(torch.isneginf(lse[:, :, r0:r1]), ~fin)
            if fin.any():
                lse_err = max(lse_err, (lse[:, :, r0:r1][fin] - l_ref[fin]).abs().max().item())
        ok = bool(torch.isfinite(out).all()) and worst < 2e-2 and lse_err < 1e-2 and inf_ok
        msg = f"blocks={picks} worst_rel={worst:.2e} lse_err={lse_err:.1e}"
    except Exception as e:
        ok, msg = False, f"{type(e).__name__}: {e}"
    log(f"  {'PASS' if ok else 'FAIL'}  {name:<30} triton {msg}")
    return {"check": name, "backend": "triton", "pass": ok, "detail": msg}

