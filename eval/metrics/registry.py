"""The metric registry: metric name -> what it computes, how its values read, what it checks first.

Metrics are computed from the stored uint8 frames, not from the mp4, so H.264 compression does
not enter them; the 8-bit quantisation (what any saved video holds) does. ``psnr``/``ssim``/
``lpips`` compare a sample with the dense sample of the same prompt and seed; ``clip`` scores a
sample against its prompt; ``fid`` is per setting, between the setting's frames and the dense
frames (``fid_frames`` evenly spaced frames per video); ``vbench`` always gives VBench's temporal
flickering computed natively per sample (on the raw frames, VBench itself reads the mp4), and with
``vbench_python`` runs VBench's other dimensions in its own environment, per setting.

A ``Metric`` has per-sample values (``SampleValue``: computed in the scoring phase, cached per
sample under a key that changes when what the value means changes) and/or a per-setting step
(run when the results are aggregated). Adding a metric is adding an entry to ``METRICS``.
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from fastdit.eval.runner.config import EvalError
from fastdit.eval.runner.storage import fid_features_path, load_frames

__all__ = ["COLUMN_INFO", "METRICS", "PER_SAMPLE_COLUMNS", "VBENCH_CUSTOM_DIMENSIONS", "Metric", "SampleInput",
           "SampleValue", "SettingScores", "check_metrics", "resolve_clip_model", "run_checks", "sample_values"]

#: VBench dimensions that work on any prompt (custom mode), used when no dimension tags say otherwise.
VBENCH_CUSTOM_DIMENSIONS = ["subject_consistency", "background_consistency", "motion_smoothness",
                            "dynamic_degree", "aesthetic_quality", "imaging_quality", "temporal_flickering"]


@dataclass(frozen=True)
class SampleInput:
    """What a per-sample value is computed from. ``reference``: the dense sample's frames (None
    for values that need no reference)."""

    cfg: object
    sample: object
    frames: np.ndarray
    reference: Optional[np.ndarray]
    device: str


@dataclass(frozen=True)
class SampleValue:
    """One value per sample. ``key(cfg)``: its cache key. ``reference``: compared with the dense
    sample of the same prompt and seed (dense samples get None). ``stored_in(cfg, sample)``: the
    value is a file (written by ``compute``), not a number in the cache."""

    name: str
    key: Callable
    compute: Callable
    reference: bool = False
    stored_in: Optional[Callable] = None


@dataclass(frozen=True)
class SettingScores:
    """What a per-setting step gives: the result columns it adds, setting name -> entries for
    that setting's results, and notes for the report."""

    columns: list
    values: dict
    notes: list


@dataclass(frozen=True)
class Metric:
    name: str
    higher_is_better: bool
    unit: str
    against: str  # "dense" (same prompt and seed), "prompt", "dense set" (per setting) or "none"
    columns: tuple  # the result columns it gives under its own name(s) (listed in its column info)
    sample_values: tuple = ()
    check: Optional[Callable] = None  # check(cfg): EvalError before any generation
    per_setting: Optional[Callable] = None  # per_setting(cfg, settings, samples, log) -> SettingScores

    def info(self):
        return {"columns": list(self.columns), "higher_is_better": self.higher_is_better, "unit": self.unit,
                "against": self.against}


# -- per-sample values -------------------------------------------------------------------------

def _psnr(x):
    from fastdit.eval.metrics.fidelity import psnr

    return float(psnr(x.frames, x.reference))


def _ssim(x):
    from fastdit.eval.metrics.fidelity import ssim

    return float(ssim(x.frames, x.reference))


def _lpips(x):
    from fastdit.eval.metrics.fidelity import lpips_distance

    return float(lpips_distance(x.frames, x.reference, net=x.cfg.lpips_net, weights=x.cfg.lpips_weights,
                                device=x.device))


def resolve_clip_model(cfg):
    """The CLIP model of a run: ``cfg.clip_model``, else ``$FASTDIT_CLIP_MODEL``, else the default."""
    from fastdit.eval.metrics.clip_score import DEFAULT_CLIP_MODEL

    return cfg.clip_model or os.environ.get("FASTDIT_CLIP_MODEL") or DEFAULT_CLIP_MODEL


