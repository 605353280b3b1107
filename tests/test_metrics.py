"""Metric values against reference implementations and closed forms, on synthetic data.

No weights are downloaded: the learned metrics (LPIPS, Inception, CLIP) run with random weights
written to temporary files and loaded through the real loading paths.
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
import scipy.linalg
import torch

from fastdit.eval import clip_score as cs
from fastdit.eval import fid as fidm
from fastdit.eval import vbench as vb
from fastdit.eval.fidelity import LPIPS, FIDELITY_METRICS, lpips_distance, psnr, ssim

FIXTURES = Path(__file__).parent / "fixtures"


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
    from fastdit.eval.fidelity import psnr, ssim
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
    root = Path(__file__).resolve().parents[1]
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
    from fastdit.eval import fidelity
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
    from fastdit.eval.fidelity import load_lpips
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


# ----------------------------------------------------------------------------- FID math

def _reference_fd(mu1, s1, mu2, s2):
    """Independent form: Tr((S1 S2)^1/2) = Tr((S1^1/2 S2 S1^1/2)^1/2), via symmetric eigh."""
    w, v = scipy.linalg.eigh(s1)
    r1 = (v * np.sqrt(np.clip(w, 0, None))) @ v.T
    m = r1 @ s2 @ r1
    tr = np.sqrt(np.clip(scipy.linalg.eigvalsh((m + m.T) / 2), 0, None)).sum()
    d = mu1 - mu2
    return d @ d + np.trace(s1) + np.trace(s2) - 2 * tr


def _spd(r, n):
    a = r.standard_normal((n, n))
    return a @ a.T / n + 0.1 * np.eye(n)


def test_frechet_identical_stats_is_zero():
    r = _rng(7)
    mu, s = r.standard_normal(16), _spd(r, 16)
    assert fidm.frechet_distance(mu, s, mu, s) == pytest.approx(0.0, abs=1e-8)


def test_frechet_diagonal_closed_form():
    r = _rng(8)
    mu1, mu2 = r.standard_normal(10), r.standard_normal(10)
    a, b = r.random(10) + 0.1, r.random(10) + 0.1
    expected = np.sum((mu1 - mu2) ** 2) + np.sum((np.sqrt(a) - np.sqrt(b)) ** 2)
    assert fidm.frechet_distance(mu1, np.diag(a), mu2, np.diag(b)) == pytest.approx(expected, rel=1e-10)
    # 1-D: (m1 - m2)^2 + (sd1 - sd2)^2
    assert fidm.frechet_distance([1.0], [[4.0]], [3.0], [[9.0]]) == pytest.approx(4.0 + 1.0)


def test_frechet_general_matches_reference():
    r = _rng(9)
    mu1, mu2, s1, s2 = r.standard_normal(12), r.standard_normal(12), _spd(r, 12), _spd(r, 12)
    assert fidm.frechet_distance(mu1, s1, mu2, s2) == pytest.approx(_reference_fd(mu1, s1, mu2, s2), rel=1e-8)


def test_frechet_singular_covariances_stay_finite():
    # fewer samples than dimensions: rank-deficient covariances (the eps * I fallback may kick in)
    r = _rng(10)
    mu1, s1 = fidm.compute_stats(features=r.standard_normal((5, 20)))
    mu2, s2 = fidm.compute_stats(features=r.standard_normal((5, 20)) + 0.5)
    d = fidm.frechet_distance(mu1, s1, mu2, s2)
    assert math.isfinite(d) and d == pytest.approx(_reference_fd(mu1, s1, mu2, s2), rel=1e-3, abs=1e-3)


def test_compute_stats_is_mean_and_unbiased_cov():
    f = _rng(11).standard_normal((50, 4))
    mu, sigma = fidm.compute_stats(features=f)
    np.testing.assert_allclose(mu, f.mean(0))
    np.testing.assert_allclose(sigma, (f - f.mean(0)).T @ (f - f.mean(0)) / 49)
    with pytest.raises(ValueError):
        fidm.compute_stats(features=f[:1])


# ----------------------------------------------------------------------------- FID Inception

@pytest.fixture(scope="module")
def inception_weights(tmp_path_factory):
    """A random FIDInceptionV3 state dict saved under the real weight file name."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("fid") / fidm.FID_WEIGHTS_NAME
    torch.save(fidm.FIDInceptionV3().state_dict(), path)
    return path


