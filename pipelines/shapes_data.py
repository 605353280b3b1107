"""Procedural "moving shapes" videos with captions, for the trained tiny-shapes model (issue 24).

Each video shows one to three coloured shapes (circle, square, triangle) moving in a straight
line (left, right, up or down) at constant speed over a plain or softly textured, low-saturation
background, rendered with OpenCV.  Its caption follows one fixed grammar::

    "a red circle moving left"
    "a red circle moving left and a blue square moving down"

Everything is deterministic from ``(seed, index)`` and unlimited: ``sample_video(seed, i)`` draws a
:class:`VideoSpec` from ``numpy.random.default_rng([seed, i])`` and :func:`render` draws it.
Colours within one video are distinct (so a caption's objects can be told apart by colour), and
every shape stays fully inside the frame for the whole clip.  ``sample_video(..., data=...)`` also draws two
simpler kinds of the same grammar (:data:`DATA_KINDS`), the first stages of a curriculum.

API: :data:`COLORS`, :data:`SHAPES`, :data:`DIRECTIONS`, :class:`ShapeSpec`, :class:`VideoSpec`,
:func:`sample_spec`, :func:`render`, :func:`caption`, :func:`parse_caption`, :func:`sample_video`,
:func:`latent_object_mask`.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import numpy as np

__all__ = ["COLORS", "DATA_KINDS", "DEMO_CAPTION", "SHAPES", "DIRECTIONS", "OPPOSITE", "ShapeSpec", "VideoSpec",
           "check_data_options", "sample_spec", "render", "caption", "opposite_directions", "parse_caption",
           "sample_video", "random_caption", "distinct_captions", "latent_object_mask"]

# RGB, saturated, so that hue separates them from each other and from the grey-ish backgrounds
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (225, 35, 35),
    "green": (40, 190, 60),
    "blue": (40, 80, 230),
    "yellow": (235, 215, 30),
}
SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
#: The caption the demos (``fastdit compare``, the app) use on tiny-shapes unless given another.
DEMO_CAPTION = "a red circle moving right and a blue square moving down"
# unit motion in image coordinates (x to the right, y downwards)
DIRECTIONS: dict[str, tuple[int, int]] = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}
#: Each direction's reverse (its unit step negated).
OPPOSITE: dict[str, str] = {d: next(o for o, v in DIRECTIONS.items() if v == (-x, -y))
                             for d, (x, y) in DIRECTIONS.items()}


#: What :func:`sample_video` draws: ``full`` (one to three shapes, the whole grammar), ``single`` (one shape of any
#: colour and kind on any background) or ``simplest`` (one yellow circle on a plain background: only its place,
#: speed and direction vary, so the caption says nothing but the direction). Why the simpler kinds: the tiny model
#: learns direction words only after ~20k samples of ``simplest`` (stop 61, BENCHMARKS.md), never on ``full`` alone.
DATA_KINDS = ("full", "single", "simplest")


@dataclass(frozen=True)
class ShapeSpec:
    color: str
    shape: str
    direction: str
    x: float  # centre at frame 0, pixels
    y: float
    size: float  # half side / radius, pixels
    speed: float  # pixels per frame


@dataclass(frozen=True)
class VideoSpec:
    shapes: tuple[ShapeSpec, ...]
    background: tuple[int, int, int]  # RGB base colour (low saturation)
    texture: str  # "plain", "noise", "stripes" or "gradient"
    texture_seed: int
    frames: int = 17
    height: int = 64
    width: int = 64


def caption(spec: VideoSpec) -> str:
    """The caption of a video: "a <colour> <shape> moving <direction>" joined by " and "."""
    return " and ".join(f"a {s.color} {s.shape} moving {s.direction}" for s in spec.shapes)


_CAPTION_PART = re.compile(r"^an? (\w+) (\w+) moving (\w+)$")


def parse_caption(text: str) -> list[tuple[str, str, str]]:
    """``[(colour, shape, direction), ...]`` of a caption in the grammar of :func:`caption`.

    Raises ``ValueError`` naming the part that does not follow the grammar or uses an unknown word.
    """
    objects = []
    for part in text.strip().lower().rstrip(".").split(" and "):
        match = _CAPTION_PART.match(part.strip())
        if not match:
            raise ValueError(f"caption part {part!r} does not follow 'a <colour> <shape> moving <direction>'")
        color, shape, direction = match.groups()
        words = ((color, COLORS, "colour"), (shape, SHAPES, "shape"), (direction, DIRECTIONS, "direction"))
        for word, known, kind in words:
            if word not in known:
                raise ValueError(f"unknown {kind} {word!r} in caption part {part!r}; known: {', '.join(known)}")
        objects.append((color, shape, direction))
    return objects


def opposite_directions(text: str) -> str:
    """The caption with every shape's direction reversed ("left" <-> "right", "up" <-> "down"), the rest kept.

    The caption of the same video played backwards; raises ``ValueError`` like :func:`parse_caption`.
    """
    return " and ".join(f"a {c} {s} moving {OPPOSITE[d]}" for c, s, d in parse_caption(text))


def check_data_options(data: str = "full", speed_scale: float = 1.0) -> None:
    """Refuse a kind of video (:data:`DATA_KINDS`) or a speed factor that :func:`sample_video` cannot draw."""
    if data not in DATA_KINDS:
        raise ValueError(f"data={data!r}: the kinds of video are {', '.join(DATA_KINDS)}")
    if speed_scale <= 0:
        raise ValueError(f"speed_scale={speed_scale}: takes a factor > 0 (1: the speeds of the frame's size)")


def sample_spec(rng: np.random.Generator, frames: int = 17, height: int = 64, width: int = 64,
                max_shapes: int = 3, shape_probs=(0.5, 0.35, 0.15), speed_scale: float = 1.0) -> VideoSpec:
    """Draw a random video: ``1..max_shapes`` shapes (weights ``shape_probs``), distinct colours.

    Sizes and speeds scale with the frame (``min(height, width) / 64``); ``speed_scale`` multiplies the speed on top
    (0.5 at 128 x 128: shapes cross as many latent cells a frame as at 64 x 64; the draws are the same).
    """
    check_data_options(speed_scale=speed_scale)
    probs = np.asarray(shape_probs[:max_shapes], dtype=float)
    count = int(rng.choice(np.arange(1, max_shapes + 1), p=probs / probs.sum()))
    colors = rng.permutation(list(COLORS))[:count]
    scale = min(height, width) / 64.0
    shapes = []
    for color in colors:
        shape = SHAPES[int(rng.integers(len(SHAPES)))]
        direction = list(DIRECTIONS)[int(rng.integers(len(DIRECTIONS)))]
        size = float(rng.uniform(7.0, 10.0)) * scale
        speed = float(rng.uniform(1.3, 2.0)) * scale * speed_scale
        dx, dy = DIRECTIONS[direction]
        travel = speed * (frames - 1)
        margin = size + 1
        # start so that the whole path stays inside the frame
        lo_x, hi_x = margin + max(0.0, -dx * travel), width - margin - max(0.0, dx * travel)
        lo_y, hi_y = margin + max(0.0, -dy * travel), height - margin - max(0.0, dy * travel)
        for _ in range(30):  # keep shapes apart at the first and the last frame where possible
            x = float(rng.uniform(lo_x, max(lo_x, hi_x)))
            y = float(rng.uniform(lo_y, max(lo_y, hi_y)))
            if all(_apart(o, x, y, size, x + dx * travel, y + dy * travel, frames - 1) for o in shapes):
                break
        shapes.append(ShapeSpec(str(color), shape, direction, x, y, size, speed))
    hue_free = int(rng.integers(90, 200))
    tint = rng.integers(-12, 13, size=3)
    background = tuple(int(np.clip(hue_free + t, 0, 255)) for t in tint)
    texture = str(rng.choice(["plain", "noise", "stripes", "gradient"], p=[0.4, 0.2, 0.2, 0.2]))
    return VideoSpec(tuple(shapes), background, texture, int(rng.integers(2**31)), frames, height, width)


def _apart(other: ShapeSpec, x: float, y: float, size: float, end_x: float, end_y: float, steps: int) -> bool:
    """Whether a new shape at (x, y) -> (end_x, end_y) is clear of ``other`` at the first and last frame."""
    odx, ody = DIRECTIONS[other.direction]
    gap = other.size + size + 2.0
    other_end = (other.x + odx * other.speed * steps, other.y + ody * other.speed * steps)
    return bool(np.hypot(other.x - x, other.y - y) > gap and np.hypot(other_end[0] - end_x, other_end[1] - end_y) > gap)


def _background(spec: VideoSpec) -> np.ndarray:
    h, w = spec.height, spec.width
    base = np.broadcast_to(np.asarray(spec.background, np.float32), (h, w, 3)).copy()
    rng = np.random.default_rng(spec.texture_seed)
    if spec.texture == "noise":  # smooth grey blotches
        import cv2

        small = rng.normal(0.0, 10.0, size=(h // 8 + 1, w // 8 + 1)).astype(np.float32)
        base += cv2.resize(small, (w, h), interpolation=cv2.INTER_CUBIC)[..., None]
    elif spec.texture == "stripes":
        angle = rng.uniform(0, np.pi)
        yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
        phase = (xx * np.cos(angle) + yy * np.sin(angle)) * 2 * np.pi / rng.uniform(8, 16)
        base += (10.0 * np.sign(np.sin(phase)))[..., None]
    elif spec.texture == "gradient":
        yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
        angle = rng.uniform(0, 2 * np.pi)
        base += (25.0 * ((xx * np.cos(angle) + yy * np.sin(angle)) / max(h, w)))[..., None]
    return np.clip(base, 0, 255).astype(np.uint8)


def _draw(frame: np.ndarray, s: ShapeSpec, x: float, y: float) -> None:
    import cv2

    color = COLORS[s.color]
    shift = 4  # sub-pixel positions: smooth motion at slow speeds
    f = 1 << shift
    cx, cy, r = int(round(x * f)), int(round(y * f)), int(round(s.size * f))
    if s.shape == "circle":
        cv2.circle(frame, (cx, cy), r, color, -1, cv2.LINE_AA, shift)
    elif s.shape == "square":
        pts = np.array([[cx - r, cy - r], [cx + r, cy - r], [cx + r, cy + r], [cx - r, cy + r]], np.int32)
        cv2.fillPoly(frame, [pts], color, cv2.LINE_AA, shift)
    else:  # upward triangle, base 2r wide and 2r high, centred on its bounding box
        pts = np.array([[cx, cy - r], [cx + r, cy + r], [cx - r, cy + r]], np.int32)
        cv2.fillPoly(frame, [pts], color, cv2.LINE_AA, shift)


def render(spec: VideoSpec) -> np.ndarray:
    """The video as ``uint8`` ``[frames, height, width, 3]`` RGB."""
    background = _background(spec)
    video = np.empty((spec.frames, spec.height, spec.width, 3), np.uint8)
    for t in range(spec.frames):
        frame = background.copy()
        for s in spec.shapes:
            dx, dy = DIRECTIONS[s.direction]
            _draw(frame, s, s.x + dx * s.speed * t, s.y + dy * s.speed * t)
        video[t] = frame
    return video


def sample_video(seed: int, index: int, data: str = "full", **kwargs) -> tuple[np.ndarray, str, VideoSpec]:
    """``(video uint8 [F, H, W, 3], caption, spec)`` number ``index`` of the stream ``seed``, of the kind ``data``
    (:data:`DATA_KINDS`; ``full`` draws exactly what it always drew)."""
    check_data_options(data)
    if data != "full":
        kwargs["max_shapes"] = 1
    spec = sample_spec(np.random.default_rng([seed, index]), **kwargs)
    if data == "simplest":
        circle = dataclasses.replace(spec.shapes[0], color="yellow", shape="circle")
        spec = dataclasses.replace(spec, shapes=(circle,), texture="plain")
    return render(spec), caption(spec), spec


def random_caption(rng: np.random.Generator, max_shapes: int = 3, shape_probs=(0.5, 0.35, 0.15)) -> str:
    """A caption drawn like those of :func:`sample_spec` (for held-out prompt sets)."""
    return caption(sample_spec(rng, max_shapes=max_shapes, shape_probs=shape_probs))


def distinct_captions(count: int, seed: int, accept=None, **kwargs) -> tuple[str, ...]:
    """``count`` distinct :func:`random_caption` draws (``kwargs``) from ``default_rng(seed)``, in
    draw order, keeping only those ``accept(text)`` passes (all when None)."""
    rng, found = np.random.default_rng(seed), []
    while len(found) < count:
        text = random_caption(rng, **kwargs)
        if text not in found and (accept is None or accept(text)):
            found.append(text)
    return tuple(found)


def latent_object_mask(video: np.ndarray, latent_shape: tuple[int, int, int]) -> "torch.Tensor":
    """Where a video's shapes are, on its latent grid: bool ``[T, h, w]`` for uint8 ``[F, H, W, 3]``.

    A pixel belongs to a shape when its saturation (max - min over RGB) exceeds 0.3: the shapes'
    colours are saturated (>= 0.8), the backgrounds grey-ish (<= 0.1, textures add grey). Latent frame
    0 holds video frame 0 and latent frame t >= 1 frames 2t - 1 and 2t (the Wan VAE's causal 2x time
    factor); a latent pixel counts when any pixel of its cell does, grown by one latent pixel so that
    the outline's neighbourhood, where circle, square and triangle differ, is weighted too.
    """
    import torch

    frames, height, width = latent_shape
    sat = torch.from_numpy((video.max(-1).astype(np.int16) - video.min(-1)) > 0.3 * 255).float()  # [F, H, W]
    groups = [sat[:1].amax(0)] + [sat[2 * t - 1:2 * t + 1].amax(0) for t in range(1, frames)]
    cells = torch.nn.functional.adaptive_max_pool2d(torch.stack(groups)[:, None], (height, width))
    return torch.nn.functional.max_pool2d(cells, 3, stride=1, padding=1)[:, 0] > 0
