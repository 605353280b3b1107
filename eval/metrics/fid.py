"""Fréchet Inception Distance (Heusel et al. 2017) for images.

``FID = ||mu1 - mu2||^2 + Tr(S1 + S2 - 2 (S1 S2)^{1/2})`` between Gaussians fitted to the
2048-d pool features of Inception-v3.

Feature extractor: the TF "2015-12-05" Inception graph as ported by pytorch-fid
(``pt_inception-2015-12-05-6726825d.pth``). It differs from torchvision's Inception-v3 in the
pooling branches (TF average pooling excludes padding, and the last block max-pools), which is
why the blocks are written out here rather than taken from torchvision (which cannot be
installed beside this torch build). The module names match torchvision's ``Inception3`` with
``num_classes=1008, aux_logits=False`` so the weight file loads with ``strict=True``.

Weights are never downloaded: pass ``weights=``, or set ``FASTDIT_FID_WEIGHTS`` (file or
directory), or put the file in ``~/.cache/fastdit/fid/`` (torch hub's checkpoint cache, where
pytorch-fid stores it, is also searched).

Resizing to 299x299 (``resize=``):

* ``"clean"`` (default, clean-fid, Parmar et al. 2022): PIL bicubic on each channel of the
  uint8 image as a float32 image (no re-quantisation), clipped to [0, 255];
* ``"legacy_pytorch"``: pytorch-fid's ``F.interpolate(bilinear, align_corners=False)`` on
  [0, 1] tensors (no antialiasing);
* ``"legacy_tensorflow"``: TF1 ``resize_bilinear`` (``align_corners=False``,
  ``half_pixel_centers=False``) as inside the original TTUR graph.

Then ``x / 255 * 2 - 1`` into the network. Note clean-fid's own "clean" mode feeds NVIDIA's
torchscript port of the same TF graph; this module uses pytorch-fid's port, so values agree
with clean-fid only up to the small differences between the two ports.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Tuple, Union

import numpy as np
import scipy.linalg
import torch
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image

from fastdit.media.video import to_uint8

PathLike = Union[str, os.PathLike]

FID_WEIGHTS_NAME = "pt_inception-2015-12-05-6726825d.pth"
RESIZE_MODES = ("clean", "legacy_pytorch", "legacy_tensorflow")

__all__ = [
    "FID_WEIGHTS_NAME",
    "FIDInceptionV3",
    "load_inception",
    "inception_features",
    "compute_stats",
    "frechet_distance",
    "fid",
    "reference_stats",
    "resolve_fid_weights",
]


# ----------------------------------------------------------------------------
# network
# ----------------------------------------------------------------------------

class BasicConv2d(nn.Module):
    """conv (no bias) -> BatchNorm(eps=1e-3) -> ReLU, as torchvision's Inception blocks."""

    def __init__(self, cin: int, cout: int, **kw):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, bias=False, **kw)
        self.bn = nn.BatchNorm2d(cout, eps=0.001)

    def forward(self, x):
        return F.relu(self.bn(self.conv(x)))


def _tf_avg_pool(x):
    # TF's 3x3 "SAME" average pool divides by the number of real (unpadded) pixels.
    return F.avg_pool2d(x, kernel_size=3, stride=1, padding=1, count_include_pad=False)


class FIDInceptionA(nn.Module):
    def __init__(self, cin: int, pool_features: int):
        super().__init__()
        self.branch1x1 = BasicConv2d(cin, 64, kernel_size=1)
        self.branch5x5_1 = BasicConv2d(cin, 48, kernel_size=1)
        self.branch5x5_2 = BasicConv2d(48, 64, kernel_size=5, padding=2)
        self.branch3x3dbl_1 = BasicConv2d(cin, 64, kernel_size=1)
        self.branch3x3dbl_2 = BasicConv2d(64, 96, kernel_size=3, padding=1)
        self.branch3x3dbl_3 = BasicConv2d(96, 96, kernel_size=3, padding=1)
        self.branch_pool = BasicConv2d(cin, pool_features, kernel_size=1)

    def forward(self, x):
        b1 = self.branch1x1(x)
        b5 = self.branch5x5_2(self.branch5x5_1(x))
        b3 = self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x)))
        bp = self.branch_pool(_tf_avg_pool(x))
        return torch.cat([b1, b5, b3, bp], 1)


