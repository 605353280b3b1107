"""Pictures of attention masks.

One path: the token mask a patched layer used in its latest call (``Patch.mask(layer, head)``, which
builds it with ``BlockPlan.token_mask``), max-pooled to at most ``MASK_PIXELS`` cells a side and
drawn as a PNG (attended = dark), with frame starts as grey lines and the video | text boundary as
orange lines. The mask is ``S x S`` booleans, so sequences above ``MASK_TOKEN_LIMIT`` tokens are not
drawn (``FASTDIT_APP_MASK_TOKENS`` raises the limit).
"""
from __future__ import annotations

import os

from fastdit.media.pictures import MASK_PIXELS, mask_picture, pooled_mask

from .errors import AppError

__all__ = ["MASK_PIXELS", "MASK_TOKEN_LIMIT", "draw_patch_mask", "mask_picture", "mask_token_limit", "pooled_mask"]

#: Largest sequence drawn: its S x S mask is 1 GiB of booleans (Wan 2.1 at 480p x 81 frames is 32,760).
MASK_TOKEN_LIMIT = 32768


def mask_token_limit():
    env = os.environ.get("FASTDIT_APP_MASK_TOKENS")
    return int(env) if env else MASK_TOKEN_LIMIT


def draw_patch_mask(patch, layer, head, path):
    """The picture of ``layer``'s mask for ``head`` in its latest call, from a live patch applied
    with ``record_masks=True``. Returns ``(path, caption)``; ``AppError`` when it cannot be drawn."""
    try:
        index = patch.layer_index(int(layer))
        layout = patch.last_layout(index)
        plan = patch.last_plan(index)
    except (ValueError, RuntimeError) as error:
        raise AppError(str(error)) from None
    seq = layout.seq_len
    limit = mask_token_limit()
    if seq > limit:
        raise AppError(f"not drawn: {seq:,} tokens make a {seq:,} x {seq:,} mask, more than the {limit:,}-token limit "
                       "(FASTDIT_APP_MASK_TOKENS raises it)")
    try:
        mask = patch.mask(index, int(head))
    except (ValueError, RuntimeError) as error:
        raise AppError(str(error)) from None
    pooled, factor = pooled_mask(mask)
    del mask
    boundaries = []
    if layout.text_len:
        boundaries = [b for b in (layout.video_start, layout.video_start + layout.video_len) if 0 < b < seq]
    frame_starts = []
    if 1 < layout.frames <= 64 and layout.frame_len / factor * (MASK_PIXELS / pooled.shape[0]) >= 6:
        frame_starts = [layout.video_start + k * layout.frame_len for k in range(1, layout.frames)]
    mask_picture(pooled, factor, path, boundaries, frames=frame_starts)
    kind = "dense (a dense step or layer, or a layout the method runs densely)" if plan is None else plan.name
    caption = (f"layer {index} ({patch.layers[index]}), head {int(head)}, last step: {kind}; "
               f"{layout.describe()}, {factor}x{factor} tokens per pixel, {100 * float(pooled.mean()):.0f}% of cells "
               "attended")
    if frame_starts:
        caption += "; grey lines: frames"
    if boundaries:
        caption += "; orange lines: video | text tokens"
    return path, caption
