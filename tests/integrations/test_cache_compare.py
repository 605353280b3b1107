"""``fastdit compare --cache dbcache`` and ``fastdit eval --cache dbcache`` on the tiny Wan at the
tiny test size, and the combinations that are refused (with the reason)."""
import json
import os
import sys

import numpy as np
import pytest

from fastdit.integrations.caches import block_lists, cache_settings, check_cache
from fastdit.cli import main as cli_main
from fastdit.compare import compare, format_table, generate
from fastdit.cli.eval import main as eval_main
from fastdit.pipelines.tiny import TINY_TEST_DEFAULTS, tiny

pytest.importorskip("cache_dit", reason="cache-dit is the optional extra fastdit[cache]")

SIZE = TINY_TEST_DEFAULTS["wan"]
#: caches every block it may from step 1 on (the random tiny model's residuals change a lot)
CACHING = {"residual_diff_threshold": 10.0, "max_warmup_steps": 1}


@pytest.fixture(scope="module")
def pipe():
    return tiny("wan")


def test_compare_runs_each_method_with_and_without_the_cache(pipe, tmp_path):
    before = generate(pipe, "a red fox", 0, dict(SIZE)).frames
    report = compare(pipe, ["dense", "sta"], "a red fox", 0, dict(SIZE), str(tmp_path), warmup=False,
                     method_options={"sta": {"tile": (1, 2, 2), "window": (1, 3, 3), "dense_steps": 0}},
                     backend="torch", log=lambda *_: None, cache="dbcache", cache_options=CACHING)
    rows = {row["method"]: row for row in report["runs"]}
    assert list(rows) == ["dense", "dense+dbcache", "sta", "sta+dbcache"]
    assert rows["dense"]["psnr_db"] is None
    for name in ("dense+dbcache", "sta+dbcache"):
        assert rows[name]["cache"]["cached_steps"] == 1  # step 1 of 2 reused the cached blocks
        assert rows[name]["cache"]["config"]["Fn_compute_blocks"] == 1
        assert np.isfinite(rows[name]["psnr_db"]) and rows[name]["speedup"] > 0
    assert "cache" not in rows["sta"]
    # fastdit counts the attention calls that ran: 4 layers x 2 CFG calls x 2 steps without the
    # cache; with it, step 1 computes the front block only (Fn=1, Bn=0)
    ran = {name: rows[name]["dense_calls"] + rows[name]["sparse_calls"] + rows[name]["fallback_calls"]
           for name in ("sta", "sta+dbcache")}
    assert ran == {"sta": 16, "sta+dbcache": 8 + 2}
    assert rows["sta+dbcache"]["sparse_density"] == pytest.approx(rows["sta"]["sparse_density"])
    assert os.path.isfile(tmp_path / "sta+dbcache.mp4")
    table = format_table(report["runs"])
    assert "cached steps" in table.splitlines()[0] and "attn calls" in table.splitlines()[0]
    assert [line.split()[-2:] for line in table.splitlines()[2:]] == [["-", "-"], ["-", "1"], ["16", "-"], ["10", "1"]]
    # afterwards the pipeline is as it was: its output equals the one before, bit for bit
    assert np.array_equal(generate(pipe, "a red fox", 0, dict(SIZE)).frames, before)


def test_eval_runs_cached_settings_against_the_uncached_reference(tmp_path):
    prompts = tmp_path / "one.txt"
    prompts.write_text("A boat sails on a calm lake.\n")
    out = tmp_path / "eval"
    args = ["--model", "tiny-wan", "--frames", str(SIZE["num_frames"]), "--height", str(SIZE["height"]),
            "--width", str(SIZE["width"]), "--steps", str(SIZE["num_inference_steps"]), "--device", "cpu",
            "--methods", "dense,sta", "--set", "sta.tile=1,2,2", "--set", "sta.dense_steps=0", "--prompts",
            str(prompts), "--seeds", "0", "--metrics", "psnr", "--out", str(out), "--no-progress", "--no-plots",
            "--no-warmup", "--cache", "dbcache", "--cache-set", "residual_diff_threshold=10.0",
            "--cache-set", "max_warmup_steps=1"]
    assert eval_main(args) == 0
    with open(out / "results.json") as f:
        results = json.load(f)
    settings = {s["setting"]: s for s in results["settings"]}
    assert list(settings) == ["dense", "dense+dbcache", "sta", "sta+dbcache"]
    assert settings["dense"]["psnr"] is None  # the reference itself
    assert settings["dense+dbcache"]["psnr"] is not None and np.isfinite(settings["dense+dbcache"]["psnr"])
    assert settings["sta+dbcache"]["sparse_calls"] < settings["sta"]["sparse_calls"]
    table = open(out / "results.md").read()
    assert "`sta+dbcache`" in table


def test_fitted_settings(pipe):
    assert block_lists(pipe.transformer) == {"blocks": 4}
    config = cache_settings("dbcache", pipe, 8)["cache_config"]
    assert (config.Fn_compute_blocks, config.Bn_compute_blocks, config.max_warmup_steps) == (1, 0, 2)
    assert config.residual_diff_threshold == 0.08
    hunyuan = tiny("hunyuan_video")
    assert block_lists(hunyuan.transformer) == {"transformer_blocks": 2, "single_transformer_blocks": 2}


@pytest.mark.parametrize("call, message", [
    (lambda pipe: check_cache("teacache"), "unknown cache 'teacache'; available: dbcache"),
    (lambda pipe: check_cache("dbcache", parallel=True), "--cache with --cp is not supported"),
    (lambda pipe: cache_settings("dbcache", pipe, 8, {"Fn_blocks": 2}), "unknown DBCacheConfig field"),
    (lambda pipe: cache_settings("dbcache", pipe, 8, {"Fn_compute_blocks": 3, "Bn_compute_blocks": 2}),
     "shortest block list has 4 blocks"),
])
def test_refused_combinations_say_why(pipe, call, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        call(pipe)


def test_missing_cache_dit_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "cache_dit", None)
    with pytest.raises(ValueError, match=r'pip install "fastdit\[cache\]"'):
        check_cache("dbcache")


@pytest.mark.parametrize("extra, message", [
    (["--cache", "dbcache", "--cp", "2"], "--cache with --cp is not supported"),
    (["--cache-set", "residual_diff_threshold=0.1"], "--cache-set: needs --cache"),
    (["--cache", "dbcache", "--cache-set", "nonsense"], "expects FIELD=VALUE"),
])
def test_cli_refusals(extra, message, capsys):
    with pytest.raises(SystemExit) as raised:
        cli_main(["compare", "--methods", "dense,sta", *extra])
    assert raised.value.code == 2
    assert message in capsys.readouterr().err


def test_cli_refuses_blocks_that_do_not_fit(capsys, tmp_path):
    with pytest.raises(SystemExit) as raised:
        cli_main(["compare", "--model", "tiny-wan", "--methods", "dense", "--frames", str(SIZE["num_frames"]), "--height",
                  str(SIZE["height"]), "--width", str(SIZE["width"]), "--steps", "2", "--cache", "dbcache",
                  "--cache-set", "Fn_compute_blocks=5", "--out", str(tmp_path)])
    assert raised.value.code == 2
    assert "shortest block list has 4 blocks" in capsys.readouterr().err