def _clip(x):
    from fastdit.eval.metrics.clip_score import clip_score_video

    return float(clip_score_video(x.frames, x.sample.prompt.text, resolve_clip_model(x.cfg), device=x.device))


def _temporal_flickering(x):
    from fastdit.eval.metrics.vbench import temporal_flickering

    return float(temporal_flickering(x.frames)) if len(x.frames) > 1 else None


def _fid_frames(frames, count):
    index = np.unique(np.linspace(0, len(frames) - 1, min(count, len(frames))).round().astype(int))
    return frames[index]


def _fid_features(x):
    from fastdit.eval.metrics.fid import inception_features
    from fastdit.eval.runner.storage import save_npy

    feats = inception_features(_fid_frames(x.frames, x.cfg.fid_frames), weights=x.cfg.fid_weights, device=x.device)
    save_npy(fid_features_path(x.cfg, x.sample), feats)


# -- up-front checks -----------------------------------------------------------------------------

def _check_lpips(cfg):
    from fastdit.eval.metrics.fidelity import LPIPS_NETS, resolve_lpips_files

    if cfg.lpips_net not in LPIPS_NETS:
        raise EvalError(f"--lpips-net must be one of {sorted(LPIPS_NETS)}, got {cfg.lpips_net!r}")
    try:
        resolve_lpips_files(cfg.lpips_net, cfg.lpips_weights)
    except FileNotFoundError as error:
        raise EvalError(f"metric lpips: {error} Or pass --lpips-weights DIR.") from None


def _check_fid(cfg):
    from fastdit.eval.metrics.fid import resolve_fid_weights

    try:
        resolve_fid_weights(cfg.fid_weights)
    except FileNotFoundError as error:
        raise EvalError(f"metric fid: {error} (--fid-weights PATH on the command line).") from None
    if cfg.fid_frames < 1:
        raise EvalError("--fid-frames must be at least 1")
    if len(cfg.prompts) * len(cfg.seeds) * cfg.fid_frames < 2:
        raise EvalError("metric fid needs at least 2 frames per setting (more prompts, seeds or --fid-frames)")


def _check_clip(cfg):
    model = resolve_clip_model(cfg)
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


def _check_vbench(cfg):
    if not cfg.vbench_python:
        return
    from fastdit.eval.metrics.vbench import NORMALIZE, resolve_vbench_python

    try:
        resolve_vbench_python(cfg.vbench_python)
    except FileNotFoundError as error:
        raise EvalError(f"metric vbench: {error}") from None
    bad = [d for d in cfg.vbench_dimensions or [] if d not in NORMALIZE]
    if bad:
        raise EvalError(f"unknown VBench dimension(s) {bad}; known: {sorted(NORMALIZE)}")


# -- per-setting steps ---------------------------------------------------------------------------

def _fid_per_setting(cfg, settings, samples, log):
    from fastdit.eval.metrics.fid import compute_stats, frechet_distance

    def stats(setting):
        feats = np.concatenate([np.load(fid_features_path(cfg, s)) for s in samples if s.setting == setting])
        return compute_stats(features=feats)

    ref_stats = stats(settings[0])
    values = {settings[0].name: {"fid": None}}
    for setting in settings[1:]:
        values[setting.name] = {"fid": float(frechet_distance(*stats(setting), *ref_stats))}
    note = (f"fid: per setting, its frames against the dense frames ({cfg.fid_frames} evenly spaced frames "
            f"per video); few samples give a noisy, biased FID.")
    return SettingScores(["fid"], values, [note])


