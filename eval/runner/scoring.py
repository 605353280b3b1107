"""Phase 2: the per-sample metric values of this process's share of the samples (all generated
by now), cached per sample: a value is computed again only when the sample, its dense reference
(their fingerprints) or what the value means (its key in the registry) changed."""
from __future__ import annotations

import os

from fastdit.eval.runner.config import EvalError
from fastdit.eval.metrics.registry import SampleInput, sample_values
from fastdit.eval.runner.processes import Log, process_device, process_rank, shard
from fastdit.eval.runner.settings import fingerprint
from fastdit.eval.runner.storage import load_frames, read_metric_cache, write_metric_cache

__all__ = ["compute_sample_metrics", "missing_values"]


def missing_values(cfg, sample, reference, values):
    """``(cache, names)``: the sample's metric cache (a fresh one when it belongs to another sample
    or reference) and the names of the ``values`` (name -> ``SampleValue``) it lacks."""
    cache = read_metric_cache(cfg, sample)
    fp, ref_fp = fingerprint(cfg, sample), fingerprint(cfg, reference)
    if cache.get("sample") != fp or cache.get("reference") != ref_fp:
        cache = {"sample": fp, "reference": ref_fp, "keys": {}, "values": {}}
    missing = [name for name, value in values.items()
               if cache["keys"].get(name) != value.key(cfg)
               or (value.stored_in is not None and not os.path.isfile(value.stored_in(cfg, sample)))]
    return cache, missing


def compute_sample_metrics(cfg, samples, state=None, log=None):
    """Per-sample metrics for this process's share of the samples. Returns how many samples had
    values to compute."""
    from tqdm.auto import tqdm

    log = log or Log(state)
    values = sample_values(cfg)
    dense = {(s.prompt_index, s.seed): s for s in samples if s.setting.is_reference}
    device = process_device(cfg, state, default="cpu")
    rank = process_rank(state)
    todo = []
    for sample in shard(state, samples):
        reference = dense[(sample.prompt_index, sample.seed)]
        cache, missing = missing_values(cfg, sample, reference, values)
        if missing:
            todo.append((sample, reference, cache, missing))
    if not todo:
        return 0
    bar = tqdm(todo, desc="metrics" if rank == 0 else f"metrics [rank {rank}]", position=rank,
               disable=not cfg.progress, dynamic_ncols=True)
    for sample, reference, cache, missing in bar:
        frames = load_frames(cfg, sample)
        is_dense = sample.setting.is_reference
        ref = None
        if not is_dense and any(values[name].reference for name in missing):
            ref = load_frames(cfg, reference)
            if ref.shape != frames.shape:
                raise EvalError(
                    f"cannot compare videos of different sizes: {sample.stem(cfg.out)}.npy is {tuple(frames.shape)}, "
                    f"its dense reference {reference.stem(cfg.out)}.npy is {tuple(ref.shape)}")
        for name in missing:
            value = values[name]
            if value.reference and is_dense:
                result = None  # the dense sample is the reference itself
            else:
                result = value.compute(SampleInput(cfg, sample, frames, ref if value.reference else None, device))
            if value.stored_in is None:
                cache["values"][name] = result
            cache["keys"][name] = value.key(cfg)
        write_metric_cache(cfg, sample, cache)
    bar.close()
    return len(todo)
