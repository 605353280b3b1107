"""Pictures of attention masks: the one drawing path for ``Patch.mask`` in the app, the radial
report and the docs.

A token- or block-level boolean mask ``(S, S)`` is max-pooled to at most ``size`` cells a side (a
cell is attended when any of its pairs is) and drawn with attended cells dark, optional boundary
lines (video | text) and frame lines.
"""
from __future__ import annotations

import numpy as np

__all__ = ["MASK_PIXELS", "mask_picture", "pooled_mask"]

MASK_PIXELS = 512


def pooled_mask(mask, size=MASK_PIXELS):
    """Max-pool an ``(S, S)`` boolean mask to at most ``size`` cells a side: ``(array, factor)``,
    ``factor`` tokens per cell (a cell is True when any of its token pairs is attended)."""
    import torch

    mask = torch.as_tensor(mask, dtype=torch.bool)
    seq = mask.shape[0]
    factor = max(1, -(-seq // size))
    if factor == 1:
        return mask.cpu().numpy().astype(bool), 1
    cells = -(-seq // factor)
    padded = torch.zeros(cells * factor, cells * factor, dtype=torch.bool, device=mask.device)
    padded[:seq, :seq] = mask
    pooled = padded.view(cells, factor, cells, factor).any(dim=3).any(dim=1)
    return pooled.cpu().numpy(), factor


def mask_picture(pooled, factor, path, boundaries=(), size=MASK_PIXELS, frames=()):
    """Draw a pooled mask (attended = dark) as a PNG of at most ``size`` px: ``boundaries`` (token
    indices, e.g. video | text) as orange lines, ``frames`` (frame starts) as thin grey lines."""
    from PIL import Image, ImageDraw

    cells = pooled.shape[0]
    scale = max(1, size // max(cells, 1))
    light, dark = np.array([240, 243, 250], np.uint8), np.array([49, 70, 160], np.uint8)
    rgb = np.where(pooled[..., None], dark, light).astype(np.uint8)
    image = Image.fromarray(rgb).resize((cells * scale, cells * scale), Image.NEAREST)
    draw = ImageDraw.Draw(image)
    for tokens, colour, width in ((frames, (140, 140, 140), 1), (boundaries, (245, 130, 32), 2)):
        for token in tokens:
            x = int(round(token / factor * scale))
            if 0 < x < image.width:
                draw.line([(x, 0), (x, image.height)], fill=colour, width=width)
                draw.line([(0, x), (image.width, x)], fill=colour, width=width)
    image.save(path)
    return path
