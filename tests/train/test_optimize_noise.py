"""``fastdit.optimize_noise`` on the tiny random-weight Wan pipeline (105 video tokens): the
latent keeps mean 0 / std 1, changes, and lowers its own loss (recomputed independently of the
optimiser's report); the same result with an untrainable patch (its attention falls back to the
model's own under gradients); a trainable optiprune patch runs; the attention maps against a
float64 softmax; subject finding; bad input."""
import types

import pytest
import torch

import fastdit
from fastdit.pipelines.tiny import tiny
from fastdit.train.noise import _AttentionMaps, find_subjects, noise_loss, subject_tokens
from helpers import load_script

PROMPT = "a red circle moving left and a blue square moving down"


@pytest.fixture(scope="module")
def pipe():
    p = tiny("wan", seed=0)
    p.set_progress_bar_config(disable=True)
    return p


def start(pipe, seed=0):
    """N(0, I) latents of 9 frames of 80 x 112 (grid 3 x 5 x 7 after the 1 x 2 x 2 patch)."""
    channels = pipe.transformer.config.in_channels
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, channels, 3, 10, 14, generator=g)


def normalised(z):
    return (z - z.mean()) / z.std()


def test_latent_stays_standard_changes_and_its_loss_goes_down(pipe):
    z0 = start(pipe)
    out = fastdit.optimize_noise(pipe, PROMPT, latents=z0, steps=3, lr=0.2)
    assert out.shape == z0.shape and torch.isfinite(out).all()
    assert abs(float(out.mean())) < 0.05 and abs(float(out.std()) - 1) < 0.05
    assert (out - normalised(z0)).abs().mean() > 0.05  # it really moved
    history = out.loss_history
    assert len(history) == 4 and history[-1]["loss"] < history[0]["loss"]
    before, _ = noise_loss(pipe, PROMPT, normalised(z0))
    after, parts = noise_loss(pipe, PROMPT, out)
    assert float(after) < float(before)
    assert float(after) == pytest.approx(history[-1]["loss"], rel=1e-5)
    assert 0 <= parts["peak"] <= 1 and 0 <= parts["overlap"] <= 1


def test_same_result_under_an_untrainable_patch_and_a_trainable_optiprune_runs(pipe):
    z0 = start(pipe, seed=1)
    plain = fastdit.optimize_noise(pipe, PROMPT, latents=z0, steps=1, lr=0.2)
    with fastdit.patch(pipe, "optiprune") as p:
        patched = fastdit.optimize_noise(pipe, PROMPT, latents=z0, steps=1, lr=0.2)
        assert p.stats.fallback_calls > 0  # the model's own attention ran under gradients, counted
    torch.testing.assert_close(patched, plain, rtol=1e-5, atol=1e-5)
    with fastdit.patch(pipe, "optiprune", trainable=True, dense_steps=0) as p:
        trained = fastdit.optimize_noise(pipe, PROMPT, latents=z0, steps=1, lr=0.2)
        assert p.stats.sparse_calls > 0
    assert torch.isfinite(trained).all() and not torch.equal(trained, plain)


def test_attention_maps_equal_a_float64_softmax():
    g = torch.Generator().manual_seed(2)
    n, length = 11, 5
    q = torch.randn(2, 3, n, 8, generator=g)
    k = torch.randn(2, 3, length, 8, generator=g)
    joint_q = torch.randn(2, 3, n + length, 8, generator=g)
    joint_k = torch.randn(2, 3, n + length, 8, generator=g)
    maps = _AttentionMaps(n, length, text_prefix=True)
    with maps:
        torch.nn.functional.scaled_dot_product_attention(q, k, k)
        torch.nn.functional.scaled_dot_product_attention(joint_q, joint_k, joint_k, scale=0.3)
        torch.nn.functional.scaled_dot_product_attention(q, q, q)  # video self-attention: not a map
    assert len(maps.maps) == 2
    expected = (q[-1].double() @ k[-1].double().transpose(-1, -2) / 8 ** 0.5).softmax(-1).mean(0)
    torch.testing.assert_close(maps.maps[0].double(), expected, rtol=1e-5, atol=1e-6)
    qv, kt = joint_q[-1, :, length:].double(), joint_k[-1, :, :length].double()
    torch.testing.assert_close(maps.maps[1].double(), (0.3 * qv @ kt.transpose(-1, -2)).softmax(-1).mean(0),
                               rtol=1e-5, atol=1e-6)


def test_subjects_found_and_located(pipe):
    assert find_subjects(PROMPT) == ["circle", "square"]
    assert find_subjects("A cat sitting on a mat, a dog with a ball") == ["cat", "dog", "ball"]
    tokens = subject_tokens(pipe, PROMPT)
    ids = pipe.tokenizer(PROMPT)["input_ids"]
    for word, positions in tokens.items():
        assert [ids[i] for i in positions] == pipe.tokenizer(word, add_special_tokens=False)["input_ids"]


def test_bad_input_names_the_argument(pipe):
    z0 = start(pipe)
    with pytest.raises(ValueError, match="subjects"):
        fastdit.optimize_noise(pipe, PROMPT, latents=z0, subjects=["giraffe"])
    with pytest.raises(ValueError, match="subjects"):
        fastdit.optimize_noise(pipe, "moving left", latents=z0)
    untexted = types.SimpleNamespace(transformer=pipe.transformer, tokenizer=None, text_encoder=None)
    with pytest.raises(ValueError, match="pipe"):
        fastdit.optimize_noise(untexted, PROMPT, latents=z0)
    with pytest.raises(ValueError, match="steps"):
        fastdit.optimize_noise(pipe, PROMPT, latents=z0, steps=-1)
    with pytest.raises(ValueError, match="lr"):
        fastdit.optimize_noise(pipe, PROMPT, latents=z0, lr=0)


def test_adherence_bench_code_path_on_the_trained_model(tmp_path):
    """scripts/bench_optiprune.py (the issue's evidence, run outside CI) on 1 caption, 1 denoising
    step, 5 frames: every config scored, neglect = some object's colour term < 0.5."""
    import json

    bench = load_script("bench_optiprune")
    captions = bench.two_object_captions(3)
    assert len(set(captions)) == 3 and all(c.count(" and ") == 1 for c in captions)
    out = tmp_path / "r.json"
    bench.main(["--captions", "1", "--seeds", "0", "--steps", "1", "--noise-steps", "1", "--frames", "5",
                "--json", str(out)])
    result = json.loads(out.read_text())
    (record,) = result["records"]
    for config in bench.CONFIGS:
        row = record[config]
        assert 0 <= row["score"] <= 1 and row["neglect"] == (min(row["object_colour"]) < 0.5)
    assert record["optiprune"]["density"] < 1 and record["dense"]["density"] is None
    assert record["tome"]["density"] == pytest.approx(record["optiprune"]["density"])  # equal pruned fraction
    for config in ("optiprune", "tome"):  # fidelity against dense of the same latent, from the videos
        assert 0 < record[config]["psnr"] and -1 <= record[config]["ssim"] <= 1
    assert "psnr" not in record["optiprune+noise"]  # another latent: no comparison with dense(z0)
    assert [r["videos"] for r in result["summary"]] == [1] * len(bench.CONFIGS)
    assert result["peak_rss_mib"] > 0
