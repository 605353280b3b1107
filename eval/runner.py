"""``fastdit eval``: generate dense and accelerated samples over prompts x seeds, score them, report.

A run is a list of *samples*, one per ``(setting, prompt index, seed)``. A *setting* is a method
with one set of options (``sta``, or ``sta[dense_steps=0.25]`` from a ``--grid``); ``dense`` (the
unpatched pipeline) is always the first setting and the reference of every fidelity metric.

Files under the output folder ``DIR``::

    DIR/samples/<setting>/<prompt>_<seed>.mp4           the video (H.264)
    DIR/samples/<setting>/<prompt>_<seed>.npy           its raw frames, uint8 (F, H, W, 3)
    DIR/samples/<setting>/<prompt>_<seed>.json          the generation record (written last, atomically)
    DIR/samples/<setting>/<prompt>_<seed>.metrics.json  cached per-sample metric values
    DIR/samples/<setting>/<prompt>_<seed>.fid.npy       Inception features of its frames (metric fid)
    DIR/results.json, DIR/results.md, DIR/plots/*.png

Resume: a sample whose record, video and frames exist and whose record's fingerprint (model,
requested sizes, dtype, backend, method options, prompt text, seed) matches is never generated
again; an interrupted run therefore loses at most the samples that were in flight. Metric values
are cached the same way (keyed by the fingerprints of the sample and of its dense reference).

Metrics are computed from the stored uint8 frames, not from the mp4, so H.264 compression does not
enter them; the 8-bit quantisation (what any saved video holds) does. ``psnr``/``ssim``/``lpips``
compare a sample with the dense sample of the same prompt and seed; ``clip`` scores a sample
against its prompt; ``fid`` is per setting, between the setting's frames and the dense frames
(``--fid-frames`` evenly spaced frames per video); ``vbench`` always gives VBench's temporal
flickering computed natively per sample (on the raw frames, VBench itself reads the mp4), and
with ``--vbench-python`` runs VBench's other dimensions in its own environment, per setting.

Timing: ``latency_s`` is the sample's denoising+decoding time (CUDA events on a GPU, else wall
clock); warm-up runs (1 step, not recorded) happen first in every process. ``speedup`` of a sample
is the dense latency of the same prompt and seed divided by its latency; a setting's ``speedup``
is the mean of its samples' speedups (``speedup_of_means``, the ratio of mean latencies, is given
too). With several processes, a sample and its dense reference run in the same process (the
per-setting split puts the same prompt and seed at the same rank), so speedups compare like with
like. ``peak_memory_mb``: CUDA peak allocated memory during the sample (null on the CPU).
"""
from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
import os
import re
import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import numpy as np

SCHEMA = "fastdit.eval/1"

#: Metric name -> how its values read. ``against``: "dense" (same prompt and seed), "prompt", or
#: "dense set" (per setting). Column names in results: the metric's ``columns``.
METRICS = {
    "psnr": {"columns": ["psnr"], "higher_is_better": True, "unit": "dB", "against": "dense"},
    "ssim": {"columns": ["ssim"], "higher_is_better": True, "unit": "", "against": "dense"},
    "lpips": {"columns": ["lpips"], "higher_is_better": False, "unit": "", "against": "dense"},
    "clip": {"columns": ["clip"], "higher_is_better": True, "unit": "", "against": "prompt"},
    "fid": {"columns": ["fid"], "higher_is_better": False, "unit": "", "against": "dense set"},
    "vbench": {"columns": ["temporal_flickering"], "higher_is_better": True, "unit": "", "against": "none"},
}
COLUMN_INFO = {
    "psnr": METRICS["psnr"], "ssim": METRICS["ssim"], "lpips": METRICS["lpips"], "clip": METRICS["clip"],
    "fid": METRICS["fid"],
    "temporal_flickering": {"higher_is_better": True, "unit": "", "against": "none"},
    "vbench_quality": {"higher_is_better": True, "unit": "", "against": "none"},
    "vbench_semantic": {"higher_is_better": True, "unit": "", "against": "none"},
    "vbench_total": {"higher_is_better": True, "unit": "", "against": "none"},
}
PER_SAMPLE_COLUMNS = ["psnr", "ssim", "lpips", "clip", "temporal_flickering"]
#: Fields that depend on the machine and the moment, not on the samples (left out when comparing runs).
TIMING_FIELDS = {"latency_s", "latency_std_s", "speedup", "speedup_of_means", "peak_memory_mb", "wall_s",
                 "num_processes", "created", "device", "elapsed_s"}
#: VBench dimensions that work on any prompt (custom mode), used when no dimension tags say otherwise.
VBENCH_CUSTOM_DIMENSIONS = ["subject_consistency", "background_consistency", "motion_smoothness",
                            "dynamic_degree", "aesthetic_quality", "imaging_quality", "temporal_flickering"]
SHIPPED_PROMPTS = {"coco": "coco_captions.txt", "vbench": "vbench_subset.json"}


class EvalError(ValueError):
    """Bad input to an eval run (unknown metric or method, bad prompt file, missing weights, ...)."""


