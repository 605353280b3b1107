"""The LoRA recipe (``fastdit.train``) end to end on the tiny Wan, a few steps.

* ``train_lora`` writes the LoRA (diffusers' format), checkpoints, the loss history and plot; the
  losses are finite and the patch ran every call sparse (no fallback) with gradients.
* Resume: 2 + 2 steps from a checkpoint give exactly the losses and weights of 4 steps in one go.
* Round trip: ``load_lora`` into a fresh pipeline gives the trained transformer's output; a LoRA
  of another model is refused with diffusers' error and the file name.
"""
from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("peft")

from fastdit.pipelines.tiny import tiny  # noqa: E402
from fastdit.train import LoraTrainConfig, load_lora, train_lora  # noqa: E402

CALL = {"num_frames": 9, "height": 64, "width": 64, "num_inference_steps": 2, "guidance_scale": 1.0,
        "max_sequence_length": 16}  # a 3 x 4 x 4 latent grid
OPTIONS = {"tile": (1, 2, 2), "window": (1, 1, 1), "dense_steps": 0, "dense_layers": 0}


def _pipe():
    pipe = tiny("wan", seed=0, num_layers=2)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _config(steps):
    return LoraTrainConfig(method="sta", options=OPTIONS, prompts=("a cat", "a dog"), seeds=(0,), samples=3,
                           steps=steps, lr=1e-2, rank=4, checkpoint_every=2, call_kwargs=CALL, backend="torch")


def _output(pipe, seed=5):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, pipe.transformer.config.in_channels, 3, 8, 8, generator=gen)
    text = pipe.encode_prompt("a bird", do_classifier_free_guidance=False, max_sequence_length=16)[0]
    with torch.no_grad():
        return pipe.transformer(hidden_states=x, timestep=torch.tensor([300.0]), encoder_hidden_states=text,
                                return_dict=False)[0]


def test_recipe_end_to_end_resume_and_round_trip(tmp_path):
    whole = _pipe()
    result = train_lora(whole, _config(4), tmp_path / "whole", progress=False)
    assert len(result["losses"]) == 4 and all(torch.isfinite(torch.tensor(result["losses"])))
    assert result["stats"]["fallback_calls"] == 0 and result["stats"]["sparse_calls"] > 0
    assert result["stats"]["sparse_density"] < 0.8
    for name in ("pytorch_lora_weights.safetensors", "losses.json", "loss.png", "checkpoints/step-000002.pt"):
        assert (tmp_path / "whole" / name).exists(), name
    assert json.loads((tmp_path / "whole" / "losses.json").read_text())["losses"] == result["losses"]

    # resume: 2 steps, then 2 more from the checkpoint, in fresh pipelines
    train_lora(_pipe(), _config(2), tmp_path / "split", progress=False)
    resumed_pipe = _pipe()
    resumed = train_lora(resumed_pipe, _config(4), tmp_path / "split", resume=True, progress=False)
    assert resumed["resumed_from"] == 2
    assert resumed["losses"] == pytest.approx(result["losses"], rel=1e-6, abs=1e-9)
    torch.testing.assert_close(_output(resumed_pipe), _output(whole), rtol=1e-5, atol=1e-6)

    # round trip through diffusers' LoRA format: the adapter changes the output, and loads back exactly
    fresh = _pipe()
    base = _output(fresh)
    load_lora(fresh, tmp_path / "whole")
    loaded = _output(fresh)
    assert (loaded - base).abs().max() > 1e-6
    torch.testing.assert_close(loaded, _output(whole), rtol=1e-5, atol=1e-6)

    other = tiny("wan", seed=0, num_layers=2, attention_head_dim=8)
    with pytest.raises(ValueError, match="pytorch_lora_weights|whole"):
        load_lora(other, tmp_path / "whole")


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="steps must be an int >= 1"):
        LoraTrainConfig(steps=0)
    with pytest.raises(ValueError, match="lr must be a number > 0"):
        LoraTrainConfig(lr=-1.0)


def test_cli_trains_the_trained_tiny_model_on_its_own_grammar(tmp_path):
    """``python -m fastdit.train --model tiny-shapes``: the shipped trained model loads offline with
    its native call (a small size of it here); training and held-out prompts are captions of its grammar (the only text it
    knows), distinct and disjoint; one step at a reduced call runs end to end."""
    from fastdit.pipelines.shapes_data import parse_caption
    from fastdit.train.__main__ import _shapes_captions, main

    train, held = _shapes_captions(8, seed=7), _shapes_captions(4, seed=8)
    assert len(set(train)) == 8 and len(set(held)) == 4 and not set(train) & set(held)
    assert all(parse_caption(text) for text in train + held)
    out = tmp_path / "lora"
    main(["--model", "tiny-shapes", "--method", "sta", "--options",
          json.dumps({"tile": [1, 4, 4], "window": [1, 1, 1], "dense_steps": 0, "dense_layers": 0}),
          "--call", json.dumps({"num_frames": 5, "height": 64, "width": 64, "num_inference_steps": 1}),
          "--prompts", json.dumps(train[:1]),
          "--steps", "1", "--samples", "1", "--backend", "torch", "--no-progress", "--out", str(out),
          "--json", str(out / "result.json")])
    result = json.loads((out / "result.json").read_text())
    assert result["call"]["height"] == 64 and result["call"]["num_frames"] == 5 and result["steps"] == 1
    assert result["held_out"] == list(held) and (out / "pytorch_lora_weights.safetensors").exists()


