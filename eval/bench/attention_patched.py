"""The attention benchmark's patched path (``--path patched``): what a patched layer runs.

The methods' own plans (``dense_steps=0``, ``dense_layers=0``: every call sparse) on the token
layouts of real models, text tokens and the text key mask included; per case and method the kernel
alone on pre-permuted inputs, ``fastdit.run_plan`` from model order and ``fastdit.attention``,
next to dense SDPA. The cases and columns are described in ``fastdit.eval.bench.attention``.
"""
from __future__ import annotations

import dataclasses
import statistics

import torch
import torch.nn.functional as F

from fastdit.jsonutil import to_json
from fastdit.kernels import available_backends, block_sparse_attention

from .common import first_line, fmt, peak_memory_mb, rel_error, time_once

#: Text of the HunyuanVideo case: 256 token slots (the pipeline's max_sequence_length) after the
#: video, of which the first 64 are a prompt and the rest padding (masked as keys).
HY_TEXT, HY_TEXT_VALID = 256, 64


def patched_cases(cuda, quick):
    """Model-layout cases of the patched-path benchmark: full sizes on CUDA, scaled down on the CPU."""
    if cuda:
        sizes = {"wan480": ((21, 30, 52), "Wan2.1 480p x 81 frames"),
                 "hunyuan720": ((30, 48, 80), "HunyuanVideo 720p-class, 768x1280 x 117 frames")}
        heads, dim, dtype = {"wan480": 12, "hunyuan720": 24}, 128, torch.bfloat16
    elif quick:
        sizes = {"wan480": ((5, 16, 32), "smoke size (CPU --quick), Wan layout"),
                 "hunyuan720": ((4, 24, 40), "smoke size (CPU --quick), HunyuanVideo layout")}
        heads, dim, dtype = {"wan480": 2, "hunyuan720": 2}, 64, torch.float32
    else:
        sizes = {"wan480": ((7, 30, 52), "CPU scale-down: Wan2.1 480p x 25 frames (full: 21x30x52)"),
                 "hunyuan720": ((6, 34, 60), "CPU scale-down: HunyuanVideo 544x960 x 21 frames (full: 30x48x80)")}
        heads, dim, dtype = {"wan480": 2, "hunyuan720": 2}, 64, torch.float32
    return [
        {"name": "wan480", "family": "wan", "grid": sizes["wan480"][0], "what": sizes["wan480"][1],
         "text_len": 0, "text_valid": 0, "H": heads["wan480"], "D": dim, "dtype": dtype},
        {"name": "hunyuan720", "family": "hunyuan_video", "grid": sizes["hunyuan720"][0],
         "what": sizes["hunyuan720"][1], "text_len": HY_TEXT, "text_valid": HY_TEXT_VALID,
         "H": heads["hunyuan720"], "D": dim, "dtype": dtype},
    ]


def method_config(method, family):
    """The method's config as ``fastdit.patch`` resolves it for ``family``, with every call sparse
    (``dense_steps=0``, ``dense_layers=0``)."""
    from fastdit.methods.base import get_method

    cls = get_method(method)
    return cls.resolve(cls.make_config(dense_steps=0, dense_layers=0), family)


HEADER = (
    f"{'case':<11} {'method':<7} {'impl':<12} {'N':>7} {'H':>3} {'density':>7} {'time_ms':>10} "
    f"{'speedup':>8} {'x kernel':>8} {'peak_MiB':>9}"
)


def format_row(r):
    return (
        f"{r['case']:<11} {r['method']:<7} {r['impl']:<12} {r['N']:>7} {r['H']:>3} {fmt(r['density'], '7.3f')} "
        f"{fmt(r['time_ms'], '10.2f')} {fmt(r['speedup'], '8.2f')} {fmt(r.get('vs_kernel'), '8.2f')} "
        f"{fmt(r['peak_mem_mb'], '9.1f')}"
    )


def _case_inputs(case, device):
    """``(layout, q, k, v, key_mask or None)`` of a case, in model token order."""
    from fastdit.layout import TokenLayout

    layout = TokenLayout(case["grid"], case["text_len"], "suffix" if case["text_len"] else "none")
    S = layout.seq_len
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(1, case["H"], S, case["D"], generator=gen, device=device, dtype=case["dtype"])
               for _ in range(3))
    key_mask = None
    if case["text_len"]:
        key_mask = torch.ones(1, S, dtype=torch.bool, device=device)
        key_mask[:, layout.text_start + case["text_valid"]: layout.text_start + layout.text_len] = False
    return layout, q, k, v, key_mask


def _dense_entries(base, q, k, v, key_mask):
    """Dense SDPA as the model calls it (key mask included) and, with a mask, the call without it."""
    attn_mask = None if key_mask is None else key_mask[:, None, None, :]
    dense = dict(base, method="dense", backend="sdpa", density=1.0, block_density=None, config=None, plan=None)
    entries = [dict(row=dict(dense, impl="sdpa"),
                    fn=lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask))]
    if key_mask is not None:
        entries.append(dict(row=dict(dense, impl="sdpa_nomask"), fn=lambda: F.scaled_dot_product_attention(q, k, v)))
    return entries


