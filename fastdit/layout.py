"""Token layouts: where each token of an attention call sits in the latent grid or the text span.

DiT models flatten a latent video of ``(T, H, W)`` patches frame-major (``t``, then ``h``, then
``w``) and, for joint attention, put text (or other conditioning) tokens before or after it::

    text_position="none":    [ video (T*H*W) ]
    text_position="prefix":  [ text (L) | video (T*H*W) ]      e.g. CogVideoX, SD3, Flux
    text_position="suffix":  [ video (T*H*W) | text (L) ]      e.g. HunyuanVideo

Methods build their block plans from a ``TokenLayout`` alone, so one method serves every model.
``key_mask_from_attn_mask`` reads a model's attention mask as key and query validity.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

TEXT_POSITIONS = ("none", "prefix", "suffix")


@dataclass(frozen=True)
class TokenLayout:
    """The token order of one attention call.

    Attributes:
        grid: ``(T, H, W)`` latent tokens (after patchification); images have ``T = 1``.
        text_len: number of text / conditioning tokens in the joint sequence.
        text_position: ``"none"``, ``"prefix"`` or ``"suffix"``.
    """

    grid: tuple
    text_len: int = 0
    text_position: str = "none"

    def __post_init__(self):
        grid = tuple(int(g) for g in self.grid)
        if len(grid) != 3 or min(grid) < 1:
            raise ValueError(f"grid must be three positive ints (T, H, W), got {self.grid!r}")
        object.__setattr__(self, "grid", grid)
        if self.text_position not in TEXT_POSITIONS:
            raise ValueError(f"text_position must be one of {TEXT_POSITIONS}, got {self.text_position!r}")
        if self.text_len < 0 or (self.text_len > 0 and self.text_position == "none"):
            raise ValueError(f"text_len={self.text_len} does not fit text_position={self.text_position!r}")

    @property
    def frames(self):
        return self.grid[0]

    @property
    def frame_len(self):
        """Tokens per frame, ``H * W``."""
        return self.grid[1] * self.grid[2]

    @property
    def video_len(self):
        return self.grid[0] * self.grid[1] * self.grid[2]

    @property
    def seq_len(self):
        return self.video_len + self.text_len

    @property
    def video_start(self):
        return self.text_len if self.text_position == "prefix" else 0

    @property
    def text_start(self):
        return 0 if self.text_position == "prefix" else self.video_len

    def video_positions(self, device=None):
        """Sequence index of every video token, in frame-major grid order."""
        return torch.arange(self.video_start, self.video_start + self.video_len, device=device)

    def text_positions(self, device=None):
        return torch.arange(self.text_start, self.text_start + self.text_len, device=device)

    def describe(self):
        t, h, w = self.grid
        text = f" + {self.text_len} text ({self.text_position})" if self.text_len else ""
        return f"{t}x{h}x{w} video tokens{text}"


def shard_order(layout, shards):
    """Where each model-order token sits in a Ulysses call's sequence, or None when the streams do
    not split evenly.

    Diffusers' context parallelism splits each input stream (video, and text where the model's
    plan splits it) into ``shards`` equal chunks along the sequence; a rank's processor joins its
    chunks in the model's order (``[text_r | video_r]`` for a text prefix, ``[video_r | text_r]``
    for a suffix), and the all-to-all concatenates the ranks' sequences. So the call's token at
    position ``r * L/N + (offset of the stream) + i`` is token ``i`` of chunk ``r`` of that stream.
    Returns a long tensor ``order`` with ``order[model token] = call position``.
    """
    video, text = layout.video_len, layout.text_len
    if video % shards or text % shards:
        return None
    v_chunk, t_chunk = video // shards, text // shards
    local = v_chunk + t_chunk
    video_index = torch.arange(video)
    text_index = torch.arange(text)
    prefix = layout.text_position == "prefix"
    video_pos = (video_index // v_chunk) * local + (t_chunk if prefix else 0) + video_index % v_chunk
    text_pos = text_index  # without text: the empty index (and t_chunk is 0)
    if text:
        text_pos = (text_index // t_chunk) * local + (0 if prefix else v_chunk) + text_index % t_chunk
    order = torch.empty(layout.seq_len, dtype=torch.long)
    order[layout.video_positions()] = video_pos
    order[layout.text_positions()] = text_pos
    return order


def key_mask_from_attn_mask(attn_mask, batch, q_len, k_len):
    """Read the model's attention mask as key (and query) validity.

    Returns ``(key_mask, query_mask, ok)``: bool ``(B, Nk)`` / ``(B, Nq)`` or None when all
    True. Two forms are understood: a key mask broadcast over queries (``(B, 1, 1, Nk)``, e.g.
    HunyuanVideo's text padding) and an outer product ``valid[q] & valid[k]`` (HunyuanVideo 1.5),
    whose fully masked query rows come out as 0, as in torch's attention. ``ok`` is False for any
    other mask (one that varies with the head, a float bias other than 0 / -inf-like, a
    block-causal mask): the block engine does not express it and the call runs the model's own
    attention.
    """
    if attn_mask is None:
        return None, None, True
    mask = attn_mask
    if mask.dtype != torch.bool:
        if not torch.is_floating_point(mask):
            return None, None, False
        zero, blocked = mask == 0, mask <= -1e4
        if not bool((zero | blocked).all()):
            return None, None, False
        mask = zero
    while mask.dim() < 4:
        mask = mask.unsqueeze(0) if mask.dim() < 2 else mask.unsqueeze(1)
    if mask.shape[1] > 1:
        if not bool((mask == mask[:, :1]).all()):
            return None, None, False
        mask = mask[:, :1]
    mask = mask[:, 0].expand(batch, mask.shape[2], k_len)  # (B, Nq or 1, Nk)
    if mask.shape[1] == 1:
        key_mask, query_mask = mask[:, 0], None
    else:
        key_mask, query_mask = mask.any(dim=1), mask.any(dim=2)
        if not bool((mask == (query_mask[:, :, None] & key_mask[:, None, :])).all()):
            return None, None, False
    key_mask = None if bool(key_mask.all()) else key_mask.contiguous()
    query_mask = None if query_mask is None or bool(query_mask.all()) else query_mask.contiguous()
    return key_mask, query_mask, True
