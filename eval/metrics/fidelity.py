"""Fidelity of an accelerated output to the dense output of the same seed.

All metrics take two images or videos ``a`` (e.g. sparse-attention output) and
``b`` (the dense reference) of identical shape:

* ``(F, H, W, C)`` video, ``(H, W, C)`` image, or ``(H, W)`` grayscale image
  (a 3-D array is always read as one image; a grayscale video is ``(F, H, W, 1)``);
* numpy arrays or torch tensors, float in [0, 1] or ``uint8`` (divided by 255).

Each metric is computed per frame and averaged over frames. Float inputs that are
clearly not in [0, 1] (e.g. [-1, 1] or [0, 255]) raise ``ValueError`` instead of
silently giving wrong numbers.

Functions: :func:`psnr`, :func:`ssim`, :func:`lpips_distance`; ``FIDELITY_METRICS``
maps names to them for callers that loop over metrics.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Dict, Optional, Sequence, Tuple, Union

import numpy as np
import torch
import torch.nn as nn

ArrayLike = Union[np.ndarray, torch.Tensor]
PathLike = Union[str, os.PathLike]

__all__ = [
    "as_frames",
    "psnr",
    "ssim",
    "lpips_distance",
    "LPIPS",
    "load_lpips",
    "LPIPS_NETS",
    "resolve_lpips_files",
    "FIDELITY_METRICS",
]


# ----------------------------------------------------------------------------
# input handling
# ----------------------------------------------------------------------------

#: Elements (pixels x channels) of one chunk that PSNR and SSIM convert to float64 and work on at
#: a time. The metrics are per frame, so processing a video in chunks of frames gives the same
#: numbers while the memory stays bounded by the chunk instead of growing with the video: a
#: whole 29 x 512 x 768 x 3 video is 274 MB per float64 copy and SSIM needs over a dozen such
#: maps. 2^21 elements are 16 MiB per float64 map (one 512 x 768 RGB frame is 1.2 M elements).
CHUNK_ELEMENTS = 1 << 21


def _frames_native(x: ArrayLike, name: str = "input") -> torch.Tensor:
    """``x`` as an ``(F, H, W, C)`` tensor in its own dtype (no float64 copy), range-checked.

    The range check runs on the native dtype: min and max of a float array are exact in any
    float dtype, so the check (and its message) is the one :func:`as_frames` always made.
    """
    t = x.detach().cpu() if isinstance(x, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(x))
    if t.dtype == torch.uint8:
        pass
    elif t.is_floating_point():
        if t.numel() and (float(t.min()) < -0.5 or float(t.max()) > 1.5):
            raise ValueError(
                f"{name}: float values must be in [0, 1], got range "
                f"[{float(t.min()):.3g}, {float(t.max()):.3g}] (rescale [-1, 1] or [0, 255] data first)"
            )
    else:
        raise TypeError(f"{name}: expected uint8 or float data, got dtype {t.dtype}")
    if t.ndim == 2:
        t = t[None, :, :, None]
    elif t.ndim == 3:
        t = t[None]
    elif t.ndim != 4:
        raise ValueError(f"{name}: expected (F, H, W, C), (H, W, C) or (H, W), got shape {tuple(t.shape)}")
    return t


def _unit_float64(t: torch.Tensor) -> torch.Tensor:
    """float64 copy in [0, 1]: ``uint8`` divided by 255, floats converted."""
    if t.dtype == torch.uint8:
        return t.to(torch.float64) / 255.0
    return t.to(torch.float64)


def as_frames(x: ArrayLike, name: str = "input") -> torch.Tensor:
    """Return ``x`` as a float64 tensor of shape ``(F, H, W, C)`` in [0, 1].

    ``uint8`` input is divided by 255. ``(H, W)`` becomes ``(1, H, W, 1)`` and
    ``(H, W, C)`` becomes ``(1, H, W, C)``.
    """
    return _unit_float64(_frames_native(x, name))


def _pair_native(a: ArrayLike, b: ArrayLike) -> Tuple[torch.Tensor, torch.Tensor]:
    """Both inputs as (F, H, W, C) in their own dtypes; different shapes raise ValueError naming both."""
    shape_a, shape_b = tuple(a.shape), tuple(b.shape)
    if shape_a != shape_b:
        raise ValueError(f"inputs must have the same shape, got {shape_a} and {shape_b}")
    return _frames_native(a, "a"), _frames_native(b, "b")


def _pair(a: ArrayLike, b: ArrayLike) -> Tuple[torch.Tensor, torch.Tensor]:
    """Both inputs as (F, H, W, C) float64; different shapes raise ValueError naming both."""
    x, y = _pair_native(a, b)
    return _unit_float64(x), _unit_float64(y)


def _frame_chunks(x: torch.Tensor, y: torch.Tensor, max_elements: int):
    """Yield float64 ``(x[i:j], y[i:j])`` over frames, about ``max_elements`` elements each (>= 1 frame)."""
    per_frame = max(1, x[0].numel()) if x.shape[0] else 1
    step = max(1, int(max_elements) // per_frame)
    for i in range(0, x.shape[0], step):
        yield _unit_float64(x[i:i + step]), _unit_float64(y[i:i + step])


# ----------------------------------------------------------------------------
# PSNR
# ----------------------------------------------------------------------------

def psnr(a: ArrayLike, b: ArrayLike) -> float:
    """Peak signal-to-noise ratio in dB, data range 1, averaged over frames.

    ``PSNR = 10 log10(1 / MSE)`` with the MSE over all pixels and channels of one
    frame. Identical frames give ``inf`` and the average then is ``inf`` too.

    The MSE of a frame depends on that frame only, so it is computed a chunk of
    :data:`CHUNK_ELEMENTS` elements at a time: float64 copies of a chunk, not of the
    whole video (whose float64 difference and square alone would be 4x its float32 size).
    """
    x, y = _pair_native(a, b)
    mse = torch.cat([((xc - yc) ** 2).mean(dim=(1, 2, 3)) for xc, yc in _frame_chunks(x, y, CHUNK_ELEMENTS)]
                    or [torch.zeros(0, dtype=torch.float64)])
    with np.errstate(divide="ignore"):
        per_frame = 10.0 * np.log10(1.0 / mse.numpy())
    return float(per_frame.mean())


# ----------------------------------------------------------------------------
# SSIM
# ----------------------------------------------------------------------------

def _gaussian_kernel(sigma: float = 1.5, truncate: float = 3.5) -> torch.Tensor:
    """1-D Gaussian taps as scipy.ndimage.gaussian_filter builds them (radius int(truncate*sigma+0.5))."""
    radius = int(truncate * sigma + 0.5)
    xs = torch.arange(-radius, radius + 1, dtype=torch.float64)
    k = torch.exp(-0.5 * (xs / sigma) ** 2)
    return k / k.sum()


def _valid_filter(m: torch.Tensor, taps: Sequence[float], dim: int) -> torch.Tensor:
    """Valid 1-D correlation of ``m`` with ``taps`` along ``dim``, as a weighted sum of shifted slices.

    ``out[i] = sum_k taps[k] * m[i + k]`` for ``i < len - (win - 1)``. Each tap is one fused
    multiply-add over a view of ``m`` into a single output buffer, so the only new memory is
    the output, where a convolution would first build an im2col buffer ``win`` times the input
    (the Gaussian is symmetric, so correlation and convolution agree).
    """
    win = len(taps)
    n = m.shape[dim] - win + 1
    out = m.narrow(dim, 0, n) * taps[0]
    for k in range(1, win):
        out.add_(m.narrow(dim, k, n), alpha=taps[k])
    return out


def _gaussian_valid(m: torch.Tensor, taps: Sequence[float]) -> torch.Tensor:
    """Separable 2-D valid Gaussian of an ``(N, H, W, C)`` map: rows (dim 1), then columns (dim 2)."""
    return _valid_filter(_valid_filter(m, taps, 1), taps, 2)


def _ssim_map_sum(x: torch.Tensor, y: torch.Tensor, taps: Sequence[float], c1: float, c2: float) -> torch.Tensor:
    """Per-frame sum of the valid SSIM map of float64 ``(N, H, W, C)`` blocks, shape ``(N,)``."""
    ux, uy = _gaussian_valid(x, taps), _gaussian_valid(y, taps)
    uxx = _gaussian_valid(x * x, taps)
    uyy = _gaussian_valid(y * y, taps)
    uxy = _gaussian_valid(x * y, taps)
    # Population moments, in skimage's order of operations, in place to keep few maps alive.
    uxx.sub_(ux * ux)                                           # s_x = E[x^2] - mu_x^2
    uyy.sub_(uy * uy)                                           # s_y
    uxy.sub_(ux * uy).mul_(2).add_(c2)                          # A2 = 2 s_xy + C2
    uxx.add_(uyy).add_(c2)                                      # B2 = s_x + s_y + C2
    del uyy
    b1 = (ux * ux).add_(uy * uy).add_(c1)                       # B1 = mu_x^2 + mu_y^2 + C1
    ux.mul_(uy).mul_(2).add_(c1)                                # A1 = 2 mu_x mu_y + C1
    del uy
    s = ux.mul_(uxy).div_(b1.mul_(uxx))                         # A1 A2 / (B1 B2)
    return s.sum(dim=(1, 2, 3))


def ssim(a: ArrayLike, b: ArrayLike, sigma: float = 1.5, k1: float = 0.01, k2: float = 0.03, *,
         max_chunk_elements: int = CHUNK_ELEMENTS) -> float:
    """Structural similarity (Wang et al. 2004), Gaussian window, averaged over frames and channels.

    Matches ``skimage.metrics.structural_similarity(x, y, gaussian_weights=True, sigma=1.5,
    use_sample_covariance=False, data_range=1.0, channel_axis=-1)`` frame by frame:

    * local statistics with an 11-tap Gaussian (sigma 1.5, truncate 3.5 -> radius 5):
      ``mu_x, mu_y``, ``s_x = E[x^2] - mu_x^2``, ``s_y``, ``s_xy = E[xy] - mu_x mu_y``;
    * ``SSIM = (2 mu_x mu_y + C1)(2 s_xy + C2) / ((mu_x^2 + mu_y^2 + C1)(s_x + s_y + C2))``,
      ``C1 = (0.01 L)^2``, ``C2 = (0.03 L)^2``, ``L = 1``;
    * skimage filters with reflect padding, then crops ``(win - 1) // 2 = 5`` pixels on every
      side before averaging. The window radius equals that crop, so the kept pixels never see
      the padding and a *valid* filter gives exactly the cropped map; we use that. Every
      channel's map has the same size, so skimage's mean over channels of per-channel means is
      the mean over the frame's whole ``(H - 10, W - 10, C)`` map, and the video's value is the
      mean of the frames' values.

    Memory is bounded, whatever the video's length or frame size. The map at an output pixel
    depends only on the ``win x win`` input window below it, so the video is processed in
    blocks of about ``max_chunk_elements`` input elements (16 MiB of float64 by default), each
    block's map summed per frame and the block freed: whole frames at a time when a frame fits,
    else horizontal strips of output rows of one frame, each read with its ``win - 1`` rows of
    overlap. The Gaussian is separable and applied along rows, then columns, as a weighted sum
    of 11 shifted slices (:func:`_valid_filter`), which needs no im2col buffer; a batched
    ``conv2d`` over the whole video's five moment maps built one of about 15 GB for
    29 x 512 x 768 x 3. Per block, about a dozen float64 maps of the block's size are live.

    Frames must be at least 11x11. Computed in float64.
    """
    x, y = _pair_native(a, b)
    f, h, w, c = x.shape
    taps = _gaussian_kernel(sigma).tolist()
    win = len(taps)
    if h < win or w < win:
        raise ValueError(f"ssim needs frames of at least {win}x{win}, got {h}x{w}")
    c1, c2 = (k1 * 1.0) ** 2, (k2 * 1.0) ** 2
    out_h = h - win + 1
    frame_elements = h * w * c
    frames_per_block = max(1, int(max_chunk_elements) // frame_elements)
    # Output rows per block: all of them when whole frames fit, else as many as fit with overlap.
    rows = out_h if frame_elements <= max_chunk_elements else max(1, int(max_chunk_elements) // (w * c) - (win - 1))
    sums = torch.zeros(f, dtype=torch.float64)
    for i in range(0, f, frames_per_block):
        j = min(f, i + frames_per_block)
        for r in range(0, out_h, rows):
            n = min(rows, out_h - r)
            xb = _unit_float64(x[i:j, r:r + n + win - 1])
            yb = _unit_float64(y[i:j, r:r + n + win - 1])
            sums[i:j] += _ssim_map_sum(xb, yb, taps, c1, c2)
            del xb, yb
    per_frame = sums / (out_h * (w - win + 1) * c)
    return float(per_frame.mean())


# ----------------------------------------------------------------------------
# LPIPS
# ----------------------------------------------------------------------------

# Backbone layouts (torchvision's `features` Sequential indices) and LPIPS' slice ends.
# AlexNet: conv1 relu1 | pool conv2 relu2 | pool conv3 relu3 | conv4 relu4 | conv5 relu5
_ALEX_CFG = [(3, 64, 11, 4, 2), "R", "M", (64, 192, 5, 1, 2), "R", "M", (192, 384, 3, 1, 1), "R",
             (384, 256, 3, 1, 1), "R", (256, 256, 3, 1, 1), "R"]
_ALEX_SLICES = [2, 5, 8, 10, 12]
# VGG16 features up to relu5_3.
_VGG_CFG = []
for _cin, _cout, _n in [(3, 64, 2), (64, 128, 2), (128, 256, 3), (256, 512, 3), (512, 512, 3)]:
    if _VGG_CFG:
        _VGG_CFG.append("M")
    for _i in range(_n):
        _VGG_CFG += [(_cin if _i == 0 else _cout, _cout, 3, 1, 1), "R"]
_VGG_SLICES = [4, 9, 16, 23, 30]

LPIPS_NETS = {
    # net: (features config, slice ends, channels, torchvision backbone file name)
    "alex": (_ALEX_CFG, _ALEX_SLICES, (64, 192, 384, 256, 256), "alexnet-owt-7be5be79.pth"),
    "vgg": (_VGG_CFG, _VGG_SLICES, (64, 128, 256, 512, 512), "vgg16-397923af.pth"),
}


def _features(cfg, pool: Tuple[int, int]) -> nn.Sequential:
    """torchvision's `features` Sequential from a config ("R" ReLU, "M" max-pool, tuple conv)."""
    layers = []
    for item in cfg:
        if item == "R":
            layers.append(nn.ReLU(inplace=False))
        elif item == "M":
            layers.append(nn.MaxPool2d(*pool))
        else:
            cin, cout, ks, stride, pad = item
            layers.append(nn.Conv2d(cin, cout, ks, stride=stride, padding=pad))
    return nn.Sequential(*layers)


