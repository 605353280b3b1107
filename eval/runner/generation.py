"""Phase 1: generate this process's samples that are not stored yet, timed, and store them.

Timing: ``latency_s`` is the sample's denoising+decoding time (CUDA events on a GPU, else wall
clock); warm-up runs (1 step, not recorded) happen first in every process. Each setting's samples
are split between processes (accelerate's contiguous split), so a sample and its dense reference
(same prompt and seed) land on the same process and speedups compare like with like.
``peak_memory_mb``: CUDA peak allocated memory during the sample (null on the CPU). ``load``: the
machine's load around the timed call (``fastdit.cpu_load``); a warning is logged when other work
shared the cores, and the report counts such samples.

The record keeps what the patch did (``Generation.extra``): ``density`` is the effective density
(computed / total attention blocks over all calls of the patched layers, dense steps, dense layers
and fallback calls included), ``extra`` the sparse-only density, the dense / sparse / fallback
call counts and the fallback reasons.
"""
from __future__ import annotations

import time

import numpy as np

from fastdit.compare import COMPARE_TINY_SIZE
from fastdit.cpu_load import load_warning
from fastdit.eval.runner.config import EvalError
from fastdit.eval.runner.processes import Log, process_device, process_rank, several, shard
from fastdit.eval.runner.settings import fingerprint
from fastdit.eval.runner.storage import load_record, store_sample

__all__ = ["TINY_CALL_SIZE", "call_kwargs", "generate_samples", "load_pipe", "sample_record", "timed_generate",
           "warmup"]

#: The tiny built-ins' call size in ``fastdit eval`` when no size is given: that of ``fastdit
#: compare`` (29 frames at 512x768, an 8 x 32 x 48 latent token grid, 8 steps): one constant,
#: ``fastdit.compare.COMPARE_TINY_SIZE``.
TINY_CALL_SIZE = COMPARE_TINY_SIZE


def load_pipe(cfg, device):
    """The run's pipeline on ``device`` in ``cfg.dtype`` (``EvalError`` when the model is missing)."""
    import torch

    from fastdit.pipelines.loading import ModelNotFoundError, load_pipeline

    dtype = getattr(torch, cfg.dtype) if cfg.dtype else None
    try:
        pipe = load_pipeline(cfg.model, device, dtype)
    except ModelNotFoundError as error:
        raise EvalError(str(error)) from None
    if hasattr(pipe, "set_progress_bar_config"):
        pipe.set_progress_bar_config(disable=True)  # the eval's own bar shows progress
    return pipe


def call_kwargs(pipe, cfg, log=print, check_call=None):
    """Pipeline call kwargs: the tiny model's defaults (at ``TINY_CALL_SIZE``), then the requested
    sizes of ``cfg.call`` fitted to the pipeline (a note per change). ``check_call(pipe, kwargs)``,
    when given, may refuse the result (the command line checks its size limits there)."""
    from fastdit.pipelines.loading import TRAINED_DEFAULTS, fitted_call, tiny_name, trained_name

    base = {}
    name = tiny_name(cfg.model)
    if name is not None:
        from fastdit.pipelines.tiny import TINY_DEFAULTS

        base = {**TINY_DEFAULTS[name], **TINY_CALL_SIZE}
    elif trained_name(cfg.model) is not None:  # trained built-ins run at their native size
        base = dict(TRAINED_DEFAULTS[cfg.model])
    call = cfg.call
    kwargs, notes = fitted_call(pipe, base, call.get("height"), call.get("width"), call.get("frames"),
                                call.get("steps"), call.get("guidance"))
    for note in notes:
        log(f"note: {note}")
    if check_call is not None:
        check_call(pipe, kwargs)
    if call.get("negative_prompt") is not None:
        kwargs["negative_prompt"] = call["negative_prompt"]
    return kwargs


def timed_generate(pipe, sample, call_kwargs, backend, cache=None):
    """``fastdit.compare.generate`` timed with CUDA events on a GPU (its wall clock elsewhere).
    ``cache``: ``cache_dit.enable_cache`` arguments for a setting with a cache (else unused).
    Returns ``(Generation, wall seconds)``."""
    import torch

    from fastdit.compare import generate, pipeline_device

    on_cuda = str(pipeline_device(pipe)).startswith("cuda")
    if on_cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    wall = time.perf_counter()
    result = generate(pipe, sample.prompt.text, sample.seed, call_kwargs, sample.setting.method,
                      sample.setting.options, backend, cache=cache if sample.setting.cache else None)
    wall = time.perf_counter() - wall
    if on_cuda:
        end.record()
        end.synchronize()
        result.latency_s = start.elapsed_time(end) / 1000.0
    return result, wall


