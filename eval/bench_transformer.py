"""Benchmark: one transformer forward, dense against fastdit's methods, eager and ``torch.compile``d.

Run ``python -m fastdit.eval.bench_transformer`` (CUDA: full size) or ``--scale tiny`` (CPU, about
a minute). Prints a table and writes JSON (``--out``, default
``bench_results/transformer_<device>_<timestamp>.json``).

Models, built from their published configs with random weights (nothing is downloaded):

* ``wan``: Wan2.1-T2V-1.3B (``WanTransformer3DModel``: 30 layers, 12 heads of 128, ffn 8960,
  text_dim 4096, freq_dim 256, patch (1, 2, 2), 16 channels in and out, qk_norm
  rms_norm_across_heads, cross_attn_norm, eps 1e-6, rope_max_seq_len 1024; 1.42B parameters) at
  480p x 81 frames: latents (1, 16, 21, 60, 104) -> 21x30x52 = 32760 tokens; 512 text tokens
  (cross-attention, not patched);
* ``hunyuan``: HunyuanVideo 13B (``HunyuanVideoTransformer3DModel`` with its published config,
  diffusers' defaults: 20 double- and 40 single-stream blocks, 24 heads of 128, mlp_ratio 4, 2
  refiner layers, text_embed_dim 4096, pooled 768, patch 2 / 1, rope axes 16/56/56; 12.8B
  parameters) at 720p x 129 frames: latents (1, 16, 33, 90, 160) -> 33x45x80 = 118800 video
  tokens + 256 text tokens (64 valid, the rest padding under the model's key mask) in every
  joint attention. ``--hy-frames`` picks another length (``(frames - 1) / 4 + 1`` latent frames).

The big models are built directly on the GPU (float32 init there, then cast to bfloat16: no host
RAM is used for weights); the parameter count comes from a build on the meta device first.
``--scale tiny`` shrinks layers, heads and the grid (Wan: 2 layers, 2 heads of 64, latents
4x32x48 -> 4x16x24 = 1536 tokens; HunyuanVideo: 1 + 1 blocks, 2 heads of 64, 4x32x48 -> 4x16x24 =
1536 tokens + 32 text, 12 valid) and runs in float32 on the CPU; there ``sta`` uses the tiny
preset tile 4x4x8 (as ``fastdit compare`` does on the tiny models), elsewhere the method's
defaults, and ``torch.compile`` uses the ``aot_eager`` backend on the CPU by default (dynamo and
AOT tracing as with inductor, no code generation: inductor's C++ compile of each method would take
minutes on a 2-core CPU; ``--compile-backend inductor`` to use it).

Per model, for ``mode`` in eager, compiled and ``method`` in dense, sta, radial: the bare
transformer, patched with ``fastdit.patch(transformer, method, dense_steps=0)`` (the family's
other defaults: Wan radial keeps its first layer dense), or unpatched for dense; compiled =
``torch.compile(transformer)`` of the whole model (``--compile regional``: diffusers'
``compile_repeated_blocks``), compiled afresh per method (``torch._dynamo.reset()`` between).

What is timed: one ``transformer(**inputs)`` call under ``torch.no_grad()`` (the whole forward:
embeddings, every block, the fastdit pre-hook and per-call plan lookups, the output projection),
median of ``--reps`` runs, CUDA events on the GPU (``time.perf_counter`` on the CPU). Before them,
untimed: for eager (at full size) a forward of the model cut to its first block of each kind
(warms cuBLAS, Triton autotuning and fastdit's plan cache on the same shapes) then ``--warmup``
full forwards; for compiled ``--warmup`` (at least 1) full forwards, the first of which compiles
(its wall time is ``compile_s``). Excluded: model build, input creation, warm-up, compilation.
Defaults: 3 timed after 1 warm-up; HunyuanVideo at full size 1 timed after the first-block
forward alone (a dense forward there is tens of seconds).

Columns: time_ms, speedup = dense time / method time in the same mode (the JSON's
``speedup_vs_eager`` = the eager time of the same method / the compiled time), density = query-key
score computations performed / dense attention's over all patched layers of the timed calls (dense
layers count 1.0), peak = peak allocated GPU memory during the timed calls (weights included; CPU:
the resident set's peak during the timed calls above its level before them, sampled every 5 ms by
a thread), graph breaks = ``torch._dynamo.explain`` of the patched (or unpatched) model; at full
size of a copy with only its first blocks (Wan 2 layers, HunyuanVideo 1 + 1) at a small grid, from
the same config (every block runs the same code: a break inside a block would show there once per
block, one outside the blocks once). The JSON also has dynamo's counters of the real compilation
(``dynamo``: unique graphs, graph breaks).

``--compile regional`` compiles each repeated block (``compile_repeated_blocks``) instead. The
unpatched model then needs one graph per block class, but a patched one one graph per patched
layer: each layer's attention reaches fastdit through its own backend member and layer index,
constants that dynamo guards on (measured at tiny scale: Wan's 2 layers give 1 graph unpatched, 2
patched). The benchmark raises dynamo's recompile limit to the block count so that no layer falls
back to eager silently; expect long compiles.

``--budget-s`` caps the run: each measurement is skipped (a row with the reason) when its
estimated time exceeds what is left; rows are written as they come, so a kill keeps them.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as _dt
import gc
import json
import math
import os
import statistics
import sys
import time

import torch

from fastdit.jsonutil import to_json

_OOM = getattr(torch, "OutOfMemoryError", getattr(torch.cuda, "OutOfMemoryError", MemoryError))

# --------------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------------

WAN_1_3B = dict(  # Wan-AI/Wan2.1-T2V-1.3B-Diffusers, transformer/config.json
    patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
    text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True,
    qk_norm="rms_norm_across_heads", eps=1e-6, image_dim=None, added_kv_proj_dim=None, rope_max_seq_len=1024,
)
HUNYUAN_13B = dict(  # hunyuanvideo-community/HunyuanVideo, transformer/config.json (= diffusers' defaults)
    in_channels=16, out_channels=16, num_attention_heads=24, attention_head_dim=128, num_layers=20,
    num_single_layers=40, num_refiner_layers=2, mlp_ratio=4.0, patch_size=2, patch_size_t=1, qk_norm="rms_norm",
    guidance_embeds=True, text_embed_dim=4096, pooled_projection_dim=768, rope_theta=256.0, rope_axes_dim=(16, 56, 56),
)

MODELS = {
    "wan": {
        "name": "Wan2.1-T2V-1.3B", "class": "WanTransformer3DModel", "family": "wan", "config": WAN_1_3B,
        "video": "480p (832x480) x 81 frames", "latent": (21, 60, 104), "text": 512, "text_valid": None,
        "block_lists": ("blocks",),
        "tiny": {"config": dict(num_layers=2, num_attention_heads=2, attention_head_dim=64, ffn_dim=256, text_dim=64,
                                freq_dim=32), "latent": (4, 32, 48), "text": 16, "video": "tiny"},
        "reduced": dict(num_layers=2),
    },
    "hunyuan": {
        "name": "HunyuanVideo-13B", "class": "HunyuanVideoTransformer3DModel", "family": "hunyuan_video",
        "config": HUNYUAN_13B, "video": "720p (1280x720) x 129 frames", "latent": (33, 90, 160), "text": 256,
        "text_valid": 64, "block_lists": ("transformer_blocks", "single_transformer_blocks"),
        "tiny": {"config": dict(num_layers=1, num_single_layers=1, num_refiner_layers=1, num_attention_heads=2,
                                attention_head_dim=64, mlp_ratio=2.0, text_embed_dim=64, pooled_projection_dim=32,
                                rope_axes_dim=(16, 24, 24)),
                 "latent": (4, 32, 48), "text": 32, "text_valid": 12, "video": "tiny"},
        "reduced": dict(num_layers=1, num_single_layers=1),
    },
}

#: Tiny-scale option overrides (the tiny preset tile of ``fastdit compare``).
TINY_METHOD_OPTIONS = {"sta": {"tile": (4, 4, 8)}}


def model_spec(name, scale, hy_frames=None):
    """``(config, latent (T, H, W), text tokens, valid text tokens or None, description)``."""
    spec = MODELS[name]
    config = dict(spec["config"])
    if scale == "tiny":
        tiny = spec["tiny"]
        config.update(tiny["config"])
        return config, tiny["latent"], tiny["text"], tiny.get("text_valid"), tiny["video"]
    latent, video = spec["latent"], spec["video"]
    if name == "hunyuan" and hy_frames:
        latent = ((hy_frames - 1) // 4 + 1, *latent[1:])
        video = f"720p (1280x720) x {hy_frames} frames"
    return config, latent, spec["text"], spec["text_valid"], video


def token_grid(config, latent):
    p = config["patch_size"]
    p_t, p_h, p_w = p if isinstance(p, (tuple, list)) else (config.get("patch_size_t", 1), p, p)
    return (latent[0] // p_t, latent[1] // p_h, latent[2] // p_w)


def model_class(name):
    import diffusers

    return getattr(diffusers, MODELS[name]["class"])


def count_parameters(name, config):
    """Parameters of the model, counted on a meta-device build (no memory)."""
    with torch.device("meta"):
        model = model_class(name)(**config)
    return sum(p.numel() for p in model.parameters())


def build_model(name, config, device, dtype, seed=0):
    """The model with random weights, built on ``device`` (no host copy on CUDA) and cast to ``dtype``
    as ``from_pretrained(torch_dtype=dtype)`` casts: the class's ``_keep_in_fp32_modules`` (Wan:
    rope, time embedder, modulation tables, norms) stay float32."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = model_class(name)(**config)
    keep = tuple(getattr(model, "_keep_in_fp32_modules", None) or ())
    with torch.no_grad():
        for tensors in (model.named_parameters(), model.named_buffers()):
            for key, tensor in tensors:
                if tensor.is_floating_point() and tensor.dtype != dtype and not any(k in key.split(".") for k in keep):
                    tensor.data = tensor.data.to(dtype)
    return model.eval().requires_grad_(False)