# -- the flow-matching loss on user videos ---------------------------------------------------------

def _video(frames=11, size=70, seed=3):
    gen = torch.Generator().manual_seed(seed)
    return (torch.rand(frames, size, size, 3, generator=gen) * 255).to(torch.uint8).numpy()


def test_flow_samples_encode_as_the_pipeline_decodes_and_target_the_velocity():
    """``x0`` inverts the Wan pipeline's own decode (``latents / (1 / std) + mean`` gives the VAE's
    mode back, with a non-trivial mean and std); an 11-frame 70 x 70 video is trimmed to 9 frames
    and cropped to 64 x 64 (never rejected); each sample is ``x_t = (1 - s) x0 + s eps`` with
    target ``eps - x0``, so ``x_t - s * target == x0``."""
    from fastdit.train.flow import encode_video, flow_samples, read_frames

    pipe = _pipe()
    z = pipe.vae.config.z_dim
    pipe.vae.register_to_config(latents_mean=[0.1 * i for i in range(z)], latents_std=[0.5 + 0.1 * i for i in range(z)])
    frames = read_frames(_video())
    x0, kept = encode_video(pipe, frames)
    assert kept == (9, 64, 64)
    pixels = torch.from_numpy(frames[:9, :64, :64]).permute(3, 0, 1, 2)[None] * 2 - 1
    with torch.no_grad():
        mode = pipe.vae.encode(pixels).latent_dist.mode()
    mean = torch.tensor(pipe.vae.config.latents_mean).view(1, z, 1, 1, 1)
    std_inverse = 1.0 / torch.tensor(pipe.vae.config.latents_std).view(1, z, 1, 1, 1)
    torch.testing.assert_close(x0 / std_inverse + mean, mode, atol=1e-5, rtol=1e-5)  # the pipeline's decode step
    config = LoraTrainConfig(prompts=("a cat",), seeds=(0,), samples=3, videos=(("a bird", _video()),),
                             call_kwargs=CALL)
    samples, kept_all = flow_samples(pipe, config, lambda prompt: torch.zeros(1, 4, 8))
    assert kept_all == [(9, 64, 64)] and len(samples) == 3
    for sample in samples:
        sigma = float(sample["timestep"]) / 1000.0
        torch.testing.assert_close(sample["hidden_states"] - sigma * sample["target"], x0, atol=1e-5, rtol=1e-5)


def test_flow_weight_adds_the_flow_loss_linearly(tmp_path):
    """First-step losses (before any update) with ``flow_weight`` 0, 1, 2: 0 is distillation alone
    (the same as without videos), and the added term doubles with the weight and is positive."""
    first = {}
    for weight in (None, 0.0, 1.0, 2.0):
        pipe = _pipe()
        extra = {} if weight is None else {"videos": (("a bird", _video()),), "flow_weight": weight}
        config = LoraTrainConfig(**{**_config(1).__dict__, "checkpoint_every": 0, **extra})
        first[weight] = train_lora(pipe, config, tmp_path / f"w{weight}", progress=False)["losses"][0]
    assert first[0.0] == pytest.approx(first[None], rel=1e-6)
    added = first[1.0] - first[0.0]
    assert added > 0 and first[2.0] - first[0.0] == pytest.approx(2 * added, rel=1e-4)


def test_flow_loss_refuses_what_it_cannot_use():
    from fastdit.train.flow import encode_video, read_frames

    with pytest.raises(ValueError, match="flow_weight"):
        LoraTrainConfig(videos=(("a", _video()),), flow_weight=-1.0)
    with pytest.raises(ValueError, match="videos must be"):
        LoraTrainConfig(videos=(_video(),))
    with pytest.raises(ValueError, match=r"videos: a video must be frames of shape \(F, H, W, 3\)"):
        read_frames(torch.zeros(4, 8, 8))
    with pytest.raises(ValueError, match="videos: cannot read"):
        read_frames("/nonexistent/clip.mp4")
    pipe = tiny("hunyuan_video", seed=0, num_layers=1)
    with pytest.raises(ValueError, match="videos: flow-matching on user videos needs a VAE with latents_mean"):
        encode_video(pipe, read_frames(_video(frames=5, size=32)))
