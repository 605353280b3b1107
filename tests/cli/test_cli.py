"""The command line: ``fastdit compare`` end to end on the tiny model, and its errors."""
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from fastdit.cli import main
from fastdit.cli.common import parse_options, parse_value

from helpers import one_line_error  # the fixture no_model (fails the test if a model loads): conftest.py


def test_compare_writes_report_and_playable_videos(tmp_path, capsys):
    out = tmp_path / "cmp"
    code = main(["compare", "--model", "tiny-wan", "--frames", "9", "--height", "80", "--width", "112", "--steps", "2",
                 "--methods", "dense,sta", "--set", "sta.tile=1,2,2", "--set", "sta.window=1,3,3",
                 "--set", "sta.dense_steps=0", "--out", str(out), "--no-warmup"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "speedup" in printed and "PSNR" in printed and "padding" in printed
    report = json.loads((out / "report.json").read_text())
    assert report["model"] == "tiny-wan" and report["device"] == "cpu"
    dense, sta = report["runs"]
    assert dense["method"] == "dense" and dense["speedup"] == 1.0
    assert dense["psnr_db"] is None and dense["ssim"] is None
    assert sta["method"] == "sta" and sta["options"]["tile"] == [1, 2, 2]
    assert sta["latency_s"] > 0 and sta["speedup"] > 0 and 0 < sta["ssim"] <= 1 and sta["psnr_db"] > 0
    assert 0 < sta["density"] < 1 and sta["padding_fraction"] >= 0
    for run in report["runs"]:
        load = run["load"]  # the machine's load around the timed call (fastdit.cpu_load)
        assert load["cpu_count"] >= 1 and load["own_cores"] >= 0 and load["wall_s"] > 0
        assert load["before"] is None or (set(load["before"]) == {"1m", "5m", "15m"} and isinstance(load["shared"], bool))
        data = open(run["video"], "rb").read()
        assert b"avc1" in data[:4096] or b"avc1" in data  # H.264 in an mp4 container


def test_compare_rounds_sizes_with_a_note(tmp_path, capsys):
    main(["compare", "--model", "tiny-wan", "--frames", "10", "--height", "90", "--width", "100", "--steps", "1", "--methods", "dense",
          "--out", str(tmp_path), "--no-warmup"])
    printed = capsys.readouterr().out
    assert "height 90 -> 96" in printed and "frames 10 -> 9" in printed


def test_missing_model_is_a_message_not_a_traceback(tmp_path):
    result = subprocess.run([sys.executable, "-m", "fastdit.cli", "compare", "--model", str(tmp_path / "nope"),
                             "--out", str(tmp_path / "o")], capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "no such folder" in result.stderr and "Traceback" not in result.stderr


BAD_SHARED = [  # (arguments, option named, words of the message): compare and eval both
    (["--set", "sta.tile=0,0,0"], "--set sta.tile=0,0,0", "three positive ints"),
    (["--set", "sta.windw=3,3,3"], "--set sta.windw=3,3,3", "valid options"),
    (["--set", "sta.window=2,2,2"], "--set sta.window=2,2,2", "odd and positive"),
    (["--set", "sta.tile"], "--set", "METHOD.OPTION=VALUE"),
    (["--steps", "0"], "--steps", "integer >= 1"),
    (["--steps", "-1"], "--steps", "integer >= 1"),
    (["--frames", "0"], "--frames", "integer >= 1"),
    (["--frames", "-9"], "--frames", "integer >= 1"),
    (["--height", "0"], "--height", "integer >= 1"),
    (["--width", "-16"], "--width", "integer >= 1"),
    (["--height", "1000000"], "--height", "at most 1048576 fit"),
    (["--frames", "100000"], "--frames", "at most 1048576 fit"),
    (["--model", "tiny-wan", "--width", "1000000", "--frames", "5"], "--width", "--width <= 262144 here"),
    (["--model", "tiny-wan", "--width", "100000", "--frames", "4001"], "--frames", "--frames <= 17 here"),
    (["--model", "tiny-shapes", "--width", "1000000", "--frames", "5"], "--width", "--width <= 43688 here"),
    (["--fps", "0"], "--fps", "integer >= 1"),
    (["--device", "nodevice"], "--device", "not a torch device"),
    (["--methods", "dense,bogus"], "--methods", "unknown method"),
    (["--methods", "dense", "--set", "sta.tile=1,2,2"], "--set", "not in --methods"),
    (["--model", "tiny-nothing"], "--model", "built-in tiny models"),
]


@pytest.mark.parametrize("command", ["compare", "eval"])
@pytest.mark.parametrize("argv, option, message", BAD_SHARED)
def test_bad_arguments_are_one_line_before_loading(command, argv, option, message, tmp_path, capsys, no_model):
    with pytest.raises(SystemExit) as info:
        main([command, *argv, "--out", str(tmp_path / "out")])
    line = one_line_error(capsys, info)
    assert line.startswith(f"fastdit {command}: error: argument {option}") and message in line, line


@pytest.mark.parametrize("command", ["compare", "eval"])
def test_out_that_is_a_file(command, tmp_path, capsys, no_model):
    existing = tmp_path / "report.txt"
    existing.write_text("not a folder")
    for out, message in ((existing, "is an existing file"), (existing / "below", "is a file, so the folder")):
        with pytest.raises(SystemExit) as info:
            main([command, "--out", str(out)])
        line = one_line_error(capsys, info)
        assert line.startswith(f"fastdit {command}: error: argument --out: {existing}") and message in line, line


def test_absurd_size_names_the_limit(tmp_path, capsys, no_model):
    with pytest.raises(SystemExit) as info:
        main(["compare", "--model", "tiny-wan", "--height", "1000000", "--out", str(tmp_path)])
    line = one_line_error(capsys, info)
    assert line == ("fastdit compare: error: argument --height: 1000000 is too large: 29 frames of 1000000x768 make "
                    "8x62500x48 = 24000000 latent tokens (16 pixels, 4 frames per token); at most 1048576 fit "
                    "(FASTDIT_MAX_TOKENS); --height <= 43680 here")


@pytest.mark.parametrize("argv, option, message", [
    (["--grid", "sta.window=3,3,3;2,2,2"], "--grid sta.window=2,2,2", "odd and positive"),
    (["--grid", "sta.windw=1,3"], "--grid sta.windw=1", "valid options"),
    (["--grid", "sta.dense_steps=0,1.5"], "--grid sta.dense_steps=1.5", "[0, 1)"),
    (["--grid", "sta.tile"], "--grid", "METHOD.OPTION=V1,V2"),
    (["--seeds", "0-x"], "--seeds", "ranges like"),
    (["--seeds", "4-1"], "--seeds", "empty range"),
    (["--fid-frames", "0"], "--fid-frames", "integer >= 1"),
    (["--prompts", "no_such_prompts.txt"], "--prompts", "does not exist"),
])
def test_bad_eval_arguments(argv, option, message, tmp_path, capsys, no_model):
    with pytest.raises(SystemExit) as info:
        main(["eval", *argv, "--out", str(tmp_path / "out")])
    line = one_line_error(capsys, info)
    assert line.startswith(f"fastdit eval: error: argument {option}") and message in line, line


def test_eval_entry_point_reports_one_line(tmp_path, capsys, no_model):
    from fastdit.cli.eval import main as eval_main

    with pytest.raises(SystemExit) as info:
        eval_main(["--set", "sta.tile=0,0,0", "--out", str(tmp_path)])
    assert "three positive ints" in str(info.value)  # the message stays on the exception for callers
    assert one_line_error(capsys, info).startswith("fastdit eval: error: argument --set sta.tile=0,0,0")


@pytest.mark.parametrize("argv, option", [
    (["--set", "sta.tile=0,0,0"], "--set sta.tile=0,0,0"),
    (["--steps", "0"], "--steps"),
    (["--height", "1000000"], "--height"),
])
def test_errors_in_a_subprocess_are_one_line(argv, option, tmp_path):
    result = subprocess.run([sys.executable, "-m", "fastdit.cli", "compare", *argv, "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"fastdit compare: error: argument {option}"), result.stderr
    assert result.stdout == "" and not (tmp_path / "report.json").exists()


def test_size_checked_again_once_loaded():
    """Sizes of a real model: a lower bound before loading, the exact latent grid once loaded."""
    from types import SimpleNamespace

    from fastdit.cli.common import call_arguments, check_requested_size

    class Pipe:  # a Wan-like pipeline: VAE 8x spatial, 4x temporal, patch (1, 2, 2), 81 frames by default
        vae_scale_factor_spatial, vae_scale_factor_temporal = 8, 4
        transformer = SimpleNamespace(config=SimpleNamespace(patch_size=(1, 2, 2)))

        def __call__(self, prompt=None, height=480, width=832, num_frames=81, num_inference_steps=50,
                     guidance_scale=5.0):
            raise AssertionError("not called")

    check_requested_size("org/model", None, 8192, 8192)  # 1 x 256 x 256 tokens at least: may fit
    assert call_arguments(Pipe(), "org/model", height=720, width=1280)["height"] == 720
    with pytest.raises(SystemExit, match=r"argument --height: 8192 is too large: 81 frames of 8192x8192 make "
                                         r"21x512x512 = 5505024 latent tokens .* --height <= 1552 here"):
        call_arguments(Pipe(), "org/model", height=8192, width=8192)


def test_unexpected_errors_are_one_line_unless_debugging(tmp_path, capsys, monkeypatch):
    import fastdit.pipelines.loading as loading

    def broken(*args, **kwargs):
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(loading, "load_pipeline", broken)
    monkeypatch.delenv("FASTDIT_DEBUG", raising=False)
    argv = ["compare", "--steps", "1", "--out", str(tmp_path)]
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert one_line_error(capsys, info, code=1) == "fastdit: error: RuntimeError: boom (FASTDIT_DEBUG=1 shows the traceback)"
    monkeypatch.setenv("FASTDIT_DEBUG", "1")
    with pytest.raises(RuntimeError, match="boom"):
        main(argv)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(loading, "load_pipeline", interrupted)
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert one_line_error(capsys, info, code=130) == "fastdit compare: interrupted"


def test_option_parsing():
    assert parse_value("6,8,8") == (6, 8, 8)
    assert parse_value("0.25") == 0.25 and parse_value("2") == 2 and parse_value("true") is True
    assert parse_value("[(1,3,3),(3,3,3)]") == [(1, 3, 3), (3, 3, 3)]
    assert parse_options(["sta.window=3,5,5"], ["dense", "sta"]) == {"sta": {"window": (3, 5, 5)}}


def test_debug_mode_validates_plans(monkeypatch):
    from fastdit.kernels import block_sparse_attention

    q = torch.randn(1, 1, 8, 16)
    idx = torch.tensor([[[[0, 0]]]], dtype=torch.int32)  # a duplicate index
    cnt = torch.tensor([[[2]]], dtype=torch.int32)
    monkeypatch.setenv("FASTDIT_DEBUG", "1")
    with pytest.raises(ValueError, match="duplicate"):
        block_sparse_attention(q, q, q, idx, cnt, block_m=8, block_n=8, backend="torch")
    monkeypatch.setenv("FASTDIT_DEBUG", "0")
    out, _ = block_sparse_attention(q, q, q, idx[..., :1], cnt - 1, block_m=8, block_n=8, backend="torch")
    assert np.isfinite(out.numpy()).all()
