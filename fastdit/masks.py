"""Reading a model's attention mask as key and query validity (the forms the block engine honours)."""
from __future__ import annotations

import torch


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
