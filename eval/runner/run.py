"""``fastdit eval``: generate dense and accelerated samples over prompts x seeds, score them, report.

A run is a list of *samples*, one per ``(setting, prompt index, seed)``. A *setting* is a method
with one set of options (``sta``, or ``sta[dense_steps=0.25]`` from a ``--grid``); ``dense`` (the
unpatched pipeline) is always the first setting and the reference of every fidelity metric.

    check_inputs     settings, metric weights and tools         (every process, before any work)
    generate_samples phase 1, sharded: samples -> OUT/samples/   (``fastdit.eval.runner.generation``)
    compute_sample_metrics  phase 2, sharded: per-sample values  (``fastdit.eval.runner.scoring``, ``metrics``)
    aggregate        phase 3, main process: results dict         (``fastdit.eval.runner.aggregate``)
    write_reports    results.json, results.md, plots/            (``fastdit.eval.runner.report``)

Resume: a sample whose record, video and frames exist and whose record's fingerprint (model,
requested sizes, dtype, backend, method options, prompt text, seed) matches is never generated
again; an interrupted run therefore loses at most the samples that were in flight. Metric values
are cached the same way (keyed by the fingerprints of the sample and of its dense reference).
Files: ``fastdit.eval.runner.storage``; metrics: ``fastdit.eval.metrics.registry``; timing and what a record
holds: ``fastdit.eval.runner.generation``; speedup and density: ``fastdit.eval.runner.aggregate``.
"""
from __future__ import annotations

import os

from fastdit.eval.runner.aggregate import aggregate
from fastdit.eval.runner.config import EvalError
from fastdit.eval.runner.generation import generate_samples
from fastdit.eval.metrics.registry import check_metrics, run_checks
from fastdit.eval.runner.processes import Log
from fastdit.eval.runner.report import markdown_table, write_contact_sheets, write_reports
from fastdit.eval.runner.scoring import compute_sample_metrics
from fastdit.eval.runner.settings import build_samples, build_settings

__all__ = ["check_inputs", "run_eval"]


def check_inputs(cfg):
    """Validate what can be validated before any generation: metrics, seeds, prompts, settings,
    weights. Returns the list of settings. Raises ``EvalError`` with a message that names the problem.
    """
    check_metrics(cfg)
    if not cfg.prompts:
        raise EvalError("no prompts given")
    if not cfg.seeds:
        raise EvalError("no seeds given")
    if len(set(cfg.seeds)) != len(cfg.seeds):
        raise EvalError(f"repeated seeds in {cfg.seeds}")
    if cfg.cache is not None:
        from fastdit.integrations.caches import check_cache

        try:
            check_cache(cfg.cache, cfg.cp is not None or cfg.cp_ring is not None)
        except ValueError as error:
            raise EvalError(f"cache {cfg.cache!r}: {error}") from None
    settings = build_settings(cfg)
    run_checks(cfg)
    return settings


def run_eval(cfg, state=None, log=None, check_call=None):
    """Check inputs, generate (sharded), score (sharded), aggregate and report (main process).

    ``state``: an ``accelerate.PartialState`` (None: one process; ``fastdit.eval.runner.processes.make_state``
    makes one). ``check_call(pipe, call_kwargs)``: called once the pipeline is loaded, may refuse
    the call (the command line checks its size limits). Returns the results dict on the main
    process, None on the others.
    """
    log = log or Log(state)
    settings = check_inputs(cfg)  # every process checks, so every process stops on bad input
    samples = build_samples(cfg, settings)
    os.makedirs(cfg.out, exist_ok=True)
    log(f"{len(settings)} setting(s) x {len(cfg.prompts)} prompt(s) x {len(cfg.seeds)} seed(s) = {len(samples)} samples"
        f" -> {cfg.out}")
    generate_samples(cfg, samples, state, log, check_call)
    if state is not None:
        state.wait_for_everyone()
    compute_sample_metrics(cfg, samples, state, log)
    if state is not None:
        state.wait_for_everyone()
    results = None
    if state is None or state.is_main_process:
        results = aggregate(cfg, settings, samples, log, num_processes=1 if state is None else state.num_processes)
        write_reports(cfg, results, log)
        write_contact_sheets(cfg, samples, results, log)
        log(markdown_table(results))
        log(f"results.json, results.md and plots/ in {cfg.out}")
    if state is not None:
        state.wait_for_everyone()
    return results