def warmup(pipe, cfg, todo, call_kwargs):
    """Untimed 1-step runs so first-call costs (allocation, compilation) stay out of the timings."""
    from fastdit.compare import generate, pipeline_device, warm_up_options

    warm = {**call_kwargs, "num_inference_steps": 1, "output_type": "latent"}
    prompt = todo[0].prompt.text
    generate(pipe, prompt, 0, warm, "dense", {}, cfg.backend)
    if str(pipeline_device(pipe)).startswith("cuda"):
        seen = set()
        for sample in todo:
            if sample.setting.method != "dense" and sample.setting.name not in seen:
                seen.add(sample.setting.name)
                options = warm_up_options(sample.setting.options)
                generate(pipe, prompt, 0, warm, sample.setting.method, options, cfg.backend)


def sample_record(cfg, sample, result, wall, shape, call, device):
    """The stored record of a generated sample (``result``: a ``fastdit.compare.Generation``)."""
    return {
        "fingerprint": fingerprint(cfg, sample), "setting": sample.setting.name, "method": sample.setting.method,
        "options": sample.setting.options, "effective_options": result.options,
        "prompt_index": sample.prompt_index, "prompt": sample.prompt.text, "seed": sample.seed,
        "latency_s": result.latency_s, "wall_s": wall, "peak_memory_mb": result.peak_memory_mb,
        "density": result.density, "padding_fraction": result.padding_fraction, "extra": result.extra,
        "shape": list(shape), "call": call, "device": device, "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "load": result.load,
    }


def generate_samples(cfg, samples, state=None, log=None, check_call=None):
    """Generate this process's share of the samples that are not stored yet. Returns the count.
    ``check_call``: see ``call_kwargs``."""
    from tqdm.auto import tqdm

    from fastdit.media.video import to_uint8

    log = log or Log(state)
    parallel = None
    if cfg.cp is not None or cfg.cp_ring is not None:  # groups of cp x ring processes split each sample
        from fastdit import parallel as cp

        parallel = cp.setup(cfg.cp or 1, cfg.cp_ring or 1)
    by_setting = {}
    for sample in samples:
        by_setting.setdefault(sample.setting.name, []).append(sample)
    if parallel is None:
        mine = [s for group in by_setting.values() for s in shard(state, group)]
    else:
        mine = [s for group in by_setting.values() for s in cp.group_share(parallel, group)]
    todo = [s for s in mine if load_record(cfg, s) is None]
    if parallel is not None:
        cp.barrier()  # every rank of a group read the same stored samples before its leader writes new ones
    log(f"{len(mine) - len(todo)} of {len(mine)} samples of this process already done; generating {len(todo)}",
        all_ranks=several(state))
    if not todo:
        return 0
    pipe = load_pipe(cfg, process_device(cfg, state) if parallel is None else str(parallel.device))
    if parallel is not None:
        try:  # Ulysses' heads checked before any sample is generated
            cp.enable(pipe, parallel)
        except ValueError as error:
            raise EvalError(str(error)) from None
    kwargs = call_kwargs(pipe, cfg, log, check_call)
    cache = None
    if cfg.cache is not None:
        from fastdit.integrations.caches import cache_settings

        try:
            cache = cache_settings(cfg.cache, pipe, kwargs.get("num_inference_steps", 50), cfg.cache_options)
        except (ValueError, TypeError) as error:
            raise EvalError(f"--cache: {error}") from None
    if cfg.warmup:
        warmup(pipe, cfg, todo, kwargs)
    rank = process_rank(state)
    bar = tqdm(todo, desc="generate" if rank == 0 else f"generate [rank {rank}]", position=rank,
               disable=not cfg.progress, dynamic_ncols=True, leave=True)
    shown_call = {k: v for k, v in kwargs.items() if isinstance(v, (int, float, str, bool))}
    for sample in bar:
        bar.set_postfix_str(f"{sample.setting.name} p{sample.prompt_index} s{sample.seed}")
        result, wall = timed_generate(pipe, sample, kwargs, cfg.backend, cache)
        if parallel is not None:  # the group's slowest rank; density: the mean over the group's ranks
            result.latency_s, wall = cp.reduce(result.latency_s, "max", parallel), cp.reduce(wall, "max", parallel)
            result.density = cp.reduce(result.density, "mean", parallel)
            if not parallel.is_group_leader:
                continue
        warning = load_warning(result.load, f"{sample.setting.name} p{sample.prompt_index} s{sample.seed}")
        if warning:
            log(warning, all_ranks=several(state))
        frames8 = to_uint8(np.asarray(result.frames))
        record = sample_record(cfg, sample, result, wall, frames8.shape, shown_call, str(getattr(pipe, "device", "")))
        store_sample(cfg, sample, frames8, record)
    bar.close()
    return len(todo)
