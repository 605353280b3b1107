"""Writing generated frames as files people can open: H.264 mp4 (browsers play it) or PNG.

Pipelines return float frames in [0, 1] shaped ``(F, H, W, C)`` (or ``(H, W, C)`` for an image).
H.264 with yuv420p needs even sizes, so odd frames are padded by repeating the last row/column.
"""
from __future__ import annotations

import os

import numpy as np


def to_uint8(frames, three_dims="image"):
    """``(N, H, W, 3)`` uint8 RGB from float [0, 1] or uint8 data.

    Accepts numpy arrays, torch tensors, PIL images and lists of any of them. A 3-D array is one
    ``(H, W, C)`` image (``three_dims="image"``) or a grayscale video ``(F, H, W)``
    (``three_dims="grayscale"``); grayscale gets 3 channels. Floats are rounded to the nearest
    level (as writing an image file would); values clearly outside [0, 1] raise ``ValueError``.
    """
    from PIL import Image

    if isinstance(frames, Image.Image):
        frames = np.asarray(frames.convert("RGB"))
    elif isinstance(frames, (list, tuple)):
        if not frames:
            return np.zeros((0, 1, 1, 3), np.uint8)
        return np.concatenate([to_uint8(f, three_dims) for f in frames])
    if hasattr(frames, "detach"):  # torch tensor
        frames = frames.detach().cpu().numpy()
    frames = np.asarray(frames)
    if frames.ndim == 3:
        frames = frames[None] if three_dims == "image" else frames[..., None]
    if frames.ndim != 4 or frames.shape[-1] not in (1, 3):
        raise ValueError(f"expected images (H, W, 3) / (N, H, W, 3) or a video (F, H, W, 3), got shape {frames.shape}")
    if frames.shape[-1] == 1:
        frames = np.repeat(frames, 3, axis=-1)
    if frames.dtype != np.uint8:
        if frames.size and (frames.min() < -0.5 or frames.max() > 1.5):
            raise ValueError(f"float images must be in [0, 1], got range [{frames.min():.3g}, {frames.max():.3g}]")
        frames = np.clip(np.rint(frames.astype(np.float64) * 255.0), 0, 255).astype(np.uint8)
    return frames


def pipeline_frames(output):
    """The first sample's frames ``(F, H, W, C)`` float from a diffusers pipeline output (np)."""
    frames = getattr(output, "frames", None)
    if frames is None:
        frames = getattr(output, "images", None)
    if frames is None:
        raise ValueError(f"pipeline output {type(output).__name__} has neither .frames nor .images")
    frames = np.asarray(frames[0] if isinstance(frames, (list, tuple)) else frames)
    if frames.ndim == 5:  # (B, F, H, W, C)
        frames = frames[0]
    if frames.ndim == 3:  # a single image (H, W, C)
        frames = frames[None]
    if frames.ndim == 4 and frames.shape[1] in (1, 3) and frames.shape[-1] not in (1, 3):  # (F, C, H, W)
        frames = frames.transpose(0, 2, 3, 1)
    return frames.astype(np.float32)


def write_video(path, frames, fps=16):
    """Write ``frames`` ``(F, H, W, C)`` as H.264 mp4 (yuv420p, faststart) and return the path.

    A single frame is written as PNG instead when ``path`` ends in ``.png``.
    """
    import imageio.v2 as imageio

    frames = to_uint8(frames)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if path.endswith(".png"):
        imageio.imwrite(path, frames[0])
        return path
    pad_h, pad_w = frames.shape[1] % 2, frames.shape[2] % 2
    if pad_h or pad_w:
        frames = np.pad(frames, ((0, 0), (0, pad_h), (0, pad_w), (0, 0)), mode="edge")
    writer = imageio.get_writer(
        path, fps=fps, codec="libx264", pixelformat="yuv420p", macro_block_size=1,
        ffmpeg_params=["-movflags", "+faststart", "-crf", "18"],
    )
    try:
        for frame in frames:
            writer.append_data(frame)
    finally:
        writer.close()
    return path
