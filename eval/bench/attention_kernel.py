"""The attention benchmark's kernel mode (``--path kernel``): the engine alone on synthetic plans.

Plans: 128-token blocks (384 for HunyuanVideo) in tile order of a 3-D tile grid, each query tile
attending a window of neighbouring tiles, shifted inward at the borders like sliding-tile
attention, sized to hit a density. Per case, dense SDPA (every backend that runs; the fastest is
the baseline), fastdit's engine (``validate=False``: the plans are valid by construction) and on
CUDA compiled FlexAttention with a BlockMask of the same plan. The cases and columns are described
in ``fastdit.eval.bench.attention``.
"""
from __future__ import annotations

import itertools
import math
import time
from contextlib import nullcontext

import torch
import torch.nn.functional as F

from fastdit.kernels import available_backends, block_sparse_attention

from .common import first_line, fmt, rel_error, time_fn

# --------------------------------------------------------------------------------------------------
# Plans
# --------------------------------------------------------------------------------------------------


def sliding_tile_plan(tile_grid, window, device="cpu"):
    """Sliding-tile plan over a 3-D grid of tiles numbered in row-major order (one tile = one block).

    Query tile ``(t, y, x)`` attends the ``window`` tiles around it, the window shifted inward at
    the borders so that every tile sees the same number of key tiles (STA).
    Returns ``kv_indices`` int32 ``(1, 1, n, prod(window))`` and ``kv_counts`` int32 ``(1, 1, n)``.
    """
    grid = tuple(int(g) for g in tile_grid)
    window = tuple(min(int(w), g) for w, g in zip(window, grid))
    starts = []
    for g, w in zip(grid, window):
        c = torch.arange(g)
        starts.append((c - w // 2).clamp(0, g - w))
    st, sy, sx = torch.meshgrid(*starts, indexing="ij")  # window start of each query tile
    ot, oy, ox = torch.meshgrid(*(torch.arange(w) for w in window), indexing="ij")
    kt = st.reshape(-1, 1) + ot.reshape(1, -1)
    ky = sy.reshape(-1, 1) + oy.reshape(1, -1)
    kx = sx.reshape(-1, 1) + ox.reshape(1, -1)
    idx = (kt * grid[1] + ky) * grid[2] + kx
    n = idx.shape[0]
    cnt = torch.full((1, 1, n), idx.shape[1], dtype=torch.int32)
    return idx.to(torch.int32).view(1, 1, n, -1).to(device), cnt.to(device)


def choose_window(tile_grid, density):
    """Window (per dim <= grid) whose tile count / total tiles is closest to ``density``;
    ties go to the most cube-like window."""
    total = math.prod(tile_grid)
    best = None
    for w in itertools.product(*(range(1, g + 1) for g in tile_grid)):
        d = math.prod(w) / total
        score = (abs(d - density), max(w) / min(w))
        if best is None or score < best[0]:
            best = (score, w)
    return best[1]


def block_grid(n_blocks):
    """A 3-D tile grid holding exactly ``n_blocks`` tiles, as cube-like as possible."""
    best = None
    for a in range(1, n_blocks + 1):
        if n_blocks % a:
            continue
        for b in range(a, n_blocks // a + 1):
            if (n_blocks // a) % b:
                continue
            c = n_blocks // a // b
            if c < b:
                continue
            score = c / a
            if best is None or score < best[0]:
                best = (score, (a, b, c))
    return best[1]


def computed_pairs(kv_indices, kv_counts, n_q, n_k, block_m, block_n, batch, heads, kv_valid=None):
    """(query, key) pairs the plan computes, summed over batch and heads (partial blocks counted exactly)."""
    idx = kv_indices.long().cpu()
    cnt = kv_counts.long().cpu()
    n_qb, n_kb = idx.shape[2], -(-n_k // block_n)
    rows = torch.clamp(n_q - torch.arange(n_qb) * block_m, max=block_m)
    keys = torch.clamp(n_k - torch.arange(n_kb) * block_n, max=block_n)
    used = torch.arange(idx.shape[3]) < cnt.unsqueeze(-1)
    per_block = torch.where(used, keys[idx.clamp(0, n_kb - 1)], torch.zeros((), dtype=torch.long)).sum(-1)
    pairs = (per_block * rows).sum()
    rep = (batch // idx.shape[0]) * (heads // idx.shape[1])
    return int(pairs) * rep


# --------------------------------------------------------------------------------------------------
# Backends
# --------------------------------------------------------------------------------------------------


def sdpa_variants(cuda):
    """(name, context-manager factory) for the dense SDPA backends to time."""
    if not cuda:
        return [("sdpa", nullcontext)]
    variants = []
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        for name, be in (("sdpa_flash", "FLASH_ATTENTION"), ("sdpa_cudnn", "CUDNN_ATTENTION")):
            if hasattr(SDPBackend, be):
                variants.append((name, lambda be=be: sdpa_kernel(getattr(SDPBackend, be))))
    except Exception:  # pragma: no cover - old torch
        pass
    return variants or [("sdpa", nullcontext)]


_FLEX = {}


def flex_block_mask(kv_indices, kv_counts, n_q, n_k, block_m, block_n, token_mask=False):
    """A FlexAttention BlockMask of a ``(1, 1, ...)`` plan.

    Every listed block is a *full* block, so the compiled kernel visits exactly the plan's blocks
    and never calls ``mask_mod``; keys past ``Nk`` are cut by ``seq_lengths``. With
    ``token_mask=True`` ``mask_mod`` also states the plan at token level, which is what eager
    FlexAttention evaluates (checks on the CPU); the benchmark leaves it out so that every plan
    shares one ``mask_mod`` and the compiled kernel is not recompiled per plan."""
    import inspect

    from torch.nn.attention.flex_attention import BlockMask

    n_kb = -(-n_k // block_n)
    _, _, n_qb, width = kv_indices.shape
    dev = kv_indices.device
    # BlockMask wants the index width to be the number of key blocks (it densifies the rows)
    idx = torch.zeros(1, 1, n_qb, n_kb, dtype=torch.int32, device=dev)
    idx[..., : min(width, n_kb)] = kv_indices[..., : min(width, n_kb)].to(torch.int32)
    cnt = kv_counts.to(torch.int32)
    used = torch.arange(n_kb, device=dev) < cnt.long().unsqueeze(-1)
    block_ok = torch.zeros(n_qb, n_kb + 1, dtype=torch.bool, device=dev)
    block_ok.scatter_(-1, torch.where(used, idx.long(), n_kb)[0, 0], True)
    block_ok = block_ok[:, :n_kb].contiguous()

    def mask_mod(b, h, q_idx, kv_idx):
        return block_ok[q_idx // block_m, kv_idx // block_n]

    kwargs = {}
    params = inspect.signature(BlockMask.from_kv_blocks).parameters
    if "seq_lengths" in params:
        kwargs["seq_lengths"] = (n_q, n_k)
    return BlockMask.from_kv_blocks(
        torch.zeros_like(cnt), idx, cnt, idx, BLOCK_SIZE=(block_m, block_n),
        mask_mod=mask_mod if token_mask else None, **kwargs,
    )


def flex_fn(compiled=True):
    """FlexAttention, ``torch.compile``d once per process (``compiled=False``: eager)."""
    key = "compiled" if compiled else "eager"
    if key not in _FLEX:
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX[key] = torch.compile(flex_attention, dynamic=False) if compiled else flex_attention
    return _FLEX[key]

# --------------------------------------------------------------------------------------------------
# Cases
# --------------------------------------------------------------------------------------------------


def base_cases(quick):
    """B=1, H=2, D=64 float32 grid over N and density (128-token blocks)."""
    cases = []
    for n in (8192,) if quick else (8192, 32768):
        n_blocks = -(-n // 128)
        grid = block_grid(n_blocks)
        for density in (1.0, 0.5, 0.25, 0.1):
            window = grid if density >= 1.0 else choose_window(grid, density)
            cases.append({
                "name": f"base_n{n}_d{density:g}", "N": n, "H": 2, "D": 64, "dtype": torch.float32,
                "block": 128, "target_density": density, "tile_grid": grid, "window": window,
                "plan": lambda dev, grid=grid, window=window: sliding_tile_plan(grid, window, dev),
                "dense_ref": f"base_n{n}",
            })
    return cases


def big_cases():
    """CUDA cases: Wan2.1-1.3B 480p and HunyuanVideo 720p (D=128, bf16)."""
    cases = []
    # Wan 1.3B 480p: latent 21x30x52 = 32760 tokens -> 256 blocks of 128 (last one partial).
    wan_grid = block_grid(256)
    for density in (1.0, 0.5, 0.25, 0.1):
        window = wan_grid if density >= 1.0 else choose_window(wan_grid, density)
        cases.append({
            "name": f"wan480_d{density:g}", "N": 32760, "H": 12, "D": 128, "dtype": torch.bfloat16,
            "block": 128, "target_density": density, "tile_grid": wan_grid, "window": window,
            "plan": lambda dev, g=wan_grid, w=window: sliding_tile_plan(g, w, dev), "dense_ref": "wan480",
        })
    # HunyuanVideo 720p: latent 30x48x80 = 115200 tokens; STA tiles 6x8x8 = 384 tokens -> 5x6x10 tiles.
    hy_grid = (30 // 6, 48 // 8, 80 // 8)
    for name, window in (("hunyuan720_sta", (3, 3, 3)), ("hunyuan720_full", hy_grid)):
        cases.append({
            "name": name, "N": 115200, "H": 24, "D": 128, "dtype": torch.bfloat16, "block": 384,
            "target_density": math.prod(window) / math.prod(hy_grid), "tile_grid": hy_grid, "window": window,
            "plan": lambda dev, g=hy_grid, w=window: sliding_tile_plan(g, w, dev), "dense_ref": "hunyuan720",
        })
    return cases + block_size_ab_cases()


def block_size_ab_cases():
    """Why sta's Wan 480p plan ran at half the engine's rate per computed entry on the first H200 run
    (BENCHMARKS.md, "GPU"): it has 378-token blocks (7x6x9 tiles: key sub-tiles of 64 never end on the
    block's end) and a key-validity vector (its padded tiles). One sliding-tile plan (3x5x6 tiles,
    window 3x3x3: density 0.3, H 12, D 128, bf16) on 384-token blocks, on 378-token blocks, and on
    378-token blocks with an all-true ``kv_valid``: the first two differ by the block size alone, the
    last two by the vector alone. FlexAttention is left out (its compiles would not fit the part's cap)."""
    grid, window = (3, 5, 6), (3, 3, 3)
    cases = []
    for block, kv_valid in ((384, False), (378, False), (378, True)):
        cases.append({
            "name": f"ab_sta_b{block}" + ("_kv" if kv_valid else ""), "N": math.prod(grid) * block, "H": 12,
            "D": 128, "dtype": torch.bfloat16, "block": block, "target_density": 0.3, "tile_grid": grid,
            "window": window, "plan": lambda dev, g=grid, w=window: sliding_tile_plan(g, w, dev),
            "dense_ref": f"ab_n{math.prod(grid) * block}", "kv_valid": kv_valid, "flex": False,
        })
    return cases



# --------------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------------

HEADER = (
    f"{'case':<20} {'N':>6} {'H':>3} {'D':>4} {'dtype':<9} {'density':>7} {'backend':<15} "
    f"{'time_ms':>10} {'TFLOP/s':>8} {'speedup':>8} {'eff':>6}"
)


def format_row(r):
    return (
        f"{r['case']:<20} {r['N']:>6} {r['H']:>3} {r['D']:>4} {r['dtype']:<9} {r['density']:>7.3f} "
        f"{r['backend']:<15} {fmt(r['time_ms'], '10.2f')} {fmt(r['tflops'], '8.2f')} {fmt(r['speedup'], '8.2f')} "
        f"{fmt(r['efficiency'], '6.2f')}"
    )


def dense_baselines(q, k, v, key, base, reps, warmup, cuda, report):
    """Times every dense SDPA backend on ``q, k, v``; adds their rows (speedup against the fastest)
    and returns the fastest time (None when none ran)."""
    B, H, N, D = q.shape
    variants = sdpa_variants(cuda)
    if cuda and q.dtype == torch.float32:  # flash / cuDNN are half-precision only: let torch pick
        variants = [("sdpa", nullcontext)]
    rows = []
    for name, ctx in variants:
        try:
            with ctx():
                t = time_fn(lambda: F.scaled_dot_product_attention(q, k, v), reps, warmup, cuda)
        except Exception as e:
            report.log(f"  ({name} unavailable for {key}: {first_line(e, 100)})")
            continue
        tflops = 4 * B * H * D * N * N / (t * 1e-3) / 1e12
        rows.append(report.add(dict(base, case=key + "_dense", density=1.0, backend=name, time_ms=t, tflops=tflops,
                                    speedup=None, efficiency=None, pairs=B * H * N * N)))
    best = min((r["time_ms"] for r in rows), default=None)
    for r in rows:
        r["speedup"] = r["efficiency"] = best / r["time_ms"]
        report.log(format_row(r))
    return best


def run_kernel(device, quick, reps, warmup, report, fixed_reps=None, fixed_warmup=None, flex=True):
    """The kernel-mode benchmark: rows into ``report`` (written after every case).

    ``fixed_reps`` / ``fixed_warmup``: what the command line asked for; without them, CPU cases over
    2 x 8192^2 pairs per head (seconds per dense call) run 2 timed calls after none."""
    cuda = device.type == "cuda"
    sparse_backend = "triton" if cuda and "triton" in available_backends(device) else "torch"
    cases = base_cases(quick) + (big_cases() if cuda else [])
    report.log("")
    report.log(HEADER)
    report.log("-" * len(HEADER))
    dense_times = {}
    tensors = {}
    for case in cases:
        B, H, N, D, dtype, blk = 1, case["H"], case["N"], case["D"], case["dtype"], case["block"]
        key = case["dense_ref"]
        if key not in tensors:
            tensors.clear()  # free the previous shape first
            if cuda:
                torch.cuda.empty_cache()
            gen = torch.Generator(device=device).manual_seed(0)
            tensors[key] = tuple(torch.randn(B, H, N, D, generator=gen, device=device, dtype=dtype) for _ in range(3))
        q, k, v = tensors[key]
        slow_cpu = not cuda and H * N * N > 2 * 8192 * 8192
        c_reps = fixed_reps or (2 if slow_cpu else reps)
        c_warmup = fixed_warmup if fixed_warmup is not None else (0 if slow_cpu else warmup)
        base = {"path": "kernel", "case": case["name"], "N": N, "H": H, "D": D,
                "dtype": str(dtype).replace("torch.", ""), "block": blk,
                "tile_grid": list(case["tile_grid"]), "window": list(case["window"])}
        if key not in dense_times:  # dense baselines, once per shape
            dense_times[key] = dense_baselines(q, k, v, key, base, c_reps, c_warmup, cuda, report)
        t_dense = dense_times[key]

        idx, cnt = case["plan"](device)
        pairs = computed_pairs(idx, cnt, N, N, blk, blk, B, H)
        density = pairs / (B * H * N * N)
        # an all-true key-validity vector: the kernel's masked path with nothing masked (block_size_ab_cases)
        kv_valid = torch.ones(1, N, dtype=torch.bool, device=device) if case.get("kv_valid") else None
        # the benchmark's plans are valid by construction: the engine's per-call plan validation
        # (two host syncs on a GPU) is left out, as fastdit's own callers may
        runners = [(f"fastdit_{sparse_backend}" + ("+kv_valid" if kv_valid is not None else ""),
                    lambda: block_sparse_attention(q, k, v, idx, cnt, blk, blk, kv_valid=kv_valid, return_lse=False,
                                                   backend=sparse_backend, validate=False))]
        if cuda and flex and case.get("flex", True) and case["dtype"] != torch.float32:
            try:
                bmask = flex_block_mask(idx, cnt, N, N, blk, blk)  # shared mask_mod: one compile per shape
                flex_attention = flex_fn(compiled=True)
                runners.append(("flex", lambda: flex_attention(q, k, v, block_mask=bmask)))
            except Exception as e:
                report.log(f"  (flex unavailable: {first_line(e, 100)})")
        for name, fn in runners:
            t_start = time.time()
            try:
                t = time_fn(fn, c_reps, c_warmup, cuda)
            except Exception as e:
                report.log(f"  ({name} failed on {case['name']}: {first_line(e)})")
                continue
            tflops = 4 * D * pairs / (t * 1e-3) / 1e12
            speedup = t_dense / t if t_dense else None
            row = dict(base, density=density, backend=name, time_ms=t, tflops=tflops, speedup=speedup,
                       efficiency=None if speedup is None else speedup * density, pairs=pairs,
                       wall_s=time.time() - t_start)
            if name.startswith("fastdit_triton") and cuda:
                from fastdit.kernels import block_sparse_triton as bst

                row["kernel_launch"] = bst.last_launch()  # the variant and tile that ran (not the autotuner's memory)
            if name == "flex":  # same plan, so the same output as fastdit's
                try:
                    row["rel_err_vs_fastdit"] = rel_error(fn().float(), runners[0][1]().float())
                except Exception as e:
                    row["rel_err_vs_fastdit"] = f"{type(e).__name__}: {e}"
            report.add(row)
            report.log(format_row(row))
        report.write()
    report.log("")
    report.log("speedup = dense SDPA time (fastest dense backend) / time; eff = speedup * density (1.0 = ideal)")
