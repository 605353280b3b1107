"""The trained tiny-shapes model (issue 24): its data, the adherence metric, the training script,
loading the shipped weights (one-step generation) and the messages for missing or corrupt files."""
import json
import os
import shutil

import numpy as np
import pytest
import torch

from fastdit.eval.metrics.adherence import CHANCE_LEVEL, adherence, chance_level
from fastdit.pipelines import shapes_data
from fastdit.pipelines.loading import (
    TRAINED_DEFAULTS,
    WEIGHTS_DIR,
    ModelNotFoundError,
    check_trained_weights,
    load_pipeline,
)
from helpers import record_train_timesteps

SHAPES_DIR = os.path.join(WEIGHTS_DIR, "tiny-shapes")


# -- data --------------------------------------------------------------------------------------

def test_videos_are_deterministic_and_captions_parse():
    a, caption_a, spec_a = shapes_data.sample_video(3, 17)
    b, caption_b, _ = shapes_data.sample_video(3, 17)
    c, _, _ = shapes_data.sample_video(3, 18)
    assert np.array_equal(a, b) and caption_a == caption_b and not np.array_equal(a, c)
    assert a.shape == (17, 64, 64, 3) and a.dtype == np.uint8
    parsed = shapes_data.parse_caption(caption_a)
    assert parsed == [(s.color, s.shape, s.direction) for s in spec_a.shapes]
    assert shapes_data.parse_caption("a red circle moving left and a blue square moving down") == [
        ("red", "circle", "left"), ("blue", "square", "down")]


@pytest.mark.parametrize("caption, word", [("a purple circle moving left", "purple"),
                                           ("a red hexagon moving left", "hexagon"),
                                           ("a red circle moving sideways", "sideways"),
                                           ("red circle left", "red circle left")])
def test_bad_captions_name_the_word(caption, word):
    with pytest.raises(ValueError, match=word):
        shapes_data.parse_caption(caption)


def test_shapes_stay_inside_the_frame():
    for i in range(50):
        spec = shapes_data.sample_spec(np.random.default_rng([9, i]))
        for s in spec.shapes:
            dx, dy = shapes_data.DIRECTIONS[s.direction]
            for t in (0, spec.frames - 1):
                x, y = s.x + dx * s.speed * t, s.y + dy * s.speed * t
                assert s.size <= x <= spec.width - s.size and s.size <= y <= spec.height - s.size


# -- adherence metric --------------------------------------------------------------------------

def test_ground_truth_scores_near_one_noise_near_zero_and_shuffled_captions_at_chance():
    gt = [adherence(*shapes_data.sample_video(101, i)[:2]).score for i in range(40)]
    assert np.mean(gt) > 0.95 and min(gt) > 0.75
    rng = np.random.default_rng(5)
    noise = [adherence(rng.integers(0, 256, (17, 64, 64, 3), dtype=np.uint8), shapes_data.sample_video(6, i)[1]).score
             for i in range(10)]
    assert np.mean(noise) < 0.05  # nothing large enough is found in noise: at or below chance
    chance = chance_level(samples=60, seed=77)
    assert abs(chance - CHANCE_LEVEL) < 0.07 and 0.1 < chance < 0.4


def test_each_attribute_is_scored():
    video, caption, spec = shapes_data.sample_video(0, 2, max_shapes=1)
    s = spec.shapes[0]
    good = adherence(video, caption)
    assert good.colour == 1.0 and good.shape == 1.0 and good.motion == 1.0
    other_colour = next(c for c in shapes_data.COLORS if c != s.color)
    other_shape = next(c for c in shapes_data.SHAPES if c != s.shape)
    opposite = {"left": "right", "right": "left", "up": "down", "down": "up"}[s.direction]
    assert adherence(video, f"a {other_colour} {s.shape} moving {s.direction}").colour == 0.0
    assert adherence(video, f"a {s.color} {other_shape} moving {s.direction}").shape < 0.2
    # what was drawn is read from the frames, not the caption: the same classes under either shape word
    drawn = good.objects[0][6]
    assert adherence(video, f"a {s.color} {other_shape} moving {s.direction}").objects[0][6] == drawn
    assert max(drawn, key=drawn.get) == s.shape and sum(drawn.values()) == len(video)
    assert adherence(video, f"a {s.color} {s.shape} moving {opposite}").motion == 0.0
    still = np.repeat(video[:1], len(video), axis=0)  # the right shape, not moving
    assert adherence(still, caption).motion == 0.0
    assert adherence(video[::-1], caption).motion == 0.0  # played backwards: the opposite direction


