"""Fidelity metric values (PSNR, SSIM, LPIPS) against reference implementations and closed forms,
on synthetic data. FID and CLIP score are in test_metrics_fid_clip.py, VBench in
test_metrics_vbench.py.

No weights are downloaded: LPIPS runs with random weights written to temporary files and loaded
through the real loading paths.
"""

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from fastdit.eval.metrics.fidelity import LPIPS, FIDELITY_METRICS, lpips_distance, psnr, ssim

def _rng(seed=0):
    return np.random.default_rng(seed)

# ----------------------------------------------------------------------------- PSNR

def test_psnr_identical_is_inf():
    a = _rng().random((3, 16, 16, 3))
    assert psnr(a, a.copy()) == math.inf
    # one identical frame makes the frame average infinite too
    b = a.copy()
    b[1] = np.clip(b[1] + 0.1, 0, 1)
    assert psnr(a, b) == math.inf


@pytest.mark.parametrize("c", [0.01, 0.05, 0.2])
def test_psnr_constant_offset(c):
    a = _rng().random((2, 20, 24, 3)) * 0.7
    assert psnr(a, a + c) == pytest.approx(-10 * math.log10(c * c), abs=1e-9)
    assert psnr(a[0], a[0] + c) == pytest.approx(-10 * math.log10(c * c), abs=1e-9)  # (H, W, C) image


def test_psnr_averages_frames_and_accepts_uint8_and_tensors():
    a = np.zeros((2, 8, 8, 3), np.uint8)
    b = a.copy()
    b[0] += 10  # mse (10/255)^2
    b[1] += 20
    expected = np.mean([-20 * math.log10(10 / 255), -20 * math.log10(20 / 255)])
    assert psnr(a, b) == pytest.approx(expected, abs=1e-9)
    assert psnr(torch.from_numpy(a), torch.from_numpy(b)) == pytest.approx(expected, abs=1e-9)


def test_float_range_is_checked():
    a = _rng().random((8, 8, 3))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        psnr(a * 255, a * 255)


# ----------------------------------------------------------------------------- SSIM

def _skimage_ssim(a, b):
    from skimage.metrics import structural_similarity
    kw = dict(gaussian_weights=True, sigma=1.5, use_sample_covariance=False, data_range=1.0)
    if a.ndim == 2:
        return structural_similarity(a, b, **kw)
    return structural_similarity(a, b, channel_axis=-1, **kw)