def make_inputs(name, config, latent, text, text_valid, device, dtype, seed=1):
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype)

    inputs = {"hidden_states": randn(1, config["in_channels"], *latent),
              "timestep": torch.tensor([999.0], device=device)}
    if name == "wan":
        inputs["encoder_hidden_states"] = randn(1, text, config["text_dim"])
    else:
        mask = torch.zeros(1, text, dtype=torch.bool, device=device)
        mask[:, : text_valid or text] = True
        inputs.update(encoder_hidden_states=randn(1, text, config["text_embed_dim"]), encoder_attention_mask=mask,
                      pooled_projections=randn(1, config["pooled_projection_dim"]),
                      guidance=torch.tensor([6000.0], device=device))
    return inputs


@contextlib.contextmanager
def first_blocks_only(model, block_lists):
    """The model with each repeated-block list cut to its first block (restored on exit)."""
    saved = {}
    try:
        for attr in block_lists:
            blocks = getattr(model, attr, None)
            if isinstance(blocks, torch.nn.ModuleList) and len(blocks) > 1:
                saved[attr] = blocks
                setattr(model, attr, torch.nn.ModuleList([blocks[0]]))
        yield model
    finally:
        for attr, blocks in saved.items():
            setattr(model, attr, blocks)


# --------------------------------------------------------------------------------------------------
# Measuring
# --------------------------------------------------------------------------------------------------


