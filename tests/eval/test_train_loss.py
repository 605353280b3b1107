"""``train_loss``: flow matching and the direction contrast of ``train_tiny``, against losses written out here
with one transformer call per sample and caption (float64 sums)."""
import json

import numpy as np

import pytest
import torch

from fastdit.pipelines import shapes_data
from fastdit.pipelines.train_loss import crop_batch, flow_matching_loss, noisy_batch, shapes_fit
from fastdit.pipelines.train_tiny import PRESETS, TrainConfig, build_pipeline, main
from helpers import record_train_calls, record_train_timesteps

TEXTS = ["a red circle moving left and a blue square moving up", "", "a green triangle moving down"]


def test_opposite_directions_reverses_every_path_and_keeps_the_rest():
    for direction, (x, y) in shapes_data.DIRECTIONS.items():
        assert shapes_data.DIRECTIONS[shapes_data.OPPOSITE[direction]] == (-x, -y)
    text = "a red circle moving left and a blue square moving up and a green triangle moving down"
    reversed_ = shapes_data.opposite_directions(text)
    assert reversed_ == "a red circle moving right and a blue square moving down and a green triangle moving up"
    assert shapes_data.opposite_directions(reversed_) == text
    with pytest.raises(ValueError, match="sideways"):
        shapes_data.opposite_directions("a red circle moving sideways")


@pytest.fixture(scope="module")
def batch():
    cfg = TrainConfig(**PRESETS["test"])
    pipe = build_pipeline(cfg)
    gen = torch.Generator().manual_seed(3)
    x0 = torch.randn(3, cfg.vae_z_dim, 3, 8, 8, generator=gen)
    noise = torch.randn(x0.shape, generator=gen)
    sigma = torch.tensor([0.95, 0.5, 0.2])
    s = sigma.view(-1, 1, 1, 1, 1)
    return pipe, cfg, (1 - s) * x0 + s * noise, sigma, noise - x0


def _per_sample(pipe, cfg, xt, sigma, target, texts, weight=None):
    out = []
    for i, text in enumerate(texts):
        embeds = pipe._get_t5_prompt_embeds([text], max_sequence_length=cfg.max_sequence_length, device="cpu")
        pred = pipe.transformer(xt[i:i + 1], sigma[i:i + 1] * 1000.0, embeds, return_dict=False)[0].double()
        w = torch.ones(()) if weight is None else weight[i:i + 1].double() / weight.double().mean()
        out.append((w * (pred - target[i:i + 1].double()) ** 2).mean())
    return torch.stack(out)


def test_plain_and_weighted_loss_match_the_per_sample_mean(batch):
    pipe, cfg, xt, sigma, target = batch
    with torch.no_grad():
        loss, stats = flow_matching_loss(pipe, xt, sigma, target, TEXTS, cfg.max_sequence_length)
        expected = _per_sample(pipe, cfg, xt, sigma, target, TEXTS).mean()
        assert stats == {} and abs(loss.double() - expected) <= 1e-5 * expected
        weight = 1 + 4 * (torch.rand(3, 1, 3, 8, 8, generator=torch.Generator().manual_seed(1)) > 0.7).float()
        weighted, _ = flow_matching_loss(pipe, xt, sigma, target, TEXTS, cfg.max_sequence_length, weight)
        expected_w = _per_sample(pipe, cfg, xt, sigma, target, TEXTS, weight).mean()
    assert abs(weighted.double() - expected_w) <= 1e-5 * expected_w and abs(expected_w - expected) > 1e-4 * expected


@pytest.mark.parametrize("margin", [0.05, 0.0, 10.0])
def test_direction_contrast_is_the_hinge_against_the_reversed_captions(batch, margin):
    pipe, cfg, xt, sigma, target = batch
    with torch.no_grad():
        loss, stats = flow_matching_loss(pipe, xt, sigma, target, TEXTS, cfg.max_sequence_length,
                                         contrast=0.5, margin=margin)
        true = _per_sample(pipe, cfg, xt, sigma, target, TEXTS)
        reversed_ = _per_sample(pipe, cfg, xt, sigma, target, [shapes_data.opposite_directions(t) if t else ""
                                                               for t in TEXTS])
    kept = [0, 2]  # the dropped caption ("") has no reverse and takes no part in the contrast
    assert float((reversed_[kept] - true[kept]).abs().max()) > 0  # the words do change this random model's output
    hinge = torch.relu(true[kept] - reversed_[kept] + margin * true[kept])
    expected = true.mean() + 0.5 * hinge.mean()
    assert abs(loss.double() - expected) <= 1e-5 * expected
    assert stats["reversed_over_true"] == pytest.approx(float((reversed_[kept] / true[kept]).mean()), rel=1e-5)
    if margin == 10.0:
        assert float(hinge.min()) > 0  # a large margin: every kept sample pays


