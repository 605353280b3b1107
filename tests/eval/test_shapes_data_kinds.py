"""shapes_data's simpler kinds of video (``sample_video(data=...)``, ``train_tiny --set data=...``)."""
import numpy as np
import pytest
import torch

from fastdit.pipelines import shapes_data


def test_simpler_data_kinds_keep_the_grammar_and_full_draws_what_it_always_drew(tmp_path):
    """``full`` is the plain ``sample_spec`` of ``default_rng([seed, index])``; ``single`` one shape of that stream
    with one shape at most; ``simplest`` one yellow circle on a plain background, read back from its pixels (a
    saturated yellow blob on an unsaturated ground), with every direction drawn."""
    import cv2

    for index in range(4):
        video, text, spec = shapes_data.sample_video(5, index)
        assert spec == shapes_data.sample_spec(np.random.default_rng([5, index]))
        assert np.array_equal(video, shapes_data.render(spec))
    counts, directions = set(), set()
    for index in range(40):
        _, text, spec = shapes_data.sample_video(5, index, data="single")
        assert spec == shapes_data.sample_spec(np.random.default_rng([5, index]), max_shapes=1)
        counts.add(len(shapes_data.parse_caption(text)))
        video, text, spec = shapes_data.sample_video(5, index, data="simplest", height=32, width=32)
        [(color, shape, direction)] = shapes_data.parse_caption(text)
        assert (color, shape, spec.texture) == ("yellow", "circle", "plain") and video.shape == (17, 32, 32, 3)
        directions.add(direction)
        hsv = cv2.cvtColor(np.ascontiguousarray(video[0]), cv2.COLOR_RGB2HSV)
        saturated = hsv[..., 1] > 120
        assert 20 <= int(np.median(hsv[..., 0][saturated])) <= 40  # OpenCV hue of yellow, not red / green / blue
        _, counts_of_colour = np.unique(video[0].reshape(-1, 3), axis=0, return_counts=True)
        assert saturated.mean() < 0.25 and counts_of_colour.max() >= 0.75 * 32 * 32  # one flat ground colour
    assert counts == {1} and directions == set(shapes_data.DIRECTIONS)
    with pytest.raises(ValueError, match="simplest"):
        shapes_data.sample_video(5, 0, data="easy")
    from fastdit.pipelines.train_tiny import TrainConfig, main

    with pytest.raises(ValueError, match="full, single, simplest"):
        TrainConfig(data="easy")
    assert main(["--preset", "test", "--work", str(tmp_path / "w"), "--out", str(tmp_path / "out"), "--no-progress",
                 "--set", "data=simplest", "--set", "steps=1"]) == 0
    captions = torch.load(tmp_path / "w" / "latents.pt", weights_only=False)["captions"]
    assert captions and all(c.startswith("a yellow circle moving ") for c in captions)