def test_inception_architecture_size():
    # torchvision Inception3(num_classes=1008, aux_logits=False) has 23,850,960 parameters and 566
    # state-dict entries; the pytorch-fid weight file is a state dict of that model.
    net = fidm.FIDInceptionV3()
    assert sum(p.numel() for p in net.parameters()) == 23_850_960
    assert len(net.state_dict()) == 566


def test_inception_features_end_to_end(inception_weights, tmp_path, monkeypatch):
    imgs = _rng(12).random((2, 24, 32, 3))
    feats = fidm.inception_features(imgs, weights=inception_weights, batch_size=2)
    assert feats.shape == (2, 2048) and np.isfinite(feats).all() and (feats >= 0).all()
    assert not np.allclose(feats[0], feats[1])
    # a list of differently sized images: each is resized on its own
    from PIL import Image
    mixed = [Image.fromarray((imgs[0] * 255).round().astype(np.uint8)), _rng(1).random((40, 20, 3))]
    feats_list = fidm.inception_features(mixed, weights=inception_weights, batch_size=2)
    np.testing.assert_allclose(feats_list[0], feats[0], rtol=1e-4, atol=1e-5)
    # the env var (file or directory) reaches the same loader; the cached model gives equal features
    monkeypatch.setenv("FASTDIT_FID_WEIGHTS", str(inception_weights.parent))
    stats_dir = tmp_path / "stats"
    mu, sigma = fidm.reference_stats("toy", imgs, cache_dir=stats_dir, batch_size=2)
    np.testing.assert_allclose(mu, feats.mean(0), rtol=1e-6, atol=1e-9)
    assert sigma.shape == (2048, 2048) and (stats_dir / "toy.npz").is_file()
    # second call reads the cache (no images needed)
    mu2, sigma2 = fidm.reference_stats("toy", cache_dir=stats_dir)
    np.testing.assert_array_equal(mu, mu2)
    np.testing.assert_array_equal(sigma, sigma2)
    with pytest.raises(ValueError, match="resize"):
        fidm.reference_stats("toy", cache_dir=stats_dir, resize="legacy_pytorch")
    with pytest.raises(FileNotFoundError):
        fidm.reference_stats("absent", cache_dir=stats_dir)


def test_inception_missing_weights(tmp_path, monkeypatch):
    monkeypatch.delenv("FASTDIT_FID_WEIGHTS", raising=False)
    with pytest.raises(FileNotFoundError) as e:
        fidm.load_inception(weights=tmp_path)
    assert fidm.FID_WEIGHTS_NAME in str(e.value) and str(tmp_path) in str(e.value)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    with pytest.raises(FileNotFoundError, match="FASTDIT_FID_WEIGHTS"):
        fidm.load_inception()


@pytest.mark.parametrize("mode", fidm.RESIZE_MODES)
def test_resize_modes(mode):
    r = _rng(13)
    x299 = (r.random((1, 299, 299, 3)) * 255).astype(np.uint8)
    # at the target size every mode is the identity, then x / 255 * 2 - 1
    out = fidm.preprocess(x299, mode)
    expected = torch.from_numpy(x299).permute(0, 3, 1, 2).float() / 255 * 2 - 1
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=0)
    small = fidm.preprocess(r.random((2, 20, 30, 3)), mode)
    assert small.shape == (2, 3, 299, 299) and small.min() >= -1 and small.max() <= 1


def test_tf1_bilinear_resize_samples_top_left_aligned():
    # TF1 resize_bilinear(align_corners=False, half_pixel_centers=False): src = dst * in / out
    t = torch.arange(4.0).view(1, 1, 1, 4).expand(1, 1, 2, 4)
    out = fidm._resize_tf1_bilinear(t, 8)
    torch.testing.assert_close(out[0, 0, 0], torch.tensor([0, 0.5, 1, 1.5, 2, 2.5, 3, 3.0]))