def _structured(shape):
    h, w = shape[:2]
    yy, xx = np.mgrid[0:h, 0:w]
    img = 0.5 + 0.25 * np.sin(xx / 3.0) * np.cos(yy / 5.0) + 0.2 * ((xx // 4 + yy // 4) % 2)
    img = np.clip(img, 0, 1)
    if len(shape) == 3:
        img = np.stack([np.roll(img, k, axis=1) for k in range(shape[2])], axis=-1)
    return img


@pytest.mark.parametrize("shape", [(11, 11), (17, 23), (32, 32, 3), (33, 47, 3), (25, 19, 1), (64, 48, 3)])
@pytest.mark.parametrize("kind", ["random", "structured"])
def test_ssim_matches_skimage(shape, kind):
    r = _rng(len(shape) + shape[0])
    a = r.random(shape) if kind == "random" else _structured(shape)
    b = np.clip(a + 0.08 * r.standard_normal(shape), 0, 1)
    ref = _skimage_ssim(a, b)
    assert ssim(a, b) == pytest.approx(ref, abs=1e-4)
    assert abs(ssim(a, b) - ref) < 1e-9  # in practice equal to float64 precision


def test_ssim_video_is_mean_of_frames_and_identical_is_one():
    r = _rng(3)
    a = r.random((4, 21, 30, 3))
    b = np.clip(a + 0.1 * r.standard_normal(a.shape), 0, 1)
    ref = np.mean([_skimage_ssim(a[i], b[i]) for i in range(4)])
    assert ssim(a, b) == pytest.approx(ref, abs=1e-4)
    assert ssim(a, a) == pytest.approx(1.0, abs=1e-12)
    # uint8 and float32 inputs go through the same path
    a8, b8 = (a * 255).round().astype(np.uint8), (b * 255).round().astype(np.uint8)
    ref8 = np.mean([_skimage_ssim(a8[i] / 255.0, b8[i] / 255.0) for i in range(4)])
    assert ssim(a8, b8) == pytest.approx(ref8, abs=1e-4)
    assert ssim(a.astype(np.float32), b.astype(np.float32)) == pytest.approx(ref, abs=1e-4)


@pytest.mark.parametrize("max_elements", [
    1 << 21,            # default: all frames in one block
    2 * 41 * 57 * 3,    # two whole frames per block (the last block holds one)
    41 * 57 * 3,        # exactly one frame per block
    57 * 3 * 13,        # strips of 3 output rows (+10 overlap rows) of one frame
    57 * 3 * 11,        # strips of 1 output row
    1,                  # smaller than a strip: still 1 output row at a time
])
def test_ssim_blocks_match_skimage(max_elements):
    """Blocks of frames and row strips with their overlap give skimage's per-frame values.

    41-row frames have 31 valid output rows, cut into strips that do not divide them evenly (10
    strips of 3 and one of 1), so a strip that read the wrong rows or a double-counted row shows.
    """
    r = _rng(21)
    a = r.random((3, 41, 57, 3))
    b = np.clip(a + 0.1 * r.standard_normal(a.shape), 0, 1)
    b[1] = _structured((41, 57, 3))  # frames of different similarity, so a wrong frame average shows
    ref = np.mean([_skimage_ssim(a[i], b[i]) for i in range(3)])
    assert abs(ssim(a, b, max_chunk_elements=max_elements) - ref) < 1e-9
    # single frame through strips
    assert abs(ssim(a[2], b[2], max_chunk_elements=max_elements) - _skimage_ssim(a[2], b[2])) < 1e-9


_LARGE_VIDEO_CHILD = textwrap.dedent("""
    import json, sys
    import numpy as np
    from fastdit.eval.metrics.fidelity import psnr, ssim
    r = np.random.default_rng(0)
    a = r.random((29, 512, 768, 3), dtype=np.float32)
    b = np.clip(a + 0.05 * r.standard_normal(a.shape, dtype=np.float32), 0, 1)
    json.dump({"ssim": ssim(a, b), "psnr": psnr(a, b)}, open(sys.argv[1], "w"))
""")


@pytest.mark.slow
def test_ssim_psnr_large_video_bounded_memory(tmp_path):
    """29 x 512 x 768 x 3 float32 (the `fastdit compare` video) in a child process under 1.5 GB.

    The child's whole peak resident memory is measured by scripts/peak_memory.py, which kills it
    at the limit (a regression then fails fast instead of using 15+ GB). It includes the Python,
    torch and numpy baseline (about 0.3-0.5 GB) and both float32 inputs (0.27 GB). The values are
    checked against skimage and numpy on the same video, regenerated here from the seed.
    """
    root = Path(__file__).resolve().parents[2]
    values, report = tmp_path / "values.json", tmp_path / "peak.json"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, str(root / "scripts" / "peak_memory.py"), "--limit-gb", "1.5", "--kill-over-limit",
         "--json", str(report), "--", sys.executable, "-c", _LARGE_VIDEO_CHILD, str(values)],
        env=env, capture_output=True, text=True, timeout=900)
    peak = json.loads(report.read_text())
    assert proc.returncode == 0, (proc.stderr[-3000:], peak)
    assert peak["peak_rss_bytes"] < 1.5e9 and not peak["over_limit"]
    got = json.loads(values.read_text())
    r = _rng(0)
    a = r.random((29, 512, 768, 3), dtype=np.float32)
    b = np.clip(a + 0.05 * r.standard_normal(a.shape, dtype=np.float32), 0, 1)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    del a, b
    mse = ((a64 - b64) ** 2).mean(axis=(1, 2, 3))
    assert got["psnr"] == pytest.approx(np.mean(10 * np.log10(1 / mse)), abs=1e-9)
    ref = np.mean([_skimage_ssim(a64[i], b64[i]) for i in range(len(a64))])
    assert abs(got["ssim"] - ref) < 1e-9


def test_ssim_too_small_raises():
    a = np.zeros((10, 12, 3))
    with pytest.raises(ValueError, match="11x11"):
        ssim(a, a)


@pytest.mark.parametrize("name", ["psnr", "ssim", "lpips"])
def test_different_shapes_raise(name):
    a, b = np.zeros((2, 16, 16, 3)), np.zeros((2, 16, 18, 3))
    with pytest.raises(ValueError) as e:
        FIDELITY_METRICS[name](a, b)
    assert "(2, 16, 16, 3)" in str(e.value) and "(2, 16, 18, 3)" in str(e.value)


# ----------------------------------------------------------------------------- LPIPS

@pytest.fixture(scope="module")
def lpips_dir(tmp_path_factory):
    """Random LPIPS-alex weights in the official file formats: torchvision backbone + lpips heads."""
    d = tmp_path_factory.mktemp("lpips")
    torch.manual_seed(0)
    net = LPIPS("alex")
    backbone = {f"features.{k}": v for k, v in net.features.state_dict().items()}
    backbone["classifier.1.weight"] = torch.zeros(4, 4)  # torchvision files carry a classifier too
    torch.save(backbone, d / "alexnet-owt-7be5be79.pth")
    lins = {f"lin{i}.model.1.weight": torch.rand(1, c, 1, 1) for i, c in enumerate((64, 192, 384, 256, 256))}
    torch.save(lins, d / "alex.pth")
    return d


