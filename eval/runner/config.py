"""What defines an eval run (``EvalConfig``), the error every eval step raises on bad input, and
the results' schema constants. The bottom of ``fastdit.eval``: imports nothing from it.

A run is a list of *samples*, one per ``(setting, prompt index, seed)``. A *setting* is a method
with one set of options (``sta``, or ``sta[dense_steps=0.25]`` from a ``grid``); ``dense`` (the
unpatched pipeline) is always the first setting and the reference of every fidelity metric.
The modules, bottom up: ``config``, ``prompts``, ``settings`` (settings, samples, fingerprints),
``storage`` (files under the output folder), ``processes`` (logging, sharding), ``metrics`` (the
metric registry), ``generation`` and ``scoring`` (the two sharded phases), ``aggregate``
(results.json), ``report`` (results.md, plots) and ``runner`` (the whole run).
"""
from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["SCHEMA", "TIMING_FIELDS", "EvalConfig", "EvalError"]

SCHEMA = "fastdit.eval/1"
#: Fields that depend on the machine and the moment, not on the samples (left out when comparing runs).
TIMING_FIELDS = {"latency_s", "latency_std_s", "speedup", "speedup_of_means", "peak_memory_mb", "wall_s",
                 "num_processes", "created", "device", "elapsed_s"}


class EvalError(ValueError):
    """Bad input to an eval run (unknown metric or method, bad prompt file, missing weights, ...)."""


@dataclass
class EvalConfig:
    """Everything that defines an eval run. ``call`` holds the requested generation sizes
    (``steps``, ``frames``, ``height``, ``width``, ``guidance``, ``negative_prompt``); the model's
    defaults fill the rest when the pipeline is loaded. ``prompts``: ``fastdit.eval.runner.prompts.Prompt``
    objects (``load_prompts``)."""

    out: str
    model: str = "tiny-wan"
    methods: list = field(default_factory=lambda: ["dense", "sta"])
    options: dict = field(default_factory=dict)  # method -> options, for every setting of it
    grid: dict = field(default_factory=dict)  # method -> {option: [values]}: one setting per combination
    prompts: list = field(default_factory=list)  # Prompt
    prompts_file: str = ""
    seeds: list = field(default_factory=lambda: [0])
    metrics: list = field(default_factory=lambda: ["psnr", "ssim", "vbench"])
    call: dict = field(default_factory=dict)
    device: str | None = None
    dtype: str | None = None
    backend: str = "auto"
    fps: int = 16
    warmup: bool = True
    progress: bool = True
    lpips_net: str = "alex"
    lpips_weights: str | None = None
    fid_weights: str | None = None
    fid_frames: int = 16
    clip_model: str | None = None
    vbench_python: str | None = None
    vbench_dimensions: list | None = None
    plots: bool = True
    #: Ulysses context-parallel degree (``--cp``): each sample is split over this many processes
    #: of the launcher; the groups of processes share the samples. None: one process per sample.
    cp: int | None = None
    #: ring degree (``--cp-ring``): with ``cp``, Ulysses x ring; groups of ``cp * cp_ring`` processes.
    cp_ring: int | None = None
    #: a cache-dit cache (``fastdit.integrations.caches.CACHES``): every setting also runs with it (``sta+dbcache``);
    #: ``cache_options`` override its fitted ``DBCacheConfig`` fields. None: no cache runs.
    cache: str | None = None
    cache_options: dict = field(default_factory=dict)
