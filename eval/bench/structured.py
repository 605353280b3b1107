"""Video-like q, k, v with known attention structure, for benchmarks and tests of sparse methods.

Random q and k give nearly uniform attention, where no sparse method can win or lose. Here every
head is one of four kinds, built so that its attention is known in closed form:

* ``"spatial"``: mass near the query in its own and the neighbouring frames;
* ``"temporal"``: mass on the same spatial position ``(h, w)`` in every frame;
* ``"global"``: diffuse (a weak positional bias, nearly uniform);
* ``"semantic"``: mass on the tokens of the query's "object", wherever they are in the video (not
  in ``DEFAULT_KINDS``: ask for it with ``kinds``). The first three favour methods that select by
  position; this one favours methods that group tokens by content (svg2's k-means).

Construction (exact, bounded, no learned weights)
-------------------------------------------------
A video token sits at ``(t, h, w)`` in the ``(T, H, W)`` grid. Along one axis of length ``n`` the
feature map of a coordinate ``x`` is, for ``m = 1 .. M`` frequencies ``omega_m = 2 pi m / P``
(period ``P = n + max(3, ceil(n / 3))``: longer than the axis, so the farthest pair of tokens does
not wrap round to look near)::

    e(x) = [ sqrt(a_m) cos(omega_m x), sqrt(a_m) sin(omega_m x) ]_m ,    a_m = exp(-(omega_m sigma)^2 / 2)

so that ``e(x) . e(y) = sum_m a_m cos(omega_m (x - y)) = A kappa(x - y)`` with ``A = sum_m a_m``
and ``kappa(0) = 1``: a (truncated, periodic) Gaussian bump of width about ``sigma`` tokens in the
distance ``d = x - y``. Queries and keys of a head concatenate the axis features it uses, each
scaled by ``c = sqrt(beta / (scale * A))``, so the scaled score is exactly::

    scale * q_i . k_j = beta * sum_axes kappa_axis(d_axis) + (noise terms)

and attention is ``softmax_j`` of it: a product of per-axis bumps, sharpened by ``beta``.

* spatial heads: axes t (``sigma = 1`` frame), h and w (``sigma = 1.5`` tokens), ``beta = 8``;
* temporal heads: axes h and w only (``sigma = 0.25``: the sharpest the frequencies allow),
  ``beta = 12`` and no temporal feature, so every frame's token at the same ``(h, w)`` scores
  alike;
* global heads: the spatial construction with ``beta = 1`` (nearly flat).

Semantic heads
--------------
``semantic_objects(grid, objects, seed)`` cuts the video into ``K = objects`` objects: a weighted
Voronoi partition of every frame around ``K`` seeds, seed ``c`` at ``s_c + t u_c`` in frame ``t``
(``s_c`` uniform in the frame, velocity ``u_c`` uniform in ``[-0.5, 0.5]^2`` tokens per frame,
weight ``r_c`` uniform in ``[0.6, 1.4]``); token ``(t, h, w)`` belongs to
``argmin_c |(h, w) - s_c - t u_c| / r_c``. The objects are irregular, mostly contiguous regions
that drift a little between frames, each spread over many tiles and every frame. The seeds come
from their own generator (``seed``), so the other kinds' draws are unchanged. The features are the
object's one-hot vector in ``K`` dims scaled by ``sqrt(beta_obj / scale)`` and, in the dims left,
the spatial construction with a weak ``beta = 0.5``, so the scaled score is exactly::

    scale * q_i . k_j = beta_obj [obj(i) = obj(j)] + 0.5 sum_axes kappa_axis(d_axis) + (noise terms)

with ``beta_obj = 6``: a query spreads its mass over its object (slightly more on nearby tokens)
and puts ``~ e^6 / (e^6 + K - 1)`` of it there. It needs ``head_dim - 2 >= K``.

Rotary and smooth heads (norm-preserving, like RoPE'd queries and keys)
-----------------------------------------------------------------------
``"rotary"``: position enters through ``M`` random Fourier features of the 3-D coordinate
``x = (t, h, w)``: frequencies ``omega_m ~ N(0, diag(sigma)^-2)`` (``sigma = (1, 1.5, 1.5)``), each
pair ``[cos(omega_m . x), sin(omega_m . x)] / sqrt(M)``, scaled by ``sqrt(beta / scale)`` with
``beta = 8``. Every token's position part has the same norm (no feature grows with position: a
rotation, as RoPE is), and ``scale * q_i . k_j = beta (1 / M) sum_m cos(omega_m . (x_i - x_j))``,
a Monte-Carlo estimate of ``beta exp(-|d / sigma|^2 / 2)`` (Bochner) whose ripples leak some mass
far away, as real rotary heads do. The last 16 feature dims carry per-token content, drawn
independently for q and k (``N(0, 1)`` per dim, scaled so the content logit has std 1): a
random, unstructured part of every score.
``"smooth"``: the scores come mostly from spatially smooth content, as in real video latents:
32 content dims of white noise on the grid, blurred by a Gaussian of width ``(1, 2, 2)`` tokens
along ``(t, h, w)`` and normalised per token to unit norm (neighbouring tokens' content is
correlated; distant tokens are unrelated but may look alike by chance), scaled by
``sqrt(6 / scale)`` in q and k alike (``scale * q_i . k_j = 6 cos(c_i, c_j)`` + position), plus
the rotary position part above with a weak ``beta = 2``. Both kinds draw their frequencies and
content from their own generator (``seed``), so other kinds' draws are unchanged.

The frequencies per axis are capped by the head dimension (two dims per frequency, two dims kept
for the offsets below) and by the axis (``M <= P // 2``; a length-1 axis gets none). Two more
dims carry a per-head constant offset: queries get ``offset * |features|`` in dim ``D - 1`` and
keys in dim ``D - 2`` (zero in the other's dim), so ``q . k`` is unchanged while tokens of a block
look alike, as DiT queries and keys do (their large shared mean); SpargeAttn's self-similarity
test then sees what it sees in real models. Gaussian noise of ``noise * |features| / sqrt(D)``
per feature dim makes every token distinct. Values are standard normal. Optional text tokens
(``text_len``, before or after the video) have standard normal q and k scaled like the video
features (they draw a moderate, diffuse share of attention) and never carry positional structure.

Verifying the attention
-----------------------
``attention_masses(q, k, layout)`` computes dense attention row by row (in chunks) and reports
per head, averaged over video queries: ``local`` (mass on video keys with ``|dt| <= 1`` and
``|dh|, |dw| <= radius``, default 2), ``same_position`` (mass on keys at the query's ``(h, w)`` in
*other* frames), ``text``, ``entropy`` (normalised by ``log`` of the key count) and ``top5``
(mass on the row's 5% largest keys, wherever they are).
``check_kinds(masses, kinds, frames)`` asserts the documented structure: spatial heads put at
least 0.8 of their mass locally; temporal heads at least ``0.6 * (T - 1) / T`` on the same
position in other frames (a temporal head spreads its mass over the T frames alike, so the
query's own frame holds ``1 / T`` of it); global heads have normalised entropy at least 0.85;
semantic heads put at least 0.8 of their mass on their own object (``same_object``: reported
when ``attention_masses`` gets ``objects``, the per-video-token labels of ``semantic_objects``).
``tests/eval/test_structured.py`` runs it.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

from fastdit.layout import TokenLayout

KINDS = ("spatial", "temporal", "global", "semantic", "rotary", "smooth")
DEFAULT_KINDS = ("spatial", "temporal", "global")
#: Per kind: (sigma per axis (t, h, w) in tokens or None for an unused axis, beta).
KIND_SHAPES = {
    "spatial": ((1.0, 1.5, 1.5), 8.0),
    "temporal": ((None, 0.25, 0.25), 12.0),
    "global": ((1.0, 1.5, 1.5), 1.0),
    "semantic": ((1.0, 1.5, 1.5), 0.5),  # the weak positional part; the object part is SEMANTIC_BETA
}
#: Semantic heads: the score of a same-object pair, and the default number of objects.
SEMANTIC_BETA = 6.0
DEFAULT_OBJECTS = 8
#: Thresholds of ``check_kinds`` (the documented structure).
MIN_SPATIAL_LOCAL = 0.8
MIN_TEMPORAL_SAME_POSITION = 0.6  # of the (T - 1) / T share the other frames hold
MIN_GLOBAL_ENTROPY = 0.85
MIN_SEMANTIC_SAME_OBJECT = 0.8
#: Rotary and smooth heads: local mass at least this (they leak more than spatial heads: the random
#: features' kernel has long-range ripples, and smooth content recurs away from the query).
MIN_ROTARY_LOCAL = 0.35
MIN_SMOOTH_LOCAL = 0.3

#: Rotary heads: (sigma per axis (t, h, w) of the Gaussian kernel the random frequencies sample,
#: position beta, content dims, content logit std). Smooth heads: (content dims, content
#: smoothing width per axis in tokens, content beta, position beta of a weak rotary part).
ROTARY_SHAPE = ((1.0, 1.5, 1.5), 8.0, 16, 1.0)
SMOOTH_SHAPE = (32, (1.0, 2.0, 2.0), 6.0, 2.0)


class StructuredInputs(NamedTuple):
    """``q, k, v`` ``(B, H, S, D)`` in model token order, the ``TokenLayout`` and each head's kind."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    layout: TokenLayout
    kinds: tuple