def test_lpips_end_to_end(lpips_dir):
    r = _rng(5)
    a = r.random((3, 48, 40, 3))
    b = np.clip(a + 0.2 * r.standard_normal(a.shape), 0, 1)
    assert lpips_distance(a, a, weights=lpips_dir) == pytest.approx(0.0, abs=1e-7)
    d = lpips_distance(a, b, weights=lpips_dir)
    assert d > 0 and math.isfinite(d)
    assert lpips_distance(b, a, weights=lpips_dir) == pytest.approx(d, rel=1e-5)
    per_frame = [lpips_distance(a[i], b[i], weights=lpips_dir) for i in range(3)]
    assert d == pytest.approx(np.mean(per_frame), rel=1e-5)
    pair = (lpips_dir / "alexnet-owt-7be5be79.pth", lpips_dir / "alex.pth")
    assert lpips_distance(a, b, weights=pair) == pytest.approx(d, rel=1e-6)
    assert lpips_distance(a, b, weights=lpips_dir / "alex.pth") == pytest.approx(d, rel=1e-6)
    # non-contiguous views are fine
    assert lpips_distance(a[::-1], b[::-1], weights=lpips_dir) == pytest.approx(d, rel=1e-5)
    # grayscale frames are repeated to RGB
    g = lpips_distance(a[..., :1], b[..., :1], weights=lpips_dir)
    assert g == pytest.approx(lpips_distance(np.repeat(a[..., :1], 3, -1), np.repeat(b[..., :1], 3, -1),
                                             weights=lpips_dir), rel=1e-5)


def test_lpips_large_frames_run_in_smaller_batches(lpips_dir, monkeypatch):
    """Under a small activation budget frames go one at a time; the distance stays the same."""
    from fastdit.eval.metrics import fidelity
    r = _rng(8)
    a = r.random((5, 40, 48, 3)).astype(np.float32)
    b = np.clip(a + 0.2 * r.standard_normal(a.shape).astype(np.float32), 0, 1)
    whole = lpips_distance(a, b, weights=lpips_dir)  # 5 frames in one batch
    calls = []
    net = fidelity.load_lpips("alex", lpips_dir)
    monkeypatch.setattr(type(net), "forward", lambda self, x, y, f=type(net).forward: calls.append(len(x)) or f(self, x, y))
    monkeypatch.setattr(fidelity, "LPIPS_BATCH_BYTES", 2 * 40 * 48 * fidelity._lpips_bytes_per_pixel("alex"))
    assert lpips_distance(a, b, weights=lpips_dir) == pytest.approx(whole, rel=1e-5)
    assert calls == [2, 2, 1]
    monkeypatch.setattr(fidelity, "LPIPS_BATCH_BYTES", 1)
    calls.clear()
    assert lpips_distance(a, b, weights=lpips_dir) == pytest.approx(whole, rel=1e-5)
    assert calls == [1] * 5


def test_lpips_formula_by_hand(lpips_dir):
    """The LPIPS v0.1 formula written out on the loaded network's feature taps."""
    from fastdit.eval.metrics.fidelity import load_lpips
    net = load_lpips("alex", lpips_dir)
    r = _rng(6)
    x = torch.from_numpy(r.random((1, 3, 40, 40))).float() * 2 - 1
    y = torch.from_numpy(r.random((1, 3, 40, 40))).float() * 2 - 1
    shift = torch.tensor([-0.030, -0.088, -0.188]).view(1, 3, 1, 1)
    scale = torch.tensor([0.458, 0.448, 0.450]).view(1, 3, 1, 1)
    fx, fy = net._taps((x - shift) / scale), net._taps((y - shift) / scale)
    total = 0.0
    for i, (a, b) in enumerate(zip(fx, fy)):
        w = net.lins[i][1].weight.view(1, -1, 1, 1)
        na, nb = a / (a.norm(dim=1, keepdim=True) + 1e-10), b / (b.norm(dim=1, keepdim=True) + 1e-10)
        total += (w * (na - nb) ** 2).sum(1).mean().item()
    assert net(x, y).item() == pytest.approx(total, rel=1e-5)


def test_lpips_weights_from_env(lpips_dir, monkeypatch):
    monkeypatch.setenv("FASTDIT_LPIPS_WEIGHTS", str(lpips_dir))
    a = _rng(7).random((32, 32, 3))
    assert lpips_distance(a, 1 - a) == pytest.approx(lpips_distance(a, 1 - a, weights=lpips_dir))
    with pytest.raises(ValueError, match="31x31"):
        lpips_distance(a[:30], a[:30])


def test_lpips_missing_weights(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    with pytest.raises(FileNotFoundError) as e:
        lpips_distance(np.zeros((32, 32, 3)), np.zeros((32, 32, 3)), weights=tmp_path)
    msg = str(e.value)
    assert "alexnet-owt-7be5be79.pth" in msg and "alex.pth" in msg and str(tmp_path) in msg
