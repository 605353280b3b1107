"""scripts/shapes_direction.py: the travel read from a video, the hit rule, the effects, and a run end to end."""
import json

import numpy as np
import pytest

from fastdit.pipelines import shapes_data
from helpers import load_script


@pytest.fixture(scope="module")
def direction():
    return load_script("shapes_direction")


@pytest.mark.parametrize("texture", ["plain", "stripes"])
@pytest.mark.parametrize("heading,start", [("left", (90.0, 60.0)), ("right", (35.0, 70.0)),
                                           ("up", (64.0, 95.0)), ("down", (50.0, 30.0))])
def test_travel_of_a_rendered_shape_is_its_speed_times_the_frames(direction, heading, start, texture):
    """A yellow circle at 2.5 px a frame over 17 frames travels 40 px along its heading (image y grows
    downwards), read from the rendered pixels alone; an unsaturated background must not pull it."""
    circle = shapes_data.ShapeSpec("yellow", "circle", heading, x=start[0], y=start[1], size=9.0, speed=2.5)
    video = shapes_data.render(shapes_data.VideoSpec((circle,), (120, 128, 110), texture, 3, frames=17,
                                                     height=128, width=128))
    dx, dy = direction.travel(video)
    ux, uy = shapes_data.DIRECTIONS[heading]
    assert abs(dx - 40.0 * ux) < 1.5 and abs(dy - 40.0 * uy) < 1.5, (dx, dy)
    assert direction.hit(heading, dx, dy)
    assert not any(direction.hit(other, dx, dy) for other in direction.DIRECTIONS if other != heading)


def test_summary_separates_what_the_caption_moves_from_what_the_noise_moves(direction):
    follows = {"left": [(-40, 0), (-40, 0)], "right": [(40, 0), (40, 0)], "up": [(0, -40), (0, -40)],
               "down": [(0, 40), (0, 40)]}
    summary = direction.summarise(follows)
    assert summary["hit_rate"] == 1.0 and summary["caption_effect_px"] == pytest.approx(40.0)
    assert summary["noise_effect_px"] == pytest.approx(0.0)
    assert summary["mean_travel"]["up"] == [0.0, -40.0]
    deaf = {d: [(-30, 0), (30, 0), (0, 50)] for d in direction.DIRECTIONS}  # the noise alone decides
    summary = direction.summarise(deaf)
    assert summary["caption_effect_px"] == pytest.approx(0.0) and summary["noise_effect_px"] > 25
    assert summary["hit_rate"] == pytest.approx(3 / 12)  # each noise's path matches one of four captions


