"""What the token methods (``todo``, ``tome``, ``optiprune``) share: splitting a call into video and text tokens,
attention with a float score bias, and dense text rows.

A token method reduces the video tokens of a call (pools or merges them) and runs one attention
of the video queries it keeps over ``[reduced video keys | text keys]`` with an additive score
bias ``b``::

    out_i = sum_j exp(s_ij + b_j) v_j / sum_j exp(s_ij + b_j),   s_ij = scale * q_i . k_j

``b_j = log(n_j)`` for a key that stands for ``n_j`` tokens (proportional attention, ToMe): a key
repeated ``n`` times contributes ``n exp(s)``, so a group of identical tokens merged into one key
gives exactly the unreduced result. ``b_j = -inf`` for a key that is not valid (the model's key
mask, or a group with no valid token).

Text / conditioning tokens are never reduced: their keys join every video query's attention
unchanged (with the model's key mask), and their query rows attend every valid key densely, so
text rows and columns are what dense attention gives.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


class TokenSplit:
    """The video and text parts of one attention call (``q, k, v``: ``(B, H, S, D)``, model order).

    Attributes:
        video_q, video_k, video_v: ``(B, H, N, D)`` video tokens in frame-major grid order.
        text_k, text_v: ``(B, H, L, D)`` text tokens (``L`` may be 0).
        video_key_valid, text_key_valid: bool ``(B, N)`` / ``(B, L)``, or None when all valid.
        video_query_valid: bool ``(B, N)`` or None.
    """

    def __init__(self, ctx, q, k, v):
        layout = ctx.layout
        self.layout = layout
        start, length = layout.video_start, layout.video_len
        video = slice(start, start + length)
        text = slice(layout.text_start, layout.text_start + layout.text_len)
        self.q, self.k, self.v = q, k, v
        self.video_q, self.video_k, self.video_v = q[:, :, video], k[:, :, video], v[:, :, video]
        self.text_k, self.text_v = k[:, :, text], v[:, :, text]
        self.text_q = q[:, :, text]
        key_mask, query_mask = ctx.key_mask, ctx.query_mask
        self.key_mask = None if key_mask is None else key_mask.to(device=q.device, dtype=torch.bool)
        self.query_mask = None if query_mask is None else query_mask.to(device=q.device, dtype=torch.bool)
        self.video_key_valid = None if self.key_mask is None else self.key_mask[:, video]
        self.text_key_valid = None if self.key_mask is None else self.key_mask[:, text]
        self.video_query_valid = None if self.query_mask is None else self.query_mask[:, video]

    def text_bias(self, dtype):
        """``(B, 1, L)`` score bias of the text keys: 0, or -inf where the key mask says invalid."""
        batch, length = self.text_k.shape[0], self.text_k.shape[2]
        bias = torch.zeros(batch, 1, length, dtype=dtype, device=self.q.device)
        if self.text_key_valid is not None:
            bias = bias.masked_fill(~self.text_key_valid[:, None, :], float("-inf"))
        return bias

    def text_rows(self, scale):
        """Text queries attend every valid key: dense rows ``(B, H, L, D)``."""
        if self.text_q.shape[2] == 0:
            return self.text_q
        mask = None if self.key_mask is None else self.key_mask[:, None, None, :]
        return F.scaled_dot_product_attention(self.text_q, self.k, self.v, attn_mask=mask, scale=scale)

    def assemble(self, video_out, scale):
        """Model-order output from the video rows and dense text rows; masked query rows are 0."""
        text_out = self.text_rows(scale)
        position = self.layout.text_position
        if position == "prefix":
            out = torch.cat([text_out, video_out], dim=2)
        elif position == "suffix":
            out = torch.cat([video_out, text_out], dim=2)
        else:
            out = video_out
        if self.query_mask is not None:
            out = out * self.query_mask[:, None, :, None].to(out.dtype)
        return out


def log_size_bias(sizes, proportional=True):
    """Score bias of keys that stand for ``sizes`` valid tokens (float): ``log(size)`` (or 0 with
    ``proportional=False``), and -inf for a key standing for no valid token."""
    if proportional:
        return sizes.clamp(min=0).log()  # log(0) = -inf: groups without a valid token
    return torch.zeros_like(sizes).masked_fill(sizes <= 0, float("-inf"))


def biased_attention(q, k, v, bias, scale, masked=True):
    """``softmax(scale * q k^T + bias) v`` with a float bias broadcastable to ``(B, H, Q, K)``, in
    the inputs' dtype. With ``masked`` (some bias may be -inf), rows whose bias is -inf everywhere
    (no valid key) give 0, not NaN."""
    bias = bias.to(q.dtype)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)
    if not masked:
        return out
    # A device-side where, no host sync.
    attended = torch.isfinite(bias).any(dim=-1, keepdim=True)
    return torch.where(attended, out, out.new_zeros(()))


def record_token_call(ctx, split, queries, keys):
    """Tell the stats what was computed: ``queries`` video queries against ``keys`` keys, plus the
    dense text rows, over all batch elements and heads (pure shape arithmetic, no host sync)."""
    batch, heads, seq = split.q.shape[0], split.q.shape[1], split.q.shape[2]
    text_rows = split.text_q.shape[2]
    performed = batch * heads * (queries * keys + text_rows * split.k.shape[2])
    ctx.record(performed=performed, total=batch * heads * seq * split.k.shape[2])
    ctx.info["attention_shape"] = (int(queries), int(keys))


def accumulation_dtype(dtype):
    """Sums and means run in float32 (float64 for float64 inputs, e.g. references)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def nearest_destination(keys, dst, src, dst_valid=None):
    """Each source's most cosine-similar destination (``tome``'s matching).

    ``keys``: ``(B, H, N, D)``; ``dst``/``src``: token indices, 1-D (the same for every batch element
    and head) or ``(B, H, n)``; ``dst_valid``: bool broadcastable to ``(B, H, Nd)`` (invalid
    destinations are never chosen while a valid one exists). With ``c(i, j) = k_i . k_j / (|k_i| |k_j|)``
    returns ``(best, which)``: ``max_j c(i, dst_j)`` and ``argmax_j`` (a position in ``dst``), ``(B, H, Ns)``.
    """
    # Cosine similarity in float32 on the CPU; in the inputs' dtype on a GPU (a plain matmul).
    work = accumulation_dtype(keys.dtype) if keys.device.type == "cpu" else keys.dtype
    metric = F.normalize(keys.to(accumulation_dtype(keys.dtype)), dim=-1).to(work)

    def pick(index):
        if index.dim() == 1:
            return metric.index_select(2, index)
        return metric.gather(2, index[..., None].expand(-1, -1, -1, metric.shape[-1]))

    scores = pick(src) @ pick(dst).transpose(-1, -2)  # (B, H, Ns, Nd)
    if dst_valid is not None:
        scores = scores.masked_fill(~dst_valid[..., None, :], float("-inf"))
    return scores.max(dim=-1)


def ceil_div(a, b):
    return -(-a // b)


def grid_groups(grid, window):
    """Number of groups per axis when ``grid`` is cut into ``window`` (edge groups may be partial)."""
    return tuple(ceil_div(g, w) for g, w in zip(grid, window))


