"""Files under the output folder ``OUT`` and how they are written (atomically) and read back::

    OUT/samples/<setting>/<prompt>_<seed>.mp4           the video (H.264)
    OUT/samples/<setting>/<prompt>_<seed>.npy           its raw frames, uint8 (F, H, W, 3)
    OUT/samples/<setting>/<prompt>_<seed>.json          the generation record (written last, atomically)
    OUT/samples/<setting>/<prompt>_<seed>.metrics.json  cached per-sample metric values
    OUT/samples/<setting>/<prompt>_<seed>.fid.npy       Inception features of its frames (metric fid)
    OUT/results.json, OUT/results.md, OUT/plots/*.png

JSON goes through ``fastdit.jsonutil`` (numpy numbers, tuples, infinities made JSON).
"""
from __future__ import annotations

import json
import os

import numpy as np

from fastdit.eval.runner.settings import fingerprint
from fastdit.jsonutil import dump_json

__all__ = ["fid_features_path", "load_frames", "load_record", "read_json", "read_metric_cache", "save_npy",
           "store_sample", "write_json", "write_metric_cache"]


def write_json(path, data):
    """``data`` as JSON (``fastdit.jsonutil.to_json``), through a temporary file and a rename."""
    return dump_json(path, data, indent=2, atomic=True)


def save_npy(path, array):
    """``np.save`` through a temporary file and a rename."""
    tmp = f"{path}.tmp{os.getpid()}.npy"
    np.save(tmp, array)
    os.replace(tmp, path)


def read_json(path):
    """The JSON in ``path``, or None when it is missing or unreadable."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return None


def store_sample(cfg, sample, frames8, record):
    """Write the sample's video, frames and record, the record last: its presence means the
    sample is complete (an interrupted write leaves no record, so the sample is generated again)."""
    from fastdit.media.video import write_video

    stem = sample.stem(cfg.out)
    os.makedirs(os.path.dirname(stem), exist_ok=True)
    tmp_video = f"{stem}.tmp{os.getpid()}.mp4"
    write_video(tmp_video, frames8, fps=cfg.fps)
    os.replace(tmp_video, stem + ".mp4")
    save_npy(stem + ".npy", frames8)
    write_json(stem + ".json", record)


def load_record(cfg, sample):
    """The stored record of ``sample`` if it is complete and matches the current run, else None.

    A method's record from before the effective density (whose ``density`` counted the sparse
    calls only, and whose ``extra`` has no ``sparse_density``) does not count as complete: its
    sample is generated again, so no report mixes the two meanings of density."""
    stem = sample.stem(cfg.out)
    record = read_json(stem + ".json")
    if not record or record.get("fingerprint") != fingerprint(cfg, sample):
        return None
    if not (os.path.isfile(stem + ".mp4") and os.path.isfile(stem + ".npy")):
        return None
    if record.get("method") != "dense" and "sparse_density" not in (record.get("extra") or {}):
        return None
    return record


def load_frames(cfg, sample):
    """The sample's stored uint8 frames ``(F, H, W, 3)``."""
    return np.load(sample.stem(cfg.out) + ".npy")


def fid_features_path(cfg, sample):
    return sample.stem(cfg.out) + ".fid.npy"


def read_metric_cache(cfg, sample):
    """The sample's metric cache ``{"sample", "reference", "keys", "values"}`` (``{}`` if none)."""
    return read_json(sample.stem(cfg.out) + ".metrics.json") or {}


def write_metric_cache(cfg, sample, cache):
    write_json(sample.stem(cfg.out) + ".metrics.json", cache)