def test_the_contrast_pushes_the_reversed_caption_away(batch):
    """A few optimiser steps on the contrast alone raise l_reversed / l_true on the batch: the gradient reaches
    the direction words (the transformer and the text encoder train together, as in train_tiny)."""
    import copy

    pipe, cfg, xt, sigma, target = batch
    pipe = copy.deepcopy(pipe)
    params = list(pipe.transformer.parameters()) + list(pipe.text_encoder.parameters())
    opt = torch.optim.Adam(params, lr=3e-3)
    texts = [TEXTS[0], TEXTS[2], TEXTS[0]]
    ratios = []
    for _ in range(8):
        loss, stats = flow_matching_loss(pipe, xt, sigma, target, texts, cfg.max_sequence_length, contrast=1.0,
                                         margin=1.0)
        ratios.append(stats["reversed_over_true"])
        opt.zero_grad()
        (loss - flow_matching_loss(pipe, xt, sigma, target, texts, cfg.max_sequence_length)[0]).backward()
        opt.step()
    assert ratios[-1] > ratios[0] + 0.05, ratios


def test_training_with_the_contrast_logs_its_ratio_and_bad_values_are_refused(tmp_path):
    argv = ["--preset", "test", "--out", str(tmp_path / "out"), "--no-progress", "--set", "steps=2",
            "--set", "caption_dropout=0"]
    assert main(argv + ["--work", str(tmp_path / "w"), "--set", "direction_contrast=1"]) == 0
    records = [json.loads(line) for line in (tmp_path / "w" / "log.jsonl").read_text().splitlines()]
    ratio = [r["reversed_over_true"] for r in records if r.get("phase") == "transformer"]
    assert ratio and all(r > 0 for r in ratio)
    for bad in ({"direction_contrast": -1.0}, {"direction_margin": -0.1}):
        with pytest.raises(ValueError, match="direction_"):
            TrainConfig(**bad)
    with pytest.raises(SystemExit):
        main(argv + ["--work", str(tmp_path / "w2"), "--set", "direction_contrast=-2"])
    assert not (tmp_path / "w2").exists()


def test_anchoring_lowers_one_frame_and_the_rest_is_the_plain_draw():
    from types import SimpleNamespace

    x0 = torch.randn(6, 4, 5, 3, 3, generator=torch.Generator().manual_seed(0))
    plain_cfg = SimpleNamespace(flow_shift=3.0, high_noise_prob=0.0, high_noise_min=0.9, anchor_prob=0.0)
    xt, sigma, target = noisy_batch(plain_cfg, x0, torch.Generator().manual_seed(5))
    gen = torch.Generator().manual_seed(5)  # the plain draw written out: shifted uniform, then the noise
    u = torch.rand(6, generator=gen)
    s = 3 * u / (1 + 2 * u)
    noise = torch.randn(x0.shape, generator=gen)
    assert torch.equal(sigma, s) and torch.equal(target, noise - x0)
    assert torch.allclose(xt, (1 - s.view(-1, 1, 1, 1, 1)) * x0 + s.view(-1, 1, 1, 1, 1) * noise)
    anchored_cfg = SimpleNamespace(**{**vars(plain_cfg), "anchor_prob": 1.0})
    xt_a, sigma_a, target_a = noisy_batch(anchored_cfg, x0, torch.Generator().manual_seed(5))
    assert sigma_a.shape == (6, 5) and torch.equal(target_a, target)  # same levels s and noise drawn first
    for b in range(6):
        lower = (sigma_a[b] < s[b]).nonzero().flatten()
        assert lower.numel() == 1 and bool((sigma_a[b][sigma_a[b] != sigma_a[b, lower[0]]] == s[b]).all())
        for f in range(5):
            level = float(sigma_a[b, f])
            assert torch.allclose(xt_a[b, :, f], (1 - level) * x0[b, :, f] + level * noise[b, :, f], atol=1e-6)
    half = SimpleNamespace(**{**vars(plain_cfg), "anchor_prob": 0.5})
    _, sigma_h, _ = noisy_batch(half, torch.zeros(400, 1, 3, 1, 1), torch.Generator().manual_seed(1))
    share = float((sigma_h.min(1).values < sigma_h.max(1).values).float().mean())
    assert 0.4 < share < 0.6  # about half the samples anchored (400 draws)