def test_runs_on_a_trained_pipeline_and_writes_its_report(direction, tmp_path):
    from fastdit.pipelines.train_tiny import main

    model = tmp_path / "model"
    assert main(["--preset", "test", "--work", str(tmp_path / "work"), "--out", str(model), "--no-progress"]) == 0
    out = tmp_path / "direction.json"
    report = direction.main(["--model", str(model), "--seeds", "2", "--sigmas", "1.0,0.9", "--size", "32",
                             "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert set(report["sigmas"]) == {"1.0", "0.9"}
    for summary in report["sigmas"].values():
        assert set(summary["mean_travel"]) == set(direction.DIRECTIONS)
        assert 0.0 <= summary["hit_rate"] <= 1.0
        assert np.isfinite([summary["caption_effect_px"], summary["noise_effect_px"]]).all()
    with pytest.raises(SystemExit):
        direction.main(["--seeds", "0"])


def test_sampled_reads_the_whole_sampler_with_either_negative_prompt(direction, test_model, monkeypatch):
    """--sampled: each travel is the one read off the pipeline's own video for that caption and seed (called here
    directly), and --negative opposite hands the pipeline the caption with its direction reversed."""
    import torch

    from fastdit.pipelines.loading import TRAINED_DEFAULTS, load_pipeline

    model = test_model
    report = direction.main(["--model", str(model), "--sampled", "--seeds", "1", "--size", "32"])
    assert report["negative"] == "empty" and "sigmas" not in report
    call = TRAINED_DEFAULTS["tiny-shapes"]
    pipe = load_pipeline(str(model), "cpu")
    video = pipe(prompt="a yellow circle moving up", num_frames=call["num_frames"], height=32, width=32,
                 num_inference_steps=call["num_inference_steps"], guidance_scale=call["guidance_scale"],
                 max_sequence_length=call["max_sequence_length"], output_type="np",
                 generator=torch.Generator().manual_seed(0)).frames[0]
    expected = direction.travel((np.asarray(video) * 255).round().astype(np.uint8))
    assert report["sampled"]["mean_travel"]["up"] == pytest.approx(list(expected), abs=0.01)

    negatives = []
    original = type(pipe).__call__

    def spy(self, *args, **kwargs):
        negatives.append((kwargs["prompt"], kwargs["negative_prompt"]))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(type(pipe), "__call__", spy)  # test-only spy on the pipeline class
    direction.main(["--model", str(model), "--sampled", "--seeds", "1", "--size", "32", "--negative", "opposite"])
    assert dict(negatives) == {"a yellow circle moving left": "a yellow circle moving right",
                               "a yellow circle moving right": "a yellow circle moving left",
                               "a yellow circle moving up": "a yellow circle moving down",
                               "a yellow circle moving down": "a yellow circle moving up"}


class _Recorder:
    """Stands in for a pipeline's transformer: records each call's input and timestep, returns ``respond(x)``."""

    def __init__(self, config, respond):
        self.config, self.respond, self.calls = config, respond, []

    def eval(self):
        return self

    def __call__(self, x, timestep, embeds, return_dict=False):
        self.calls.append((x.clone(), timestep.clone()))
        return (self.respond(x),)


@pytest.fixture(scope="module")
def test_model(tmp_path_factory):
    from fastdit.pipelines.train_tiny import main

    root = tmp_path_factory.mktemp("direction_model")
    assert main(["--preset", "test", "--work", str(root / "work"), "--out", str(root / "model"), "--no-progress"]) == 0
    return str(root / "model")


def test_anchored_keeps_the_first_frame_clear_and_tells_the_transformer_so(direction, test_model):
    """Every call sees latent frame 0 equal to the encoded first frame at timestep 0 and every other frame's tokens at
    the schedule's level x 1000 (one level per step, falling from 1000); the travels come out finite."""
    import torch

    from fastdit.pipelines.loading import TRAINED_DEFAULTS, load_pipeline

    pipe = load_pipeline(test_model, "cpu")
    call = dict(TRAINED_DEFAULTS["tiny-shapes"], num_inference_steps=3)
    recorder = _Recorder(pipe.transformer.config, lambda x: 0.1 * x)
    pipe.transformer = recorder
    summary = direction.anchored(pipe, call, 32, 1)
    assert np.isfinite(np.array(list(summary["mean_travel"].values()))).all()
    assert len(recorder.calls) == 4 * 3 * 2  # directions x steps x (caption, empty caption)
    cells = 32 // pipe.vae_scale_factor_spatial
    first = recorder.calls[0][0][:, :, :1]
    shift = pipe.scheduler.config.flow_shift
    for i, (x, timestep) in enumerate(recorder.calls[:6]):
        torch.testing.assert_close(x[:, :, :1], first)  # the same anchor at every step (same seed and direction)
        per_token = timestep.view(1, x.shape[2], cells * cells)
        assert (per_token[:, 0] == 0).all()
        u = 1 - (i // 2) / 3
        assert torch.allclose(per_token[:, 1:], torch.tensor(1000 * shift * u / (1 + (shift - 1) * u)))
    assert not torch.equal(recorder.calls[0][0][:, :, 1:], recorder.calls[2][0][:, :, 1:])  # the rest moves


def test_equivariance_reads_zero_for_a_shift_equivariant_model_and_not_for_a_position_dependent_one(
        direction, test_model):
    import torch

    from fastdit.pipelines.loading import TRAINED_DEFAULTS, load_pipeline

    pipe = load_pipeline(test_model, "cpu")
    call = TRAINED_DEFAULTS["tiny-shapes"]
    pipe.transformer = _Recorder(pipe.transformer.config, lambda x: 2.0 * x)  # commutes with any roll
    report = direction.equivariance(pipe, call, 32)
    for r in report.values():
        assert r["width_roll"] < 1e-6 and r["time_roll"] < 1e-6
        assert r["another_noise"] == pytest.approx(2 ** 0.5, rel=0.2)  # two independent noises
    ramp = lambda x: x + torch.arange(x.shape[-1], dtype=x.dtype)  # noqa: E731  (knows its absolute column)
    pipe.transformer = _Recorder(pipe.transformer.config, ramp)
    report = direction.equivariance(pipe, call, 32)
    assert all(r["width_roll"] > 0.3 and r["time_roll"] < 1e-6 for r in report.values())
