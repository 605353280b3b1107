"""Batched k-means on the device, for svg2's semantic-aware permutation.

Sparse VideoGen 2 (Yang, Xi et al., 2025, "Sparse VideoGen2: Accelerate Video Generation with
Sparse Attention via Semantic-Aware Permutation") clusters each head's queries and keys with plain
Euclidean (L2) k-means; so does this module. ``G`` independent problems (one per (batch, head))
run at once: ``x`` ``(G, N, D)``, ``centroids`` ``(G, C, D)``.

One iteration (Lloyd's):

* assignment: ``label_i = argmin_c |x_i - c|^2 = argmax_c (2 x_i . c - |c|^2)`` (``|x_i|^2`` is
  the same for every ``c``): one batched matrix product ``x @ centroids^T``; the first cluster on
  ties;
* update: ``c = mean of the valid x_i labelled c``; a cluster with no valid point keeps its
  previous centroid (it may win points back in a later iteration).

``kmeans`` runs ``iters`` iterations and returns the last assignment, the centroids updated from
it and the valid sizes, so the three agree (``centroids[c]`` is the mean of the valid points with
label ``c``, for every non-empty ``c``). Invalid points (``valid`` False: masked keys) get a label
like any point, so a permutation can place them, but never move a centroid or count in a size.
``cluster_permutation`` turns labels into svg2's kernel order (each cluster contiguous, then the
text) and ``inverse_order`` undoes it.

Everything is torch on the input's device with no host synchronisation (no ``.item()``, no
data-dependent shapes). The ``(G, N, C)`` scores are computed in chunks of problems so that at most
``SCORE_BUDGET`` float32 entries are held at once. Half-precision inputs are clustered in float32;
float64 stays float64 (tests).
"""
from __future__ import annotations

import functools

import torch

#: float32 entries of the (problems, points, clusters) score table held at once.
SCORE_BUDGET = 1 << 26