def test_per_frame_levels_reach_the_transformer_per_token(batch):
    pipe, cfg, xt, sigma, target = batch
    with torch.no_grad():
        flat, _ = flow_matching_loss(pipe, xt, sigma, target, TEXTS, cfg.max_sequence_length)
        same, _ = flow_matching_loss(pipe, xt, sigma[:, None].repeat(1, 3), target, TEXTS, cfg.max_sequence_length)
        assert abs(float(same - flat)) <= 1e-5 * float(flat)  # one level per frame, all equal: the plain loss
        per_frame = torch.tensor([[0.95, 0.2, 0.95], [0.5, 0.5, 0.1], [0.2, 0.2, 0.2]])
        seen = []
        hook = pipe.transformer.register_forward_pre_hook(lambda module, args: seen.append(args[1].clone()))
        try:
            loss, _ = flow_matching_loss(pipe, xt, per_frame, target, TEXTS, cfg.max_sequence_length)
        finally:
            hook.remove()
        tokens = torch.stack([torch.cat([torch.full((64,), 1000.0 * float(v)) for v in row]) for row in per_frame])
        assert torch.equal(seen[0], tokens)  # frame-major token order, 8 x 8 tokens per latent frame
        expected = []
        for i, text in enumerate(TEXTS):
            embeds = pipe._get_t5_prompt_embeds([text], max_sequence_length=cfg.max_sequence_length, device="cpu")
            pred = pipe.transformer(xt[i:i + 1], tokens[i:i + 1], embeds, return_dict=False)[0].double()
            expected.append(((pred - target[i:i + 1].double()) ** 2).mean())
        expected = torch.stack(expected).mean()
    assert abs(loss.double() - expected) <= 1e-5 * expected and abs(float(loss - flat)) > 1e-4 * float(flat)


def test_training_with_anchoring_sends_per_token_timesteps(tmp_path, monkeypatch):
    seen = record_train_timesteps(monkeypatch)
    assert main(["--preset", "test", "--out", str(tmp_path / "out"), "--no-progress", "--set", "steps=2",
                 "--work", str(tmp_path / "w"), "--set", "anchor_prob=1"]) == 0
    assert len(seen) == 2 and all(t.dim() == 2 and t.unique().numel() == 2 for t in seen)
    with pytest.raises(ValueError, match="anchor_prob"):
        TrainConfig(anchor_prob=1.5)