def _method_entries(method, case, base, layout, q, k, v, key_mask, backend, log):
    """The kernel alone, ``run_plan`` and ``fastdit.attention`` of one method (none when it fails or
    runs dense); the plan is built and cached before timing."""
    import fastdit
    from fastdit.plan import run_plan

    config = method_config(method, case["family"])
    try:
        out, info = fastdit.attention(q, k, v, method, config, layout=layout, key_mask=key_mask,
                                      backend=backend, return_info=True)  # builds and caches the plan
    except Exception as e:
        log(f"  ({method} failed on {case['name']}: {first_line(e)})")
        return []
    plan = info["plan"]
    if plan is None:
        log(f"  ({method} runs dense on {case['name']}: no plan)")
        return []
    # kernel order, built before timing (excluded from the kernel row)
    if plan.perm is not None:
        qp, kp, vp = (t.index_select(2, plan.gather_index) for t in (q, k, v))
    else:
        qp, kp, vp = q, k, v
    kv_valid = plan.kernel_kv_valid(key_mask)

    def kernel():
        return block_sparse_attention(qp, kp, vp, plan.kv_indices, plan.kv_counts, plan.block_m, plan.block_n,
                                      kv_valid=kv_valid, return_lse=True, backend=backend, validate=False)

    # the same computation, so the same numbers: checked once, untimed
    k_out = kernel()[0]
    launch = None
    if backend == "triton":  # the variant and tile that ran (block_sparse_triton.last_launch)
        from fastdit.kernels import block_sparse_triton

        launch = block_sparse_triton.last_launch()
    if plan.inverse is not None:
        k_out = k_out.index_select(2, plan.inverse)
    same = rel_error(k_out.float(), out.float())
    del k_out, out
    extra = {"method": method, "backend": backend, "config": to_json(dataclasses.asdict(config)),
             "plan": plan.name, "block_m": plan.block_m, "block_n": plan.block_n,
             "kernel_len": plan.kernel_len, "padding_fraction": plan.padding_fraction,
             "density": info["density"], "block_density": plan.density, "rel_err_kernel_vs_attention": same,
             "kernel_launch": launch}
    return [
        dict(row=dict(base, impl="kernel", **extra), fn=kernel),
        dict(row=dict(base, impl="run_plan", **extra),
             fn=lambda: run_plan(q, k, v, plan, key_mask=key_mask, backend=backend)),
        dict(row=dict(base, impl="attention", **extra),
             fn=lambda: fastdit.attention(q, k, v, method, config, layout=layout, key_mask=key_mask, backend=backend)),
    ]


def _measure(entries, reps, warmup, cuda, case_name, log):
    """Warm-up, interleaved timed rounds and one untimed peak-memory call per entry; an entry that
    raises (e.g. out of memory) is reported and marked ``failed``, the rest go on."""
    def failed(entry, stage, e):
        log(f"  ({entry['row']['method']}/{entry['row']['impl']} failed on {case_name} ({stage}): {first_line(e)})")
        entry["failed"] = True
        if cuda:
            torch.cuda.empty_cache()

    for entry in entries:
        entry["times"] = []
        try:
            for _ in range(warmup):
                entry["fn"]()
        except Exception as e:
            failed(entry, "warm-up", e)
    for _ in range(reps):
        for entry in entries:
            if not entry.get("failed"):
                try:
                    entry["times"].append(time_once(entry["fn"], cuda))
                except Exception as e:
                    failed(entry, "timed", e)
    for entry in entries:
        if not entry.get("failed"):
            try:
                entry["mem"] = peak_memory_mb(entry["fn"], cuda)
            except Exception as e:
                failed(entry, "memory", e)


def run_patched(device, methods, reps, warmup, quick, log, emit):
    """The patched-path benchmark; calls ``emit(row)`` per row (see the module docstring).

    Per case, every implementation (dense SDPA, and per method the kernel alone, ``run_plan`` and
    ``fastdit.attention``) gets ``warmup`` untimed calls, then ``reps`` rounds each time one call
    of every implementation in turn (interleaved, so that a change in the machine's load during
    the run hits all of them alike); the row's time is the median over the rounds."""
    cuda = device.type == "cuda"
    backend = "triton" if cuda and "triton" in available_backends(device) else "torch"
    for case in patched_cases(cuda, quick):
        if cuda:
            torch.cuda.empty_cache()
        layout, q, k, v, key_mask = _case_inputs(case, device)
        dtype = str(case["dtype"]).replace("torch.", "")
        log(f"# {case['name']}: {case['what']}: {layout.describe()}"
            + (f", {case['text_valid']} valid text keys" if case["text_len"] else "")
            + f"; B=1 H={case['H']} D={case['D']} {dtype}, sparse backend {backend}")
        base = {"path": "patched", "case": case["name"], "what": case["what"], "family": case["family"],
                "grid": list(case["grid"]), "text_len": case["text_len"], "text_valid": case["text_valid"],
                "N": layout.seq_len, "B": 1, "H": case["H"], "D": case["D"], "dtype": dtype, "reps": reps,
                "warmup": warmup, "timer": "cuda_events" if cuda else "perf_counter", "interleaved": True}
        entries = _dense_entries(base, q, k, v, key_mask)
        for method in methods:
            entries += _method_entries(method, case, base, layout, q, k, v, key_mask, backend, log)
        _measure(entries, reps, warmup, cuda, case["name"], log)
        medians = {(e["row"]["method"], e["row"]["impl"]): statistics.median(e["times"])
                   for e in entries if not e.get("failed") and e["times"]}
        t_dense = medians.get(("dense", "sdpa"))
        for entry in entries:
            row = entry["row"]
            t = medians.get((row["method"], row["impl"]))
            if t is None:
                continue
            t_kernel = medians.get((row["method"], "kernel"))
            emit(dict(row, time_ms=t, times_ms=entry["times"], speedup=None if t_dense is None else t_dense / t,
                      vs_kernel=None if (t_kernel is None or row["method"] == "dense") else t / t_kernel,
                      peak_mem_mb=entry.get("mem")))
        entries.clear()
        q = k = v = key_mask = None  # noqa: F841 - free this case's tensors before the next