def _work_dtype(x):
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def assign(x, centroids):
    """Label of each point: index of its nearest centroid (L2), long ``(G, N)``."""
    x = x.to(_work_dtype(x))
    centroids = centroids.to(x.dtype)
    groups, points = x.shape[:2]
    clusters = centroids.shape[1]
    labels = torch.empty(groups, points, dtype=torch.long, device=x.device)
    norms = centroids.square().sum(-1)  # (G, C)
    chunk = max(1, SCORE_BUDGET // max(1, points * clusters))
    for g0 in range(0, groups, chunk):
        g1 = min(groups, g0 + chunk)
        scores = torch.baddbmm(norms[g0:g1, None, :], x[g0:g1], centroids[g0:g1].transpose(1, 2), beta=-1.0, alpha=2.0)
        labels[g0:g1] = scores.max(-1).indices  # the first maximum on ties; 2x faster than argmax on the CPU
    return labels


def update(x, labels, centroids, valid=None):
    """Centroids as the means of their valid points (empty clusters keep ``centroids``) and the
    valid sizes: ``((G, C, D), float (G, C))``."""
    x = x.to(_work_dtype(x))
    groups, points, dim = x.shape
    clusters = centroids.shape[1]
    if valid is None:
        weight = torch.ones(groups * points, dtype=x.dtype, device=x.device)
    else:
        weight = valid.reshape(-1).to(x.dtype)
    # One index_add_ over the flattened (G * C) clusters: several times faster on the CPU than a
    # scatter_add_ with an index expanded over D, or a one-hot matrix product.
    flat = (labels + torch.arange(groups, device=x.device)[:, None] * clusters).reshape(-1)
    rows = x.reshape(groups * points, dim)
    sizes = torch.zeros(groups * clusters, dtype=x.dtype, device=x.device).index_add_(0, flat, weight)
    sums = torch.zeros(groups * clusters, dim, dtype=x.dtype, device=x.device).index_add_(
        0, flat, rows if valid is None else rows * weight[:, None])
    sizes, sums = sizes.view(groups, clusters), sums.view(groups, clusters, dim)
    means = sums / sizes.clamp(min=1.0)[..., None]
    return torch.where(sizes[..., None] > 0, means, centroids.to(x.dtype)), sizes


def kmeans(x, centroids, iters, valid=None):
    """``iters`` iterations of batched L2 k-means from ``centroids`` (see the module docstring).

    Args:
        x: ``(G, N, D)`` points.
        centroids: ``(G, C, D)`` initial centroids.
        iters: iterations (>= 1).
        valid: bool ``(G, N)`` or None: points that move centroids and count in sizes.

    Returns:
        ``(centroids, labels, sizes)``: ``(G, C, D)`` in the working dtype (float32, or float64 for
        float64 input), long ``(G, N)`` labels of the last assignment, and float ``(G, C)`` counts
        of valid points per cluster.
    """
    if iters < 1:
        raise ValueError(f"kmeans: iters must be >= 1, got {iters!r}")
    if x.dim() != 3 or centroids.dim() != 3 or x.shape[0] != centroids.shape[0] or x.shape[2] != centroids.shape[2]:
        raise ValueError(f"kmeans: x must be (G, N, D) and centroids (G, C, D), got {tuple(x.shape)} and "
                         f"{tuple(centroids.shape)}")
    centroids = centroids.to(_work_dtype(x))
    for _ in range(iters):
        labels = assign(x, centroids)
        centroids, sizes = update(x, labels, centroids, valid)
    return centroids, labels, sizes


#: Seed of the cold-start choice of initial points (fixed: the same points in every call and run).
INIT_SEED = 0


@functools.lru_cache(maxsize=64)
def _init_index(points, clusters, device):
    generator = torch.Generator().manual_seed(INIT_SEED)
    index = torch.randperm(points, generator=generator)[:clusters].sort().values
    return index.to(device)  # cached per device: no host-to-device copy in later calls


def spread_init(x, clusters):
    """Deterministic cold-start centroids ``(G, C, D)``: the points at ``C`` distinct positions of
    each problem drawn once with a fixed seed (``INIT_SEED``), in increasing order. Not evenly
    spaced positions: for video tokens in model order those alias with the frame length (with
    ``C`` a multiple of the frames every frame would give the same spatial positions, which for
    heads that ignore time are duplicate centroids)."""
    points = x.shape[1]
    if not 1 <= clusters <= points:
        raise ValueError(f"spread_init: clusters must be in [1, {points}] (the number of points), got {clusters}")
    return x.index_select(1, _init_index(points, clusters, str(x.device))).to(_work_dtype(x))


def cluster_permutation(labels, clusters, video, text):
    """Kernel order of one side: ``(order (G, S), offsets int32 (G, M + 1), blocks (G, S))``:
    model token at each kernel position (video sorted by cluster, then text), block boundaries,
    and each model token's block (``clusters`` for text)."""
    groups, n_video = labels.shape
    device = labels.device
    sort = torch.argsort(labels, dim=1, stable=True)
    sizes = torch.zeros(groups, clusters, dtype=torch.long, device=device).scatter_add_(
        1, labels, torch.ones_like(labels))
    parts = [torch.zeros(groups, 1, dtype=torch.long, device=device), sizes.cumsum(1)]
    pieces = [video[sort]]
    seq = n_video + text.numel()
    if text.numel():
        parts.append(torch.full((groups, 1), seq, dtype=torch.long, device=device))
        pieces.append(text.expand(groups, -1))
    blocks = torch.full((groups, seq), clusters, dtype=torch.long, device=device)
    blocks[:, video] = labels
    return torch.cat(pieces, 1), torch.cat(parts, 1).to(torch.int32), blocks


def inverse_order(order):
    """Kernel position of every model token, ``(G, S)``."""
    positions = torch.arange(order.shape[1], device=order.device).expand_as(order)
    return torch.empty_like(order).scatter_(1, order, positions)
