"""ModelOpt's skip-softmax and fastdit's, side by side on the trained tiny Wan (tiny-shapes), on the CPU.

    python scripts/modelopt_side_by_side.py                       # ~10 min on 2 shared cores
    python scripts/modelopt_side_by_side.py --targets 0.1 0.2 --json side_by_side.json

For each target sparsity ``s``:

1. **ModelOpt** (``nvidia-modelopt``, its own code): ``mtsa.sparsify`` puts ``flash_skip_softmax``
   (its PyTorch path, 128 x 128 blocks, every self-attention layer ``attn1``) on a fresh
   pipeline's transformer and calibrates ``scale_factor = a * exp(b * s)`` on one pipeline run
   (the calibration prompt); then one run of the evaluation prompt with its calibrated threshold
   ``lambda = scale_factor / N_k``. ModelOpt's Triton kernels import only with CUDA, so on the CPU
   its PyTorch path runs: it computes dense scores, masks the skipped blocks and takes the softmax
   (``fastdit.integrations.profiles.SoftmaxAttention`` routes diffusers' SDPA through
   ``F.softmax`` for it). Its sparsity: its own statistics (skipped / all 128 x 128 blocks).
2. **fastdit at ModelOpt's profile**: ``export_sparse_attention_config`` (ModelOpt's exporter) ->
   ``fastdit.integrations.profiles.apply_profile`` on another fresh pipeline: the ``skip_softmax``
   method at the same ``lambda`` (64 x 64 sub-tiles, the engine's PyTorch fallback).
3. **fastdit at equal sparsity**: the same method with its scale factor bisected (on the
   evaluation run) until its skipped share matches ModelOpt's measured sparsity.

Error: relative L2 of the final latents against the dense run (same prompt, seed, steps).
Sparsity: skipped (row tile, key tile) pairs / all, over every self-attention call of the run.
Predicted GPU time (``fastdit.costmodel``, no GPU here): Wan2.1-T2V-1.3B at 480p x 81 frames on
``--gpu`` at the measured skip share, one transformer forward: a skipped tile saves its exp and
P.V (half the tile's matmul FLOPs; Q.K^T is still computed), the kernel otherwise dense at
fastdit's kernel efficiency (both kernels are FlashAttention-2-style Triton kernels; ModelOpt's is
modelled at the same efficiency: an assumption, no GPU has run either here).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import platform
import time
import warnings

import torch


def _latents(pipe, call):
    generator = torch.Generator().manual_seed(call["seed"])
    kwargs = {k: v for k, v in call.items() if k != "seed"}
    with torch.no_grad():
        return pipe(generator=generator, output_type="latent", **kwargs).frames.float()


def _relative(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def _modelopt(load, call, calibration, target):
    import modelopt.torch.sparsity.attention_sparsity as mtsa
    from modelopt.torch.sparsity.attention_sparsity.conversion import export_sparse_attention_config

    from fastdit.integrations.profiles import SoftmaxAttention

    pipe = load()
    layer = {"method": "flash_skip_softmax", "br": 128, "bc": 128, "backend": "pytorch", "is_causal": False,
             "collect_stats": True, "enable": True}
    config = {"sparse_cfg": {"calibration": {"target_sparse_ratio": {"prefill": target, "decode": 0.0},
                                             "fit_logspace": True},
                             "*attn1*": layer, "default": {"enable": False}}}

    def forward_loop(_):
        with SoftmaxAttention():
            _latents(pipe, calibration)

    with contextlib.redirect_stdout(None):
        mtsa.sparsify(pipe.transformer, config, forward_loop=forward_loop)
    modules = [m for m in pipe.transformer.modules() if getattr(m, "_stats_manager", None) is not None and m.is_enabled]
    for module in modules:
        module._stats_manager.reset()
    start = time.perf_counter()
    with SoftmaxAttention():
        latents = _latents(pipe, call)
    seconds = time.perf_counter() - start
    sparse = sum(m._stats_manager.aggregated_stats.get("sparse_blocks", [0])[0] for m in modules)
    total = sum(m._stats_manager.aggregated_stats["total_blocks"] for m in modules)
    return latents, sparse / max(total, 1), export_sparse_attention_config(pipe.transformer), seconds


def _fastdit(load, call, profile, scale_factor=None):
    from fastdit.integrations.profiles import apply_profile, read_profile

    pipe = load()
    profile = read_profile(profile)
    if scale_factor is not None:
        profile.group.options["scale_factor"] = scale_factor
    patch = apply_profile(pipe, profile, backend="torch")
    start = time.perf_counter()
    latents = _latents(pipe, call)
    seconds = time.perf_counter() - start
    share = patch.stats.skip_share or 0.0  # skipped / walked sub-tiles over the run (PatchStats)
    patch.remove()
    return latents, share, profile.group.options["scale_factor"], seconds


def _equal_sparsity(load, call, profile, wanted, start_factor, rounds):
    """Bisect ``log(scale_factor)`` until fastdit's skipped share is ``wanted`` (rounds runs)."""
    low, high = math.log(start_factor) - 6.0, math.log(start_factor) + 2.0
    best = None
    for _ in range(rounds):
        middle = 0.5 * (low + high)
        latents, share, factor, seconds = _fastdit(load, call, profile, math.exp(middle))
        if best is None or abs(share - wanted) < abs(best[1] - wanted):
            best = (latents, share, factor, seconds)
        low, high = (middle, high) if share < wanted else (low, middle)
    return best


