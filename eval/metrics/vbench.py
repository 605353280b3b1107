"""VBench (Huang et al., CVPR 2024) glue: write videos, run VBench in its own environment,
read its results, and compute the normalised Quality / Semantic / Total scores.

VBench pins old libraries, so it lives in a separate Python environment and is driven here
through that interpreter with ``subprocess``. Only :func:`temporal_flickering` is computed
natively (it needs no model).

File naming (VBench README and ``VBench.build_full_info_json``):

* standard prompt suite (``--mode vbench_standard``): ``{prompt}-{index}.mp4`` with the prompt
  text exactly as ``prompt_en`` in ``VBench_full_info.json`` and index 0..4 (VBench looks for
  five samples per prompt and warns about missing ones);
* custom prompts (``--mode custom_input``): VBench takes the prompt from the file name with a
  trailing ``-<number>`` removed, or from ``--prompt_file``, a JSON ``{file name: prompt}``.
  :func:`write_vbench_videos` writes such a ``prompts.json`` and :func:`run_vbench` passes it, so
  prompts that cannot be file names still work.

Results file (``<output_path>/<name>_eval_results.json``)::

    {"<dimension>": [<average score>, [{"video_path": ..., "video_results": ...}, ...]], ...}

Score normalisation and weights follow VBench's ``scripts/constant.py`` and
``scripts/cal_final_score.py`` (checked against the repository's stored copy):
``norm_d = (s_d - min_d) / (max_d - min_d)``; Quality and Semantic are the ``DIM_WEIGHT``-weighted
means of their dimensions (``dynamic_degree`` weighs 0.5, all others 1); Total is
``(4 * Quality + 1 * Semantic) / 5``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import warnings
from collections import Counter
from pathlib import Path
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Union

import numpy as np

from fastdit.media.video import to_uint8

PathLike = Union[str, os.PathLike]

__all__ = [
    "QUALITY_DIMENSIONS",
    "SEMANTIC_DIMENSIONS",
    "NORMALIZE",
    "DIM_WEIGHT",
    "write_vbench_videos",
    "run_vbench",
    "parse_vbench_results",
    "vbench_scores",
    "temporal_flickering",
    "read_video_frames",
    "resolve_vbench_python",
]

# --- VBench scripts/constant.py -------------------------------------------------------------

QUALITY_DIMENSIONS = [
    "subject_consistency", "background_consistency", "temporal_flickering", "motion_smoothness",
    "aesthetic_quality", "imaging_quality", "dynamic_degree",
]
SEMANTIC_DIMENSIONS = [
    "object_class", "multiple_objects", "human_action", "color", "spatial_relationship", "scene",
    "appearance_style", "temporal_style", "overall_consistency",
]
# (min, max) used to normalise each dimension's raw score.
NORMALIZE = {
    "subject_consistency": (0.1462, 1.0),
    "background_consistency": (0.2615, 1.0),
    "temporal_flickering": (0.6293, 1.0),
    "motion_smoothness": (0.706, 0.9975),
    "dynamic_degree": (0.0, 1.0),
    "aesthetic_quality": (0.0, 1.0),
    "imaging_quality": (0.0, 1.0),
    "object_class": (0.0, 1.0),
    "multiple_objects": (0.0, 1.0),
    "human_action": (0.0, 1.0),
    "color": (0.0, 1.0),
    "spatial_relationship": (0.0, 1.0),
    "scene": (0.0, 0.8222),
    "appearance_style": (0.0009, 0.2855),
    "temporal_style": (0.0, 0.364),
    "overall_consistency": (0.0, 0.364),
}
DIM_WEIGHT = {d: 1.0 for d in NORMALIZE}
DIM_WEIGHT["dynamic_degree"] = 0.5
QUALITY_WEIGHT = 4.0
SEMANTIC_WEIGHT = 1.0

# Dimensions VBench refuses in custom_input mode (they need the suite's auxiliary info).
_STANDARD_ONLY = {"object_class", "multiple_objects", "scene", "appearance_style", "color", "spatial_relationship"}


def _key(name: str) -> str:
    """'temporal flickering' / 'Temporal Flickering' / 'temporal_flickering' -> 'temporal_flickering'."""
    return name.strip().lower().replace(" ", "_")


# --- writing videos -------------------------------------------------------------------------

def _safe_filename(prompt: str, max_len: int = 180) -> str:
    # Custom mode only: the real prompt goes to prompts.json, so the name just has to be valid.
    name = re.sub(r'[\\/:*?"<>|\n\r\t]', "_", prompt).strip(" .")
    return (name[:max_len] or "video")


def write_vbench_videos(videos: Sequence, prompts: Sequence[str], out_dir: PathLike, mode: str = "standard",
                        fps: int = 8, quality: float = 9.0) -> List[Path]:
    """Write ``videos[i]`` (F, H, W, 3) float [0, 1] or uint8 as mp4 named for VBench.

    The index of a video is its occurrence count among equal prompts, in order:
    ``["a", "a", "b"]`` -> ``a-0.mp4, a-1.mp4, b-0.mp4``.

    ``mode="standard"``: ``{prompt}-{index}.mp4``, the prompt verbatim (it must be usable as a
    file name; VBench's suite prompts are). More than five samples per prompt are written but
    VBench only reads indices 0..4, so this warns.
    ``mode="custom"``: ``{sanitised prompt}-{index}.mp4`` plus ``prompts.json`` mapping each file
    name to its exact prompt (VBench's ``--prompt_file`` format).

    Encoded with H.264 (yuv420p) through imageio-ffmpeg; ``quality`` is imageio's 0-10 scale.
    Returns the written paths.
    """
    import imageio.v2 as imageio

    if mode not in ("standard", "custom"):
        raise ValueError(f"mode must be 'standard' or 'custom', got {mode!r}")
    if len(videos) != len(prompts):
        raise ValueError(f"got {len(videos)} videos but {len(prompts)} prompts")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    seen: Counter = Counter()
    paths, prompt_map = [], {}
    for video, prompt in zip(videos, prompts):
        index = seen[prompt]
        seen[prompt] += 1
        if mode == "standard":
            if re.search(r'[\\/\x00]', prompt):
                raise ValueError(f"prompt {prompt!r} cannot be a file name; use mode='custom'")
            stem = prompt
        else:
            stem = _safe_filename(prompt)
        name = f"{stem}-{index}.mp4"
        if mode == "custom" and name in prompt_map and prompt_map[name] != prompt:
            raise ValueError(f"prompts {prompt_map[name]!r} and {prompt!r} map to the same file name {name!r}")
        frames = to_uint8(video, three_dims="grayscale")
        path = out / name
        # macro_block_size=1 keeps the frame size as is (yuv420p still needs even sizes).
        imageio.mimwrite(path, list(frames), fps=fps, codec="libx264", quality=quality,
                         macro_block_size=1, pixelformat="yuv420p")
        paths.append(path)
        prompt_map[name] = prompt
    if mode == "standard":
        many = [p for p, n in seen.items() if n > 5]
        if many:
            warnings.warn(f"VBench reads only 5 samples per prompt (indices 0-4); more were written for {many[:3]}...")
    else:
        path = out / "prompts.json"
        old = json.loads(path.read_text()) if path.is_file() else {}
        old.update(prompt_map)
        path.write_text(json.dumps(old, indent=2, ensure_ascii=False))
    return paths


# --- running VBench -------------------------------------------------------------------------

def resolve_vbench_python(python: Optional[PathLike]) -> str:
    """The path of VBench's interpreter: ``python`` (a path or a name on PATH), else
    ``$FASTDIT_VBENCH_PYTHON``. Raises ``FileNotFoundError`` when neither gives one that exists."""
    exe = str(python) if python is not None else os.environ.get("FASTDIT_VBENCH_PYTHON")
    if not exe:
        raise FileNotFoundError(
            "run_vbench needs the Python interpreter of VBench's own environment: pass "
            "python='/path/to/vbench-env/bin/python' or set FASTDIT_VBENCH_PYTHON.")
    resolved = shutil.which(exe) if os.path.sep not in exe else (exe if os.path.isfile(exe) else None)
    if resolved is None:
        raise FileNotFoundError(f"VBench interpreter {exe!r} not found")
    return resolved


def run_vbench(videos_dir: PathLike, dimensions: Iterable[str], python: Optional[PathLike] = None,
               out_dir: PathLike = "vbench_results", mode: str = "standard", *, full_json: Optional[PathLike] = None,
               prompt_file: Optional[PathLike] = None, load_ckpt_from_local: bool = False, ngpus: int = 1,
               extra_args: Sequence[str] = (), env: Optional[Mapping[str, str]] = None,
               timeout: Optional[float] = None) -> Dict[str, float]:
    """Run VBench's evaluation on ``videos_dir`` through another interpreter; return ``{dim: score}``.

    Runs what ``vbench evaluate`` runs, but with the given interpreter instead of whatever
    ``python`` is on PATH::

        <python> -m torch.distributed.run --standalone --nproc_per_node <ngpus> \\
            <vbench>/launch/evaluate.py --videos_path DIR --dimension D1 D2 ... \\
            --output_path OUT --mode vbench_standard|custom_input [--prompt_file F] [--full_json_dir J]

    ``mode``: ``"standard"`` or ``"custom"``; in custom mode ``prompt_file`` defaults to
    ``videos_dir/prompts.json`` if present. VBench's launcher uses CUDA. Model checkpoints are
    VBench's business (``load_ckpt_from_local=True`` for pre-downloaded ones).
    Returns the parsed newest ``*_eval_results.json`` written to ``out_dir``.
    """
    if mode not in ("standard", "custom"):
        raise ValueError(f"mode must be 'standard' or 'custom', got {mode!r}")
    dims = [_key(d) for d in dimensions]
    if not dims:
        raise ValueError("no dimensions given")
    if mode == "custom" and set(dims) & _STANDARD_ONLY:
        raise ValueError(f"VBench cannot evaluate {sorted(set(dims) & _STANDARD_ONLY)} on custom prompts")
    exe = resolve_vbench_python(python)
    probe = subprocess.run([exe, "-c", "import os, vbench; print(os.path.dirname(vbench.__file__))"],
                           capture_output=True, text=True, env=None if env is None else {**os.environ, **env})
    if probe.returncode != 0:
        raise RuntimeError(f"VBench is not importable with {exe}: {probe.stderr.strip().splitlines()[-1:]}")
    launch = Path(probe.stdout.strip().splitlines()[-1]) / "launch" / "evaluate.py"
    if not launch.is_file():
        raise RuntimeError(f"{launch} not found: this VBench install is too old (needs the launch/evaluate.py "
                           f"entry point of current VBench)")
    videos_dir, out = Path(videos_dir).resolve(), Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    cmd = [exe, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ngpus), str(launch),
           "--videos_path", str(videos_dir), "--dimension", *dims, "--output_path", str(out),
           "--mode", "vbench_standard" if mode == "standard" else "custom_input"]
    if full_json is not None:
        cmd += ["--full_json_dir", str(Path(full_json).resolve())]
    if mode == "custom":
        pf = Path(prompt_file) if prompt_file is not None else videos_dir / "prompts.json"
        if pf.is_file():
            cmd += ["--prompt_file", str(pf.resolve())]
    if load_ckpt_from_local:
        cmd += ["--load_ckpt_from_local", "True"]  # argparse type=bool: any non-empty string is True
    cmd += list(extra_args)
    before = set(out.glob("*_eval_results.json"))
    proc = subprocess.run(cmd, env=None if env is None else {**os.environ, **env}, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"VBench failed with exit code {proc.returncode}: {' '.join(cmd)}")
    new = set(out.glob("*_eval_results.json")) - before
    if not new:
        raise RuntimeError(f"VBench finished but wrote no *_eval_results.json to {out}")
    return parse_vbench_results(max(new, key=lambda p: p.stat().st_mtime))


def parse_vbench_results(json_path: PathLike, per_video: bool = False):
    """Read VBench's ``*_eval_results.json`` -> ``{dimension: score}`` (dimension names with underscores).

    With ``per_video=True`` returns ``{dimension: (score, [{"video_path", "video_results"}, ...])}``.
    A directory reads all ``*_eval_results.json`` in it, later files (by mtime) overriding earlier.
    """
    path = Path(json_path)
    if path.is_dir():
        merged = {}
        for f in sorted(path.glob("*_eval_results.json"), key=lambda p: p.stat().st_mtime):
            merged.update(parse_vbench_results(f, per_video))
        if not merged:
            raise FileNotFoundError(f"no *_eval_results.json in {path}")
        return merged
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object of dimension -> [score, per-video results]")
    out = {}
    for dim, value in data.items():
        if isinstance(value, (list, tuple)) and value:
            score, videos = value[0], (value[1] if len(value) > 1 else [])
        elif isinstance(value, (int, float)):
            score, videos = value, []
        else:
            raise ValueError(f"{path}: unexpected value for {dim!r}: {str(value)[:80]}")
        out[_key(dim)] = (float(score), videos) if per_video else float(score)
    return out


def vbench_scores(dim_scores: Mapping[str, float], missing: str = "skip") -> Dict[str, object]:
    """VBench's normalised Quality, Semantic and Total scores (fractions; the leaderboard shows %).

    ``norm_d = (s_d - min_d) / (max_d - min_d)``;
    ``Quality = sum_{d in Q} w_d norm_d / sum_{d in Q} w_d`` (likewise Semantic);
    ``Total = (4 Quality + 1 Semantic) / 5``.

    ``missing``: how to treat dimensions absent from ``dim_scores`` — ``"zero"`` as VBench's
    ``cal_final_score.py`` does (raw score 0), ``"skip"`` (default) averages over the dimensions
    present (a group with none gives ``None``, and then Total is ``None``), ``"error"`` raises.
    With all 16 dimensions the three choices agree.

    Returns ``{"quality_score", "semantic_score", "total_score", "normalized": {dim: norm_d},
    "missing": [dims]}``. Unknown dimension names raise ``KeyError``.
    """
    if missing not in ("skip", "zero", "error"):
        raise ValueError(f"missing must be 'skip', 'zero' or 'error', got {missing!r}")
    scores = {_key(k): float(v) for k, v in dim_scores.items()}
    unknown = set(scores) - set(NORMALIZE)
    if unknown:
        raise KeyError(f"unknown VBench dimensions {sorted(unknown)}; known: {sorted(NORMALIZE)}")
    absent = [d for d in NORMALIZE if d not in scores]
    if absent and missing == "error":
        raise KeyError(f"missing VBench dimensions {absent}")
    if missing == "zero":
        scores.update({d: 0.0 for d in absent})
    normalized = {d: (s - NORMALIZE[d][0]) / (NORMALIZE[d][1] - NORMALIZE[d][0]) for d, s in scores.items()}

    def group(dims):
        present = [d for d in dims if d in normalized]
        if not present:
            return None
        return sum(DIM_WEIGHT[d] * normalized[d] for d in present) / sum(DIM_WEIGHT[d] for d in present)

    quality, semantic = group(QUALITY_DIMENSIONS), group(SEMANTIC_DIMENSIONS)
    total = None
    if quality is not None and semantic is not None:
        total = (QUALITY_WEIGHT * quality + SEMANTIC_WEIGHT * semantic) / (QUALITY_WEIGHT + SEMANTIC_WEIGHT)
    return {"quality_score": quality, "semantic_score": semantic, "total_score": total,
            "normalized": normalized, "missing": absent if missing != "zero" else []}


# --- temporal flickering (native) -----------------------------------------------------------

def read_video_frames(path: PathLike) -> np.ndarray:
    """All frames of a video file as (F, H, W, 3) uint8 **BGR**, read with cv2 as VBench does."""
    import cv2

    cap = cv2.VideoCapture(str(path))
    frames = []
    while cap.isOpened():
        ok, frame = cap.read()
        if not ok:
            break
        frames.append(frame)
    cap.release()
    if not frames:
        raise ValueError(f"could not read any frame from {path}")
    return np.stack(frames)


def temporal_flickering(video) -> float:
    """VBench's temporal flickering score of one video (higher = steadier; 1.0 for a static video).

    ``score = (255 - mean_t MAE(frame_t, frame_{t+1})) / 255`` where the MAE is the mean absolute
    difference over all pixels and channels on the 0-255 scale, over all consecutive pairs of
    all frames (VBench ``temporal_flickering.py``: cv2 frames, ``cv2.absdiff`` in float32).

    ``video``: (F, H, W, C) or (F, H, W) array/tensor, float [0, 1] (quantised to uint8 as a
    written video would be) or uint8; or a path to a video file, read with cv2 like VBench.
    The score is invariant to channel order, so RGB arrays match VBench's BGR frames. VBench
    scores the *encoded* file, so lossy compression makes its number differ slightly from the
    score of the raw array.
    """
    if isinstance(video, (str, os.PathLike)):
        frames = read_video_frames(video)
    else:
        frames = to_uint8(video, three_dims="grayscale")
    if frames.shape[0] < 2:
        raise ValueError(f"temporal flickering needs at least 2 frames, got {frames.shape[0]}")
    f = frames.astype(np.float32)
    mae = np.abs(f[1:] - f[:-1]).reshape(f.shape[0] - 1, -1).mean(axis=1, dtype=np.float64)
    return float((255.0 - mae.mean()) / 255.0)