def _sync(cuda):
    if cuda:
        torch.cuda.synchronize()


def time_calls(fn, reps, cuda):
    """``([milliseconds of each of reps calls], output of the last)`` (CUDA events, else perf_counter)."""
    times, out = [], None
    for _ in range(reps):
        out = None  # the previous output is freed before the next call, as in a denoising loop
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            out = fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            out = fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return times, out


class RSSPeak:
    """The process's resident-set peak while the block runs, above its level on entry (MiB),
    sampled every ``interval`` s by a thread (Linux; None elsewhere or when disabled)."""

    def __init__(self, enabled=True, interval=0.005):
        self.enabled, self.interval, self.peak_mib = enabled, interval, None

    def __enter__(self):
        import threading

        from fastdit.eval.bench_attention import _rss_bytes

        self._read = _rss_bytes
        self._base = _rss_bytes() if self.enabled else None
        if self._base is None:
            return self
        self._peak = self._base
        self._done = threading.Event()

        def sample():
            while not self._done.is_set():
                self._peak = max(self._peak, self._read() or 0)
                self._done.wait(self.interval)

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        if self._base is not None:
            self._done.set()
            self._thread.join()
            self.peak_mib = (max(self._peak, self._read() or 0) - self._base) / 2**20
        return False


def pair_density(patch):
    """Query-key score computations of the latest call of every patched layer / dense attention's
    (dense layers 1.0), averaged over layers (every layer of one forward has the same length)."""
    values = []
    for layer in range(len(patch.layers)):
        try:
            plan = patch.last_plan(layer)
            layout = patch.last_layout(layer)
        except RuntimeError:  # the layer did not run
            continue
        if plan is None:
            values.append(1.0)
        else:
            values.append(float(plan.pair_counts().double().mean()) / float(layout.seq_len) ** 2)
    return sum(values) / len(values) if values else None