def test_adherence_rejects_bad_input():
    video, caption, _ = shapes_data.sample_video(0, 0)
    with pytest.raises(ValueError, match="grammar|does not follow"):
        adherence(video, "a fox in the snow")
    with pytest.raises(ValueError, match=r"\[F, H, W, 3\]"):
        adherence(video[..., 0], caption)
    assert abs(adherence(video.astype(np.float32) / 255, caption).score - adherence(video, caption).score) < 1e-9


# -- training script ---------------------------------------------------------------------------

def test_training_script_runs_resumes_and_writes_a_loadable_pipeline(tmp_path):
    from diffusers import DiffusionPipeline

    from fastdit.pipelines.train_tiny import main

    work, out = tmp_path / "work", tmp_path / "out"
    argv = ["--preset", "test", "--work", str(work), "--out", str(out), "--no-progress"]
    assert main(argv) == 0
    first = torch.load(work / "dit.pt", weights_only=False)
    assert first["step"] == 3 and len(first["losses"]) == 3 and all(np.isfinite(first["losses"]))
    assert main(argv + ["--set", "steps=4"]) == 0  # resumes at step 3, runs one more
    resumed = torch.load(work / "dit.pt", weights_only=False)
    assert resumed["step"] == 4 and resumed["losses"][:3] == first["losses"]
    with pytest.raises(ValueError, match="layers"):  # a different model cannot resume this run
        main(argv + ["--set", "layers=2"])
    for name in ("README.md", "loss_curve.png", "model_index.json", "transformer/diffusion_pytorch_model.safetensors"):
        assert (out / name).is_file(), name
    card = (out / "README.md").read_text()
    assert "4 of 4 planned steps" in card and "video tokens" in card
    check_trained_weights("tiny-shapes", str(out))  # complete and readable
    pipe = DiffusionPipeline.from_pretrained(str(out), local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    frames = pipe(prompt="a red circle moving left", num_frames=5, height=32, width=32, num_inference_steps=1,
                  max_sequence_length=40, output_type="np").frames[0]
    assert frames.shape == (5, 32, 32, 3) and np.isfinite(frames).all()


def test_object_mask_marks_the_latent_cells_a_moving_square_covers():
    # a square of half side 8 moving right 4 px per frame: its edges sit mid-cell (x = 22 + 4f .. 38 + 4f,
    # y = 54 .. 70) for every frame, so the covered 4 x 4 cells are known exactly; a striped background
    # (grey, unsaturated) must not count
    square = shapes_data.ShapeSpec("yellow", "square", "right", x=30.0, y=62.0, size=8.0, speed=4.0)
    spec = shapes_data.VideoSpec((square,), (120, 128, 110), "stripes", 5, frames=17, height=128, width=128)
    mask = shapes_data.latent_object_mask(shapes_data.render(spec), (9, 32, 32))
    expected = torch.zeros(9, 32, 32, dtype=torch.bool)
    for t in range(9):
        frames = [0] if t == 0 else [2 * t - 1, 2 * t]  # latent frame t: video frames of the causal 2x time factor
        x_lo, x_hi = (22 + 4 * min(frames)) // 4, (38 + 4 * max(frames)) // 4
        expected[t, 13 - 1:17 + 2, x_lo - 1:x_hi + 2] = True  # grown by one cell
    assert mask.dtype == torch.bool and torch.equal(mask, expected)


def test_foreground_weight_changes_the_loss_and_an_older_latents_file_gets_its_masks(tmp_path):
    from fastdit.pipelines.train_tiny import main

    argv = ["--preset", "test", "--out", str(tmp_path / "out"), "--no-progress", "--set", "steps=1"]
    assert main(argv + ["--work", str(tmp_path / "plain")]) == 0
    saved = torch.load(tmp_path / "plain" / "latents.pt", weights_only=False)
    expected = torch.stack([shapes_data.latent_object_mask(shapes_data.sample_video(0, i, frames=5, height=32,
                                                                                     width=32)[0], (3, 8, 8))
                            for i in range(3)])
    assert torch.equal(saved["masks"], expected) and expected.any() and not expected.all()
    os.makedirs(tmp_path / "weighted")
    del saved["masks"]  # a latents file written before the masks existed
    torch.save(saved, tmp_path / "weighted" / "latents.pt")
    assert main(argv + ["--work", str(tmp_path / "weighted"), "--set", "fg_weight=4"]) == 0
    assert torch.equal(torch.load(tmp_path / "weighted" / "latents.pt", weights_only=False)["masks"], expected)
    plain = torch.load(tmp_path / "plain" / "dit.pt", weights_only=False)["losses"][0]
    weighted = torch.load(tmp_path / "weighted" / "dit.pt", weights_only=False)["losses"][0]
    assert np.isfinite(weighted) and abs(weighted - plain) > 1e-4 * plain  # same weights, data and noise


def test_high_noise_share_draws_the_asked_noise_levels(tmp_path, monkeypatch):
    """``high_noise_prob=1`` trains every sample at s in [high_noise_min, 1]; the default keeps the shifted
    uniform (lower levels too); out-of-range values are refused by the config and the parser."""
    from fastdit.pipelines import train_tiny

    seen = record_train_timesteps(monkeypatch)
    argv = ["--preset", "test", "--out", str(tmp_path / "out"), "--no-progress", "--set", "steps=3",
            "--set", "batch=4"]
    assert train_tiny.main(argv + ["--work", str(tmp_path / "high"), "--set", "high_noise_prob=1",
                                   "--set", "high_noise_min=0.95"]) == 0
    high = torch.cat(seen) / 1000.0
    assert high.numel() == 12 and bool(((high >= 0.95) & (high <= 1.0)).all()) and high.unique().numel() == 12
    seen.clear()
    assert train_tiny.main(argv + ["--work", str(tmp_path / "plain")]) == 0
    plain = torch.cat(seen) / 1000.0
    assert plain.numel() == 12 and bool((plain < 0.9).any())  # 12 shifted uniform draws: P(all >= 0.9) = 0.25 ** 12
    for bad in ({"high_noise_prob": 1.5}, {"high_noise_prob": -0.1}, {"high_noise_min": 1.0}):
        with pytest.raises(ValueError, match="high_noise"):
            train_tiny.TrainConfig(**bad)
    with pytest.raises(SystemExit):
        train_tiny.main(["--preset", "test", "--work", str(tmp_path / "w3"), "--set", "high_noise_min=2"])
    assert not (tmp_path / "w3").exists()


def test_warm_start_at_a_larger_frame_continues_from_a_saved_pipeline(tmp_path):
    """The ``large`` preset's code path: weights of a saved pipeline start a run at another frame
    size (the VAE kept: vae_steps=0); a folder of another model size or a missing file is refused."""
    from safetensors.torch import load_file

    from fastdit.pipelines.train_tiny import PRESETS, TrainConfig, build_pipeline, load_weights, main

    small = tmp_path / "small"
    assert main(["--preset", "test", "--work", str(tmp_path / "w1"), "--out", str(small), "--no-progress"]) == 0
    big = tmp_path / "big"
    argv = ["--preset", "test", "--work", str(tmp_path / "w2"), "--out", str(big), "--no-progress",
            "--set", "height=48", "--set", "width=48", "--set", "vae_steps=0", "--set", f"init_from={small}",
            "--set", "steps=1"]
    assert main(argv) == 0
    saved_vae = load_file(str(small / "vae/diffusion_pytorch_model.safetensors"))
    new_vae = load_file(str(big / "vae/diffusion_pytorch_model.safetensors"))
    assert all(torch.equal(saved_vae[k], new_vae[k]) for k in saved_vae)  # the VAE is kept as it was
    start = torch.load(tmp_path / "w2" / "dit.pt", weights_only=False)
    assert start["step"] == 1 and np.isfinite(start["losses"]).all()
    # the transformer started from the saved one: one step away from it, not from a fresh init
    saved = load_file(str(small / "transformer/diffusion_pytorch_model.safetensors"))
    fresh = build_pipeline(TrainConfig(**PRESETS["test"]))
    key = next(k for k in saved if k.endswith("proj_out.weight"))
    moved = (start["transformer"][key] - saved[key]).abs().max()
    assert moved < (fresh.transformer.state_dict()[key] - saved[key]).abs().max()
    with pytest.raises(FileNotFoundError, match="vae/diffusion_pytorch_model.safetensors"):
        load_weights(build_pipeline(TrainConfig()), str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="other shapes"):
        load_weights(build_pipeline(TrainConfig()), str(small))  # the test preset is a smaller model


def test_caption_vocabulary_spells_shape_words_whole_and_grows_a_saved_text_encoder(tmp_path):
    """``caption_vocab``: every caption word is one token, the plain vocabulary's ids are unchanged
    (appended after it), and a text encoder saved without the words keeps its rows for the old ids
    (a warm start grows new rows only); ``--set caption_vocab=false`` means false."""
    from safetensors.torch import load_file

    from fastdit.pipelines.shapes_data import SHAPES
    from fastdit.pipelines.tiny_tokenizers import tiny_tokenizer
    from fastdit.pipelines.train_tiny import CAPTION_WORDS, PRESETS, TrainConfig, build_pipeline, load_weights, main

    plain, grown = tiny_tokenizer("t5"), tiny_tokenizer("t5", extra_words=CAPTION_WORDS)
    text = "a red circle moving left and a green triangle moving up and a blue square moving down"
    assert len(plain.tokenize(text)) > len(text.split())  # the plain vocabulary spells shapes letter by letter
    assert grown.tokenize(text) == text.split() and len(grown) == len(plain) + len(SHAPES)
    assert all(grown.convert_tokens_to_ids(t) == i for t, i in plain.get_vocab().items())
    small = tmp_path / "plain"
    assert main(["--preset", "test", "--work", str(tmp_path / "w1"), "--out", str(small), "--no-progress",
                 "--set", "caption_vocab=false"]) == 0
    cfg = TrainConfig(**{**PRESETS["test"], "caption_vocab": True})
    pipe = build_pipeline(cfg)
    fresh_rows = pipe.text_encoder.shared.weight[len(plain):].detach().clone()
    load_weights(pipe, str(small))
    saved = load_file(str(small / "text_encoder/model.safetensors"))
    old = next(v for k, v in saved.items() if k.endswith(("shared.weight", "embed_tokens.weight")))
    assert old.shape[0] == len(plain) and pipe.text_encoder.shared.weight.shape[0] == len(grown)
    assert torch.equal(pipe.text_encoder.shared.weight[:len(plain)], old)
    assert torch.equal(pipe.text_encoder.shared.weight[len(plain):], fresh_rows)
    for bad in ("caption_vocab=maybe", "steps=many", "fg_weight=-2"):  # refused by the parser before any work
        with pytest.raises(SystemExit):
            main(["--preset", "test", "--work", str(tmp_path / "w2"), "--set", bad])
    assert not (tmp_path / "w2").exists()
    with pytest.raises(ValueError, match="fg_weight"):  # the config itself refuses it, not only the parser
        TrainConfig(fg_weight=-2.0)


# -- the shipped weights -----------------------------------------------------------------------

def test_shipped_weights_load_offline_and_generate_one_step(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    pipe = load_pipeline("tiny-shapes", device="cpu")
    assert type(pipe).__name__ == "WanPipeline" and pipe.transformer.dtype == torch.float32
    pipe.set_progress_bar_config(disable=True)
    call = {**TRAINED_DEFAULTS["tiny-shapes"], "num_inference_steps": 1}
    frames = pipe(prompt="a red circle moving left", generator=torch.Generator().manual_seed(0), **call,
                  output_type="np").frames[0]
    assert frames.shape == (17, 128, 128, 3) and np.isfinite(frames).all()
    from fastdit.pipelines.loading import latent_grid, trained_grid

    t, h, w = latent_grid(pipe, call)
    assert (t, h, w) == (9, 32, 32) == trained_grid("tiny-shapes")
    assert t * h * w >= 8192  # issue 40's minimum token count at the native size
    total = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(SHAPES_DIR) for f in fs)
    assert total <= 20 * 2**20


@pytest.fixture
def weights_copy(tmp_path, monkeypatch):
    """A copy of the shipped weights that ``load_pipeline("tiny-shapes")`` reads instead."""
    import fastdit.pipelines.loading as loading

    root = tmp_path / "weights"
    shutil.copytree(SHAPES_DIR, root / "tiny-shapes")
    monkeypatch.setattr(loading, "WEIGHTS_DIR", str(root))
    return root / "tiny-shapes"


@pytest.mark.parametrize("rel, damage", [
    ("transformer/diffusion_pytorch_model.safetensors", "delete"),
    ("transformer/diffusion_pytorch_model.safetensors", "truncate"),
    ("vae/diffusion_pytorch_model.safetensors", "garbage"),
    ("text_encoder/model.safetensors", "truncate"),
    ("model_index.json", "delete"),
    ("vae/config.json", "garbage"),
])
def test_missing_or_corrupt_weights_name_the_file_and_the_fix(weights_copy, rel, damage):
    path = weights_copy / rel
    if damage == "delete":
        path.unlink()
    elif damage == "truncate":
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    else:
        path.write_bytes(b"\x07garbage" * 3)
    with pytest.raises(ModelNotFoundError) as info:
        load_pipeline("tiny-shapes", device="cpu")
    message = str(info.value)
    assert str(path) in message and ("missing" in message or "corrupt" in message)
    assert "python -m fastdit.pipelines.train_tiny" in message


def test_compare_without_a_model_runs_tiny_shapes_with_its_presets_and_a_contact_sheet(tmp_path, capsys):
    """``fastdit compare`` with no ``--model`` and no ``--methods`` (here at a small size of the same
    model): tiny-shapes, the demo methods at the presets shipped beside its weights, adherence, and
    a contact sheet whose rows are the runs' frames."""
    from PIL import Image

    from fastdit.cli import main
    from fastdit.cli.compare import DEFAULT_METHODS
    from fastdit.pipelines.loading import trained_presets

    out = tmp_path / "cmp"
    code = main(["compare", "--steps", "1", "--frames", "5", "--height", "64", "--width", "64", "--out", str(out),
                 "--no-warmup"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "adherence" in printed and "chance" in printed and "method presets: calibrated for tiny-shapes" in printed
    report = json.loads((out / "report.json").read_text())
    assert report["model"] == "tiny-shapes"
    assert report["call"]["num_frames"] == 5 and report["call"]["height"] == 64
    methods = DEFAULT_METHODS["tiny-shapes"].split(",")
    assert "auto" in methods and "note: auto left out of the default methods" in printed  # not the native grid
    methods = [m for m in methods if m != "auto"]
    assert [run["method"] for run in report["runs"]] == methods and len(methods) >= 4
    presets = trained_presets("tiny-shapes")
    for run in report["runs"]:
        assert 0.0 <= run["adherence"] <= 1.0
        for option, value in presets.get(run["method"], {}).items():
            if option != "calibration":
                assert run["options"][option] == (list(value) if isinstance(value, tuple) else value), (run, option)
    with Image.open(report["contact_sheet"]) as sheet:
        assert sheet.format == "PNG" and sheet.size[1] >= len(methods) * 64
    assert os.path.getsize(report["contact_sheet"]) <= 300 * 1024
    with pytest.raises(SystemExit):
        main(["compare", "--model", "tiny-shapes", "--prompt", "a fox", "--out", str(out)])
    assert "tiny-shapes takes captions like" in capsys.readouterr().err


def test_shipped_presets_load_and_a_mismatched_file_is_refused(tmp_path):
    """``presets.json`` beside a trained model's weights: methods' options (and plan files) for
    ``fastdit compare`` / ``eval`` / the app; a file for another model or naming a missing plan
    is refused naming it; a random-weight tiny model keeps its own labelled presets."""
    import json

    from fastdit.calibration.calibration_file import CalibrationError
    from fastdit.eval.runner.settings import method_presets, tiny_method_presets
    from fastdit.pipelines.loading import trained_presets

    folder = tmp_path / "model"
    folder.mkdir()
    assert trained_presets("tiny-shapes", str(folder)) == {}  # none shipped: the methods' defaults
    (folder / "plans").mkdir()
    (folder / "plans" / "auto.json").write_text("{}")
    (folder / "presets.json").write_text(json.dumps({"model": "tiny-shapes", "grid": [9, 32, 32],
                                                     "methods": {"sparge": {"cdf": 0.95}},
                                                     "plans": {"auto": "plans/auto.json"}}))
    presets = trained_presets("tiny-shapes", str(folder))
    assert presets["sparge"] == {"cdf": 0.95}
    assert presets["auto"] == {"calibration": str(folder / "plans" / "auto.json")}
    (folder / "presets.json").write_text(json.dumps({"model": "tiny-wan", "methods": {}}))
    with pytest.raises(CalibrationError, match="tiny-wan"):
        trained_presets("tiny-shapes", str(folder))
    (folder / "presets.json").write_text(json.dumps({"model": "tiny-shapes", "plans": {"auto": "plans/none.json"}}))
    with pytest.raises(CalibrationError, match="none.json"):
        trained_presets("tiny-shapes", str(folder))
    (folder / "presets.json").write_text(json.dumps({"model": "tiny-shapes", "grid": [9, 16, 16], "methods": {}}))
    with pytest.raises(CalibrationError, match=r"\[9, 16, 16\].*\[9, 32, 32\]"):
        trained_presets("tiny-shapes", str(folder))
    (folder / "presets.json").write_text("{not json")
    with pytest.raises(CalibrationError, match="not valid JSON"):
        trained_presets("tiny-shapes", str(folder))
    presets, label = method_presets("tiny-wan")
    assert "random-weight" in label and presets["sparge"]["topk"] == 0.125
    assert tiny_method_presets("tiny-wan", ["sparge"], {"sparge": {"topk": 0.5}})["sparge"]["topk"] == 0.5  # user wins


def test_the_app_opens_on_tiny_shapes_and_its_run_shows_the_contact_sheet():
    """The page opens on tiny-shapes with a caption of its grammar; a run there (one step) uses the
    presets shipped beside the weights and returns the contact sheet of that run with its numbers;
    at another size, a calibrated plan that does not carry over gives way to the file's options."""
    from PIL import Image

    from fastdit.app import RunRequest, Runner, build_app
    from fastdit.pipelines.loading import trained_presets
    from fastdit.pipelines.shapes_data import parse_caption

    demo = build_app()
    values = {block.elem_id: block.value for block in demo.blocks.values()
              if getattr(block, "elem_id", None) and hasattr(block, "value")}
    assert values["fd-model"] == "tiny-shapes"
    assert parse_caption(values["fd-prompt"])  # a caption the model was trained on
    runner = Runner()
    method = "sparge"
    out = runner.compare(RunRequest(model="tiny-shapes", prompt=values["fd-prompt"], steps=1, method=method))
    metrics = out.metrics
    assert metrics["size"] == "17x128x128" and metrics["speedup"] > 0 and metrics["psnr_db"] > 0
    preset = trained_presets("tiny-shapes")[method]
    if "calibration" in preset:
        assert metrics["calibration"] is None and any("calibration made for tiny-shapes" in note for note in out.notes)
        assert metrics["options"]["layer_settings"], metrics["options"]  # the patch runs the plan's settings
    else:
        assert all(metrics["options"][k] == v for k, v in preset.items())
    with Image.open(out.contact_sheet) as sheet:
        assert sheet.format == "PNG" and sheet.size[1] == 2 * (128 + 4)
    small = runner.compare(RunRequest(model="tiny-shapes", prompt=values["fd-prompt"], steps=1, frames=5, height=64,
                                      width=64, method=method))
    fallback = trained_presets("tiny-shapes", grid=(3, 16, 16)).get(method, {})
    assert "calibration" not in fallback and not small.metrics["options"].get("layer_settings")
    assert all(small.metrics["options"][k] == v for k, v in fallback.items())


def test_user_options_a_preset_plan_sets_replace_the_plan(capsys):
    """``--set sparge.topk=...`` on tiny-shapes: the shipped sparge calibration sets ``topk`` per layer,
    so the preset file's options run under the user's (with a note) instead of a CalibrationError;
    options the calibration does not set keep it; ``--calibration`` still wins. sta's preset is plain
    options, the user's on top."""
    from fastdit.eval.runner.settings import tiny_method_presets

    chosen = tiny_method_presets("tiny-shapes", ["sta", "sparge", "svg2"], {"sparge": {"topk": 0.3},
                                                                            "svg2": {"guard": False},
                                                                            "sta": {"window": (1, 3, 3)}})
    assert "calibration" not in chosen["sparge"] and chosen["sparge"]["topk"] == 0.3
    assert chosen["sparge"]["tile"] == [3, 8, 8]  # the preset file's options for sparge
    assert "topk given" in capsys.readouterr().out
    assert chosen["svg2"]["calibration"].endswith("svg2.json") and chosen["svg2"]["guard"] is False
    assert chosen["sta"]["window"] == (1, 3, 3) and chosen["sta"]["tile"] == [3, 4, 4]
    assert chosen["sta"]["dense_steps"] == 6
    kept = tiny_method_presets("tiny-shapes", ["sparge"], {"sparge": {"calibration": "mine.json"}})
    assert kept["sparge"]["calibration"] == "mine.json"
    kept = tiny_method_presets("tiny-shapes", ["sparge"], {"sparge": {"plan": "mine.json"}})  # the earlier name
    assert kept["sparge"]["plan"] == "mine.json" and "calibration" not in kept["sparge"]


def test_eval_settings_take_the_shipped_plans():
    """``fastdit eval --model tiny-shapes`` runs its methods at the calibrated plans beside the
    weights: a setting that carries ``plan`` is checked as the patch applies it (the plan's options,
    the user's on top), not refused as an unknown option; an option the plan sets is still refused."""
    from fastdit.eval.runner.config import EvalConfig
    from fastdit.eval.runner.settings import EvalError, build_settings, tiny_method_presets

    options = tiny_method_presets("tiny-shapes", ["svg2", "sparge"], {"svg2": {"guard": 0.1}})
    settings = build_settings(EvalConfig(out="unused", methods=["svg2", "sparge"], options=options))
    by_name = {s.name: s.options for s in settings}
    assert by_name["svg2"]["calibration"].endswith("svg2.json") and by_name["svg2"]["guard"] == 0.1
    assert by_name["sparge"]["calibration"].endswith("sparge.json")
    clash = {"sparge": {"calibration": options["sparge"]["calibration"], "layer_settings": {"0_0": None}}}
    with pytest.raises(EvalError, match="layer_settings"):
        build_settings(EvalConfig(out="unused", methods=["sparge"], options=clash))


def test_shipped_auto_calibration_runs_its_choices_and_other_grids_are_told_why_not(capsys):
    """tiny-shapes ships an ``auto`` calibration (issue 40 item 2): on the native grid the presets hand it to
    the patch, whose per-head choices are the file's (checked head by head against the JSON read here); at
    another size ``fastdit compare --methods dense,auto`` stops before any run, naming both grids."""
    import json

    import fastdit
    from fastdit.cli import main as cli_main
    from fastdit.eval.runner.settings import tiny_method_presets
    from fastdit.pipelines.loading import trained_grid

    native = trained_grid("tiny-shapes")
    chosen = tiny_method_presets("tiny-shapes", ["auto"], {}, native)["auto"]
    path = chosen["calibration"]
    assert path.endswith(os.path.join("calibrations", "auto.json"))
    data = json.load(open(path))
    assert data["method"] == "auto" and data["model"]["grids"] == [list(native)] and data["budget"] == 0.05
    names = {c["method"] for c in data["candidates"]}
    assert len(names) > 1  # a real choice across methods, not one method in disguise
    pipe = load_pipeline("tiny-shapes", "cpu")
    with fastdit.patch(pipe, "auto", **chosen) as p:
        as_json = json.loads(json.dumps({"candidates": p.config.candidates, "choices": p.config.choices}))
        assert as_json["candidates"] == data["candidates"] and as_json["choices"] == data["choices"]
    with pytest.raises(SystemExit):
        cli_main(["compare", "--methods", "dense,auto", "--height", "64", "--width", "64", "--steps", "1",
                  "--no-warmup"])
    err = capsys.readouterr().err
    assert "needs a calibration" in err and "[9, 32, 32]" in err and "[9, 16, 16]" in err
