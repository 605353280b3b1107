"""FID (the Frechet distance, feature statistics, the Inception network, resizing) and CLIP score
against reference implementations and closed forms, on synthetic data.

No weights are downloaded: Inception and CLIP run with random weights written to temporary files
and loaded through the real loading paths.
"""

import math

import numpy as np
import pytest
import scipy.linalg
import torch

from fastdit.eval.metrics import clip_score as cs
from fastdit.eval.metrics import fid as fidm

def _rng(seed=0):
    return np.random.default_rng(seed)

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