def _vbench_per_setting(cfg, settings, samples, log):
    """Full VBench per setting through its own interpreter (with ``cfg.vbench_python``)."""
    if not cfg.vbench_python:
        note = ("vbench: only temporal_flickering was computed (natively, on the raw frames); VBench's other "
                "dimensions need VBench's own interpreter: --vbench-python /path/to/vbench-env/bin/python "
                "(or FASTDIT_VBENCH_PYTHON).")
        return SettingScores([], {}, [note])
    from fastdit.eval.metrics.vbench import run_vbench, vbench_scores, write_vbench_videos

    tagged = all(p.dimension for p in cfg.prompts)
    mode = "standard" if tagged else "custom"
    dims = cfg.vbench_dimensions or (sorted({d for p in cfg.prompts for d in p.dimension}) if tagged
                                     else VBENCH_CUSTOM_DIMENSIONS)
    values = {}
    for setting in settings:
        mine = [s for s in samples if s.setting == setting]
        videos_dir = os.path.join(cfg.out, "vbench", setting.slug, "videos")
        if os.path.isdir(videos_dir):
            shutil.rmtree(videos_dir)
        log(f"VBench ({mode}, {', '.join(dims)}) on {setting.name}")
        write_vbench_videos([load_frames(cfg, s) for s in mine], [s.prompt.text for s in mine], videos_dir,
                            mode=mode, fps=cfg.fps)
        scores = run_vbench(videos_dir, dims, python=cfg.vbench_python,
                            out_dir=os.path.join(cfg.out, "vbench", setting.slug, "results"), mode=mode)
        summary = vbench_scores(scores)
        full = {"mode": mode, "dimensions": scores, "quality_score": summary["quality_score"],
                "semantic_score": summary["semantic_score"], "total_score": summary["total_score"]}
        values[setting.name] = {"vbench_quality": full["quality_score"], "vbench_semantic": full["semantic_score"],
                                "vbench_total": full["total_score"], "vbench": full}
    return SettingScores(["vbench_quality", "vbench_semantic", "vbench_total"], values, [])


# -- the registry --------------------------------------------------------------------------------

METRICS = {m.name: m for m in [
    Metric("psnr", True, "dB", "dense", ("psnr",),
           (SampleValue("psnr", lambda cfg: "psnr", _psnr, reference=True),)),
    Metric("ssim", True, "", "dense", ("ssim",),
           (SampleValue("ssim", lambda cfg: "ssim", _ssim, reference=True),)),
    Metric("lpips", False, "", "dense", ("lpips",),
           (SampleValue("lpips", lambda cfg: f"lpips:{cfg.lpips_net}", _lpips, reference=True),), check=_check_lpips),
    Metric("clip", True, "", "prompt", ("clip",),
           (SampleValue("clip", lambda cfg: f"clip:{resolve_clip_model(cfg)}", _clip),), check=_check_clip),
    Metric("fid", False, "", "dense set", ("fid",),
           (SampleValue("fid_features", lambda cfg: f"fid_features:{cfg.fid_frames}", _fid_features,
                        stored_in=fid_features_path),), check=_check_fid, per_setting=_fid_per_setting),
    Metric("vbench", True, "", "none", ("temporal_flickering",),
           (SampleValue("temporal_flickering", lambda cfg: "temporal_flickering:raw", _temporal_flickering),),
           check=_check_vbench, per_setting=_vbench_per_setting),
]}

_PLAIN = {"higher_is_better": True, "unit": "", "against": "none"}
#: Result column -> how its values read (``higher_is_better``, ``unit``, ``against``).
COLUMN_INFO = {
    **{name: m.info() for name, m in METRICS.items() if name in m.columns},
    "temporal_flickering": dict(_PLAIN),
    "vbench_quality": dict(_PLAIN), "vbench_semantic": dict(_PLAIN), "vbench_total": dict(_PLAIN),
}
#: Result columns with one value per sample (means over samples per setting), in report order.
PER_SAMPLE_COLUMNS = [v.name for m in METRICS.values() for v in m.sample_values if v.stored_in is None]


def check_metrics(cfg):
    """``EvalError`` for unknown metric names, or a metric whose weights or tools are missing."""
    unknown = [m for m in cfg.metrics if m not in METRICS]
    if unknown:
        raise EvalError(f"unknown metric(s) {', '.join(unknown)}; available: {', '.join(METRICS)}")
    if not cfg.metrics:
        raise EvalError("no metrics given")


def run_checks(cfg):
    """Each selected metric's up-front check (weights and tools present)."""
    for name, metric in METRICS.items():
        if name in cfg.metrics and metric.check is not None:
            metric.check(cfg)


def sample_values(cfg):
    """The per-sample values the run's metrics need, name -> ``SampleValue``."""
    return {v.name: v for name, m in METRICS.items() if name in cfg.metrics for v in m.sample_values}