# ----------------------------------------------------------------------------- CLIP score

@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory):
    """A random tiny CLIPModel + WordLevel tokenizer + image processor saved as a HF folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import CLIPConfig, CLIPModel, PreTrainedTokenizerFast

    try:
        from transformers import CLIPImageProcessorPil as CLIPImageProcessor
    except ImportError:
        from transformers import CLIPImageProcessor

    path = tmp_path_factory.mktemp("clip")
    words = ["a", "cat", "dog", "photo", "of", "the", "red", "car"]
    vocab = {"<pad>": 0, "<unk>": 1, "<bos>": 2, "<eos>": 3, **{w: i + 4 for i, w in enumerate(words)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.post_processor = processors.TemplateProcessing(
        single="<bos> $A <eos>", special_tokens=[("<bos>", 2), ("<eos>", 3)])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", unk_token="<unk>",
                                  bos_token="<bos>", eos_token="<eos>")
    cfg = CLIPConfig(
        text_config=dict(vocab_size=len(vocab), hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=16, bos_token_id=2, eos_token_id=3,
                         pad_token_id=0),
        vision_config=dict(hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
                           image_size=32, patch_size=8),
        projection_dim=16)
    torch.manual_seed(0)
    CLIPModel(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(path)
    return path


def test_clip_score_matches_model_forward(tiny_clip):
    net, tok, proc = cs.load_clip(tiny_clip)
    r = _rng(14)
    imgs = (r.random((3, 40, 50, 3)) * 255).astype(np.uint8)
    texts = ["a red cat", "a dog", "a photo of the car"]
    got = cs.clip_scores(imgs, texts, model=tiny_clip)
    # reference: CLIPModel's own forward, logits_per_image = exp(logit_scale) * cos
    with torch.no_grad():
        enc = tok(texts, padding=True, return_tensors="pt")
        pix = proc(images=list(imgs), return_tensors="pt")["pixel_values"]
        out = net(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], pixel_values=pix)
        cos = torch.diagonal(out.logits_per_image) / net.logit_scale.exp()
    np.testing.assert_allclose(got, 100 * np.clip(cos.numpy(), 0, None), rtol=1e-4, atol=1e-4)
    assert cs.clip_score(imgs, texts, model=tiny_clip) == pytest.approx(got.mean())
    # float [0, 1] frames are quantised like the uint8 ones
    np.testing.assert_allclose(cs.clip_scores(imgs / 255.0, texts, model=tiny_clip), got, rtol=1e-5)


def test_clip_score_video_is_frame_average(tiny_clip):
    r = _rng(15)
    v1, v2 = r.random((4, 36, 36, 3)), r.random((2, 36, 36, 3))
    per_frame = cs.clip_scores(v1, "a cat", model=tiny_clip)
    assert cs.clip_score_video(v1, "a cat", model=tiny_clip) == pytest.approx(per_frame.mean())
    both = cs.clip_score_video([v1, v2], ["a cat", "a dog"], model=tiny_clip)
    assert both[0] == pytest.approx(per_frame.mean())
    assert both[1] == pytest.approx(cs.clip_scores(v2, "a dog", model=tiny_clip).mean())
    assert all(0 <= s <= 100 for s in both)


def test_clip_missing_model(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        cs.load_clip(tmp_path / "no_such_model")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(FileNotFoundError, match="not available locally"):
        cs.load_clip("nobody/no-such-clip-model")


# ----------------------------------------------------------------------------- VBench

def _official_total(raw):
    """VBench scripts/cal_final_score.py, transcribed with its space-separated keys."""
    norm = {"subject consistency": (0.1462, 1.0), "background consistency": (0.2615, 1.0),
            "temporal flickering": (0.6293, 1.0), "motion smoothness": (0.706, 0.9975),
            "dynamic degree": (0.0, 1.0), "aesthetic quality": (0.0, 1.0), "imaging quality": (0.0, 1.0),
            "object class": (0.0, 1.0), "multiple objects": (0.0, 1.0), "human action": (0.0, 1.0),
            "color": (0.0, 1.0), "spatial relationship": (0.0, 1.0), "scene": (0.0, 0.8222),
            "appearance style": (0.0009, 0.2855), "temporal style": (0.0, 0.364),
            "overall consistency": (0.0, 0.364)}
    weight = {k: (0.5 if k == "dynamic degree" else 1) for k in norm}
    quality = ["subject consistency", "background consistency", "temporal flickering", "motion smoothness",
               "aesthetic quality", "imaging quality", "dynamic degree"]
    semantic = [k for k in norm if k not in quality]
    data = {k.replace("_", " "): v for k, v in raw.items()}
    data = {k: data.get(k, 0) for k in norm}
    ns = {k: (data[k] - norm[k][0]) / (norm[k][1] - norm[k][0]) * weight[k] for k in norm}
    q = sum(ns[k] for k in quality) / sum(weight[k] for k in quality)
    s = sum(ns[k] for k in semantic) / sum(weight[k] for k in semantic)
    return q, s, (q * 4 + s) / 5


def test_parse_vbench_results_fixture():
    res = vb.parse_vbench_results(FIXTURES / "vbench_eval_results.json")
    assert len(res) == 16 and res["temporal_flickering"] == pytest.approx(0.9825)
    assert res["dynamic_degree"] == pytest.approx(0.45)
    full = vb.parse_vbench_results(FIXTURES / "vbench_eval_results.json", per_video=True)
    score, videos = full["subject_consistency"]
    assert score == pytest.approx(0.9612) and len(videos) == 2 and videos[0]["video_results"] == 0.9701


def test_vbench_scores_match_official_formula():
    raw = vb.parse_vbench_results(FIXTURES / "vbench_eval_results.json")
    q, s, t = _official_total(raw)
    out = vb.vbench_scores(raw)
    assert out["quality_score"] == pytest.approx(q, abs=1e-12)
    assert out["semantic_score"] == pytest.approx(s, abs=1e-12)
    assert out["total_score"] == pytest.approx(t, abs=1e-12)
    assert out["missing"] == []
    # hand check of one normalisation: temporal flickering (0.9825 - 0.6293) / (1 - 0.6293)
    assert out["normalized"]["temporal_flickering"] == pytest.approx((0.9825 - 0.6293) / 0.3707)


def test_vbench_scores_extremes_and_missing():
    top = {d: hi for d, (lo, hi) in vb.NORMALIZE.items()}
    bottom = {d: lo for d, (lo, hi) in vb.NORMALIZE.items()}
    assert vb.vbench_scores(top)["total_score"] == pytest.approx(1.0)
    assert vb.vbench_scores(bottom)["total_score"] == pytest.approx(0.0)
    partial = {"temporal flickering": 0.9825, "Dynamic Degree": 0.45}
    skip = vb.vbench_scores(partial)
    expected_q = ((0.9825 - 0.6293) / 0.3707 + 0.5 * 0.45) / 1.5
    assert skip["quality_score"] == pytest.approx(expected_q)
    assert skip["semantic_score"] is None and skip["total_score"] is None and len(skip["missing"]) == 14
    zero = vb.vbench_scores(partial, missing="zero")
    assert zero["total_score"] == pytest.approx(_official_total(
        {"temporal_flickering": 0.9825, "dynamic_degree": 0.45})[2])
    with pytest.raises(KeyError):
        vb.vbench_scores(partial, missing="error")
    with pytest.raises(KeyError, match="unknown"):
        vb.vbench_scores({"sharpness": 1.0})


def test_temporal_flickering_synthetic():
    r = _rng(16)
    static = np.repeat(r.random((1, 16, 20, 3)), 5, axis=0)
    assert vb.temporal_flickering(static) == 1.0
    ramp = np.stack([np.full((16, 20, 3), 7 * k, np.uint8) for k in range(6)])  # +7 per frame
    assert vb.temporal_flickering(ramp) == pytest.approx((255 - 7) / 255)
    # alternating 0 / 51 on half the pixels: MAE 25.5 for every pair
    alt = np.zeros((4, 8, 8, 3), np.uint8)
    alt[1::2, :4] = 51
    assert vb.temporal_flickering(alt) == pytest.approx((255 - 25.5) / 255)
    # float input is quantised to uint8 first, as a written video is
    assert vb.temporal_flickering(ramp / 255.0) == pytest.approx((255 - 7) / 255)
    with pytest.raises(ValueError):
        vb.temporal_flickering(static[:1])


def test_write_vbench_videos_naming_and_flicker_from_file(tmp_path):
    r = _rng(17)
    static = np.repeat(r.random((1, 32, 48, 3)), 4, axis=0)
    ramp = np.stack([np.full((32, 48, 3), 10 * k, np.uint8) for k in range(4)])
    paths = vb.write_vbench_videos([static, ramp, static], ["a cat", "a cat", "a dog"], tmp_path / "std")
    assert [p.name for p in paths] == ["a cat-0.mp4", "a cat-1.mp4", "a dog-0.mp4"]
    assert vb.read_video_frames(paths[0]).shape == (4, 32, 48, 3)
    assert vb.temporal_flickering(paths[0]) == pytest.approx(1.0, abs=2e-3)
    assert vb.temporal_flickering(paths[1]) == pytest.approx((255 - 10) / 255, abs=2e-3)
    with pytest.raises(ValueError, match="custom"):
        vb.write_vbench_videos([static], ["a/b"], tmp_path / "std")
    paths = vb.write_vbench_videos([static, static], ["a/b: c?", "a/b: c?"], tmp_path / "cus", mode="custom")
    prompts = json.loads((tmp_path / "cus" / "prompts.json").read_text())
    assert prompts == {p.name: "a/b: c?" for p in paths} and len(paths) == 2


def test_run_vbench_errors(tmp_path, monkeypatch):
    monkeypatch.delenv("FASTDIT_VBENCH_PYTHON", raising=False)
    with pytest.raises(FileNotFoundError, match="FASTDIT_VBENCH_PYTHON"):
        vb.run_vbench(tmp_path, ["temporal_flickering"])
    with pytest.raises(FileNotFoundError, match="not found"):
        vb.run_vbench(tmp_path, ["temporal_flickering"], python=tmp_path / "nope" / "python")
    with pytest.raises(RuntimeError, match="not importable"):  # this interpreter has no vbench
        vb.run_vbench(tmp_path, ["temporal_flickering"], python=sys.executable,
                      env={"PYTHONPATH": str(tmp_path)})
    with pytest.raises(ValueError, match="custom"):
        vb.run_vbench(tmp_path, ["color"], python=sys.executable, mode="custom")


def test_run_vbench_with_stub_package(tmp_path):
    """Drives the real command line against a stub `vbench` whose launcher writes a results file."""
    pkg = tmp_path / "site" / "vbench"
    (pkg / "launch").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "launch" / "evaluate.py").write_text(textwrap.dedent("""
        import argparse, json, os, sys
        p = argparse.ArgumentParser()
        p.add_argument("--videos_path"); p.add_argument("--dimension", nargs="+")
        p.add_argument("--output_path"); p.add_argument("--mode"); p.add_argument("--prompt_file")
        a = p.parse_args()
        res = {d: [0.5, [{"video_path": os.path.join(a.videos_path, v), "video_results": 0.5}
                         for v in sorted(os.listdir(a.videos_path)) if v.endswith(".mp4")]]
               for d in a.dimension}
        res["_argv"] = [0.0, sys.argv[1:]]
        json.dump(res, open(os.path.join(a.output_path, "results_x_eval_results.json"), "w"))
    """))
    videos = tmp_path / "videos"
    vb.write_vbench_videos([np.zeros((2, 16, 16, 3))], ["a cat"], videos, mode="custom")
    out = vb.run_vbench(videos, ["temporal flickering", "dynamic_degree"], python=sys.executable,
                        out_dir=tmp_path / "out", mode="custom", env={"PYTHONPATH": str(tmp_path / "site")})
    assert out["temporal_flickering"] == 0.5 and out["dynamic_degree"] == 0.5
    argv = vb.parse_vbench_results(tmp_path / "out", per_video=True)["_argv"][1]
    assert argv[argv.index("--mode") + 1] == "custom_input"
    assert argv[argv.index("--prompt_file") + 1] == str((videos / "prompts.json").resolve())
