"""Batched k-means (``fastdit.methods.kmeans``) against a direct, point-by-point implementation."""
from __future__ import annotations

import pytest
import torch

from fastdit.methods.selection.kmeans import kmeans, spread_init


def direct_kmeans(x, centroids, iters, valid=None):
    """Lloyd's algorithm for one problem, in float64 Python loops: nearest centroid by the squared
    distance (first on ties), means of the valid points, empty clusters keep their centroid."""
    x, c = x.double(), centroids.double().clone()
    n, k = x.shape[0], c.shape[0]
    valid = [True] * n if valid is None else valid.tolist()
    for _ in range(iters):
        labels = []
        for i in range(n):
            d = [float(((x[i] - c[j]) ** 2).sum()) for j in range(k)]
            labels.append(min(range(k), key=lambda j: (d[j], j)))
        sizes = [0] * k
        sums = torch.zeros_like(c)
        for i, label in enumerate(labels):
            if valid[i]:
                sizes[label] += 1
                sums[label] += x[i]
        for j in range(k):
            if sizes[j]:
                c[j] = sums[j] / sizes[j]
    return c, torch.tensor(labels), torch.tensor(sizes, dtype=torch.float64)


@pytest.mark.parametrize("iters", [1, 3])
@pytest.mark.parametrize("with_valid", [False, True])
def test_same_assignments_and_centroids_as_direct(iters, with_valid):
    g = torch.Generator().manual_seed(iters + 10 * with_valid)
    groups, n, dim, k = 3, 37, 5, 6
    # three blobs plus noise, so the clusters are real and assignments not near ties
    blobs = torch.randn(groups, 3, dim, generator=g, dtype=torch.float64) * 4
    x = blobs[:, torch.randint(0, 3, (n,), generator=g)] + torch.randn(groups, n, dim, generator=g, dtype=torch.float64)
    init = x[:, torch.randperm(n, generator=g)[:k]].clone()
    valid = torch.rand(groups, n, generator=g) > 0.3 if with_valid else None
    centroids, labels, sizes = kmeans(x, init, iters, valid)
    assert torch.isfinite(centroids).all()
    for group in range(groups):
        ref_c, ref_l, ref_s = direct_kmeans(x[group], init[group], iters, None if valid is None else valid[group])
        assert torch.equal(labels[group], ref_l)
        assert torch.equal(sizes[group].double(), ref_s)
        assert torch.allclose(centroids[group].double(), ref_c, rtol=1e-10, atol=1e-10)


def test_float32_input_and_an_empty_cluster_keeps_its_centroid():
    x = torch.tensor([[[0.0, 0.0], [0.1, 0.0], [5.0, 5.0], [5.1, 5.0]]])
    init = torch.tensor([[[0.0, 0.0], [5.0, 5.0], [100.0, 100.0]]])  # the third wins no point
    centroids, labels, sizes = kmeans(x, init, 2)
    assert labels.tolist() == [[0, 0, 1, 1]] and sizes.tolist() == [[2.0, 2.0, 0.0]]
    assert torch.allclose(centroids, torch.tensor([[[0.05, 0.0], [5.05, 5.0], [100.0, 100.0]]]))
    assert centroids.dtype == torch.float32


def test_half_precision_is_clustered_in_float32_and_bad_arguments_raise():
    x = torch.randn(2, 20, 4).half()
    centroids, labels, _ = kmeans(x, spread_init(x, 3), 2)
    assert centroids.dtype == torch.float32 and labels.shape == (2, 20) and int(labels.max()) < 3
    with pytest.raises(ValueError, match="iters"):
        kmeans(x, spread_init(x, 3), 0)
    with pytest.raises(ValueError, match="centroids"):
        kmeans(x, torch.randn(2, 3, 5), 1)


def test_spread_init_takes_distinct_fixed_seed_points():
    x = torch.arange(40.0).view(1, 40, 1).expand(2, 40, 1)
    expected = torch.randperm(40, generator=torch.Generator().manual_seed(0))[:7].sort().values.double()
    assert torch.equal(spread_init(x, 7)[0, :, 0].double(), expected)
    assert torch.equal(spread_init(x, 7)[1], spread_init(x, 7)[0])  # the same positions in every problem
    assert spread_init(x, 40).flatten().unique().numel() == 40
    # evenly spaced positions would alias with a period (frames): these do not
    frames = (spread_init(x, 8)[0, :, 0].long() % 5).unique().numel()
    assert frames > 1
    with pytest.raises(ValueError, match="clusters"):
        spread_init(x, 41)