# --------------------------------------------------------------------------------------------
# prompts
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Prompt:
    text: str
    dimension: tuple = ()


def shipped_prompt_file(name):
    """Path of a prompt file shipped with fastdit: ``coco`` or ``vbench``."""
    return str(resources.files("fastdit.eval").joinpath("prompts", SHIPPED_PROMPTS[name]))


def load_prompts(path):
    """Prompts from a ``.txt`` (one per line, ``#`` comments and blank lines skipped) or ``.json``
    file (a list of strings, or of objects with ``prompt_en`` or ``prompt`` and an optional
    ``dimension`` string or list, as in VBench's ``VBench_full_info.json``).

    ``path`` may also be ``coco`` or ``vbench`` (the shipped files). Raises ``EvalError`` for a
    missing, empty or malformed file.
    """
    if path in SHIPPED_PROMPTS:
        path = shipped_prompt_file(path)
    path = os.path.expanduser(str(path))
    if not os.path.isfile(path):
        raise EvalError(f"prompt file {path} does not exist (shipped prompt sets: {', '.join(SHIPPED_PROMPTS)})")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if path.endswith(".json"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise EvalError(f"prompt file {path} is not valid JSON: {error}") from None
        if not isinstance(data, list):
            raise EvalError(f"prompt file {path}: expected a JSON list of prompts, got {type(data).__name__}")
        prompts = []
        for i, item in enumerate(data):
            if isinstance(item, str):
                prompts.append(Prompt(item.strip()))
                continue
            if not isinstance(item, dict):
                raise EvalError(f"prompt file {path}: entry {i} is {type(item).__name__}, expected a string or an object")
            value = item.get("prompt_en", item.get("prompt"))
            if not isinstance(value, str):
                raise EvalError(f"prompt file {path}: entry {i} has no string 'prompt_en' or 'prompt' field")
            dims = item.get("dimension", ())
            dims = (dims,) if isinstance(dims, str) else dims
            if not isinstance(dims, (list, tuple)) or not all(isinstance(d, str) for d in dims):
                raise EvalError(f"prompt file {path}: entry {i} has a 'dimension' that is not a string or list of strings")
            prompts.append(Prompt(value.strip(), tuple(dims)))
        empty = [i for i, p in enumerate(prompts) if not p.text]
        if empty:
            raise EvalError(f"prompt file {path}: entry {empty[0]} is an empty prompt")
    else:
        prompts = [Prompt(line.strip()) for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    if not prompts:
        raise EvalError(f"prompt file {path} holds no prompts")
    return prompts


# --------------------------------------------------------------------------------------------
# configuration, settings, samples
# --------------------------------------------------------------------------------------------

@dataclass
class EvalConfig:
    """Everything that defines an eval run. ``call`` holds the requested generation sizes
    (``steps``, ``frames``, ``height``, ``width``, ``guidance``, ``negative_prompt``); the model's
    defaults fill the rest when the pipeline is loaded."""

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


@dataclass(frozen=True)
class Setting:
    name: str
    method: str
    options: dict = field(default_factory=dict, hash=False, compare=False)

    @property
    def slug(self):
        return re.sub(r"[^A-Za-z0-9._=+-]+", "_", self.name.replace("[", "-").replace("]", "")).strip("_")


@dataclass(frozen=True)
class Sample:
    setting: Setting
    prompt_index: int
    prompt: Prompt
    seed: int

    @property
    def key(self):
        return (self.setting.name, self.prompt_index, self.seed)

    def stem(self, out):
        return os.path.join(out, "samples", self.setting.slug, f"{self.prompt_index}_{self.seed}")


def _format_value(value):
    if isinstance(value, (tuple, list)):
        return "x".join(str(v) for v in value) if all(isinstance(v, (int, float)) for v in value) else str(list(value))
    return str(value)


def build_settings(cfg):
    """Settings in run order: dense, then each method (one per grid combination)."""
    import fastdit

    methods = ["dense"] + [m for m in cfg.methods if m != "dense"]
    unknown = [m for m in methods if m not in fastdit.methods()]
    if unknown:
        raise EvalError(f"unknown method(s) {', '.join(unknown)}; available: {', '.join(fastdit.methods())}")
    for method in list(cfg.options) + list(cfg.grid):
        if method not in methods:
            raise EvalError(f"options given for method {method!r}, which is not in --methods {','.join(methods)}")
    if cfg.grid.get("dense"):
        raise EvalError("--grid on dense: dense is the reference and takes no options")
    settings = []
    for method in methods:
        base = dict(cfg.options.get(method, {}))
        grid = cfg.grid.get(method) or {}
        names = list(grid)
        for combo in itertools.product(*(grid[n] for n in names)) if names else [()]:
            options = {**base, **dict(zip(names, combo))}
            label = method if not names else method + "[" + ",".join(f"{n}={_format_value(v)}" for n, v in zip(names, combo)) + "]"
            try:
                fastdit.methods.get_method(method).make_config(None, **options)
            except (TypeError, ValueError) as error:
                raise EvalError(f"setting {label}: {error}") from None
            settings.append(Setting(label, method, options))
    return settings


def build_samples(cfg, settings):
    """All samples in a fixed order: setting, then prompt, then seed."""
    return [Sample(s, i, p, int(seed)) for s in settings for i, p in enumerate(cfg.prompts) for seed in cfg.seeds]


def fingerprint(cfg, sample):
    """What a stored sample must match to be reused on resume."""
    data = {"model": cfg.model, "call": cfg.call, "dtype": cfg.dtype, "backend": cfg.backend,
            "method": sample.setting.method, "options": sample.setting.options,
            "prompt": sample.prompt.text, "seed": sample.seed}
    return hashlib.sha1(json.dumps(data, sort_keys=True, default=_json_default).encode()).hexdigest()[:16]


# --------------------------------------------------------------------------------------------
# up-front checks
# --------------------------------------------------------------------------------------------

def resolve_clip_model(cfg):
    from fastdit.eval.clip_score import DEFAULT_CLIP_MODEL

    return cfg.clip_model or os.environ.get("FASTDIT_CLIP_MODEL") or DEFAULT_CLIP_MODEL


def check_inputs(cfg):
    """Validate what can be validated before any generation: metrics, seeds, prompts, weights.

    Returns the list of settings. Raises ``EvalError`` with a message that names the problem.
    """
    unknown = [m for m in cfg.metrics if m not in METRICS]
    if unknown:
        raise EvalError(f"unknown metric(s) {', '.join(unknown)}; available: {', '.join(METRICS)}")
    if not cfg.metrics:
        raise EvalError("no metrics given")
    if not cfg.prompts:
        raise EvalError("no prompts given")
    if not cfg.seeds:
        raise EvalError("no seeds given")
    if len(set(cfg.seeds)) != len(cfg.seeds):
        raise EvalError(f"repeated seeds in {cfg.seeds}")
    settings = build_settings(cfg)
    if "lpips" in cfg.metrics:
        from fastdit.eval.fidelity import _LPIPS_NETS, _resolve_lpips_files

        if cfg.lpips_net not in _LPIPS_NETS:
            raise EvalError(f"--lpips-net must be one of {sorted(_LPIPS_NETS)}, got {cfg.lpips_net!r}")
        try:
            _resolve_lpips_files(cfg.lpips_net, cfg.lpips_weights)
        except FileNotFoundError as error:
            raise EvalError(f"metric lpips: {error} Or pass --lpips-weights DIR.") from None
    if "fid" in cfg.metrics:
        from fastdit.eval.fid import _resolve_weights

        try:
            _resolve_weights(cfg.fid_weights)
        except FileNotFoundError as error:
            raise EvalError(f"metric fid: {error} (--fid-weights PATH on the command line).") from None
        if cfg.fid_frames < 1:
            raise EvalError("--fid-frames must be at least 1")
        if len(cfg.prompts) * len(cfg.seeds) * cfg.fid_frames < 2:
            raise EvalError("metric fid needs at least 2 frames per setting (more prompts, seeds or --fid-frames)")
    if "clip" in cfg.metrics:
        _check_clip(resolve_clip_model(cfg))
    if "vbench" in cfg.metrics and cfg.vbench_python:
        from fastdit.eval.vbench import NORMALIZE, _vbench_python

        try:
            _vbench_python(cfg.vbench_python)
        except FileNotFoundError as error:
            raise EvalError(f"metric vbench: {error}") from None
        bad = [d for d in cfg.vbench_dimensions or [] if d not in NORMALIZE]
        if bad:
            raise EvalError(f"unknown VBench dimension(s) {bad}; known: {sorted(NORMALIZE)}")
    return settings


def _check_clip(model):
    where = ("a folder holding a HF-format CLIP model (config.json, model.safetensors, tokenizer files, "
             "preprocessor_config.json), given with --clip-model PATH or FASTDIT_CLIP_MODEL")
    expanded = os.path.expanduser(str(model))
    looks_like_path = os.path.isabs(expanded) or str(model).startswith((".", "~")) or os.path.exists(expanded)
    if looks_like_path:
        if not os.path.isfile(os.path.join(expanded, "config.json")):
            raise EvalError(f"metric clip: no CLIP model at {expanded} ({os.path.join(expanded, 'config.json')} is "
                            f"missing). Put {where}.")
        return
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(str(model), "config.json")
    except Exception:  # noqa: BLE001 - an invalid repo id is "not cached" too
        cached = None
    if not isinstance(cached, str):
        raise EvalError(f"metric clip: CLIP model {model!r} is not in the local Hugging Face cache (nothing is "
                        f"downloaded). Download it on a machine with network (`huggingface-cli download {model}`) "
                        f"or put {where}.")


# --------------------------------------------------------------------------------------------
# storage helpers
# --------------------------------------------------------------------------------------------

def _atomic_write_json(path, data):
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2, default=_json_default, allow_nan=False)
    os.replace(tmp, path)


def _atomic_save_npy(path, array):
    tmp = f"{path}.tmp{os.getpid()}.npy"
    np.save(tmp, array)
    os.replace(tmp, path)


def _read_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return None


def _json_default(value):
    if isinstance(value, (np.floating, np.integer)):
        return value.item()
    if isinstance(value, (set, tuple)):
        return list(value)
    if isinstance(value, Prompt):
        return dataclasses.asdict(value)
    return str(value)


def _clean(value):
    """Non-finite floats -> None (JSON has no inf/nan), recursively."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if isinstance(value, (np.floating, np.integer)):
        return _clean(value.item())
    return value


def load_record(cfg, sample):
    """The stored record of ``sample`` if it is complete and matches the current run, else None."""
    stem = sample.stem(cfg.out)
    record = _read_json(stem + ".json")
    if not record or record.get("fingerprint") != fingerprint(cfg, sample):
        return None
    if not (os.path.isfile(stem + ".mp4") and os.path.isfile(stem + ".npy")):
        return None
    return record


def load_frames(cfg, sample):
    return np.load(sample.stem(cfg.out) + ".npy")


# --------------------------------------------------------------------------------------------
# phase 1: generation
# --------------------------------------------------------------------------------------------

class _Log:
    def __init__(self, state=None):
        self.state = state

    def __call__(self, message, all_ranks=False):
        if self.state is None or self.state.num_processes == 1:
            print(message, flush=True)
        elif all_ranks or self.state.is_main_process:
            print(f"[rank {self.state.process_index}] {message}", flush=True)


def _split(state, items):
    if state is None or state.num_processes == 1:
        return list(items)
    with state.split_between_processes(list(items)) as mine:
        return list(mine)


def _call_kwargs(pipe, cfg):
    from fastdit.cli import call_arguments

    kwargs = call_arguments(pipe, cfg.model, cfg.call.get("height"), cfg.call.get("width"), cfg.call.get("frames"),
                            cfg.call.get("steps"), cfg.call.get("guidance"))
    if cfg.call.get("negative_prompt") is not None:
        kwargs["negative_prompt"] = cfg.call["negative_prompt"]
    return kwargs


def _load_pipe(cfg, device):
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


def timed_generate(pipe, sample, call_kwargs, backend):
    """``compare.generate`` timed with CUDA events on a GPU (wall clock from generate elsewhere)."""
    import torch

    from fastdit.compare import pipeline_device

    device = pipeline_device(pipe)
    on_cuda = str(device).startswith("cuda")
    if on_cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    wall = time.perf_counter()
    from fastdit.compare import generate

    result = generate(pipe, sample.prompt.text, sample.seed, call_kwargs, sample.setting.method,
                      sample.setting.options, backend)
    wall = time.perf_counter() - wall
    if on_cuda:
        end.record()
        end.synchronize()
        result.latency_s = start.elapsed_time(end) / 1000.0
    return result, wall


def generate_samples(cfg, samples, state=None, log=None):
    """Generate this process's share of the samples that are not stored yet. Returns the count.

    Each setting's samples are split between processes (accelerate's contiguous split), so a
    sample and its dense reference land on the same process.
    """
    from tqdm.auto import tqdm

    from fastdit.video import to_uint8, write_video

    log = log or _Log(state)
    by_setting = {}
    for sample in samples:
        by_setting.setdefault(sample.setting.name, []).append(sample)
    mine = [s for group in by_setting.values() for s in _split(state, group)]
    todo = [s for s in mine if load_record(cfg, s) is None]
    log(f"{len(mine) - len(todo)} of {len(mine)} samples of this process already done; generating {len(todo)}",
        all_ranks=state is not None and state.num_processes > 1)
    if not todo:
        return 0
    device = cfg.device or (str(state.device) if state is not None and state.num_processes > 1 else None)
    pipe = _load_pipe(cfg, device)
    call_kwargs = _call_kwargs(pipe, cfg)
    if cfg.warmup:
        _warmup(pipe, cfg, todo, call_kwargs)
    rank = 0 if state is None else state.process_index
    bar = tqdm(todo, desc="generate" if rank == 0 else f"generate [rank {rank}]", position=rank,
               disable=not cfg.progress, dynamic_ncols=True, leave=True)
    shown_call = {k: v for k, v in call_kwargs.items() if isinstance(v, (int, float, str, bool))}
    for sample in bar:
        bar.set_postfix_str(f"{sample.setting.name} p{sample.prompt_index} s{sample.seed}")
        result, wall = timed_generate(pipe, sample, call_kwargs, cfg.backend)
        stem = sample.stem(cfg.out)
        os.makedirs(os.path.dirname(stem), exist_ok=True)
        frames8 = to_uint8(np.asarray(result.frames))
        tmp_video = f"{stem}.tmp{os.getpid()}.mp4"
        write_video(tmp_video, frames8, fps=cfg.fps)
        os.replace(tmp_video, stem + ".mp4")
        _atomic_save_npy(stem + ".npy", frames8)
        record = {
            "fingerprint": fingerprint(cfg, sample), "setting": sample.setting.name, "method": sample.setting.method,
            "options": sample.setting.options, "effective_options": result.options,
            "prompt_index": sample.prompt_index, "prompt": sample.prompt.text, "seed": sample.seed,
            "latency_s": result.latency_s, "wall_s": wall, "peak_memory_mb": result.peak_memory_mb,
            "density": result.density, "padding_fraction": result.padding_fraction, "extra": result.extra,
            "shape": list(frames8.shape), "call": shown_call, "device": str(getattr(pipe, "device", "")),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
        _atomic_write_json(stem + ".json", _clean(record))  # last: its presence means the sample is complete
    bar.close()
    return len(todo)


def _warmup(pipe, cfg, todo, call_kwargs):
    """Untimed 1-step runs so first-call costs (allocation, compilation) stay out of the timings."""
    from fastdit.compare import generate, pipeline_device

    warm = {**call_kwargs, "num_inference_steps": 1, "output_type": "latent"}
    prompt = todo[0].prompt.text
    generate(pipe, prompt, 0, warm, "dense", {}, cfg.backend)
    if str(pipeline_device(pipe)).startswith("cuda"):
        seen = set()
        for sample in todo:
            if sample.setting.method != "dense" and sample.setting.name not in seen:
                seen.add(sample.setting.name)
                options = {**sample.setting.options, "dense_steps": 0}
                generate(pipe, prompt, 0, warm, sample.setting.method, options, cfg.backend)


# --------------------------------------------------------------------------------------------
# phase 2: per-sample metrics
# --------------------------------------------------------------------------------------------

def _metric_keys(cfg):
    """Cache key per per-sample metric: changes when what the value means changes."""
    keys = {}
    if "psnr" in cfg.metrics:
        keys["psnr"] = "psnr"
    if "ssim" in cfg.metrics:
        keys["ssim"] = "ssim"
    if "lpips" in cfg.metrics:
        keys["lpips"] = f"lpips:{cfg.lpips_net}"
    if "clip" in cfg.metrics:
        keys["clip"] = f"clip:{resolve_clip_model(cfg)}"
    if "vbench" in cfg.metrics:
        keys["temporal_flickering"] = "temporal_flickering:raw"
    if "fid" in cfg.metrics:
        keys["fid_features"] = f"fid_features:{cfg.fid_frames}"
    return keys


def _fid_frames(frames, count):
    index = np.unique(np.linspace(0, len(frames) - 1, min(count, len(frames))).round().astype(int))
    return frames[index]


def compute_sample_metrics(cfg, samples, state=None, log=None):
    """Per-sample metrics for this process's share of the samples (all generated by now)."""
    from tqdm.auto import tqdm

    log = log or _Log(state)
    keys = _metric_keys(cfg)
    dense = {(s.prompt_index, s.seed): s for s in samples if s.setting.method == "dense"}
    mine = _split(state, samples)
    device = cfg.device or (str(state.device) if state is not None and state.num_processes > 1 else "cpu")
    rank = 0 if state is None else state.process_index
    todo = []
    for sample in mine:
        reference = dense[(sample.prompt_index, sample.seed)]
        cache = _read_json(sample.stem(cfg.out) + ".metrics.json") or {}
        fp, ref_fp = fingerprint(cfg, sample), fingerprint(cfg, reference)
        if cache.get("sample") != fp or cache.get("reference") != ref_fp:
            cache = {"sample": fp, "reference": ref_fp, "keys": {}, "values": {}}
        missing = [m for m, k in keys.items() if cache["keys"].get(m) != k]
        if "fid_features" in keys and not os.path.isfile(sample.stem(cfg.out) + ".fid.npy"):
            missing = sorted(set(missing) | {"fid_features"})
        if missing:
            todo.append((sample, reference, cache, missing))
    if not todo:
        return 0
    bar = tqdm(todo, desc="metrics" if rank == 0 else f"metrics [rank {rank}]", position=rank,
               disable=not cfg.progress, dynamic_ncols=True)
    for sample, reference, cache, missing in bar:
        frames = load_frames(cfg, sample)
        is_dense = sample.setting.method == "dense"
        ref = None
        if not is_dense and {"psnr", "ssim", "lpips"} & set(missing):
            ref = load_frames(cfg, reference)
            if ref.shape != frames.shape:
                raise EvalError(
                    f"cannot compare videos of different sizes: {sample.stem(cfg.out)}.npy is {tuple(frames.shape)}, "
                    f"its dense reference {reference.stem(cfg.out)}.npy is {tuple(ref.shape)}")
        values = cache["values"]
        for metric in missing:
            if metric == "psnr":
                from fastdit.eval.fidelity import psnr

                values["psnr"] = None if is_dense else _clean(float(psnr(frames, ref)))
            elif metric == "ssim":
                from fastdit.eval.fidelity import ssim

                values["ssim"] = None if is_dense else float(ssim(frames, ref))
            elif metric == "lpips":
                from fastdit.eval.fidelity import lpips_distance

                values["lpips"] = None if is_dense else float(
                    lpips_distance(frames, ref, net=cfg.lpips_net, weights=cfg.lpips_weights, device=device))
            elif metric == "clip":
                from fastdit.eval.clip_score import clip_score_video

                values["clip"] = float(clip_score_video(frames, sample.prompt.text, resolve_clip_model(cfg), device=device))
            elif metric == "temporal_flickering":
                from fastdit.eval.vbench import temporal_flickering

                values["temporal_flickering"] = float(temporal_flickering(frames)) if len(frames) > 1 else None
            elif metric == "fid_features":
                from fastdit.eval.fid import inception_features

                feats = inception_features(_fid_frames(frames, cfg.fid_frames), weights=cfg.fid_weights, device=device)
                _atomic_save_npy(sample.stem(cfg.out) + ".fid.npy", feats)
            cache["keys"][metric] = keys[metric]
        _atomic_write_json(sample.stem(cfg.out) + ".metrics.json", _clean(cache))
    bar.close()
    return len(todo)