def predicted_ms(gpu_name, share):
    """One Wan2.1-1.3B 480p forward on ``gpu_name`` with ``share`` of the attention tiles skipped."""
    from fastdit import costmodel
    from fastdit.eval.predict import model_shape

    gpu, shape = costmodel.gpu_named(gpu_name), model_shape("wan")
    full = costmodel.density_call(gpu, 1.0, 1, shape.heads, shape.tokens, shape.head_dim, dynamic=False)
    call_ms = full.kernel_ms * (1.0 - 0.5 * share) + full.outside_ms
    dense = costmodel.dense_call(gpu, 1, shape.heads, shape.tokens, shape.tokens, shape.head_dim)
    return costmodel.model_forward(gpu, shape, call_ms).total_ms, costmodel.model_forward(gpu, shape,
                                                                                          dense.total_ms).total_ms


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", type=float, nargs="+", default=[0.1, 0.2])
    parser.add_argument("--frames", type=int, default=9)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5, help="bisection runs for the equal-sparsity row")
    parser.add_argument("--gpu", default="H100")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(min(2, torch.get_num_threads()))

    import modelopt

    import fastdit
    from fastdit.pipelines.loading import load_pipeline
    from fastdit.pipelines.shapes_data import DEMO_CAPTION

    def load():
        return load_pipeline("tiny-shapes")

    base = dict(num_frames=args.frames, height=args.size, width=args.size, num_inference_steps=args.steps,
                guidance_scale=4.0)
    call = dict(base, prompt=DEMO_CAPTION, seed=0)
    calibration = dict(base, prompt="a green triangle moving left and a yellow circle moving up", seed=1)
    dense = _latents(load(), call)
    rows = []
    for target in args.targets:
        mo, mo_share, profile, mo_s = _modelopt(load, call, calibration, target)
        fd, fd_share, factor, fd_s = _fastdit(load, call, profile)
        eq, eq_share, eq_factor, eq_s = _equal_sparsity(load, call, profile, mo_share, factor, args.rounds)
        for name, latents, share, scale, seconds in (
                ("modelopt flash_skip_softmax (128x128)", mo, mo_share, factor, mo_s),
                ("fastdit skip_softmax, ModelOpt's profile", fd, fd_share, factor, fd_s),
                ("fastdit skip_softmax, equal sparsity", eq, eq_share, eq_factor, eq_s)):
            sparse_ms, dense_ms = predicted_ms(args.gpu, share)
            rows.append({"target": target, "run": name, "scale_factor": scale, "sparsity": share,
                         "error": _relative(latents, dense), "cpu_seconds": seconds,
                         "predicted_forward_ms": sparse_ms, "predicted_dense_forward_ms": dense_ms,
                         "predicted_speedup": dense_ms / sparse_ms})
    print(f"tiny-shapes, {args.frames} frames {args.size}x{args.size}, {args.steps} steps, CFG 4; "
          f"nvidia-modelopt {modelopt.__version__}, fastdit {fastdit.__version__}, torch {torch.__version__}, "
          f"{platform.processor() or platform.machine()}")
    print(f"| target | run | scale factor | sparsity | rel. L2 error vs dense | predicted Wan 1.3B 480p forward "
          f"({args.gpu}) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['target']:.2f} | {r['run']} | {r['scale_factor']:.4g} | {r['sparsity']:.3f} | {r['error']:.4f} | "
              f"{r['predicted_forward_ms']:.0f} ms ({r['predicted_speedup']:.2f}x) |")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"args": vars(args), "modelopt": modelopt.__version__, "fastdit": fastdit.__version__,
                       "torch": torch.__version__, "rows": rows}, handle, indent=1)


if __name__ == "__main__":
    main()