class InceptionB(nn.Module):
    """Grid reduction 35 -> 17 (torchvision's InceptionB, unchanged in the FID graph)."""

    def __init__(self, cin: int):
        super().__init__()
        self.branch3x3 = BasicConv2d(cin, 384, kernel_size=3, stride=2)
        self.branch3x3dbl_1 = BasicConv2d(cin, 64, kernel_size=1)
        self.branch3x3dbl_2 = BasicConv2d(64, 96, kernel_size=3, padding=1)
        self.branch3x3dbl_3 = BasicConv2d(96, 96, kernel_size=3, stride=2)

    def forward(self, x):
        b3 = self.branch3x3(x)
        bd = self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x)))
        bp = F.max_pool2d(x, kernel_size=3, stride=2)
        return torch.cat([b3, bd, bp], 1)


class FIDInceptionC(nn.Module):
    def __init__(self, cin: int, channels_7x7: int):
        super().__init__()
        c7 = channels_7x7
        self.branch1x1 = BasicConv2d(cin, 192, kernel_size=1)
        self.branch7x7_1 = BasicConv2d(cin, c7, kernel_size=1)
        self.branch7x7_2 = BasicConv2d(c7, c7, kernel_size=(1, 7), padding=(0, 3))
        self.branch7x7_3 = BasicConv2d(c7, 192, kernel_size=(7, 1), padding=(3, 0))
        self.branch7x7dbl_1 = BasicConv2d(cin, c7, kernel_size=1)
        self.branch7x7dbl_2 = BasicConv2d(c7, c7, kernel_size=(7, 1), padding=(3, 0))
        self.branch7x7dbl_3 = BasicConv2d(c7, c7, kernel_size=(1, 7), padding=(0, 3))
        self.branch7x7dbl_4 = BasicConv2d(c7, c7, kernel_size=(7, 1), padding=(3, 0))
        self.branch7x7dbl_5 = BasicConv2d(c7, 192, kernel_size=(1, 7), padding=(0, 3))
        self.branch_pool = BasicConv2d(cin, 192, kernel_size=1)

    def forward(self, x):
        b1 = self.branch1x1(x)
        b7 = self.branch7x7_3(self.branch7x7_2(self.branch7x7_1(x)))
        bd = x
        for i in range(1, 6):
            bd = getattr(self, f"branch7x7dbl_{i}")(bd)
        bp = self.branch_pool(_tf_avg_pool(x))
        return torch.cat([b1, b7, bd, bp], 1)


class InceptionD(nn.Module):
    """Grid reduction 17 -> 8 (torchvision's InceptionD, unchanged in the FID graph)."""

    def __init__(self, cin: int):
        super().__init__()
        self.branch3x3_1 = BasicConv2d(cin, 192, kernel_size=1)
        self.branch3x3_2 = BasicConv2d(192, 320, kernel_size=3, stride=2)
        self.branch7x7x3_1 = BasicConv2d(cin, 192, kernel_size=1)
        self.branch7x7x3_2 = BasicConv2d(192, 192, kernel_size=(1, 7), padding=(0, 3))
        self.branch7x7x3_3 = BasicConv2d(192, 192, kernel_size=(7, 1), padding=(3, 0))
        self.branch7x7x3_4 = BasicConv2d(192, 192, kernel_size=3, stride=2)

    def forward(self, x):
        b3 = self.branch3x3_2(self.branch3x3_1(x))
        b7 = self.branch7x7x3_4(self.branch7x7x3_3(self.branch7x7x3_2(self.branch7x7x3_1(x))))
        bp = F.max_pool2d(x, kernel_size=3, stride=2)
        return torch.cat([b3, b7, bp], 1)