# --------------------------------------------------------------------------------------------
# phase 3: set-level metrics, aggregation, reports (main process)
# --------------------------------------------------------------------------------------------

def _mean(values):
    values = [v for v in values if v is not None and math.isfinite(v)]
    return float(np.mean(values)) if values else None


def _std(values):
    values = [v for v in values if v is not None and math.isfinite(v)]
    return float(np.std(values)) if len(values) > 1 else None


def _vbench(cfg, settings, samples, log):
    """Full VBench per setting through its own interpreter. Returns {setting: scores}."""
    from fastdit.eval.vbench import run_vbench, vbench_scores, write_vbench_videos

    tagged = all(p.dimension for p in cfg.prompts)
    mode = "standard" if tagged else "custom"
    dims = cfg.vbench_dimensions or (sorted({d for p in cfg.prompts for d in p.dimension}) if tagged
                                     else VBENCH_CUSTOM_DIMENSIONS)
    out = {}
    for setting in settings:
        mine = [s for s in samples if s.setting == setting]
        videos_dir = os.path.join(cfg.out, "vbench", setting.slug, "videos")
        if os.path.isdir(videos_dir):
            import shutil

            shutil.rmtree(videos_dir)
        log(f"VBench ({mode}, {', '.join(dims)}) on {setting.name}")
        write_vbench_videos([load_frames(cfg, s) for s in mine], [s.prompt.text for s in mine], videos_dir,
                            mode=mode, fps=cfg.fps)
        scores = run_vbench(videos_dir, dims, python=cfg.vbench_python,
                            out_dir=os.path.join(cfg.out, "vbench", setting.slug, "results"), mode=mode)
        summary = vbench_scores(scores)
        out[setting.name] = {"mode": mode, "dimensions": scores, "quality_score": summary["quality_score"],
                             "semantic_score": summary["semantic_score"], "total_score": summary["total_score"]}
    return out