def explain_breaks(model, inputs):
    """``torch._dynamo.explain`` of one call: ``(graph_count, graph_break_count, [reasons])``."""
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            explanation = torch._dynamo.explain(model)(**inputs)
        reasons = []
        for r in explanation.break_reasons:
            text = str(getattr(r, "reason", r)).splitlines()[0][:160]
            if text not in reasons:
                reasons.append(text)
        return explanation.graph_count, explanation.graph_break_count, reasons[:5]
    finally:
        torch._dynamo.reset()


def _dynamo_counts():
    from torch._dynamo.utils import counters

    return {"unique_graphs": int(counters["stats"].get("unique_graphs", 0)),
            "graph_breaks": int(sum(counters["graph_break"].values()))}


def _set_recompile_limit(n):
    cfg = torch._dynamo.config
    for attr in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, attr):
            setattr(cfg, attr, max(getattr(cfg, attr), n))


def _versions():
    try:
        import triton

        tv = triton.__version__
    except Exception:
        tv = None
    try:
        import diffusers

        dv = diffusers.__version__
    except Exception:
        dv = None
    return torch.__version__, tv, dv


def _cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


HEADER = (f"{'model':<17} {'mode':<8} {'method':<7} {'tokens':>7} {'time_ms':>10} {'speedup':>8} {'density':>7} "
          f"{'peak':>8} {'compile_s':>9} {'breaks':>6}")


def _fmt(r):
    def f(x, spec):
        return "-" if x is None else format(x, spec)

    if r.get("skipped") or r.get("error"):
        why = r.get("skipped") or r.get("error")
        return f"{r['model']:<17} {r['mode']:<8} {r['method']:<7} {r['tokens']:>7} {'skipped' if r.get('skipped') else 'FAILED'}: {why}"
    return (f"{r['model']:<17} {r['mode']:<8} {r['method']:<7} {r['tokens']:>7} {f(r['time_ms'], '10.1f')} "
            f"{f(r['speedup'], '8.2f')} {f(r['density'], '7.3f')} {_peak(r):>8} "
            f"{f(r.get('compile_s'), '9.1f')} {f(r.get('graph_breaks'), '6d')}")


def _peak(r):
    if r.get("peak_gib") is not None:
        return f"{r['peak_gib']:.2f}G"
    if r.get("peak_rss_mib_above_start") is not None:
        return f"+{r['peak_rss_mib_above_start']:.0f}M"
    return "-"


# --------------------------------------------------------------------------------------------------
# The benchmark
# --------------------------------------------------------------------------------------------------


class Budget:
    def __init__(self, seconds):
        self.end = None if not seconds else time.monotonic() + seconds

    def left(self):
        return math.inf if self.end is None else self.end - time.monotonic()