class FIDInceptionE(nn.Module):
    """InceptionE; ``pool="avg"`` for Mixed_7b (TF avg pool), ``"max"`` for Mixed_7c.

    The max pool in the last block is a quirk of the TF FID graph that pytorch-fid reproduces.
    """

    def __init__(self, cin: int, pool: str):
        super().__init__()
        self.pool = pool
        self.branch1x1 = BasicConv2d(cin, 320, kernel_size=1)
        self.branch3x3_1 = BasicConv2d(cin, 384, kernel_size=1)
        self.branch3x3_2a = BasicConv2d(384, 384, kernel_size=(1, 3), padding=(0, 1))
        self.branch3x3_2b = BasicConv2d(384, 384, kernel_size=(3, 1), padding=(1, 0))
        self.branch3x3dbl_1 = BasicConv2d(cin, 448, kernel_size=1)
        self.branch3x3dbl_2 = BasicConv2d(448, 384, kernel_size=3, padding=1)
        self.branch3x3dbl_3a = BasicConv2d(384, 384, kernel_size=(1, 3), padding=(0, 1))
        self.branch3x3dbl_3b = BasicConv2d(384, 384, kernel_size=(3, 1), padding=(1, 0))
        self.branch_pool = BasicConv2d(cin, 192, kernel_size=1)

    def forward(self, x):
        b1 = self.branch1x1(x)
        b3 = self.branch3x3_1(x)
        b3 = torch.cat([self.branch3x3_2a(b3), self.branch3x3_2b(b3)], 1)
        bd = self.branch3x3dbl_2(self.branch3x3dbl_1(x))
        bd = torch.cat([self.branch3x3dbl_3a(bd), self.branch3x3dbl_3b(bd)], 1)
        if self.pool == "avg":
            bp = _tf_avg_pool(x)
        else:
            bp = F.max_pool2d(x, kernel_size=3, stride=1, padding=1)
        bp = self.branch_pool(bp)
        return torch.cat([b1, b3, bd, bp], 1)


class FIDInceptionV3(nn.Module):
    """Inception-v3 of the TF FID graph; ``forward`` maps (N, 3, 299, 299) in [-1, 1] to (N, 2048)."""

    def __init__(self):
        super().__init__()
        self.Conv2d_1a_3x3 = BasicConv2d(3, 32, kernel_size=3, stride=2)
        self.Conv2d_2a_3x3 = BasicConv2d(32, 32, kernel_size=3)
        self.Conv2d_2b_3x3 = BasicConv2d(32, 64, kernel_size=3, padding=1)
        self.Conv2d_3b_1x1 = BasicConv2d(64, 80, kernel_size=1)
        self.Conv2d_4a_3x3 = BasicConv2d(80, 192, kernel_size=3)
        self.Mixed_5b = FIDInceptionA(192, pool_features=32)
        self.Mixed_5c = FIDInceptionA(256, pool_features=64)
        self.Mixed_5d = FIDInceptionA(288, pool_features=64)
        self.Mixed_6a = InceptionB(288)
        self.Mixed_6b = FIDInceptionC(768, channels_7x7=128)
        self.Mixed_6c = FIDInceptionC(768, channels_7x7=160)
        self.Mixed_6d = FIDInceptionC(768, channels_7x7=160)
        self.Mixed_6e = FIDInceptionC(768, channels_7x7=192)
        self.Mixed_7a = InceptionD(768)
        self.Mixed_7b = FIDInceptionE(1280, pool="avg")
        self.Mixed_7c = FIDInceptionE(2048, pool="max")
        # Unused for FID, present so the 1008-class weight file loads with strict=True.
        self.fc = nn.Linear(2048, 1008)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.Conv2d_2b_3x3(self.Conv2d_2a_3x3(self.Conv2d_1a_3x3(x)))
        x = F.max_pool2d(x, kernel_size=3, stride=2)
        x = self.Conv2d_4a_3x3(self.Conv2d_3b_1x1(x))
        x = F.max_pool2d(x, kernel_size=3, stride=2)
        for name in ("Mixed_5b", "Mixed_5c", "Mixed_5d", "Mixed_6a", "Mixed_6b", "Mixed_6c",
                     "Mixed_6d", "Mixed_6e", "Mixed_7a", "Mixed_7b", "Mixed_7c"):
            x = getattr(self, name)(x)
        return F.adaptive_avg_pool2d(x, 1).flatten(1)


def resolve_fid_weights(weights: Optional[PathLike]) -> Path:
    """The FID Inception weights file: ``weights`` (a file or its folder), else
    ``$FASTDIT_FID_WEIGHTS``, else ``~/.cache/fastdit/fid`` or torch hub's checkpoints. Raises
    ``FileNotFoundError`` naming the file and where it was looked for."""
    if weights is not None:
        candidates = [Path(weights).expanduser()]
    elif os.environ.get("FASTDIT_FID_WEIGHTS"):
        candidates = [Path(os.environ["FASTDIT_FID_WEIGHTS"]).expanduser()]
    else:
        candidates = [Path("~/.cache/fastdit/fid").expanduser() / FID_WEIGHTS_NAME,
                      Path(torch.hub.get_dir()) / "checkpoints" / FID_WEIGHTS_NAME]
    candidates = [c / FID_WEIGHTS_NAME if c.is_dir() else c for c in candidates]
    for c in candidates:
        if c.is_file():
            return c
    raise FileNotFoundError(
        f"FID Inception weights '{FID_WEIGHTS_NAME}' not found at {candidates[0]} (no downloads are "
        f"attempted). Put the file there (it is pytorch-fid's release asset 'fid_weights/{FID_WEIGHTS_NAME}'), "
        f"or pass weights=PATH, or set FASTDIT_FID_WEIGHTS to the file or its directory."
    )