def _period(n):
    return n + max(3, math.ceil(n / 3))


def _axis_features(coords, n, sigma, max_freqs):
    """``(len(coords), 2 M)`` features of one axis and their total weight ``A`` (see the docstring)."""
    period = _period(n)
    freqs = min(max_freqs, period // 2) if n > 1 else 0
    if freqs <= 0:
        return coords.new_zeros(coords.shape[0], 0), 0.0
    omega = 2 * math.pi * torch.arange(1, freqs + 1, dtype=torch.float64) / period
    weight = torch.exp(-0.5 * (omega * sigma) ** 2)
    angle = coords[:, None].double() * omega
    feats = torch.cat([weight.sqrt() * angle.cos(), weight.sqrt() * angle.sin()], dim=1)
    return feats, float(weight.sum())


def _frequency_budget(pairs, used_axes):
    """Frequencies per used axis out of ``pairs``: time gets a fifth, h and w share the rest."""
    t_used, h_used, w_used = used_axes
    budget_t = max(1, pairs // 5) if t_used else 0
    rest = pairs - budget_t
    spatial_axes = int(h_used) + int(w_used)
    per_axis = rest // spatial_axes if spatial_axes else 0
    return (budget_t, per_axis if h_used else 0, per_axis if w_used else 0)


def semantic_objects(grid, objects=DEFAULT_OBJECTS, seed=0):
    """Object label (``0 .. objects - 1``) of every video token, ``(T*H*W,)`` long in model order:
    weighted Voronoi cells of drifting seeds (see "Semantic heads" in the module docstring)."""
    if isinstance(objects, bool) or not isinstance(objects, int) or objects < 1:
        raise ValueError(f"objects must be an int >= 1 (the number of semantic objects), got {objects!r}")
    t_, h_, w_ = grid
    gen = torch.Generator().manual_seed(int(seed) + 7919)  # its own stream: other kinds' draws unchanged
    start = torch.rand(objects, 2, generator=gen, dtype=torch.float64) * torch.tensor([h_, w_], dtype=torch.float64)
    velocity = torch.rand(objects, 2, generator=gen, dtype=torch.float64) - 0.5
    weight = 0.6 + 0.8 * torch.rand(objects, generator=gen, dtype=torch.float64)
    t, h, w = torch.meshgrid(torch.arange(t_), torch.arange(h_), torch.arange(w_), indexing="ij")
    point = torch.stack([h.reshape(-1), w.reshape(-1)], dim=1).double()  # (N, 2)
    centre = start + t.reshape(-1, 1, 1).double() * velocity  # (N, K, 2): each token's frame's seeds
    distance = (point[:, None] - centre).norm(dim=-1) / weight
    return distance.argmin(dim=1)


def grid_coords(grid):
    """``(T*H*W, 3)`` float64 ``(t, h, w)`` of every video token, model order."""
    t, h, w = torch.meshgrid(*(torch.arange(n) for n in grid), indexing="ij")
    return torch.stack([t.reshape(-1), h.reshape(-1), w.reshape(-1)], dim=1).double()


def rotary_features(grid, pairs, sigma, gen):
    """``(T*H*W, 2 * pairs)`` random Fourier features of the coordinates (unit norm per token):
    ``[cos(omega . x), sin(omega . x)] / sqrt(pairs)``, ``omega ~ N(0, diag(sigma)^-2)``."""
    if pairs < 1:
        return torch.zeros(math.prod(grid), 0, dtype=torch.float64)
    omega = torch.randn(pairs, 3, generator=gen, dtype=torch.float64) / torch.tensor(sigma, dtype=torch.float64)
    angle = grid_coords(grid) @ omega.T
    return torch.cat([angle.cos(), angle.sin()], dim=1) / math.sqrt(pairs)


def smooth_content(grid, dims, width, gen):
    """``(T*H*W, dims)`` unit-norm content: white noise on the grid blurred by a Gaussian of
    ``width`` tokens per axis (separable, zero padding), normalised per token."""
    field = torch.randn(dims, *grid, generator=gen, dtype=torch.float64)
    for axis, sigma in enumerate(width):
        n = grid[axis]
        if n < 2 or sigma <= 0:
            continue
        pos = torch.arange(n, dtype=torch.float64)
        kernel = torch.exp(-0.5 * ((pos[:, None] - pos[None]) / sigma) ** 2)  # (n, n) blur along the axis
        field = torch.movedim(torch.movedim(field, axis + 1, -1) @ kernel, -1, axis + 1)
    content = field.reshape(dims, -1).T
    return content / content.norm(dim=1, keepdim=True).clamp_min(1e-12)


def rotary_head_features(kind, grid, head_dim, scale, seed=0):
    """Noise-free ``(T*H*W, head_dim - 2)`` features of a ``"rotary"`` or ``"smooth"`` head (q == k;
    a rotary head's content dims are left 0: ``structured_qkv`` draws them apart for q and k)."""
    gen = torch.Generator().manual_seed(int(seed) + (104729 if kind == "rotary" else 130363))
    room = head_dim - 2
    if kind == "rotary":
        sigma, beta, content, _ = ROTARY_SHAPE
        content = min(content, room // 4)
        position = rotary_features(grid, (room - content) // 2, sigma, gen) * math.sqrt(beta / scale)
        parts = [position]
    else:
        content, width, beta_content, beta = SMOOTH_SHAPE
        content = min(content, room // 2)
        parts = [smooth_content(grid, content, width, gen) * math.sqrt(beta_content / scale),
                 rotary_features(grid, (room - content) // 2, ROTARY_SHAPE[0], gen) * math.sqrt(beta / scale)]
    feats = torch.cat(parts, dim=1)
    out = torch.zeros(feats.shape[0], room, dtype=torch.float64)
    out[:, : feats.shape[1]] = feats
    return out


def head_features(kind, grid, head_dim, scale, objects=None, seed=0):
    """Noise-free ``(T*H*W, head_dim - 2)`` features of one head of ``kind`` (q == k), scaled so that
    ``scale * f_i . f_j = beta * sum_axes kappa(d)`` (plus ``SEMANTIC_BETA [same object]`` for
    semantic heads, whose ``objects`` are the labels of ``semantic_objects``); rotary and smooth
    heads: ``rotary_head_features`` (``seed`` draws their frequencies and content)."""
    if kind in ("rotary", "smooth"):
        return rotary_head_features(kind, grid, head_dim, scale, seed)
    if kind not in KIND_SHAPES:
        raise ValueError(f"head kind must be one of {KINDS}, got {kind!r}")
    sigmas, beta = KIND_SHAPES[kind]
    t_, h_, w_ = grid
    if kind == "temporal" and t_ < 2:
        raise ValueError("temporal heads need a grid with at least 2 frames")
    n_objects = 0
    if kind == "semantic":
        if objects is None:
            raise ValueError("semantic heads need objects= (the labels of semantic_objects)")
        n_objects = int(objects.max()) + 1
        if n_objects > head_dim - 2:
            raise ValueError(f"semantic heads need head_dim - 2 >= objects (one dim per object), got "
                             f"{n_objects} objects and head_dim={head_dim}")
    t, h, w = torch.meshgrid(torch.arange(t_), torch.arange(h_), torch.arange(w_), indexing="ij")
    coords = (t.reshape(-1), h.reshape(-1), w.reshape(-1))
    pairs = (head_dim - 2 - n_objects) // 2
    budget = _frequency_budget(pairs, [s is not None and n > 1 for s, n in zip(sigmas, grid)])
    parts = []
    if n_objects:  # one-hot object vectors: scale * f_i . f_j = SEMANTIC_BETA exactly for a same-object pair
        parts.append(torch.nn.functional.one_hot(objects, n_objects).double() * math.sqrt(SEMANTIC_BETA / scale))
    for axis_coords, n, sigma, freqs in zip(coords, grid, sigmas, budget):
        if sigma is None or freqs == 0:
            continue
        feats, total = _axis_features(axis_coords, n, sigma, freqs)
        if total > 0:
            parts.append(feats * math.sqrt(beta / (scale * total)))
    feats = torch.cat(parts, dim=1) if parts else torch.zeros(t_ * h_ * w_, 0, dtype=torch.float64)
    out = torch.zeros(feats.shape[0], head_dim - 2, dtype=torch.float64)
    out[:, : feats.shape[1]] = feats
    return out


def structured_qkv(grid=(8, 16, 24), heads=3, head_dim=64, batch=1, kinds=None, text_len=0,
                   text_position="suffix", noise=0.1, offset=1.5, seed=0, objects=DEFAULT_OBJECTS, device="cpu",
                   dtype=torch.float32):
    """Video-like ``q, k, v`` with one attention kind per head (see the module docstring).

    Args:
        grid: ``(T, H, W)`` video tokens. heads, head_dim, batch: the tensor shape.
        kinds: one of ``KINDS`` per head; default ``("spatial", "temporal", "global")`` cycled
            (``("spatial", "global")`` for a single frame).
        text_len, text_position: optional text tokens (``"prefix"`` or ``"suffix"``).
        noise: per-dim Gaussian noise relative to the feature norm over ``sqrt(D)``.
        offset: the shared per-head offset relative to the feature norm (block self-similarity).
        seed: all randomness (noise, values, text, semantic objects) comes from this seed.
        objects: the number of objects of semantic heads (``semantic_objects(grid, objects, seed)``
            gives their labels, for ``attention_masses``).

    Returns:
        ``StructuredInputs(q, k, v, layout, kinds)``.
    """
    if head_dim < 8:
        raise ValueError(f"head_dim must be >= 8 (positional features need room), got {head_dim}")
    if kinds is None:  # images (one frame) have no temporal heads
        cycle = DEFAULT_KINDS if grid[0] > 1 else ("spatial", "global")
        kinds = tuple(cycle[i % len(cycle)] for i in range(heads))
    kinds = tuple(kinds)
    if len(kinds) != heads:
        raise ValueError(f"kinds lists {len(kinds)} heads but heads={heads}")
    if "semantic" in kinds and not (isinstance(objects, int) and 1 <= objects <= head_dim - 2):
        raise ValueError(f"objects must be an int in [1, head_dim - 2 = {head_dim - 2}] for semantic heads "
                         f"(one feature dim per object), got {objects!r}")
    layout = TokenLayout(tuple(grid), text_len, text_position if text_len else "none")
    scale = 1.0 / math.sqrt(head_dim)
    gen = torch.Generator().manual_seed(int(seed))
    n_video, seq = layout.video_len, layout.seq_len
    q = torch.zeros(batch, heads, seq, head_dim, dtype=torch.float64)
    k = torch.zeros_like(q)
    video = layout.video_positions()
    labels = semantic_objects(layout.grid, objects, seed) if "semantic" in kinds else None
    features = {kind: head_features(kind, layout.grid, head_dim, scale, labels, seed) for kind in set(kinds)}
    for head, kind in enumerate(kinds):
        feats = features[kind]
        norm = float(feats.norm(dim=1).mean()) or 1.0
        sigma = noise * norm / math.sqrt(head_dim)
        for which in (q, k):
            noisy = feats + sigma * torch.randn(batch, n_video, head_dim - 2, generator=gen, dtype=torch.float64)
            which[:, head, video, : head_dim - 2] = noisy
        if kind == "rotary":  # per-token content, independent in q and k: a logit of std ROTARY_SHAPE[3]
            dims = min(ROTARY_SHAPE[2], (head_dim - 2) // 4)
            size = math.sqrt(ROTARY_SHAPE[3] / (scale * math.sqrt(dims)))
            for which in (q, k):
                which[:, head, video, head_dim - 2 - dims: head_dim - 2] = size * torch.randn(
                    batch, n_video, dims, generator=gen, dtype=torch.float64)
        # The shared offset in separate dims: q . k unchanged, blocks self-similar.
        q[:, head, video, head_dim - 1] = offset * norm
        k[:, head, video, head_dim - 2] = offset * norm
        if text_len:
            text = layout.text_positions()
            for which in (q, k):
                which[:, head, text] = (norm / math.sqrt(head_dim)) * torch.randn(
                    batch, text_len, head_dim, generator=gen, dtype=torch.float64)
    v = torch.randn(batch, heads, seq, head_dim, generator=gen, dtype=torch.float64)
    cast = dict(device=device, dtype=dtype)
    return StructuredInputs(q.to(**cast), k.to(**cast), v.to(**cast), layout, kinds)


def attention_masses(q, k, layout, scale=None, radius=2, chunk=1024, objects=None):
    """Per head (a list of dicts), averaged over batch and video queries, of dense attention:
    ``local`` (video keys with ``|dt| <= 1``, ``|dh|, |dw| <= radius``), ``same_position`` (keys at
    the query's ``(h, w)`` in other frames), ``text``, ``entropy`` (over ``log`` of the keys), ``top5``
    (mass on the row's 5% largest keys) and, given ``objects`` (a label per video token,
    ``semantic_objects``), ``same_object`` (video keys with the query's label)."""
    batch, heads, seq, dim = q.shape
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    t_, h_, w_ = layout.grid
    video = layout.video_positions(q.device)
    grid_t = torch.arange(t_, device=q.device).repeat_interleave(h_ * w_)
    grid_h = torch.arange(h_, device=q.device).repeat_interleave(w_).repeat(t_)
    grid_w = torch.arange(w_, device=q.device).repeat(t_ * h_)
    is_text = torch.zeros(seq, dtype=torch.bool, device=q.device)
    is_text[layout.text_positions(q.device)] = True
    sums = torch.zeros(6, heads, dtype=torch.float64)
    top = max(1, math.ceil(0.05 * seq))
    labels = None if objects is None else objects.to(q.device)
    keys = k.float()
    for start in range(0, layout.video_len, chunk):
        rows = slice(start, min(start + chunk, layout.video_len))
        probs = torch.softmax(scale * q[:, :, video[rows]].float() @ keys.transpose(-1, -2), dim=-1)
        dt = (grid_t[rows, None] - grid_t[None]).abs()
        dh = (grid_h[rows, None] - grid_h[None]).abs()
        dw = (grid_w[rows, None] - grid_w[None]).abs()
        local = (dt <= 1) & (dh <= radius) & (dw <= radius)
        same = (dt > 0) & (dh == 0) & (dw == 0)
        video_probs = probs[..., video]
        sums[0] += (video_probs * local).sum((-1, -2)).sum(0).double().cpu()
        sums[1] += (video_probs * same).sum((-1, -2)).sum(0).double().cpu()
        sums[2] += (probs * is_text).sum((-1, -2)).sum(0).double().cpu()
        entropy = -torch.special.xlogy(probs, probs).sum(-1) / math.log(seq)
        sums[3] += entropy.sum(-1).sum(0).double().cpu()
        sums[5] += probs.topk(top, dim=-1).values.sum(-1).sum(-1).sum(0).double().cpu()
        if labels is not None:
            same_object = labels[rows, None] == labels[None]
            sums[4] += (video_probs * same_object).sum((-1, -2)).sum(0).double().cpu()
    sums /= batch * layout.video_len
    masses = [{"local": float(sums[0, h]), "same_position": float(sums[1, h]), "text": float(sums[2, h]),
               "entropy": float(sums[3, h]), "top5": float(sums[5, h])} for h in range(heads)]
    if labels is not None:
        for h, mass in enumerate(masses):
            mass["same_object"] = float(sums[4, h])
    return masses


def check_kinds(masses, kinds, frames):
    """Raise AssertionError naming the head when a head lacks its kind's documented structure."""
    for head, (mass, kind) in enumerate(zip(masses, kinds)):
        if kind == "spatial":
            ok = mass["local"] >= MIN_SPATIAL_LOCAL
        elif kind in ("rotary", "smooth"):
            ok = mass["local"] >= (MIN_ROTARY_LOCAL if kind == "rotary" else MIN_SMOOTH_LOCAL)
        elif kind == "temporal":
            ok = mass["same_position"] >= MIN_TEMPORAL_SAME_POSITION * (frames - 1) / frames
        elif kind == "semantic":
            if "same_object" not in mass:
                raise ValueError("semantic heads are checked on same_object: pass objects=semantic_objects(...) "
                                 "to attention_masses")
            ok = mass["same_object"] >= MIN_SEMANTIC_SAME_OBJECT
        else:
            ok = mass["entropy"] >= MIN_GLOBAL_ENTROPY
        if not ok:
            raise AssertionError(f"head {head} ({kind}) lacks its structure: {mass}")