def test_latent_crops_are_windows_holding_every_shape_of_each_sample():
    """``crop_batch``: each sample and its mask cut at one window, found here by index, that holds all the sample's
    shapes; samples get their own windows; ``shapes_fit`` against the extent of the mask written out here."""
    gen = torch.Generator().manual_seed(5)
    x0, mask = torch.randn(16, 3, 2, 9, 11, generator=gen), torch.zeros(16, 2, 9, 11, dtype=torch.bool)
    for b in range(16):  # a 3 x 2 shape in frame 0, moved by up to 2 cells in frame 1
        y, x = int(torch.randint(0, 5, (1,), generator=gen)), int(torch.randint(0, 8, (1,), generator=gen))
        mask[b, 0, y:y + 3, x:x + 2] = True
        mask[b, 1, y + b % 3:y + b % 3 + 3, x + 1:x + 3] = True
    assert shapes_fit(mask, 5).all() and not shapes_fit(mask, 4).all()
    for b in range(16):
        ys, xs = torch.nonzero(mask[b].any(0), as_tuple=True)
        extent = max(int(ys.max() - ys.min()), int(xs.max() - xs.min())) + 1
        assert [bool(shapes_fit(mask[b:b + 1], side)) for side in (3, 4, 5)] == [extent <= side for side in (3, 4, 5)]
    cropped, cropped_mask = crop_batch(x0, mask, 5, np.random.default_rng(1))
    assert cropped.shape == (16, 3, 2, 5, 5) and cropped_mask.shape == (16, 2, 5, 5)
    corners = set()
    for b in range(16):
        found = [(y, x) for y in range(5) for x in range(7) if torch.equal(cropped[b], x0[b, ..., y:y + 5, x:x + 5])]
        assert len(found) == 1
        y, x = found[0]
        assert torch.equal(cropped_mask[b], mask[b, :, y:y + 5, x:x + 5])
        assert cropped_mask[b].sum() == mask[b].sum()  # no shape cell left outside
        corners.add(found[0])
    assert len(corners) > 1
    wide = mask.clone()
    wide[0, 1, 0, 0] = wide[0, 1, 8, 10] = True
    with pytest.raises(ValueError, match="shapes_fit"):
        crop_batch(x0, wide, 5, np.random.default_rng(1))
    whole, whole_mask = crop_batch(x0, mask, 11, np.random.default_rng(1))
    assert whole is x0 and whole_mask is mask


def test_training_on_latent_crops_sends_cropped_grids(tmp_path, monkeypatch):
    shapes = record_train_calls(monkeypatch, lambda args: tuple(args[0].shape[-2:]))
    assert main(["--preset", "test", "--out", str(tmp_path / "out"), "--no-progress", "--set", "steps=2",
                 "--work", str(tmp_path / "w"), "--set", "latent_crop=5", "--set", "fg_weight=2"]) == 0
    assert shapes == [(5, 5), (5, 5)]  # the test preset's grid is 8 x 8; one of its 3 videos fits 5 cells
    shapes.clear()
    assert main(["--preset", "test", "--out", str(tmp_path / "out4"), "--no-progress", "--set", "steps=2",
                 "--work", str(tmp_path / "w4"), "--set", "latent_crop=4"]) == 0
    assert shapes == [(8, 8), (8, 8)]  # none fits 4 cells: whole frames
    shapes.clear()
    assert main(["--preset", "test", "--out", str(tmp_path / "out_mix"), "--no-progress", "--set", "steps=8",
                 "--work", str(tmp_path / "mix"), "--set", "latent_crop=5", "--set", "crop_prob=0.5"]) == 0
    assert len(shapes) == 8 and set(shapes) == {(5, 5), (8, 8)}  # cropped and whole-frame steps (seeded draws)
    for bad in ({"latent_crop": -1}, {"crop_prob": 1.5}):
        with pytest.raises(ValueError, match="latent_crop"):
            TrainConfig(**bad)


def test_image_steps_train_on_first_latent_frames_alone(tmp_path, monkeypatch):
    """image_prob: that share of steps sends image_batch one-frame latents (video frame 0), the rest video clips."""
    calls = record_train_calls(monkeypatch, lambda args: tuple(args[0].shape))
    assert main(["--preset", "test", "--out", str(tmp_path / "out"), "--no-progress", "--set", "steps=2",
                 "--work", str(tmp_path / "w"), "--set", "image_prob=1", "--set", "image_batch=3"]) == 0
    assert [c[0] for c in calls] == [3, 3] and {c[2] for c in calls} == {1}  # batch 3, one latent frame
    calls.clear()
    assert main(["--preset", "test", "--out", str(tmp_path / "out_mix"), "--no-progress", "--set", "steps=10",
                 "--work", str(tmp_path / "mix"), "--set", "image_prob=0.5", "--set", "image_batch=3"]) == 0
    images = [c for c in calls if c[2] == 1]
    assert 0 < len(images) < 10 and all(c[0] == 3 for c in images)
    assert all(c[0] == 1 and c[2] > 1 for c in calls if c[2] != 1)  # the preset's batch 1, a clip of >= 3 frames
    for bad in ({"image_prob": -0.1}, {"image_batch": 0}):
        with pytest.raises(ValueError, match="image_prob"):
            TrainConfig(**bad)