_MODEL_CACHE = {}


def load_inception(weights: Optional[PathLike] = None, device: Union[str, torch.device] = "cpu") -> FIDInceptionV3:
    """The FID Inception network with weights from a local file (cached per path)."""
    path = resolve_fid_weights(weights)
    key = str(path.resolve())
    if key not in _MODEL_CACHE:
        model = FIDInceptionV3()
        model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True), strict=True)
        _MODEL_CACHE[key] = model.eval().requires_grad_(False)
    return _MODEL_CACHE[key].to(device)


# ----------------------------------------------------------------------------
# preprocessing
# ----------------------------------------------------------------------------

def _resize_clean(x: np.ndarray, size: int = 299) -> np.ndarray:
    """clean-fid: per-channel PIL bicubic on float32 ('F' mode) images, clipped to [0, 255]."""
    out = np.empty((x.shape[0], size, size, 3), np.float32)
    for n in range(x.shape[0]):
        for c in range(3):
            im = Image.fromarray(np.ascontiguousarray(x[n, :, :, c], dtype=np.float32))  # mode "F"
            out[n, :, :, c] = np.asarray(im.resize((size, size), resample=Image.BICUBIC))
    return np.clip(out, 0, 255)


def _resize_tf1_bilinear(x: torch.Tensor, size: int = 299) -> torch.Tensor:
    """TF1 ``resize_bilinear(align_corners=False, half_pixel_centers=False)``: src = dst * in/out."""
    def axis(n_in):
        src = torch.arange(size, dtype=torch.float64) * (n_in / size)
        lo = src.floor().long().clamp(max=n_in - 1)
        hi = (lo + 1).clamp(max=n_in - 1)
        return lo, hi, (src - lo).to(x.dtype)
    y0, y1, wy = axis(x.shape[2])
    x0, x1, wx = axis(x.shape[3])
    rows = x[:, :, y0] * (1 - wy)[:, None] + x[:, :, y1] * wy[:, None]
    return rows[:, :, :, x0] * (1 - wx) + rows[:, :, :, x1] * wx


def preprocess(images, resize: str = "clean") -> torch.Tensor:
    """Images -> (N, 3, 299, 299) float32 in [-1, 1] as the network expects."""
    if resize not in RESIZE_MODES:
        raise ValueError(f"resize must be one of {RESIZE_MODES}, got {resize!r}")
    x = to_uint8(images)
    if resize == "clean":
        t = torch.from_numpy(_resize_clean(x)).permute(0, 3, 1, 2) / 255.0
    else:
        t = torch.from_numpy(x).permute(0, 3, 1, 2).float() / 255.0
        if resize == "legacy_pytorch":
            t = F.interpolate(t, size=(299, 299), mode="bilinear", align_corners=False)
        else:
            t = _resize_tf1_bilinear(t)
    return t * 2 - 1


@torch.no_grad()
def inception_features(images, weights: Optional[PathLike] = None, resize: str = "clean",
                       batch_size: int = 32, device: Union[str, torch.device] = "cpu") -> np.ndarray:
    """2048-d pool features, (N, 2048) float64.

    ``images``: (N, H, W, 3) float [0, 1] or uint8, or a list of images (arrays or PIL) that may
    differ in size (each is resized to 299x299 on its own).
    """
    model = load_inception(weights, device)
    if not isinstance(images, (list, tuple)):
        images = to_uint8(images)
    feats = []
    for i in range(0, len(images), batch_size):
        chunk = images[i:i + batch_size]
        if isinstance(chunk, np.ndarray):
            x = preprocess(chunk, resize)
        else:
            x = torch.cat([preprocess(im, resize) for im in chunk])
        feats.append(model(x.to(device)).double().cpu().numpy())
    return np.concatenate(feats)


# ----------------------------------------------------------------------------
# statistics and distance
# ----------------------------------------------------------------------------

