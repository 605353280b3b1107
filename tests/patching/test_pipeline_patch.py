"""``fastdit.patch`` on whole tiny pipelines: step counting with the scheduler, CFG, reversibility."""
import numpy as np
import pytest
import torch

import fastdit
from fastdit.layout import TokenLayout
from fastdit.pipelines.tiny import TINY_TEST_DEFAULTS, tiny

from layer_capture import LayerCapture, assert_matches_masked_dense, sta_token_mask

STA = dict(tile=(1, 2, 2), window=(1, 3, 3))


@pytest.fixture(scope="module")
def pipes():
    return {name: tiny(name) for name in ("wan", "hunyuan_video", "wan_i2v")}


def generate(pipe, name, prompt="a red fox in the snow", seed=0, **overrides):
    kwargs = {**TINY_TEST_DEFAULTS[name], **overrides}
    with torch.no_grad():
        out = pipe(prompt=prompt, generator=torch.Generator().manual_seed(seed), output_type="np", **kwargs)
    return np.asarray(out.frames)


@pytest.mark.parametrize("name", ["wan", "hunyuan_video", "wan_i2v"])
def test_dense_patch_equals_unpatched_and_remove_restores(pipes, name):
    pipe = pipes[name]
    reference = generate(pipe, name)
    with fastdit.patch(pipe, "dense") as p:
        assert p.layers
        patched = generate(pipe, name)
    assert np.abs(patched - reference).max() <= 1e-5
    assert "step" not in pipe.scheduler.__dict__ and "set_timesteps" not in pipe.scheduler.__dict__
    with fastdit.patch(pipe, "sta", dense_steps=0, **STA) as p:
        sparse = generate(pipe, name)
        assert p.stats.sparse_calls > 0
    assert np.isfinite(sparse).all() and not np.array_equal(sparse, reference)
    assert np.array_equal(generate(pipe, name), reference)  # bit for bit after remove()


@pytest.mark.parametrize("name", ["wan", "hunyuan_video"])
def test_sta_in_pipeline_matches_rule_and_masked_dense(pipes, name, monkeypatch):
    pipe = pipes[name]
    capture = LayerCapture(monkeypatch)
    with fastdit.patch(pipe, "sta", dense_steps=0, record_masks=True, **STA) as p:
        generate(pipe, name, num_inference_steps=1)
        # Layers run in order, so layer 0's latest call is len(layers) calls from the end.
        q, k, v, scale, out = capture.calls[-len(p.layers)]
        mask = p.mask(0)
        grid = (3, 5, 7)
        layout = TokenLayout(grid, mask.shape[0] - 105, "suffix" if name == "hunyuan_video" else "none")
        if name == "wan":
            assert torch.equal(mask, sta_token_mask(layout, STA["tile"], STA["window"]))
        else:  # text keys past the prompt are padding
            video_rows = mask[: layout.video_len, : layout.video_len]
            assert torch.equal(video_rows, sta_token_mask(TokenLayout(grid), STA["tile"], STA["window"]))
        assert_matches_masked_dense(q[:1], k[:1], v[:1], out[:1], [p.mask(0, h) for h in range(q.shape[1])], scale)


def test_cfg_batch_two_counts_steps_once(pipes):
    pipe = pipes["wan"]
    with fastdit.patch(pipe, "dense") as p:
        layers = len(p.layers)
    with fastdit.patch(pipe, "sta", dense_steps=1, **STA) as p:
        generate(pipe, "wan", prompt=["a fox", "a cat"], num_inference_steps=3, guidance_scale=5.0)
        calls_per_step = 2 * layers  # conditional and unconditional passes, batch 2 each
        assert p.stats.dense_calls == calls_per_step
        assert p.stats.sparse_calls == 2 * calls_per_step
        assert p.call_state.num_steps == 3


@pytest.mark.parametrize("dense_steps, dense_count", [(0, 0), (2, 2), (0.5, 2), (0.25, 1), (0.3, 2)])
def test_dense_steps_count_and_fraction(pipes, dense_steps, dense_count):
    pipe = pipes["hunyuan_video"]  # one transformer call per step (embedded guidance)
    with fastdit.patch(pipe, "sta", dense_steps=dense_steps, **STA) as p:
        generate(pipe, "hunyuan_video", num_inference_steps=4)
        layers = len(p.layers)
        assert p.stats.dense_calls == dense_count * layers
        assert p.stats.sparse_calls == (4 - dense_count) * layers
        p.reset_stats()
        generate(pipe, "hunyuan_video", num_inference_steps=4)  # counted from 0 again in a new call
        assert p.stats.dense_calls == dense_count * layers


def test_dense_layers_in_pipeline(pipes):
    pipe = pipes["wan"]
    with fastdit.patch(pipe, "sta", dense_steps=0, dense_layers=1, **STA) as p:
        generate(pipe, "wan", num_inference_steps=1, guidance_scale=1.0)
        assert p.stats.dense_calls == 1 and p.stats.sparse_calls == len(p.layers) - 1


def test_resolution_and_frame_change_between_calls(pipes):
    pipe = pipes["wan"]
    with fastdit.patch(pipe, "sta", dense_steps=0, record_masks=True, **STA) as p:
        generate(pipe, "wan", num_inference_steps=1)
        assert p.mask(0).shape == (105, 105)
        generate(pipe, "wan", num_inference_steps=1, num_frames=5, height=96, width=64)  # grid 2x6x4
        assert p.mask(0).shape == (48, 48)
        assert torch.equal(p.mask(0), sta_token_mask(TokenLayout((2, 6, 4)), STA["tile"], STA["window"]))
        assert p.stats.plans_built == 2


def test_wan22_two_transformers_share_one_step_counter(pipes):
    pipe = tiny("wan")
    pipe.transformer_2 = tiny("wan", seed=1).transformer
    pipe.register_to_config(boundary_ratio=0.5)
    with fastdit.patch(pipe, "sta", dense_steps=1, **STA) as p:
        assert any(name.startswith("transformer_2.") for name in p.layers)
        generate(pipe, "wan", num_inference_steps=4, guidance_scale=1.0)
        per_transformer = len(p.layers) // 2
        assert p.stats.dense_calls == per_transformer  # step 0 only, whichever expert ran it
        assert p.stats.sparse_calls == 3 * per_transformer
    assert not hasattr(pipe.transformer_2, "_fastdit_patch")
