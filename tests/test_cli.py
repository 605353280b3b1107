"""The command line: ``fastdit compare`` end to end on the tiny model, and its errors."""
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from fastdit.cli import main, parse_options, parse_value


def test_compare_writes_report_and_playable_videos(tmp_path, capsys):
    out = tmp_path / "cmp"
    code = main(["compare", "--frames", "9", "--height", "80", "--width", "112", "--steps", "2",
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
        data = open(run["video"], "rb").read()
        assert b"avc1" in data[:4096] or b"avc1" in data  # H.264 in an mp4 container


def test_compare_rounds_sizes_with_a_note(tmp_path, capsys):
    main(["compare", "--frames", "10", "--height", "90", "--width", "100", "--steps", "1", "--methods", "dense",
          "--out", str(tmp_path), "--no-warmup"])
    printed = capsys.readouterr().out
    assert "height 90 -> 96" in printed and "frames 10 -> 9" in printed


def test_missing_model_is_a_message_not_a_traceback(tmp_path):
    result = subprocess.run([sys.executable, "-m", "fastdit.cli", "compare", "--model", str(tmp_path / "nope"),
                             "--out", str(tmp_path / "o")], capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "no such folder" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("argv, message", [
    (["compare", "--methods", "dense,bogus"], "unknown method"),
    (["compare", "--set", "sta.tile"], "METHOD.OPTION=VALUE"),
    (["compare", "--methods", "dense", "--set", "sta.tile=1,2,2"], "not in --methods"),
    (["compare", "--model", "tiny-nothing"], "built-in tiny models"),
])
def test_bad_arguments(argv, message, tmp_path):
    with pytest.raises(SystemExit, match=message):
        main(argv + ["--out", str(tmp_path)])


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
