"""A contact sheet of a comparison: first, middle and last frame of dense and of each method.

One row per run, labelled with the method and, for the sparse runs, the speedup and the PSNR
against dense, so that a person sees at a glance whether a method kept the video. Written by
``fastdit compare`` beside the mp4s (``contact_sheet.png``) and shown by the app.
"""
from __future__ import annotations

import math

__all__ = ["contact_sheet", "row_label", "frame_indices"]

#: Each frame is scaled to this many pixels on its longer side (nearest neighbour: no blur).
FRAME_PIXELS = 128
LABEL_WIDTH = 170


def frame_indices(count):
    """First, middle and last frame (fewer for shorter videos)."""
    return sorted({0, (count - 1) // 2, count - 1})


def row_label(row):
    """``"sta\\n1.52x  27.3 dB"`` for a compare row (a dict with method, speedup, psnr_db)."""
    lines = [row["method"]]
    if row.get("psnr_db") is not None or row["method"] != "dense":
        psnr = row.get("psnr_db")
        text = "-" if psnr is None else ("inf" if math.isinf(psnr) else f"{psnr:.1f} dB")
        lines.append(f"{row.get('speedup', 1.0):.2f}x  {text}")
    if row.get("adherence") is not None:
        lines.append(f"adherence {row['adherence']:.2f}")
    return "\n".join(lines)


def _scaled(frame, pixels):
    from PIL import Image

    image = Image.fromarray(frame)
    factor = max(1, pixels // max(image.size))
    return image.resize((image.size[0] * factor, image.size[1] * factor), Image.NEAREST)


def contact_sheet(videos, labels, path, pixels=FRAME_PIXELS):
    """Write a PNG: one row per ``videos[i]`` (``[F, H, W, 3]`` uint8, or float in [0, 1]) with
    ``labels[i]`` on its left.

    Returns ``path``. Raises ``ValueError`` when there are no videos or the counts differ."""
    from PIL import Image, ImageDraw

    if not videos or len(videos) != len(labels):
        raise ValueError(f"contact_sheet needs one label per video, got {len(videos)} videos and {len(labels)} labels")
    rows = []
    from .video import to_uint8

    for video, label in zip(videos, labels):
        video = to_uint8(video, three_dims="grayscale")
        tiles = [_scaled(video[i], pixels) for i in frame_indices(len(video))]
        height = max(t.size[1] for t in tiles)
        width = LABEL_WIDTH + sum(t.size[0] + 4 for t in tiles)
        row = Image.new("RGB", (width, height + 4), "white")
        ImageDraw.Draw(row).multiline_text((6, 6), label, fill="black", spacing=4)
        x = LABEL_WIDTH
        for tile in tiles:
            row.paste(tile, (x, 2))
            x += tile.size[0] + 4
        rows.append(row)
    sheet = Image.new("RGB", (max(r.size[0] for r in rows), sum(r.size[1] for r in rows)), "white")
    y = 0
    for row in rows:
        sheet.paste(row, (0, y))
        y += row.size[1]
    sheet.save(path, optimize=True)
    return path