def aggregate(cfg, settings, samples, log=None, num_processes=1):
    """Build the results dict from the stored records and metric caches (all samples must exist)."""
    import torch

    import fastdit

    log = log or _Log()
    records, metrics = {}, {}
    for sample in samples:
        record = load_record(cfg, sample)
        if record is None:
            raise EvalError(f"sample {sample.key} has no complete record under {sample.stem(cfg.out)}.* "
                            f"(generation did not finish; run again to resume)")
        records[sample.key] = record
        metrics[sample.key] = (_read_json(sample.stem(cfg.out) + ".metrics.json") or {}).get("values", {})
    columns = [c for c in PER_SAMPLE_COLUMNS if any(c in m for m in metrics.values())]
    rows = []
    for sample in samples:
        record, values = records[sample.key], metrics[sample.key]
        dense_record = records[("dense", sample.prompt_index, sample.seed)]
        speedup = dense_record["latency_s"] / record["latency_s"] if record["latency_s"] else None
        row = {"setting": sample.setting.name, "method": sample.setting.method, "prompt_index": sample.prompt_index,
               "prompt": sample.prompt.text, "dimension": list(sample.prompt.dimension), "seed": sample.seed,
               "latency_s": record["latency_s"], "speedup": speedup, "peak_memory_mb": record["peak_memory_mb"],
               "density": record["density"], "padding_fraction": record["padding_fraction"],
               "shape": record["shape"],
               "video": os.path.relpath(sample.stem(cfg.out) + ".mp4", cfg.out),
               "frames": os.path.relpath(sample.stem(cfg.out) + ".npy", cfg.out)}
        row.update({c: values.get(c) for c in columns})
        rows.append(row)

    fid = {}
    if "fid" in cfg.metrics:
        from fastdit.eval.fid import compute_stats, frechet_distance

        def stats(setting):
            feats = np.concatenate([np.load(s.stem(cfg.out) + ".fid.npy") for s in samples if s.setting == setting])
            return compute_stats(features=feats)

        ref_stats = stats(settings[0])
        for setting in settings[1:]:
            fid[setting.name] = float(frechet_distance(*stats(setting), *ref_stats))
        fid[settings[0].name] = None
        columns.append("fid")

    vbench_full, notes = {}, []
    if "vbench" in cfg.metrics:
        if cfg.vbench_python:
            vbench_full = _vbench(cfg, settings, samples, log)
            columns += ["vbench_quality", "vbench_semantic", "vbench_total"]
        else:
            notes.append("vbench: only temporal_flickering was computed (natively, on the raw frames); VBench's other "
                         "dimensions need VBench's own interpreter: --vbench-python /path/to/vbench-env/bin/python "
                         "(or FASTDIT_VBENCH_PYTHON).")
    if "fid" in cfg.metrics:
        notes.append(f"fid: per setting, its frames against the dense frames ({cfg.fid_frames} evenly spaced frames "
                     f"per video); few samples give a noisy, biased FID.")

    aggregated = []
    for setting in settings:
        mine = [r for r in rows if r["setting"] == setting.name]
        dense_rows = [r for r in rows if r["setting"] == settings[0].name]
        record = records[(setting.name, mine[0]["prompt_index"], mine[0]["seed"])]
        mean_latency = _mean([r["latency_s"] for r in mine])
        entry = {"setting": setting.name, "method": setting.method, "options": setting.options,
                 "effective_options": record.get("effective_options") or {}, "samples": len(mine),
                 "latency_s": mean_latency, "latency_std_s": _std([r["latency_s"] for r in mine]),
                 "speedup": _mean([r["speedup"] for r in mine]),
                 "speedup_of_means": _mean([r["latency_s"] for r in dense_rows]) / mean_latency if mean_latency else None,
                 "peak_memory_mb": max((r["peak_memory_mb"] for r in mine if r["peak_memory_mb"] is not None), default=None),
                 "density": _mean([r["density"] for r in mine])}
        for column in columns:
            if column in PER_SAMPLE_COLUMNS:
                entry[column] = _mean([r.get(column) for r in mine])
        if "fid" in cfg.metrics:
            entry["fid"] = fid.get(setting.name)
        if vbench_full:
            full = vbench_full[setting.name]
            entry.update({"vbench_quality": full["quality_score"], "vbench_semantic": full["semantic_score"],
                          "vbench_total": full["total_score"], "vbench": full})
        aggregated.append(entry)

    first = records[samples[0].key]
    results = {
        "schema": SCHEMA, "model": cfg.model, "device": first.get("device"), "num_processes": num_processes,
        "call": first.get("call", {}), "backend": cfg.backend, "dtype": cfg.dtype,
        "prompts_file": cfg.prompts_file,
        "prompts": [{"index": i, "prompt": p.text, "dimension": list(p.dimension)} for i, p in enumerate(cfg.prompts)],
        "seeds": list(cfg.seeds), "metrics": list(cfg.metrics),
        "columns": {c: COLUMN_INFO[c] for c in columns},
        "speedup_definition": "per sample: dense latency of the same prompt and seed / the sample's latency; "
                              "per setting: the mean of its samples' speedups (speedup_of_means: ratio of mean latencies)",
        "settings": aggregated, "samples": rows, "notes": notes,
        "versions": {"fastdit": fastdit.__version__, "torch": torch.__version__},
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    return _clean(results)


def _fmt(value, column=None):
    if value is None:
        return "-"
    if column == "psnr":
        return f"{value:.2f}"
    if column in ("latency_s",):
        return f"{value:.3f}"
    if column == "speedup":
        return f"{value:.2f}x"
    if column in ("peak_memory_mb", "fid"):
        return f"{value:.1f}"
    if column == "density":
        return f"{value:.3f}"
    return f"{value:.4f}"


def markdown_table(results):
    """The results as Markdown: one row per setting, then run details and notes."""
    columns = list(results["columns"])
    header = ["setting", "samples", "latency (s)", "speedup", "peak mem (MB)", "density"]
    for c in columns:
        info = results["columns"][c]
        arrow = "↑" if info["higher_is_better"] else "↓"
        header.append(f"{c}{' (' + info['unit'] + ')' if info['unit'] else ''} {arrow}")
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for s in results["settings"]:
        cells = [f"`{s['setting']}`", str(s["samples"]), _fmt(s["latency_s"], "latency_s"), _fmt(s["speedup"], "speedup"),
                 _fmt(s["peak_memory_mb"], "peak_memory_mb"), _fmt(s["density"], "density")]
        cells += [_fmt(s.get(c), c) for c in columns]
        lines.append("| " + " | ".join(cells) + " |")
    call = ", ".join(f"{k}={v}" for k, v in results["call"].items())
    out = [f"# fastdit eval: {results['model']}", "", *lines, "",
           f"- device: {results['device']} ({results['num_processes']} process(es)), backend {results['backend']}",
           f"- call: {call}",
           f"- prompts: {len(results['prompts'])} from {results['prompts_file']}; seeds: {', '.join(map(str, results['seeds']))}",
           f"- speedup: {results['speedup_definition']}",
           "- psnr/ssim/lpips: against the dense sample of the same prompt and seed; means over samples "
           "(psnr ignores identical pairs)"]
    out += [f"- {note}" for note in results["notes"]]
    return "\n".join(out) + "\n"


def _pareto(points, higher_is_better):
    """Indices of points (speedup, value) not dominated by another (more speedup, better value)."""
    front = []
    for i, (x, y) in enumerate(points):
        better = (lambda a, b: a >= b) if higher_is_better else (lambda a, b: a <= b)
        dominated = any(
            (x2 >= x and better(y2, y)) and (x2 > x or y2 != y) for j, (x2, y2) in enumerate(points) if j != i)
        if not dominated:
            front.append(i)
    return sorted(front, key=lambda i: points[i][0])


def write_plots(results, out_dir):
    """``speedup_vs_<metric>.png`` (Pareto front marked) and ``per_prompt_<metric>.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    written = []
    for column, info in results["columns"].items():
        pts = [(s["speedup"], s.get(column), s["setting"]) for s in results["settings"]
               if s.get("speedup") is not None and s.get(column) is not None]
        if not pts:
            continue
        fig, ax = plt.subplots(figsize=(6, 4.5))
        xs, ys = [p[0] for p in pts], [p[1] for p in pts]
        ax.scatter(xs, ys, s=40, color="tab:blue", zorder=3, label="setting")
        for x, y, name in pts:
            ax.annotate(name, (x, y), textcoords="offset points", xytext=(5, 4), fontsize=8)
        front = _pareto(list(zip(xs, ys)), info["higher_is_better"])
        ax.plot([xs[i] for i in front], [ys[i] for i in front], "-o", color="tab:red", mfc="none", ms=12,
                zorder=2, label="Pareto front")
        unit = f" ({info['unit']})" if info["unit"] else ""
        ax.set_xlabel("speedup over dense (x)")
        ax.set_ylabel(f"{column}{unit} {'(higher is better)' if info['higher_is_better'] else '(lower is better)'}")
        ax.set_title(f"speedup vs {column}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = os.path.join(out_dir, f"speedup_vs_{column}.png")
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    for column in ["speedup", *[c for c in results["columns"] if c in PER_SAMPLE_COLUMNS]]:
        names, data = [], []
        for s in results["settings"]:
            per_prompt = {}
            for r in results["samples"]:
                if r["setting"] == s["setting"] and r.get(column) is not None:
                    per_prompt.setdefault(r["prompt_index"], []).append(r[column])
            if per_prompt:
                names.append(s["setting"])
                data.append([float(np.mean(v)) for _, v in sorted(per_prompt.items())])
        if not data:
            continue
        fig, ax = plt.subplots(figsize=(max(4.5, 1.4 * len(names) + 2), 4.5))
        ax.boxplot(data, showfliers=False)
        ax.set_xticks(range(1, len(names) + 1), names, rotation=20, ha="right", fontsize=8)
        rng = np.random.default_rng(0)
        for i, values in enumerate(data, start=1):
            ax.scatter(i + rng.uniform(-0.12, 0.12, len(values)), values, s=14, alpha=0.7, color="tab:blue", zorder=3)
        info = results["columns"].get(column, {"unit": "x"})
        ax.set_ylabel(f"{column}{' (' + info['unit'] + ')' if info.get('unit') else ''}")
        ax.set_title(f"per-prompt {column} (mean over seeds; one point per prompt)")
        ax.grid(alpha=0.3, axis="y")
        fig.tight_layout()
        path = os.path.join(out_dir, f"per_prompt_{column}.png")
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def write_reports(cfg, results):
    _atomic_write_json(os.path.join(cfg.out, "results.json"), results)
    with open(os.path.join(cfg.out, "results.md"), "w") as f:
        f.write(markdown_table(results))
    if not cfg.plots:
        return []
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("note: matplotlib is not installed, so no plots were drawn (pip install 'fastdit[eval]')")
        return []
    return write_plots(results, os.path.join(cfg.out, "plots"))


# --------------------------------------------------------------------------------------------
# the whole run
# --------------------------------------------------------------------------------------------

def run_eval(cfg, state=None, log=None):
    """Check inputs, generate (sharded), score (sharded), aggregate and report (main process).

    ``state``: an ``accelerate.PartialState`` (None: one process). Returns the results dict on
    the main process, None on the others.
    """
    log = log or _Log(state)
    settings = check_inputs(cfg)  # every process checks, so every process stops on bad input
    samples = build_samples(cfg, settings)
    os.makedirs(cfg.out, exist_ok=True)
    log(f"{len(settings)} setting(s) x {len(cfg.prompts)} prompt(s) x {len(cfg.seeds)} seed(s) = {len(samples)} samples"
        f" -> {cfg.out}")
    generate_samples(cfg, samples, state, log)
    if state is not None:
        state.wait_for_everyone()
    compute_sample_metrics(cfg, samples, state, log)
    if state is not None:
        state.wait_for_everyone()
    results = None
    if state is None or state.is_main_process:
        results = aggregate(cfg, settings, samples, log, num_processes=1 if state is None else state.num_processes)
        write_reports(cfg, results)
        log(markdown_table(results))
        log(f"results.json, results.md and plots/ in {cfg.out}")
    if state is not None:
        state.wait_for_everyone()
    return results
