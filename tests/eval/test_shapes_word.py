"""scripts/shapes_word.py: word / seed effects, areas per word, the data's areas, and a run end to end."""
import json

import numpy as np
import pytest

from helpers import load_script


@pytest.fixture(scope="module")
def word():
    return load_script("shapes_word")


def test_a_deaf_model_has_no_word_effect_and_a_hearing_one_has(word):
    rng = np.random.default_rng(0)
    seeds = rng.integers(0, 256, size=(1, 4, 2, 8, 8, 3))
    deaf = np.repeat(seeds, 3, axis=0)  # every shape word: the same picture per colour and seed
    classes = [[["circle", "circle"]] * 4] * 3
    report = word.summarise(deaf, np.full((3, 4, 2), 100.0), classes)
    pairs = [np.abs(seeds[0, :, 0].astype(float) - seeds[0, :, 1]).mean()]
    assert report["word_effect"] == 0.0 and report["seed_effect"] == pytest.approx(pairs[0])
    assert report["area_ratio"] == [1.0, 1.0, 1.0] and report["classes"][1] == {"circle": 8}
    hearing = deaf.copy()
    hearing[1] = 255 - hearing[1]  # the second word changes every pixel p into 255 - p
    areas = np.stack([np.full((4, 2), a) for a in (100.0, 125.0, 0.0)])
    report = word.summarise(hearing, areas, [[["circle", None]] * 4] * 3)
    expected = np.mean([np.abs(deaf[0] - (255 - deaf[0])).mean()] * 2 + [0.0])  # pairs (0, 1), (0, 2), (1, 2)
    assert report["word_effect"] == pytest.approx(expected)
    assert report["area"] == [100.0, 125.0, 0.0] and report["area_ratio"] == [1.0, 1.25, 0.0]
    assert report["classes"][0] == {"circle": 4, "none": 4}


def test_rendered_squares_cover_more_than_circles_and_triangles_less(word):
    circle, square, triangle = word.data_areas(samples=60, size=64)
    r = square / circle, triangle / circle
    assert 1.1 < r[0] < 1.4 and 0.4 < r[1] < 0.85, r  # 4 r^2 / (pi r^2) = 1.27; the triangle about 0.6


def test_runs_on_a_trained_pipeline_and_writes_its_report(word, tmp_path):
    from fastdit.pipelines.train_tiny import main

    model = tmp_path / "model"
    assert main(["--preset", "test", "--work", str(tmp_path / "work"), "--out", str(model), "--no-progress"]) == 0
    out, png = tmp_path / "word.json", tmp_path / "word.png"
    report = word.main(["--model", str(model), "--seeds", "2", "--size", "32", "--out", str(out), "--png", str(png)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert report["words"] == ["circle", "square", "triangle"] and len(report["area"]) == 3
    assert report["seed_effect"] > 0 and np.isfinite(report["word_effect"])
    from PIL import Image

    assert Image.open(png).size == (32 * 4 * 2, 32 * 3)