class LPIPS(nn.Module):
    """LPIPS v0.1 (Zhang et al. 2018, "The Unreasonable Effectiveness of Deep Features").

    Re-implemented here because the ``lpips`` package imports torchvision at import time.
    The modules are laid out so that the official weight files load unchanged:

    * backbone: torchvision's ImageNet state dict (``alexnet-owt-7be5be79.pth`` /
      ``vgg16-397923af.pth``), keys ``features.<i>.weight|bias`` (classifier keys ignored);
    * linear heads: the lpips package's ``weights/v0.1/<net>.pth``, keys
      ``lin<l>.model.1.weight`` of shape ``(1, C_l, 1, 1)``.

    ``d(x, y) = sum_l mean_{h,w} w_l . (n(f_l(x)) - n(f_l(y)))^2`` where ``f_l`` are the ReLU
    outputs of the 5 slices on the scaled input ``(x - shift) / scale``, ``n`` normalises each
    feature vector over channels (``f / (||f||_2 + 1e-10)``). Input in [-1, 1], NCHW.
    """

    shift = (-0.030, -0.088, -0.188)
    scale = (0.458, 0.448, 0.450)

    def __init__(self, net: str = "alex"):
        super().__init__()
        if net not in LPIPS_NETS:
            raise ValueError(f"LPIPS net must be one of {sorted(LPIPS_NETS)}, got {net!r}")
        self.net_name = net
        cfg, self.slice_ends, chns, _ = LPIPS_NETS[net]
        # AlexNet pools 3x3 stride 2, VGG 2x2 stride 2. torchvision's indices are kept in
        # `features` so backbone state dicts load as they are.
        self.features = _features(cfg, (3, 2) if net == "alex" else (2, 2))
        self.lins = nn.ModuleList(
            nn.Sequential(nn.Dropout(), nn.Conv2d(c, 1, 1, bias=False)) for c in chns
        )
        self.register_buffer("shift_t", torch.tensor(self.shift).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("scale_t", torch.tensor(self.scale).view(1, 3, 1, 1), persistent=False)

    def _taps(self, x: torch.Tensor):
        outs, start = [], 0
        for end in self.slice_ends:
            for i in range(start, end):
                x = self.features[i](x)
            outs.append(x)
            start = end
        return outs

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Distance per batch item, shape (N,). ``x``, ``y``: (N, 3, H, W) in [-1, 1]."""
        fx = self._taps((x - self.shift_t) / self.scale_t)
        fy = self._taps((y - self.shift_t) / self.scale_t)
        total = 0.0
        for lin, a, b in zip(self.lins, fx, fy):
            a = a / (a.pow(2).sum(dim=1, keepdim=True).sqrt() + 1e-10)
            b = b / (b.pow(2).sum(dim=1, keepdim=True).sqrt() + 1e-10)
            total = total + lin((a - b) ** 2).mean(dim=(2, 3))
        return total.view(-1)

    # -- weights ------------------------------------------------------------

    def load_backbone(self, state_dict: Dict[str, torch.Tensor]) -> None:
        """Load torchvision-format backbone weights (``features.*``; other keys ignored)."""
        sd = {k[len("features."):]: v for k, v in state_dict.items() if k.startswith("features.")}
        self.features.load_state_dict(sd, strict=True)

    def load_lins(self, state_dict: Dict[str, torch.Tensor]) -> None:
        """Load the lpips package's linear-head file (``lin<l>.model.1.weight``)."""
        sd = {}
        for k, v in state_dict.items():
            if k.startswith("lin") and ".model." in k:
                layer, rest = k[3:].split(".model.", 1)
                sd[f"{layer}.{rest}"] = v
        self.lins.load_state_dict(sd, strict=True)


def _lpips_default_dir() -> Path:
    env = os.environ.get("FASTDIT_LPIPS_WEIGHTS")
    if env:
        return Path(env).expanduser()
    return Path("~/.cache/fastdit/lpips").expanduser()


def resolve_lpips_files(net: str, weights: Optional[Union[PathLike, Sequence[PathLike]]]) -> Tuple[Path, Path]:
    """Find (backbone file, linear-head file) for ``net``.

    ``weights`` may be a directory holding both files, the linear-head file itself (the backbone
    is then looked up beside it), or a pair ``(backbone, lins)``. Default:
    ``$FASTDIT_LPIPS_WEIGHTS`` or ``~/.cache/fastdit/lpips``. Except for an explicit pair, the
    backbone is also looked up in torch hub's checkpoint cache, where torchvision stores it.
    """
    backbone_name = LPIPS_NETS[net][3]
    lin_name = f"{net}.pth"
    hub = Path(torch.hub.get_dir()) / "checkpoints"
    if weights is not None and not isinstance(weights, (str, os.PathLike)):
        backbone, lins = (Path(p).expanduser() for p in weights)
        candidates_b, candidates_l = [backbone], [lins]
        where = f"{backbone} and {lins}"
    elif weights is not None and Path(weights).expanduser().is_file():
        lins = Path(weights).expanduser()
        candidates_b, candidates_l = [lins.parent / backbone_name, hub / backbone_name], [lins]
        where = str(lins.parent)
    else:
        d = Path(weights).expanduser() if weights is not None else _lpips_default_dir()
        candidates_b = [d / backbone_name, hub / backbone_name]
        candidates_l = [d / lin_name, d / "v0.1" / lin_name]
        where = str(d)
    missing = []
    backbone = next((p for p in candidates_b if p.is_file()), None)
    lins = next((p for p in candidates_l if p.is_file()), None)
    if backbone is None:
        missing.append(f"'{backbone_name}' (torchvision ImageNet {net} weights) at {candidates_b[0]}")
    if lins is None:
        missing.append(f"'{lin_name}' (from the lpips package, lpips/weights/v0.1/{lin_name}) at {candidates_l[0]}")
    if missing:
        raise FileNotFoundError(
            f"LPIPS-{net} weights not found (no downloads are attempted). Place "
            + " and ".join(missing)
            + f" (directory {where}; set weights= or FASTDIT_LPIPS_WEIGHTS to use another directory)."
        )
    return backbone, lins


_LPIPS_CACHE: Dict[Tuple[str, str, str], LPIPS] = {}


def load_lpips(net: str = "alex", weights=None, device: Union[str, torch.device] = "cpu") -> LPIPS:
    """Build an :class:`LPIPS` network and load its weights from local files (cached per path)."""
    if net not in LPIPS_NETS:
        raise ValueError(f"LPIPS net must be one of {sorted(LPIPS_NETS)}, got {net!r}")
    backbone, lins = resolve_lpips_files(net, weights)
    key = (net, str(backbone), str(lins))
    if key not in _LPIPS_CACHE:
        model = LPIPS(net)
        model.load_backbone(torch.load(backbone, map_location="cpu", weights_only=True))
        model.load_lins(torch.load(lins, map_location="cpu", weights_only=True))
        _LPIPS_CACHE[key] = model.eval().requires_grad_(False)
    return _LPIPS_CACHE[key].to(device)


#: Activation memory one LPIPS batch may use (bytes, estimated by :func:`_lpips_bytes_per_pixel`).
LPIPS_BATCH_BYTES = 1 << 30

# Total downsampling of each tapped feature map (AlexNet: conv1 stride 4, then 3x3/2 pools;
# VGG16: a 2x2/2 pool before each block after the first).
_LPIPS_TAP_STRIDES = {"alex": (4, 8, 16, 16, 16), "vgg": (1, 2, 4, 8, 16)}


def _lpips_bytes_per_pixel(net: str) -> int:
    """Estimated peak bytes per input pixel of one LPIPS forward on a batch, float32.

    A tap with ``c`` channels at stride ``s`` holds ``c / s^2`` values per input pixel. Both
    inputs' five taps stay alive until the distance is taken, and the largest layer is live a
    few more times at once (conv output and ReLU, then the normalised pair, their difference and
    its square): ``4 (2 sum_l c_l / s_l^2 + 4 max_l c_l / s_l^2)`` bytes, plus 64 for the input
    copies. AlexNet comes to about 200 bytes per pixel, VGG16 (64 full-resolution channels)
    about 2 kB, i.e. 0.8 GB per 512 x 768 frame: 8 such frames at once would need 6-7 GB.
    """
    per_pixel = [c / s ** 2 for c, s in zip(LPIPS_NETS[net][2], _LPIPS_TAP_STRIDES[net])]
    return int(4 * (2 * sum(per_pixel) + 4 * max(per_pixel)) + 64)


@torch.no_grad()
def lpips_distance(a: ArrayLike, b: ArrayLike, net: str = "alex", weights=None,
                   device: Union[str, torch.device] = "cpu", batch_size: int = 8) -> float:
    """LPIPS v0.1 distance, averaged over frames (lower is closer; 0 for identical frames).

    Frames are scaled from [0, 1] to [-1, 1] (as ``lpips.LPIPS(normalize=True)`` does); grayscale
    frames are repeated to 3 channels. ``weights``: see :func:`load_lpips`.

    The distance of a frame depends on that frame only, so frames go through the network in
    batches, each converted from the input on its own (no float64 copy of the whole video).
    A batch holds at most ``batch_size`` frames and, for large frames, fewer: as many as keep
    the estimated activation memory (:func:`_lpips_bytes_per_pixel`) under
    :data:`LPIPS_BATCH_BYTES`, at least one. With AlexNet at 512 x 768 that is still 8 frames;
    VGG16 runs one frame of that size at a time.
    """
    if net not in LPIPS_NETS:
        raise ValueError(f"LPIPS net must be one of {sorted(LPIPS_NETS)}, got {net!r}")
    x, y = _pair_native(a, b)
    if x.shape[-1] not in (1, 3):
        raise ValueError(f"lpips needs 1 or 3 channels, got shape {tuple(x.shape)}")
    min_side = {"alex": 31, "vgg": 16}[net]  # smallest frame whose last feature map is non-empty
    if min(x.shape[1:3]) < min_side:
        raise ValueError(f"lpips-{net} needs frames of at least {min_side}x{min_side}, got shape {tuple(x.shape)}")
    model = load_lpips(net, weights, device)
    frame_bytes = x.shape[1] * x.shape[2] * _lpips_bytes_per_pixel(net)
    step = max(1, min(int(batch_size), LPIPS_BATCH_BYTES // frame_bytes))
    dists = []
    for i in range(0, x.shape[0], step):
        xb = _unit_float64(x[i:i + step]).permute(0, 3, 1, 2).float().to(device) * 2 - 1
        yb = _unit_float64(y[i:i + step]).permute(0, 3, 1, 2).float().to(device) * 2 - 1
        if xb.shape[1] == 1:
            xb, yb = xb.expand(-1, 3, -1, -1), yb.expand(-1, 3, -1, -1)
        dists.append(model(xb, yb).double().cpu())
    return float(torch.cat(dists).mean())


FIDELITY_METRICS: Dict[str, Callable[..., float]] = {
    "psnr": psnr,
    "ssim": ssim,
    "lpips": lpips_distance,
}
