"""Phase 3 (main process): results.json's content from the stored records and metric caches, and
the per-setting metrics (FID, full VBench).

``speedup`` of a sample is the dense latency of the same prompt and seed divided by its latency;
a setting's ``speedup`` is the mean of its samples' speedups (``speedup_of_means``, the ratio of
mean latencies, is given too).

Attention work: a sample's ``density`` is the effective density, computed / total attention
blocks over every attention call of the patched layers (dense steps, dense layers and fallback
calls count as fully computed), ``sparse_density`` the same over the calls that ran sparse alone,
and ``fallback_calls`` / ``fallbacks`` (reason -> count) the calls the patch ran with the model's
own attention. A setting gives the mean densities over its samples and the summed call counts;
the dense setting, which is not patched, has none (null).
"""
from __future__ import annotations

import math
import os
import time

import numpy as np

from fastdit.eval.runner.config import SCHEMA, EvalError
from fastdit.eval.metrics.registry import COLUMN_INFO, METRICS, PER_SAMPLE_COLUMNS
from fastdit.eval.runner.processes import Log
from fastdit.eval.runner.storage import load_record, read_metric_cache
from fastdit.jsonutil import to_json

__all__ = ["CALL_FIELDS", "DENSITY_DEFINITION", "SPEEDUP_DEFINITION", "aggregate", "attention_work", "mean", "std"]

SPEEDUP_DEFINITION = ("per sample: dense latency of the same prompt and seed / the sample's latency; "
                      "per setting: the mean of its samples' speedups (speedup_of_means: ratio of mean latencies)")
DENSITY_DEFINITION = ("density (all calls): computed / total attention blocks over every attention call of the "
                      "patched layers, dense steps, dense layers and fallback calls counted as fully computed "
                      "(mean over samples); sparse-only: the same over the calls that ran sparse; fallbacks: calls "
                      "run with the model's own attention, summed over samples, with their reasons")
#: Per-sample attention-work fields, from the record's ``extra`` (``fastdit.PatchStats.as_dict``).
CALL_FIELDS = ("dense_calls", "sparse_calls", "fallback_calls")
#: The quality guard's counts (``PatchStats.as_dict()["guard"]``), summed over a setting's samples.
GUARD_FIELDS = ("head_calls", "widened", "dense")


def mean(values):
    """Mean of the finite values (None when there are none)."""
    values = [v for v in values if v is not None and math.isfinite(v)]
    return float(np.mean(values)) if values else None


def std(values):
    """Standard deviation of the finite values (None for fewer than two)."""
    values = [v for v in values if v is not None and math.isfinite(v)]
    return float(np.std(values)) if len(values) > 1 else None


def _sample_work(record):
    """A sample's attention work from its record (all None for the unpatched dense setting)."""
    if record.get("method") == "dense":
        return {"density": None, "sparse_density": None, **{k: None for k in CALL_FIELDS}, "fallbacks": None,
                "guard": None}
    extra = record.get("extra") or {}
    guard = extra.get("guard") or {}
    return {"density": record.get("density"), "sparse_density": extra.get("sparse_density"),
            **{k: extra.get(k, 0) for k in CALL_FIELDS}, "fallbacks": dict(extra.get("fallbacks") or {}),
            "guard": {k: guard.get(k, 0) for k in GUARD_FIELDS}}


def attention_work(rows):
    """A setting's attention work from its sample rows: mean densities, summed call counts and
    fallback reasons (None where the rows have none: the dense setting)."""
    work = {"density": mean([r["density"] for r in rows]), "sparse_density": mean([r["sparse_density"] for r in rows])}
    for key in CALL_FIELDS:
        counts = [r[key] for r in rows if r[key] is not None]
        work[key] = sum(counts) if counts else None
    fallbacks = None
    for r in rows:
        if r["fallbacks"] is not None:
            fallbacks = fallbacks if fallbacks is not None else {}
            for reason, count in r["fallbacks"].items():
                fallbacks[reason] = fallbacks.get(reason, 0) + count
    work["fallbacks"] = fallbacks
    guards = [r.get("guard") for r in rows if r.get("guard") is not None]
    work["guard"] = {k: sum(g[k] for g in guards) for k in GUARD_FIELDS} if guards else None
    return work


