"""Radial attention: a static O(n log n) mask whose spatial band shrinks as temporal distance grows.

After "Radial Attention: O(n log n) Sparse Attention with Energy Decay for Long Video Generation"
(Li, Li, Cai, Xi, Yang et al., 2025; reference code github.com/mit-han-lab/radial-attention, file
``radial_attn/attn_mask.py``). The attention energy between two tokens decays with their spatial
and temporal distance, so the mask keeps a band around the spatial diagonal of every frame pair
whose width halves each time the temporal distance doubles.

Token rule (the reference's)
----------------------------
Video tokens stay in the model's frame-major order (frame, row, column). A frame holds
``s = H * W`` tokens; ``p`` is a token's index inside its frame. The band is measured against

    P = 2 ** s.bit_length()      (``band_pow2``: the smallest power of two strictly above s),

exactly as the reference does. ``P`` is ``next_pow2(s)`` when ``s`` is not a power of two and
``2 * s`` when it is (square latent frames such as 16x16, 32x32, 64x64 tokens), so ``P / 2**g``
(``g = d.bit_length()``) is about a whole frame at ``d = 1``, half a frame at ``d = 2..3``, a
quarter at ``d = 4..7``, exactly so for power-of-two frames. (Rounding ``s`` itself up, the other
reading, halves every band at power-of-two frame sizes: 67.9% instead of 87.7% of blocks at
9x16x16 with the Wan settings.) For a query in frame ``i`` and a key in frame ``j`` with
``d = |i - j|``:

* ``d = 0``: attended (each frame is dense);
* ``d = 1``: attended (``adjacent="dense"``: the reference's current rule for Wan and
  HunyuanVideo), or iff ``|p_q - p_k| <= s // 2`` (``adjacent="band"``: the rule of an older
  reference revision for Wan, kept as an option);
* ``d >= 2``: with ``g = d.bit_length()`` and ``L = P / 2**g``, attended iff
  ``|p_q - p_k| <= max(decay * L, block_size)``. When ``L < block_size`` the band cannot shrink
  below one block any more, so instead whole frame pairs are thinned: the pair is kept only if
  ``d % (block_size / L) == 0``. Either way the computed density halves whenever ``d`` doubles,
  and summed over the ``log2(T)`` distance groups the work is ``O(n log n)``;
* attention sink (``sink=True``): every query attends all of frame 0, whatever the distance rule
  says (the sink overrides band and thinning alike);
* text tokens (joint attention, e.g. HunyuanVideo): video queries attend every valid text key,
  text queries attend every valid key.

Two corners differ from the reference code, both outside its published settings (block 128,
frames of thousands of tokens): the reference thins frame pairs below a hard-coded 128 tokens
whatever its block size (fastdit: below ``block_size``, the same at the default 128), and it
applies the thinning to ``d = 1`` too, which drops neighbouring frames whenever a frame is
shorter than 128 tokens (fastdit keeps the ``adjacent`` rule there).

Block plan
----------
The kernel works on ``block_size x block_size`` blocks of the sequence in kernel order: the video
tokens in model order (blocks may straddle frames; nothing is rounded to frames), padded up to a
whole block when text follows, then the text tokens in their own blocks. A video block pair is
computed when

    allowed >= block_fill * real            (and allowed > 0),

where ``allowed`` counts the token pairs of the block pair the rule above admits and ``real`` its
token pairs that are not padding; a block pair holding any ``d = 0`` pair, or (with the sink) any
key of frame 0, is always computed, so each frame's own attention and the sink are exact. The
counts come in closed form (no token-level mask is built): the video is cut into segments at
block and frame boundaries, and for each pair of segments the number of ``(p, r)`` in a rectangle
with ``|p - r| <= w`` is a difference of ramp sums (``band_count``). HunyuanVideo at 720p
(115200 tokens, 900 blocks of 128) plans in about a second on a busy two-core CPU.

``block_fill`` (default 1/3) is this module's stand-in for the reference's block "shrinking"
heuristic (which keeps a block when over 60% of its touched key columns are more than 1/3 full).
With 1/3 the video block masks of the two reference settings come out identical to the
reference's: 28.7% of blocks for Wan2.1-14B at 69 frames 768x1280 (latent grid 18x48x80, decay
0.2, sink, adjacent dense; 26.3% with the older ``adjacent="band"``) and 27.5% for HunyuanVideo at
117 frames 768x1280 (30x48x80, decay 0.95; 27.8% with its 256 text tokens counted), and so do
those of square 9x16x16 frames (87.7% with the Wan settings). See ``docs/radial.md``.

Unlike the reference: any token count works (the last block is ragged or padded, padded keys are
masked), plans are cached per layout (the patch rebuilds them when resolution or frame count
changes), every family the patcher supports works (Wan T2V/I2V: ``attn1`` holds video tokens
only), and text may sit before or after the video. A single frame has no temporal structure: a
one-frame call runs the model's own (dense) attention, and image families are rejected by
``check_family``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fastdit.plan import BlockPlan

from .base import check_number, option, register_method
from .block_sparse import BlockSparseConfig, BlockSparseMethod

SUPPORTED_BLOCK_SIZES = (64, 128)
ADJACENT_RULES = ("band", "dense")
#: Default block-fill threshold (fraction of a block pair's token pairs the rule must allow).
DEFAULT_BLOCK_FILL = 1 / 3
#: Query segments per chunk when counting segment pairs (bounds peak memory).
_CHUNK_PAIRS = 1 << 22


@dataclass
class RadialConfig(BlockSparseConfig):
    """Options of radial attention.

    Attributes:
        decay: band width factor for ``d >= 2``: the band is ``max(decay * P / 2**g, block_size)``
            with ``P = 2 ** s.bit_length()`` (``band_pow2``). Must be > 0. None: family default
            (Wan 0.2, HunyuanVideo 0.95, others 0.95).
        block_size: kernel block (both query and key), 64 or 128. Also the band's minimum width
            and the threshold of the frame-pair thinning (``L < block_size``; the reference
            code hard-codes 128 there, the same at the default).
        sink: every query attends all of frame 0. None: family default (Wan True, as the
            reference; HunyuanVideo False; others True).
        adjacent: rule for neighbouring frames (``d = 1``): ``"dense"`` (the reference's current
            rule, Wan and HunyuanVideo alike) or ``"band"`` (``|p_q - p_k| <= s // 2``, the Wan
            rule of an older reference revision). None: family default ("dense" everywhere).
        block_fill: a video block pair is computed when at least this fraction of its real token
            pairs is allowed by the token rule (and at least one is); pairs holding same-frame or
            sink tokens are always computed. In [0, 1]; 0 computes every block touching an
            allowed pair (a superset of the token rule), 1 only blocks fully inside it.
        dense_steps: see ``MethodConfig``. Default 0.24 (12 of 50 steps, the reference scripts).
        dense_layers: see ``MethodConfig``. Default Wan 1, others 0 (the reference scripts).
        skip_threshold, correction, refresh_every: see ``BlockSparseConfig``.
    """

    decay: float | None = option(None, "band width factor for frames 2+ apart (> 0); empty: the family's default",
                                 range=(0.0, None), widget="number")
    block_size: int = option(128, "kernel block size (query and key)", choices=SUPPORTED_BLOCK_SIZES,
                             widget="dropdown")
    sink: bool | None = option(None, "every query attends all of frame 0; empty: the family's default",
                               widget="checkbox")
    adjacent: str | None = option(None, "neighbouring frames: dense (reference) or a half-frame band",
                                  choices=ADJACENT_RULES, widget="dropdown")
    block_fill: float = option(DEFAULT_BLOCK_FILL, "a block pair is computed when this fraction of its token "
                               "pairs is allowed", range=(0.0, 1.0), widget="slider")

    def validate(self):
        super().validate()
        if self.decay is not None:
            self.decay = check_number("decay", self.decay, 0, math.inf, low_open=True, high_open=True,
                                      note="the band is decay * P / 2**g tokens wide")
        if isinstance(self.block_size, bool) or self.block_size not in SUPPORTED_BLOCK_SIZES:
            raise ValueError(f"block_size must be one of {SUPPORTED_BLOCK_SIZES}, got {self.block_size!r}")
        if self.sink is not None and not isinstance(self.sink, bool):
            raise ValueError(f"sink must be True or False, got {self.sink!r}")
        if self.adjacent is not None and self.adjacent not in ADJACENT_RULES:
            raise ValueError(f"adjacent must be one of {ADJACENT_RULES}, got {self.adjacent!r}")
        self.block_fill = check_number("block_fill", self.block_fill, 0, 1)


def next_pow2(n):
    """Smallest power of two ``>= n`` (``n >= 1``). Not the band's ``P``: see ``band_pow2``."""
    return 1 << (int(n) - 1).bit_length()