def bench_model(name, args, device, dtype, budget, log, emit):
    import fastdit

    cuda = device.type == "cuda"
    spec = MODELS[name]
    config, latent, text, text_valid, video = model_spec(name, args.scale, args.hy_frames)
    grid = token_grid(config, latent)
    video_tokens = math.prod(grid)
    joint_text = text if name == "hunyuan" else 0
    tokens = video_tokens + joint_text
    reps = args.reps if args.reps is not None else (1 if (name == "hunyuan" and args.scale == "full") else 3)
    warmup = args.warmup if args.warmup is not None else (0 if (name == "hunyuan" and args.scale == "full") else 1)
    backend = "triton" if cuda else "torch"
    params = count_parameters(name, config)
    base = {"model": spec["name"] + ("" if args.scale == "full" else f" ({args.scale})"), "model_key": name,
            "class": spec["class"], "family": spec["family"], "scale": args.scale, "model_config": config,
            "parameters": params, "video": video, "latent": list(latent), "grid": list(grid), "tokens": tokens,
            "text_tokens": text, "text_valid": text_valid, "joint_text": joint_text,
            "dtype": str(dtype).replace("torch.", ""), "reps": reps, "warmup": warmup, "backend": backend,
            "timer": "cuda_events" if cuda else "perf_counter", "compile_backend": args.compile_backend,
            "compile_kind": args.compile}
    count = f"{params / 1e9:.2f}B" if params >= 1e8 else f"{params / 1e6:.1f}M"
    log(f"# {spec['name']}: {count} parameters, {video}: latents {'x'.join(map(str, latent))} -> "
        f"{'x'.join(map(str, grid))} = {video_tokens} video tokens"
        + (f" + {joint_text} text ({text_valid} valid)" if joint_text else f"; {text} text tokens (cross-attention)")
        + f"; {base['dtype']}, {reps} timed run(s) after {warmup} full warm-up run(s)")

    t0 = time.monotonic()
    try:
        model = build_model(name, config, device, dtype)
    except _OOM as e:
        emit(dict(base, mode="-", method="-", error=f"build: out of memory ({str(e).splitlines()[0][:100]})"))
        return
    inputs = make_inputs(name, config, latent, text, text_valid, device, dtype)
    _sync(cuda)
    weights_gib = torch.cuda.memory_allocated() / 2**30 if cuda else None
    log(f"  built in {time.monotonic() - t0:.1f}s" + (f", {weights_gib:.2f} GiB allocated" if cuda else ""))
    base["weights_gib"] = weights_gib

    # graph breaks: on the model itself at tiny scale, else on a one-block-of-each-kind copy
    if args.scale == "tiny":
        explain_config, explain_inputs, explain_scope = config, inputs, "the benchmarked model"
    else:
        explain_config = dict(config, **spec["reduced"])
        small_latent = (min(latent[0], 3), 16, 16)
        explain_inputs = make_inputs(name, explain_config, small_latent, text, text_valid, device, dtype)
        explain_scope = (f"same config with {spec['reduced']} at latents {'x'.join(map(str, small_latent))} "
                         "(breaks are per code path)")

    methods = ["dense"] + [m for m in args.methods.split(",") if m]
    modes = [m for m in args.modes.split(",") if m]
    times = {}  # (mode, method) -> ms
    compile_estimate = args.compile_estimate_s
    for mode in modes:
        for method in methods:
            row = dict(base, mode=mode, method=method)
            # time estimate of this measurement, from what ran already
            ref = times.get((mode, "dense")) or times.get(("eager", method)) or times.get(("eager", "dense"))
            runs = reps + max(warmup, 1 if mode == "compiled" else 0) + (0 if cuda else 1)
            estimate = (ref or 0) / 1e3 * runs + (compile_estimate if mode == "compiled" else 0)
            if budget.left() < estimate:
                emit(dict(row, skipped=f"time budget: needs ~{estimate:.0f}s, {max(budget.left(), 0):.0f}s left"))
                continue
            options = dict(TINY_METHOD_OPTIONS.get(method, {})) if args.scale == "tiny" else {}
            patch = None
            fn = model
            try:
                if method != "dense":
                    patch = fastdit.patch(model, method, dense_steps=0, record_masks=True, backend=backend, **options)
                    row["method_config"] = to_json(dataclasses.asdict(patch.config))
                # graph breaks of the (patched) model, before timing (explain resets dynamo)
                if mode == "compiled" and args.explain:
                    target = model if args.scale == "tiny" else build_model(name, explain_config, device, dtype)
                    ep = None
                    try:
                        if method != "dense" and target is not model:
                            ep = fastdit.patch(target, method, dense_steps=0, backend=backend, **options)
                        gc_count, br_count, reasons = explain_breaks(target, explain_inputs)
                        row.update(graph_count=gc_count, graph_breaks=br_count, break_reasons=reasons,
                                   explain_scope=explain_scope)
                    finally:
                        if ep is not None:
                            ep.remove()
                        if target is not model:
                            del target
                if mode == "compiled":
                    torch._dynamo.reset()
                    from torch._dynamo.utils import counters

                    counters.clear()
                    if args.compile == "regional":
                        n_blocks = sum(len(getattr(model, a, [])) for a in spec["block_lists"])
                        _set_recompile_limit(n_blocks + 8)
                        model.compile_repeated_blocks(backend=args.compile_backend)
                        fn = model
                    else:
                        fn = torch.compile(model, backend=args.compile_backend)

                def call(fn=fn):
                    with torch.no_grad():
                        return fn(**inputs)

                t_start = time.monotonic()
                if mode == "eager":
                    if args.scale == "full":  # warms the same shapes for a fraction of a forward
                        with first_blocks_only(model, spec["block_lists"]), torch.no_grad():
                            model(**inputs)
                        _sync(cuda)
                    for _ in range(warmup):
                        call()
                    _sync(cuda)
                else:
                    t_c = time.monotonic()
                    call()
                    _sync(cuda)
                    row["compile_s"] = time.monotonic() - t_c
                    compile_estimate = row["compile_s"]
                    for _ in range(max(warmup, 1) - 1):
                        call()
                    _sync(cuda)
                if patch is not None:
                    patch.reset_stats()
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
                with RSSPeak(enabled=not cuda) as rss:
                    ts, out = time_calls(call, reps, cuda)
                t = statistics.median(ts)
                if not cuda:
                    row["peak_rss_mib_above_start"] = rss.peak_mib
                sample = out[0] if isinstance(out, (tuple, list)) else getattr(out, "sample", out)
                row.update(time_ms=t, times_ms=ts, wall_s=time.monotonic() - t_start,
                           out_finite=bool(torch.isfinite(sample).all()),
                           peak_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else None)
                del out, sample
                if patch is not None:
                    stats = patch.stats.as_dict()
                    row.update(density=pair_density(patch), block_density=stats["effective_density"],
                               patch_stats={k: stats[k] for k in ("sparse_calls", "dense_calls", "fallback_calls",
                                                                   "fallbacks", "plans", "padding_fraction")})
                else:
                    row.update(density=1.0, block_density=1.0)
                if mode == "compiled":
                    row["dynamo"] = _dynamo_counts()
                times[(mode, method)] = t
                dense_t = times.get((mode, "dense"))
                row["speedup"] = dense_t / t if dense_t else None
                if mode == "compiled" and method == "dense" and times.get(("eager", "dense")):
                    row["speedup_vs_eager"] = times[("eager", "dense")] / t
                elif mode == "compiled" and times.get(("eager", method)):
                    row["speedup_vs_eager"] = times[("eager", method)] / t
                emit(row)
            except KeyboardInterrupt:
                raise
            except Exception as e:  # one failing measurement is reported, the rest goes on
                oom = isinstance(e, _OOM)
                emit(dict(row, error=f"{'out of memory' if oom else type(e).__name__}: {str(e).splitlines()[0][:200]}"))
            finally:
                if patch is not None:
                    patch.remove()
                if mode == "compiled":
                    if args.compile == "regional":
                        for sub in model.modules():  # undo module.compile()
                            if getattr(sub, "_compiled_call_impl", None) is not None:
                                sub._compiled_call_impl = None
                    torch._dynamo.reset()
                fn = None
                gc.collect()
                if cuda:
                    torch.cuda.empty_cache()
    model = inputs = None  # noqa: F841 - free the weights before the next model
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="wan,hunyuan", help="comma-separated: wan, hunyuan")
    p.add_argument("--scale", choices=("full", "tiny"), default=None,
                   help="full: the published sizes (default on CUDA); tiny: a CPU-sized model (default on the CPU)")
    p.add_argument("--methods", default="sta,radial", help="methods besides dense (comma-separated)")
    p.add_argument("--modes", default="eager,compiled", help="eager, compiled (comma-separated)")
    p.add_argument("--compile", choices=("full", "regional"), default="full",
                   help="full: torch.compile(transformer); regional: transformer.compile_repeated_blocks()")
    p.add_argument("--compile-backend", default=None,
                   help="torch.compile backend (default inductor on CUDA, aot_eager on the CPU: no code generation)")
    p.add_argument("--no-explain", dest="explain", action="store_false", help="skip torch._dynamo.explain")
    p.add_argument("--reps", type=int, default=None, help="timed runs (default 3; HunyuanVideo full size 1)")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed full forwards before timing (default 1; HunyuanVideo full size 0 in eager mode, "
                        "after the first-blocks warm-up)")
    p.add_argument("--hy-frames", type=int, default=None, help="HunyuanVideo video frames (default 129)")
    p.add_argument("--budget-s", type=float, default=None, help="skip measurements that would end past this")
    p.add_argument("--compile-estimate-s", type=float, default=None,
                   help="expected compile time for the budget check (default 90 at full size, 20 tiny)")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None,
                   help="default bfloat16 on CUDA, float32 on the CPU")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=None, help="JSON path (default bench_results/transformer_<device>_<timestamp>.json)")
    p.add_argument("--table", default=None, help="also write the printed table to this path")
    args = p.parse_args(argv)
    if args.reps is not None and args.reps < 1:
        p.error("--reps must be at least 1")
    if args.warmup is not None and args.warmup < 0:
        p.error("--warmup must be >= 0")

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    args.scale = args.scale or ("full" if cuda else "tiny")
    args.compile_backend = args.compile_backend or ("inductor" if cuda else "aot_eager")
    if args.compile_estimate_s is None:
        args.compile_estimate_s = 90.0 if args.scale == "full" else 20.0
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if cuda else torch.float32)
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    gpu = torch.cuda.get_device_name(device) if cuda else None
    cpu = _cpu_name()
    torch_v, triton_v, diffusers_v = _versions()
    dev_tag = "cpu" if not cuda else "cuda-" + "".join(c if c.isalnum() else "_" for c in gpu).strip("_")
    out_path = args.out or os.path.join("bench_results", f"transformer_{dev_tag}_{stamp}.json")
    meta = {"timestamp": stamp, "device": str(device), "gpu": gpu, "cpu": cpu, "torch": torch_v, "triton": triton_v,
            "diffusers": diffusers_v, "cpu_threads": torch.get_num_threads(), "scale": args.scale,
            "dtype": str(dtype).replace("torch.", ""), "modes": args.modes, "methods": args.methods,
            "compile": args.compile, "compile_backend": args.compile_backend, "budget_s": args.budget_s,
            "timer": "cuda_events" if cuda else "perf_counter"}
    lines, rows = [], []

    def log(s=""):
        print(s, flush=True)
        lines.append(s)

    def write():
        os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
        with open(out_path, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1, default=str)
        if args.table:
            with open(args.table, "w") as f:
                f.write("\n".join(lines) + "\n")

    def emit(row):
        row.update({k: meta[k] for k in ("timestamp", "gpu", "cpu", "torch", "triton", "diffusers")})
        rows.append(row)
        log(_fmt(row))
        write()

    log(f"fastdit transformer benchmark  device={device} gpu={gpu} cpu={cpu}")
    log(f"torch {torch_v}  triton {triton_v}  diffusers {diffusers_v}  threads {torch.get_num_threads()}  "
        f"scale {args.scale}  {meta['dtype']}  compile {args.compile}/{args.compile_backend}"
        + (f"  budget {args.budget_s:.0f}s" if args.budget_s else ""))
    if args.scale == "tiny":
        log("tiny scale: layers, heads and grids shrunk (see each model); sta uses the tiny preset tile 4x4x8")
    log("time = median of the timed forwards (" + ("CUDA events" if cuda else "perf_counter") + "); speedup = dense / "
        "method in the same mode; density = score computations performed / dense's, over all patched layers")
    log(HEADER)
    log("-" * len(HEADER))
    budget = Budget(args.budget_s)
    status = 0
    try:
        for name in [m.strip() for m in args.models.split(",") if m.strip()]:
            if name not in MODELS:
                raise SystemExit(f"unknown model {name!r}; choose from {sorted(MODELS)}")
            bench_model(name, args, device, dtype, budget, log, emit)
    except KeyboardInterrupt:
        log("interrupted: the rows so far are kept")
        meta["interrupted"] = True
        status = 130
    write()
    log(f"wrote {out_path}")
    return status


if __name__ == "__main__":
    sys.exit(main())