def compute_stats(images=None, features: Optional[np.ndarray] = None, **kw) -> Tuple[np.ndarray, np.ndarray]:
    """(mu, sigma) of Inception features: mean and ``np.cov(rowvar=False)`` (N-1 normalised).

    Pass ``images`` (forwarded with ``**kw`` to :func:`inception_features`) or precomputed
    ``features`` (N, D). At least two samples are needed.
    """
    if features is None:
        if images is None:
            raise ValueError("compute_stats needs images or features")
        features = inception_features(images, **kw)
    features = np.asarray(features, dtype=np.float64)
    if features.ndim != 2 or features.shape[0] < 2:
        raise ValueError(f"need features of shape (N >= 2, D), got {features.shape}")
    return features.mean(axis=0), np.cov(features, rowvar=False)


def frechet_distance(mu1, sigma1, mu2, sigma2, eps: float = 1e-6) -> float:
    """Fréchet distance between N(mu1, sigma1) and N(mu2, sigma2).

    ``d^2 = ||mu1 - mu2||^2 + Tr(sigma1) + Tr(sigma2) - 2 Tr((sigma1 sigma2)^{1/2})``, with
    pytorch-fid's numerics: ``scipy.linalg.sqrtm`` of the product; if that is not finite
    (singular product, e.g. fewer samples than dimensions), ``eps * I`` is added to both
    covariances; a complex result whose diagonal has imaginary parts above 1e-3 is an error,
    otherwise the real part is used.
    """
    mu1, mu2 = np.atleast_1d(np.asarray(mu1, np.float64)), np.atleast_1d(np.asarray(mu2, np.float64))
    sigma1, sigma2 = np.atleast_2d(np.asarray(sigma1, np.float64)), np.atleast_2d(np.asarray(sigma2, np.float64))
    if mu1.shape != mu2.shape or sigma1.shape != sigma2.shape:
        raise ValueError(f"mean/covariance shapes differ: {mu1.shape} vs {mu2.shape}, "
                         f"{sigma1.shape} vs {sigma2.shape}")
    diff = mu1 - mu2
    covmean = scipy.linalg.sqrtm(sigma1.dot(sigma2))
    if not np.isfinite(covmean).all():
        offset = np.eye(sigma1.shape[0]) * eps
        covmean = scipy.linalg.sqrtm((sigma1 + offset).dot(sigma2 + offset))
    if np.iscomplexobj(covmean):
        if not np.allclose(np.diagonal(covmean).imag, 0, atol=1e-3):
            raise ValueError(f"sqrtm has a large imaginary component {np.max(np.abs(covmean.imag)):.3g}")
        covmean = covmean.real
    return float(diff.dot(diff) + np.trace(sigma1) + np.trace(sigma2) - 2 * np.trace(covmean))


def fid(images_a, images_b, **kw) -> float:
    """FID between two image sets (each (N, H, W, 3), N >= 2); ``**kw`` to :func:`inception_features`."""
    return frechet_distance(*compute_stats(images_a, **kw), *compute_stats(images_b, **kw))


def _stats_dir(cache_dir: Optional[PathLike]) -> Path:
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    return Path(os.environ.get("FASTDIT_FID_STATS", "~/.cache/fastdit/fid_stats")).expanduser()


def reference_stats(name: str, images=None, cache_dir: Optional[PathLike] = None,
                    resize: str = "clean", recompute: bool = False, **kw) -> Tuple[np.ndarray, np.ndarray]:
    """(mu, sigma) of a reference set, cached in ``<cache_dir>/<name>.npz``.

    Loads the file if present (and computed with the same ``resize`` mode); otherwise computes
    the stats from ``images`` (an array/list, or a zero-argument callable returning one, so a
    large set is only loaded when needed) and writes the file. ``cache_dir`` defaults to
    ``$FASTDIT_FID_STATS`` or ``~/.cache/fastdit/fid_stats``.
    """
    path = _stats_dir(cache_dir) / f"{name}.npz"
    if path.is_file() and not recompute:
        with np.load(path) as f:
            stored = str(f["resize"]) if "resize" in f else None
            if stored is not None and stored != resize:
                raise ValueError(f"{path} holds stats computed with resize={stored!r}, not {resize!r}; "
                                 f"use another name or recompute=True")
            return f["mu"], f["sigma"]
    if images is None:
        raise FileNotFoundError(f"no cached FID reference stats at {path}, and no images given to compute them")
    if callable(images):
        images = images()
    mu, sigma = compute_stats(images, resize=resize, **kw)
    path.parent.mkdir(parents=True, exist_ok=True)
    n = len(images)
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez(tmp, mu=mu, sigma=sigma, resize=np.array(resize), n=np.array(n))
    os.replace(tmp, path)  # atomic: a concurrent reader never sees a half-written file
    return mu, sigma