def _sample_row(cfg, sample, record, dense_record, values, columns):
    speedup = dense_record["latency_s"] / record["latency_s"] if record["latency_s"] else None
    row = {"setting": sample.setting.name, "method": sample.setting.method, "prompt_index": sample.prompt_index,
           "prompt": sample.prompt.text, "dimension": list(sample.prompt.dimension), "seed": sample.seed,
           "latency_s": record["latency_s"], "speedup": speedup, "peak_memory_mb": record["peak_memory_mb"],
           **_sample_work(record), "padding_fraction": record["padding_fraction"], "shape": record["shape"],
           "video": os.path.relpath(sample.stem(cfg.out) + ".mp4", cfg.out),
           "frames": os.path.relpath(sample.stem(cfg.out) + ".npy", cfg.out)}
    row.update({c: values.get(c) for c in columns})
    return row


def aggregate(cfg, settings, samples, log=None, num_processes=1):
    """Build the results dict from the stored records and metric caches (all samples must exist)."""
    import torch

    import fastdit

    log = log or Log()
    records, metrics = {}, {}
    for sample in samples:
        record = load_record(cfg, sample)
        if record is None:
            raise EvalError(f"sample {sample.key} has no complete record under {sample.stem(cfg.out)}.* "
                            f"(generation did not finish; run again to resume)")
        records[sample.key] = record
        metrics[sample.key] = read_metric_cache(cfg, sample).get("values", {})
    columns = [c for c in PER_SAMPLE_COLUMNS if any(c in m for m in metrics.values())]
    rows = [_sample_row(cfg, s, records[s.key], records[("dense", s.prompt_index, s.seed)], metrics[s.key], columns)
            for s in samples]

    per_setting, notes = {}, []
    for name, metric in METRICS.items():
        if name in cfg.metrics and metric.per_setting is not None:
            scores = metric.per_setting(cfg, settings, samples, log)
            columns += scores.columns
            notes += scores.notes
            for setting_name, entries in scores.values.items():
                per_setting.setdefault(setting_name, {}).update(entries)

    shared = [key for key, record in records.items() if (record.get("load") or {}).get("shared")]
    if shared:  # the rule: fastdit.cpu_load; each sample record keeps its "load"
        notes.append(f"{len(shared)} of {len(records)} samples were timed while other work shared the CPU "
                     f"(their records' \"load\"): their latencies and speedups are not what an idle machine gives")
    dense_rows = [r for r in rows if r["setting"] == settings[0].name]
    aggregated = []
    for setting in settings:
        mine = [r for r in rows if r["setting"] == setting.name]
        record = records[(setting.name, mine[0]["prompt_index"], mine[0]["seed"])]
        mean_latency = mean([r["latency_s"] for r in mine])
        entry = {"setting": setting.name, "method": setting.method, "options": setting.options,
                 "effective_options": record.get("effective_options") or {}, "samples": len(mine),
                 "latency_s": mean_latency, "latency_std_s": std([r["latency_s"] for r in mine]),
                 "speedup": mean([r["speedup"] for r in mine]),
                 "speedup_of_means": (mean([r["latency_s"] for r in dense_rows]) / mean_latency
                                      if mean_latency else None),
                 "peak_memory_mb": max((r["peak_memory_mb"] for r in mine if r["peak_memory_mb"] is not None),
                                       default=None),
                 **attention_work(mine)}
        for column in columns:
            if column in PER_SAMPLE_COLUMNS:
                entry[column] = mean([r.get(column) for r in mine])
        entry.update(per_setting.get(setting.name, {}))
        aggregated.append(entry)

    first = records[samples[0].key]
    results = {
        "schema": SCHEMA, "model": cfg.model, "device": first.get("device"), "num_processes": num_processes,
        "call": first.get("call", {}), "backend": cfg.backend, "dtype": cfg.dtype,
        "prompts_file": cfg.prompts_file,
        "prompts": [{"index": i, "prompt": p.text, "dimension": list(p.dimension)} for i, p in enumerate(cfg.prompts)],
        "seeds": list(cfg.seeds), "metrics": list(cfg.metrics),
        "columns": {c: COLUMN_INFO[c] for c in columns},
        "speedup_definition": SPEEDUP_DEFINITION, "density_definition": DENSITY_DEFINITION,
        "settings": aggregated, "samples": rows, "notes": notes,
        "versions": {"fastdit": fastdit.__version__, "torch": torch.__version__},
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    return to_json(results)
