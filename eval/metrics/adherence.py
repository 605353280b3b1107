"""Prompt adherence of moving-shapes videos, measured with OpenCV (issue 24).

VBench's *color*, *object class* and *motion* dimensions in miniature, for the captions of
:mod:`fastdit.pipelines.shapes_data` ("a red circle moving left and a blue square moving down"):
for every object of the caption, each frame is searched for the object's colour and the largest
blob of it is measured.

Per caption object, over the video's ``F`` frames:

* **colour** = (frames where a blob of the colour is found) / F.  A blob is a connected region of
  pixels whose HSV hue lies in the colour's range, with saturation >= 90 and value >= 70 (of 255),
  at least ``min_area`` (0.8 % of the frame) large.
* **shape** = (frames where that blob is classified as the caption's shape) / F.  The class comes
  from the blob's fill ratio ``area / bounding-box area``: about 1 for a square, pi/4 = 0.785 for
  a circle and 1/2 for a triangle (thresholds 0.885 and 0.64, between those values).
* **motion** = 1 when the least-squares slope of the blob's centroid over the frames where it is
  found (at least 3) moves it at least ``min_travel`` (5 % of the frame side) over the clip
  along the caption's axis, in the caption's direction, and more along that axis than across
  it; else 0.

The video's score is the mean over objects of the mean of the three (1.0: everything named is
there, shaped and moving as said).  Results: :class:`Adherence` (score plus the per-attribute
means).  :func:`chance_level` gives the score of a video that ignores its caption (the rendered
video of another random caption); random noise scores about 0 (no blob is large enough), at or
below that chance.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

__all__ = ["Adherence", "adherence", "classify_shape", "detect", "chance_level", "CHANCE_LEVEL", "HUE_RANGES"]

#: ``chance_level()`` with its defaults (200 pairs, 17 frames of 64 x 64), measured once; a test
#: recomputes it.
CHANCE_LEVEL = 0.225

#: OpenCV hue ranges (0..179) of the caption colours; red wraps around 0.
HUE_RANGES: dict[str, tuple[tuple[int, int], ...]] = {
    "red": ((0, 9), (170, 179)),
    "yellow": ((18, 36), ),
    "green": ((45, 85), ),
    "blue": ((100, 130), ),
}
MIN_SATURATION = 90
MIN_VALUE = 70


@dataclass(frozen=True)
class Blob:
    area: float
    x: float
    y: float
    fill: float  # area / bounding-box area


@dataclass(frozen=True)
class Adherence:
    score: float  # mean over objects of mean(colour, shape, motion)
    colour: float
    shape: float
    motion: float
    # per object: (colour, shape, direction, colour score, shape score, motion score, drawn), drawn = {class: frames}
    # the classes of the blob in the frames where it was found, whatever the caption says (a model that draws only
    # circles shows as {"circle": F} under every shape word)
    objects: tuple


def _mask(hsv: np.ndarray, color: str) -> np.ndarray:
    h, s, v = hsv[..., 0], hsv[..., 1], hsv[..., 2]
    hue = np.zeros(h.shape, bool)
    for lo, hi in HUE_RANGES[color]:
        hue |= (h >= lo) & (h <= hi)
    return hue & (s >= MIN_SATURATION) & (v >= MIN_VALUE)


def detect(frame: np.ndarray, color: str, min_area: float | None = None) -> Blob | None:
    """The largest blob of ``color`` in an RGB uint8 frame, or None when none is ``min_area`` large."""
    import cv2

    height, width = frame.shape[:2]
    min_area = 0.008 * height * width if min_area is None else min_area
    hsv = cv2.cvtColor(np.ascontiguousarray(frame), cv2.COLOR_RGB2HSV)
    mask = _mask(hsv, color).astype(np.uint8)
    count, labels, stats, centroids = cv2.connectedComponentsWithStats(mask, connectivity=8)
    if count <= 1:
        return None
    best = 1 + int(np.argmax(stats[1:, cv2.CC_STAT_AREA]))
    area = float(stats[best, cv2.CC_STAT_AREA])
    if area < min_area:
        return None
    box = float(stats[best, cv2.CC_STAT_WIDTH] * stats[best, cv2.CC_STAT_HEIGHT])
    return Blob(area, float(centroids[best, 0]), float(centroids[best, 1]), area / box)


def classify_shape(blob: Blob) -> str:
    """circle / square / triangle from the fill ratio (square ~1, circle ~0.785, triangle ~0.5)."""
    if blob.fill >= 0.885:
        return "square"
    if blob.fill >= 0.64:
        return "circle"
    return "triangle"


def _direction_ok(track: list[tuple[int, float, float]], direction: str, frames: int, side: int,
                  min_travel: float | None) -> bool:
    from fastdit.pipelines.shapes_data import DIRECTIONS

    if len(track) < 3:
        return False
    t = np.array([p[0] for p in track], float)
    if np.ptp(t) == 0:
        return False
    sx = np.polyfit(t, [p[1] for p in track], 1)[0] * (frames - 1)
    sy = np.polyfit(t, [p[2] for p in track], 1)[0] * (frames - 1)
    dx, dy = DIRECTIONS[direction]
    along, across = (sx * dx, abs(sy)) if dx else (sy * dy, abs(sx))
    min_travel = 0.05 * side if min_travel is None else min_travel
    return bool(along >= min_travel and along > across)


def adherence(frames: np.ndarray, caption: str, min_area: float | None = None,
              min_travel: float | None = None) -> Adherence:
    """Score RGB uint8 frames ``[F, H, W, 3]`` against a shapes caption (see the module docstring).

    ``ValueError`` when the caption does not follow the grammar of ``shapes_data.caption``.
    """
    from fastdit.pipelines.shapes_data import parse_caption

    frames = np.asarray(frames)
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"frames must be [F, H, W, 3] RGB, got shape {frames.shape}")
    if frames.dtype != np.uint8:
        frames = (np.clip(frames, 0, 1) * 255).round().astype(np.uint8) if frames.max() <= 1.0 else \
            np.clip(frames, 0, 255).astype(np.uint8)
    objects = parse_caption(caption)
    n, side = len(frames), min(frames.shape[1:3])
    rows = []
    for color, shape, direction in objects:
        blobs = [detect(f, color, min_area) for f in frames]
        found = [(t, b) for t, b in enumerate(blobs) if b is not None]
        drawn = dict(Counter(classify_shape(b) for _, b in found))
        c = len(found) / n
        s = drawn.get(shape, 0) / n
        m = float(_direction_ok([(t, b.x, b.y) for t, b in found], direction, n, side, min_travel))
        rows.append((color, shape, direction, c, s, m, drawn))
    arr = np.array([r[3:6] for r in rows], float)
    return Adherence(float(arr.mean()), *map(float, arr.mean(axis=0)), tuple(rows))


def chance_level(samples: int = 200, seed: int = 12345, **video_kwargs) -> float:
    """Mean score of rendered videos against the caption of ANOTHER random video: what a model
    that draws valid moving shapes but ignores its prompt scores."""
    from fastdit.pipelines.shapes_data import sample_video

    scores = []
    for i in range(samples):
        video, _, _ = sample_video(seed, 2 * i, **video_kwargs)
        _, other, _ = sample_video(seed, 2 * i + 1, **video_kwargs)
        scores.append(adherence(video, other).score)
    return float(np.mean(scores))