def band_pow2(frame_len):
    """The band's ``P`` for frames of ``s = frame_len`` tokens: ``2 ** s.bit_length()``, the
    smallest power of two strictly greater than ``s`` (``2 * s`` when ``s`` is a power of two,
    ``next_pow2(s)`` otherwise), as the reference computes it (module docstring)."""
    return 1 << int(frame_len).bit_length()


def distance_widths(frames, frame_len, decay, block_size, adjacent):
    """Band half-width per temporal distance ``d = 0 .. frames - 1``, as int64 ``(frames,)``.

    A key at in-frame offset ``|p_q - p_k| <= width[d]`` is allowed; ``-1`` drops the frame pair;
    ``frame_len`` (or more) keeps it whole. Integer widths: ``|dp| <= w`` iff ``|dp| <= floor(w)``.
    ``P = band_pow2(frame_len)``; thinning applies from ``d = 2`` on (module docstring).
    """
    s, P = frame_len, band_pow2(frame_len)
    widths = []
    for d in range(frames):
        if d == 0:
            width = s
        elif d == 1:
            width = s // 2 if adjacent == "band" else s
        else:
            g = d.bit_length()
            L = P / 2 ** g
            if L < block_size and d % ((block_size << g) // P) != 0:
                width = -1
            else:
                width = min(math.floor(max(decay * L, block_size)), s)
        widths.append(width)
    return torch.tensor(widths, dtype=torch.long)


def frame_widths(frames, frame_len, config):
    """Band half-width for every frame pair ``(i, j)``: int64 ``(frames, frames)`` (see
    ``distance_widths``), with the sink column (``j = 0``) whole when ``config.sink``."""
    by_distance = distance_widths(frames, frame_len, config.decay, config.block_size, config.adjacent)
    f = torch.arange(frames)
    widths = by_distance[(f[:, None] - f[None, :]).abs()]
    if config.sink:
        widths[:, 0] = frame_len
    return widths


def _ramp_sum(a, z):
    """``sum_{k=0}^{a-1} max(k + z, 0)`` for integer tensors ``a >= 0``, ``z``."""
    last = a - 1 + z
    m = torch.minimum(a, (last + 1).clamp(min=0))  # positive terms: last, last - 1, ..., last - m + 1
    return m * (2 * last - m + 1) // 2


def band_count(p0, p1, r0, r1, w):
    """Number of ``(p, r)`` in ``[p0, p1) x [r0, r1)`` with ``|p - r| <= w`` (0 where ``w < 0``).

    With ``a = p1 - p0`` rows, ``b = r1 - r0`` columns and ``o = r0 - p0``, the pairs with
    ``r - p <= c`` number ``sum_{k<a} clamp(k + c - o + 1, 0, b)``, a difference of two ramp sums;
    the band is ``(r - p <= w) - (r - p <= -w - 1)``.
    """
    a, b, o = p1 - p0, r1 - r0, r0 - p0
    wc = w.clamp(min=0)
    hi, lo = wc + 1 - o, -wc - o
    count = _ramp_sum(a, hi) - _ramp_sum(a, hi - b) - _ramp_sum(a, lo) + _ramp_sum(a, lo - b)
    return torch.where(w >= 0, count, torch.zeros_like(count))


def _segments(frames, frame_len, block_size):
    """Cut ``[0, frames * frame_len)`` at block and frame boundaries: ``(block, frame, p0, p1)``."""
    total = frames * frame_len
    cuts = torch.unique(torch.cat([
        torch.arange(0, total, block_size), torch.arange(0, total, frame_len), torch.tensor([total]),
    ]))
    start, end = cuts[:-1], cuts[1:]
    frame = start // frame_len
    return start // block_size, frame, start - frame * frame_len, end - frame * frame_len


def block_counts(frames, frame_len, config):
    """Per video block pair: allowed token pairs, forced (same-frame or sink) pairs, real pairs.

    Returns ``(allowed, forced, real)``: int64 ``(n, n)`` counts of allowed and real token pairs
    and a bool ``(n, n)`` "holds a same-frame or sink pair", ``n = ceil(frames * frame_len /
    block_size)``, in kernel (= model, frame-major) order. Exact, in closed form (module docstring).
    """
    B = config.block_size
    total = frames * frame_len
    n = -(-total // B)
    widths = frame_widths(frames, frame_len, config)
    # int32 throughout: in-frame positions and per-block counts (<= B * B) stay far below 2**31.
    widths = widths.to(torch.int32)
    block, frame, p0, p1 = (t.to(torch.int32) for t in _segments(frames, frame_len, B))
    allowed = torch.zeros(n * n, dtype=torch.int32)
    n_seg = block.numel()
    chunk = max(1, _CHUNK_PAIRS // n_seg)
    for a in range(0, n_seg, chunk):
        qb, qf, qp0, qp1 = (t[a:a + chunk, None] for t in (block, frame, p0, p1))
        count = band_count(qp0, qp1, p0[None, :], p1[None, :], widths[qf.long(), frame[None, :].long()])
        target = (qb.long() * n + block[None, :].long()).reshape(-1)
        allowed.scatter_add_(0, target, count.reshape(-1))
    start = torch.arange(n) * B
    rows = (total - start).clamp(max=B)
    first, last = start // frame_len, (start + rows - 1) // frame_len
    forced = (first[:, None] <= last[None, :]) & (first[None, :] <= last[:, None])
    if config.sink:
        forced |= (first == 0)[None, :]
    return allowed.view(n, n).long(), forced, rows[:, None] * rows[None, :]


def video_block_mask(frames, frame_len, config):
    """Boolean ``(n, n)`` mask of computed video block pairs (see the module docstring)."""
    allowed, forced, real = block_counts(frames, frame_len, config)
    filled = (allowed > 0) & (allowed.double() >= config.block_fill * real.double())
    return filled | forced


def kernel_order(layout, block_size):
    """``(perm, n_video_blocks, n_text_blocks)``: video in model order padded to whole blocks, then
    text. ``perm`` is None when that order is the model's own (no text before the video, and the
    video a whole number of blocks or followed by nothing)."""
    n_video = -(-layout.video_len // block_size)
    n_text = -(-layout.text_len // block_size)
    padded = n_video * block_size
    if layout.text_len == 0 or (layout.text_position == "suffix" and padded == layout.video_len):
        return None, n_video, n_text
    video = torch.full((padded,), -1, dtype=torch.long)
    video[: layout.video_len] = layout.video_positions()
    return torch.cat([video, layout.text_positions()]), n_video, n_text


def block_mask(layout, config):
    """The full block mask ``(n, n)`` in kernel order, text blocks included, and the plan's perm."""
    t, h, w = layout.grid
    perm, n_video, n_text = kernel_order(layout, config.block_size)
    n = n_video + n_text
    mask = torch.ones(n, n, dtype=torch.bool)
    mask[:n_video, :n_video] = video_block_mask(t, h * w, config)
    return mask, perm, n_video


def mask_to_indices(mask):
    """``(kv_indices (n, width) int32, kv_counts (n,) int32)`` of a boolean block mask."""
    n_k = mask.shape[1]
    counts = mask.sum(1)
    width = max(int(counts.max()), 1)
    keyed = torch.where(mask, torch.arange(n_k), torch.tensor(n_k)).sort(dim=1).values[:, :width]
    indices = torch.where(keyed < n_k, keyed, torch.zeros_like(keyed))
    return indices.to(torch.int32), counts.to(torch.int32)


@register_method
class Radial(BlockSparseMethod):
    name = "radial"
    config_cls = RadialConfig
    #: Families without defaults of their own (CogVideoX, LTX, Mochi, ...; Wan and HunyuanVideo set
    #: theirs in their adapters): the conservative HunyuanVideo-like rule (dense neighbouring
    #: frames, wide band) plus the sink, which costs one frame of keys and anchors the
    #: conditioning frame of image-to-video models.
    default_options = {"decay": 0.95, "sink": True, "adjacent": "dense", "dense_steps": 0.24, "dense_layers": 0}
    rank, auto_candidate, engine_geometry, cost_model = 20, True, "frames", "plan"

    @classmethod
    def auto_candidates(cls, layout, base):
        """Three decays: 0.95, 0.5, 0.25 (calibrate has no default grid for radial)."""
        return [{"decay": d} for d in (0.95, 0.5, 0.25)]

    @classmethod
    def check_family(cls, adapter, config):
        if getattr(adapter, "video", True) is False:
            raise ValueError(
                f"radial attention needs a video model (its mask decays with temporal distance); "
                f"{adapter.family!r} is an image family. Use another method, e.g. 'sta' or 'dense'."
            )

    def prepare(self, layout, heads, device):
        config = self.config
        if layout.frames < 2:
            # A single frame has no temporal distance to decay over: its radial mask is dense, so
            # the call runs the model's own attention (a video model asked for one frame).
            return None
        mask, perm, n_video = block_mask(layout, config)
        indices, counts = mask_to_indices(mask)
        B = config.block_size
        video_density = float(mask[:n_video, :n_video].double().mean())
        padding = 0.0 if perm is None else (perm.numel() - layout.seq_len) / layout.seq_len
        sink = "_sink" if config.sink else ""
        return BlockPlan(
            kv_indices=indices[None, None].to(device),
            kv_counts=counts[None, None].to(device),
            block_m=B,
            block_n=B,
            seq_len=layout.seq_len,
            perm=None if perm is None else perm.to(device),
            kv_valid=None if perm is None else (perm >= 0)[None].to(device),
            padding_fraction=padding,
            name=f"radial_b{B}_decay{config.decay:g}_{config.adjacent}{sink}_fill{config.block_fill:g}",
            info={"frames": layout.frames, "frame_len": layout.frame_len, "pow2_frame_len": band_pow2(layout.frame_len),
                  "video_blocks": n_video, "video_density": video_density, "decay": config.decay,
                  "adjacent": config.adjacent, "sink": config.sink, "block_fill": config.block_fill},
        )
