"""Dense against accelerated generation with the same seed: latency, speedup, PSNR and SSIM.

``fastdit compare`` (the CLI) and the Gradio app both call ``generate`` and ``compare`` here.
The dense run is the unpatched pipeline (under ring attention: fastdit's exact ``dense`` method,
diffusers' native attention cannot run there); every other method patches it, generates, and removes
the patch again, so runs never see each other's state.
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field

import numpy as np
import torch

import fastdit
from fastdit.cpu_load import LoadWatch
from fastdit.jsonutil import dump_json
from fastdit.media.video import pipeline_frames, write_video

#: Method options for the embedded tiny models, whose latent grid (8 x 32 x 48 tokens in
#: `fastdit compare`) is far smaller than a real video's: tiles of 4x4x8 tokens keep sliding-tile
#: attention sparse (a 2 x 8 x 6 tile grid, 3x3x3 window, about 19% of blocks) where the
#: published 6x8x8 tiles would cover most of the grid. ``fit_tile`` fits the tile to every grid
#: where the plan is built (17 frames give 5 latent frames, which 4-frame tiles would pad by 60%),
#: so compare, eval and the app all get the same fitted tiles.

#: `fastdit compare` on a tiny model: 29 frames at 512x768 -> an 8 x 32 x 48 latent token grid
#: (12288 tokens), 8 steps (the first 2 dense by sliding-tile's default). Attention dominates the
#: transformer there, and 8 steps keep the VAE decode (about a quarter of a dense run) from
#: hiding the speedup on a 2-core CPU.
COMPARE_TINY_SIZE = {"num_frames": 29, "height": 512, "width": 768, "num_inference_steps": 8}


@dataclass
class Generation:
    """One generation: frames ``(F, H, W, C)`` in [0, 1], timing and what the patch did."""

    method: str
    options: dict
    frames: np.ndarray
    latency_s: float
    peak_memory_mb: float | None = None
    #: effective density: computed / total block pairs over ALL attention calls of the patched
    #: layers (dense steps, dense layers and fallbacks count as 1.0); see ``fastdit.PatchStats``.
    density: float | None = None
    padding_fraction: float | None = None
    patch: object = None
    extra: dict = field(default_factory=dict)
    #: the machine's load around the timed call (``fastdit.cpu_load.LoadWatch``'s record)
    load: dict | None = None


def _silent(*_args, **_kwargs):
    pass


def _sync(device):
    if str(device).startswith("cuda") and torch.cuda.is_available():
        torch.cuda.synchronize()


def pipeline_device(pipe):
    transformer = getattr(pipe, "transformer", None)
    if transformer is not None:
        return next(transformer.parameters()).device
    return torch.device("cpu")


def _under_ring(pipe):
    """Whether a transformer of ``pipe`` runs under ring attention (``ring_degree > 1``)."""
    for name in ("transformer", "transformer_2"):
        config = getattr(getattr(pipe, name, None), "_parallel_config", None)
        if getattr(getattr(config, "context_parallel_config", None), "ring_degree", 1) > 1:
            return True
    return False


def generate(pipe, prompt, seed=0, call_kwargs=None, method="dense", options=None, backend="auto",
             record_masks=False, keep_patch=False, cache=None, **pipe_kwargs):
    """Run ``pipe`` once with ``method`` (``"dense"`` = unpatched) and the given seed.

    Returns a ``Generation``. With ``keep_patch=True`` the patch is left applied and returned in
    ``Generation.patch`` (the caller removes it), e.g. to draw its masks afterwards. ``cache``:
    ``cache_dit.enable_cache`` keyword arguments (``fastdit.integrations.caches.cache_settings``): cache-dit is
    enabled after the patch and disabled after the run; ``extra["cache"]`` says what it reused.
    """
    from contextlib import nullcontext

    from fastdit.integrations.caches import CacheRun

    options = dict(options or {})
    from fastdit.pipelines.tiny import native_call

    # sizes and steps left out are the model's native call (the built-in models carry one), not 50 full-size steps
    call_kwargs = {"output_type": "np", **native_call(pipe, call_kwargs), **pipe_kwargs}
    device = pipeline_device(pipe)
    generator = torch.Generator(device="cpu").manual_seed(int(seed))
    patch = None
    if method != "dense" or _under_ring(pipe):
        # Under ring attention the unpatched baseline cannot run on diffusers' native attention (it
        # returns no log-sum-exp); it runs fastdit's exact dense attention (method "dense") instead.
        patch = fastdit.patch(pipe, method, backend=backend, record_masks=record_masks, **options)
    cached = CacheRun(pipe, cache) if cache is not None else None
    try:
        with cached if cached is not None else nullcontext():
            if str(device).startswith("cuda"):
                torch.cuda.reset_peak_memory_stats(device)
            _sync(device)
            watch = LoadWatch().start()
            start = time.perf_counter()
            with torch.inference_mode():
                output = pipe(prompt=prompt, generator=generator, **call_kwargs)
            _sync(device)
            latency = time.perf_counter() - start
            load = watch.stop()
        peak = torch.cuda.max_memory_allocated(device) / 2**20 if str(device).startswith("cuda") else None
        frames = pipeline_frames(output) if call_kwargs["output_type"] == "np" else None
        result = Generation(method, options, frames, latency, peak, load=load)
        if patch is not None:
            stats = patch.stats.as_dict()
            result.density = stats.pop("effective_density")
            result.padding_fraction = stats.pop("padding_fraction")
            result.options = {**_public_options(patch.config)}
            result.extra = stats  # sparse_density, dense/sparse/fallback calls, fallbacks, plans
        if cached is not None:
            result.extra["cache"] = cached.stats
    finally:
        if patch is not None and not keep_patch:
            patch.remove()
    result.patch = patch if keep_patch else None
    return result


def warm_up_options(options):
    """Options for a 1-step warm-up run: no dense steps (so the method's kernels run), except with a
    calibration file, which sets its own ``dense_steps`` (options it sets cannot be passed beside it)."""
    from fastdit.calibration.calibration_file import split_calibration

    return dict(options) if split_calibration(options)[0] is not None else {**options, "dense_steps": 0}


def _public_options(config):
    return {name: (list(value) if isinstance(value, tuple) else value) for name, value in vars(config).items()}


def fidelity(frames, reference):
    """PSNR (dB, per frame, data range 1) and SSIM of ``frames`` against the dense ``reference``."""
    from fastdit.eval.metrics.fidelity import psnr, ssim

    return float(psnr(frames, reference)), float(ssim(frames, reference))


def format_table(rows):
    """Plain-text table of compare rows (dicts with method, latency_s, speedup, psnr_db, ssim;
    an ``adherence`` column when the rows have one).

    ``density`` is the effective density (all attention calls of the patched layers, dense steps
    and fallbacks included); ``fallbacks`` counts calls the patch ran with the model's own
    attention because it could not express them; ``guard`` the head-calls the quality guard widened
    (w) or ran dense (d) out of those it checked (their work is in ``density``); ``reused`` (when a
    method ran with ``reuse_threshold``) the head-calls that kept an earlier step's selection."""
    header = ["method", "latency (s)", "speedup", "PSNR (dB)", "SSIM", "density", "sparse-only", "fallbacks", "padding",
              "guard"]
    with_adherence = any(row.get("adherence") is not None for row in rows)
    if with_adherence:
        header.insert(5, "adherence")
    caches = any(row.get("cache") for row in rows)
    if caches:  # cache-dit runs: attention calls that ran, steps on which a block list reused its blocks
        header += ["attn calls", "cached steps"]
    reuses = any((row.get("reuse") or {}).get("head_calls") for row in rows)
    if reuses:  # reuse_threshold (methods/selection/reuse.py): head-calls that kept an earlier step's selection
        header.append("reused")
    lines = []
    for row in rows:
        psnr_db = row.get("psnr_db")
        lines.append([
            row["method"],
            f"{row['latency_s']:.2f}",
            f"{row['speedup']:.2f}x",
            "-" if psnr_db is None else ("inf" if math.isinf(psnr_db) else f"{psnr_db:.2f}"),
            "-" if row.get("ssim") is None else f"{row['ssim']:.4f}",
            "-" if row.get("density") is None else f"{row['density']:.3f}",
            "-" if row.get("sparse_density") is None else f"{row['sparse_density']:.3f}",
            "-" if row.get("fallback_calls") is None else str(row["fallback_calls"]),
            "-" if row.get("padding_fraction") is None else f"{100 * row['padding_fraction']:.1f}%",
            guard_summary(row),
        ] + ([_calls(row), str(row["cache"]["cached_steps"]) if row.get("cache") else "-"] if caches else [])
          + ([reuse_summary(row)] if reuses else []))
        if with_adherence:
            lines[-1].insert(5, "-" if row.get("adherence") is None else f"{row['adherence']:.3f}")
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(header)]
    out = ["  ".join(h.ljust(w) for h, w in zip(header, widths)), "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(line, widths)) for line in lines]
    return "\n".join(out)


#: ``fastdit compare`` warns when a method's video is further than this from dense (PSNR against
#: the dense video) or its prompt adherence falls more than ``WARN_ADHERENCE_DROP`` below dense's.
WARN_PSNR_DB = 20.0
WARN_ADHERENCE_DROP = 0.1


def quality_warning(row, reference_row):
    """A one-line warning when ``row`` is far from dense (see ``WARN_PSNR_DB``), else None."""
    reasons = []
    psnr_db = row.get("psnr_db")
    if psnr_db is not None and psnr_db < WARN_PSNR_DB:
        reasons.append(f"PSNR against dense {psnr_db:.1f} dB < {WARN_PSNR_DB:g} dB")
    if row.get("adherence") is not None and reference_row.get("adherence") is not None:
        drop = reference_row["adherence"] - row["adherence"]
        if drop > WARN_ADHERENCE_DROP:
            reasons.append(f"adherence {row['adherence']:.3f} is {drop:.3f} below dense's "
                           f"{reference_row['adherence']:.3f}")
    if not reasons:
        return None
    return (f"warning: {row['method']}: {'; '.join(reasons)}: this video may not be usable (try a higher threshold, "
            f"dense_steps, or the guard: guard=0.1)")


def guard_summary(row):
    """``"12w 3d /96"``: head-calls the guard widened / ran dense / checked, "-" when it did not run."""
    guard = row.get("guard") or {}
    if not guard.get("head_calls"):
        return "-"
    return f"{guard['widened']}w {guard['dense']}d /{guard['head_calls']}"


def reuse_summary(row):
    """``"60 /108"``: head-calls that kept an earlier step's selection / ran with reuse on, "-" when off."""
    reuse = row.get("reuse") or {}
    return f"{reuse['reused']} /{reuse['head_calls']}" if reuse.get("head_calls") else "-"


def _calls(row):
    """Attention calls a patched run counted (dense, sparse and fallback), "-" for the unpatched runs."""
    counts = [row.get(name) for name in ("dense_calls", "sparse_calls", "fallback_calls")]
    return "-" if None in counts else str(sum(counts))


def compare(pipe, methods, prompt, seed=0, call_kwargs=None, out_dir="fastdit_compare", model_name="",
            method_options=None, backend="auto", fps=16, warmup=True, log=print, parallel=None, adherence=False,
            cache=None, cache_options=None):
    """Dense first, then each method with the same seed; writes mp4s and ``report.json``.

    Args:
        methods: method names; ``"dense"`` (the unpatched pipeline) is always run first.
        method_options: method name -> options for ``fastdit.patch``.
        parallel: a ``fastdit.parallel.ParallelSetup`` when the pipeline runs under context
            parallelism (every rank calls ``compare``): latency is the slowest rank's, densities
            the mean over ranks (each holds an equal share of the heads), and rank 0 alone logs
            and writes the videos and the report.
        adherence: also score each video against the prompt with ``fastdit.eval.metrics.adherence``
            (moving-shapes captions, the tiny-shapes model): ``row["adherence"]`` in [0, 1].
        cache: a cache-dit cache (``fastdit.integrations.caches.CACHES``, e.g. ``"dbcache"``): every method also
            runs with it (rows ``dense+dbcache``, ``sta+dbcache``, ...), settings fitted to the model
            (``fastdit.integrations.caches.cache_settings``) with ``cache_options`` overriding them. Speedup and
            fidelity are always against the uncached dense run.
    Returns the report dict ``{"model", "device", "prompt", "seed", "call", "runs": [...]}``.
    """
    from fastdit.parallel import reduce
    from fastdit.pipelines.tiny import native_call

    call_kwargs = native_call(pipe, call_kwargs)  # the built-in models' own sizes and steps where none are given
    method_options = method_options or {}
    main = parallel is None or parallel.is_main
    if not main:
        log = _silent
    methods = ["dense"] + [m for m in methods if m != "dense"]
    for method in methods:
        fastdit.methods.get_method(method)  # unknown names fail before any work
    runs_wanted = [(method, None) for method in methods]
    settings = None
    if cache is not None:
        from fastdit.integrations.caches import cache_settings, check_cache

        check_cache(cache, parallel is not None)
        settings = cache_settings(cache, pipe, (call_kwargs or {}).get("num_inference_steps", 50), cache_options)
        runs_wanted = [run for method in methods for run in ((method, None), (method, cache))]
    if main:
        os.makedirs(out_dir, exist_ok=True)
    device = pipeline_device(pipe)
    if warmup:  # first-call costs (allocation, kernel compilation) stay out of the timings
        warm = {**(call_kwargs or {}), "num_inference_steps": 1, "output_type": "latent"}
        log("warm-up run (1 step, not timed)")
        generate(pipe, prompt, seed, warm)
        if str(device).startswith("cuda"):
            for method in methods[1:]:
                generate(pipe, prompt, seed, warm, method, warm_up_options(method_options.get(method, {})), backend)
    runs, reference, frames_by_run = [], None, []
    for index, (method, cached) in enumerate(runs_wanted):
        name = method if cached is None else f"{method}+{cached}"
        log(f"[{index + 1}/{len(runs_wanted)}] {name}")
        result = generate(pipe, prompt, seed, call_kwargs, method, method_options.get(method), backend,
                          cache=settings if cached else None)
        if parallel is not None:
            result.latency_s = reduce(result.latency_s, "max")
            result.peak_memory_mb = reduce(result.peak_memory_mb, "max")
            result.density = reduce(result.density, "mean")
            result.extra["sparse_density"] = reduce(result.extra.get("sparse_density"), "mean")
        path = os.path.join(out_dir, f"{name}.mp4")
        if main:
            write_video(path, result.frames, fps=fps)
        row = {"method": name, "options": result.options, "latency_s": result.latency_s, "speedup": 1.0,
               "psnr_db": None, "ssim": None, "video": os.path.abspath(path),
               "density": result.density, "padding_fraction": result.padding_fraction,
               "peak_memory_mb": result.peak_memory_mb, **result.extra, "load": result.load}
        if reference is None:
            reference = result
        else:
            row["speedup"] = reference.latency_s / result.latency_s
            row["psnr_db"], row["ssim"] = fidelity(result.frames, reference.frames)
        if adherence:
            from fastdit.eval.metrics.adherence import adherence as score

            row["adherence"] = score(result.frames, prompt).score
        if runs:
            warning = quality_warning(row, runs[0])
            if warning:
                row["warning"] = warning
                log(warning)
        runs.append(row)
        frames_by_run.append(result.frames)
    report = {"model": model_name, "device": str(device), "prompt": prompt, "seed": seed,
              "call": {k: v for k, v in (call_kwargs or {}).items() if isinstance(v, (int, float, str, bool))},
              "versions": {"fastdit": fastdit.__version__, "torch": torch.__version__}, "runs": runs}
    if parallel is not None:
        report["context_parallel"] = {"ulysses_degree": parallel.ulysses, "ring_degree": parallel.ring,
                                      "mesh": parallel.describe(), "world_size": parallel.world,
                                      "latency": "slowest rank", "density": "mean over ranks"}
    if main and all(frames is not None for frames in frames_by_run):
        from fastdit.media.contact_sheet import contact_sheet, row_label

        report["contact_sheet"] = contact_sheet(frames_by_run, [row_label(row) for row in runs],
                                                os.path.join(out_dir, "contact_sheet.png"))
    if main:
        dump_json(os.path.join(out_dir, "report.json"), report)  # inf PSNR -> null, tuples -> lists
    return report
