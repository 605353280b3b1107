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


def _centroid_path(video: np.ndarray) -> np.ndarray:
    """(dx, dy) of the saturated pixels' centroid from the first frame to the last (the shape, not the ground)."""
    import cv2

    def centroid(frame):
        ys, xs = np.nonzero(cv2.cvtColor(np.ascontiguousarray(frame), cv2.COLOR_RGB2HSV)[..., 1] > 120)
        return np.array([xs.mean(), ys.mean()]), len(xs)

    (start, area0), (end, area1) = centroid(video[0]), centroid(video[-1])
    assert abs(area1 - area0) <= 0.1 * area0  # the whole shape stays inside the frame
    return end - start


def test_speed_scale_slows_the_drawn_paths_and_reaches_training():
    """``speed_scale=0.5`` at 128 x 128 halves every path (read from the rendered pixels) and keeps it inside the
    frame; colour, kind, direction and size are the same draws; ``train_tiny`` passes it to the data and refuses
    a factor <= 0."""
    from fastdit.pipelines.train_tiny import TrainConfig, _data_kwargs

    for index in range(6):
        fast, text, spec = shapes_data.sample_video(3, index, data="simplest", height=128, width=128)
        slow, slow_text, slow_spec = shapes_data.sample_video(
            3, index, **_data_kwargs(TrainConfig(height=128, width=128, data="simplest", speed_scale=0.5)))
        assert slow_text == text and slow_spec.shapes[0].size == spec.shapes[0].size
        fast_path, slow_path = _centroid_path(fast), _centroid_path(slow)
        assert np.linalg.norm(fast_path) > 128 * 0.25  # 2.6-4 px a frame at 128 x 128: a quarter of the side or more
        assert np.linalg.norm(slow_path) == pytest.approx(0.5 * np.linalg.norm(fast_path), rel=0.1)
        assert np.dot(slow_path, fast_path) > 0.95 * np.linalg.norm(slow_path) * np.linalg.norm(fast_path)
    for bad in (0.0, -1.0):
        with pytest.raises(ValueError, match="speed_scale"):
            TrainConfig(speed_scale=bad)
        with pytest.raises(ValueError, match="speed_scale"):
            shapes_data.sample_spec(np.random.default_rng(0), speed_scale=bad)
