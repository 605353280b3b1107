"""``auto`` calibrations and values checked before any work, by subject:

* ``auto`` calibrations: the user's options over the candidates, ties with dense, hand-edited
  candidates, step buckets past the run;
* values checked before the work: cache-dit settings, the cost-model predictor, the app's port and
  concurrency;
* quiet wrong turns: tiny-shapes' prompts, ``optimize_noise``'s inputs, the tiny pipelines' native call;
* engines and several GPUs: the vllm-omni plugin's head-dim message, Ulysses' heads, ``--cp`` help.
Training, copies, INT8 and the other value checks: tests/train/test_training_copies_and_int8.py.
"""
from __future__ import annotations

import warnings

import pytest

from fastdit.pipelines.tiny import tiny

CALL = {"num_frames": 9, "height": 64, "width": 64, "num_inference_steps": 2, "guidance_scale": 1.0,
        "max_sequence_length": 16, "output_type": "latent"}  # a 3 x 4 x 4 latent grid


def _pipe():
    pipe = tiny("wan", seed=0, num_layers=2)
    pipe.set_progress_bar_config(disable=True)
    return pipe


# -- auto calibrations ---------------------------------------------------------------------------------
AUTO_CANDIDATES = [{"method": "sta", "tile": [1, 2, 2], "window": [1, 1, 1]}, {"method": "todo", "factor": 2}]


def _auto_plan(candidates=None, buckets=(0,), layers=2, heads=2):
    choices = {f"{b}_{layer}_{h}": 0 for b in buckets for layer in range(layers) for h in range(heads)}
    return {"format": "fastdit-plan", "version": 2, "method": "auto", "step_buckets": list(buckets), "options": {},
            "model": {"family": "wan", "transformer": "WanTransformer3DModel", "layers": layers, "heads": heads,
                      "grids": []},
            "candidates": candidates or AUTO_CANDIDATES, "choices": choices}


def test_calibrate_auto_set_value_wins_over_the_candidates():
    """``fastdit calibrate --method auto --set todo.factor=1`` succeeded but the candidates' factors
    (2, 3, 4) overrode the user's value silently: now the user's value is the one scored."""
    from fastdit.calibration.candidates import auto_candidates

    todo = [c for c in auto_candidates(None, {"todo": {"factor": 1}}) if c["method"] == "todo"]
    assert todo == [{"method": "todo", "factor": 1}]
    with pytest.raises(ValueError, match=r"todo\.dense_steps: .*set dense_steps on auto"):
        auto_candidates(None, {"todo": {"dense_steps": 1}})


def test_cli_calibrate_auto_set_reaches_the_candidates(tmp_path, monkeypatch):
    """The command line passes ``--set todo.factor=1`` to the search with that value kept."""
    from fastdit.calibration import search
    from fastdit.calibration.candidates import auto_candidates
    from fastdit.cli import main

    seen = {}

    def fake_calibrate(pipe, method, prompts, **kwargs):
        seen["candidates"] = auto_candidates(None, kwargs["options"])
        raise ValueError("stop here")

    monkeypatch.setattr(search, "calibrate", fake_calibrate)
    with pytest.raises(SystemExit):
        main(["calibrate", "--model", "tiny-wan", "--method", "auto", "--set", "todo.factor=1", "--budget", "0.1",
              "--out", str(tmp_path / "auto.json"), "--no-progress", "--max-prompts", "1"])
    assert [c for c in seen["candidates"] if c["method"] == "todo"] == [{"method": "todo", "factor": 1}]


def test_cli_calibrate_auto_on_tiny_shapes_takes_its_presets_but_not_their_schedule(tmp_path, monkeypatch):
    """tiny-shapes' sta preset runs its first 6 steps dense; under ``calibrate --method auto`` that preset was
    handed to the candidates, which refuse a schedule, and the command failed before calibrating. The tile
    carries over to sta's candidates; ``dense_steps`` stays with sta run alone (auto takes its own)."""
    from fastdit.calibration import search
    from fastdit.calibration.candidates import auto_candidates
    from fastdit.cli import main
    from fastdit.pipelines.loading import trained_presets

    assert trained_presets("tiny-shapes")["sta"].get("dense_steps")  # the case: a preset with a schedule
    seen = {}

    def fake_calibrate(pipe, method, prompts, **kwargs):
        seen["options"], seen["candidates"] = kwargs["options"], auto_candidates(None, kwargs["options"])
        raise ValueError("stop here")

    monkeypatch.setattr(search, "calibrate", fake_calibrate)
    with pytest.raises(SystemExit):
        main(["calibrate", "--model", "tiny-shapes", "--method", "auto", "--budget", "0.1", "--out",
              str(tmp_path / "auto.json"), "--no-progress", "--max-prompts", "1"])
    assert "dense_steps" not in seen["options"]["sta"]
    assert list(seen["options"]["sta"]["tile"]) == list(trained_presets("tiny-shapes")["sta"]["tile"])
    assert {c["method"] for c in seen["candidates"]} >= {"radial", "sparge"}  # (sta's windows need a layout)


def test_dense_is_kept_on_a_rounding_tie():
    """Every head chose radial at density 1.000 over dense by a float-rounding difference of the
    predicted time (strict ``<``); docs/auto.md says dense is kept where predicted as fast."""
    from fastdit.calibration.candidates import select_auto

    dense_ms = 0.1 + 0.2  # 0.30000000000000004
    result = {"0_0": {"err2": [[0.0, 0.0]], "ref2": [1.0], "density": [[1.0, 0.5]],
                      "time": [[0.3, 0.3]], "dense_time": [dense_ms]}}
    choice, measured = select_auto([result], [{"method": "radial"}, {"method": "todo"}], budget=0.1)
    assert choice == {"0_0_0": None} and measured["0_0"]["density"] == 1.0
    result["0_0"]["time"] = [[0.3, 0.2]]  # a real gain at density < 1 is still taken
    assert select_auto([result], [{"method": "radial"}, {"method": "todo"}], budget=0.1)[0] == {"0_0_0": 1}


@pytest.mark.parametrize("candidate, message", [
    ({"method": "sta", "tile": [1, 2, 2], "window": [1, 1, 1], "dense_steps": 1}, r"sets \['dense_steps'\]"),
    ({"method": "todo", "factor": 2, "dense_layers": 1}, r"sets \['dense_layers'\]"),
    ({"method": "prune", "ratio": 0.5}, "method 'prune' is not one auto chooses from"),
    ({"method": "window", "window": [1, 1, 1]}, "method 'window' is not one auto chooses from"),
    ({"method": "dense"}, "method 'dense' is not one auto chooses from"),
])
def test_hand_edited_candidates_are_refused(candidate, message):
    """A candidate's ``dense_steps`` / ``dense_layers`` were silently forced to 0, and ``prune`` /
    ``window`` accepted though docs/auto.md leaves them out: a CalibrationError names the candidate."""
    from fastdit.calibration.calibration_file import CalibrationError, load_calibration

    with pytest.raises(CalibrationError, match=message):
        load_calibration(_auto_plan([AUTO_CANDIDATES[0], candidate]))
    load_calibration(_auto_plan())  # the plain plan loads


def test_a_plan_starting_after_the_run_warns():
    """``step_buckets: [5]`` on a 2-step run made every call dense with no warning."""
    import fastdit

    pipe = _pipe()
    with fastdit.patch(pipe, "auto", calibration=_auto_plan(buckets=(5,))) as patch:
        with pytest.warns(UserWarning, match=r"first step bucket \(5\).*whole run is dense"):
            pipe("a cat", **CALL)
        assert patch.stats.effective_density == 1.0
    with fastdit.patch(pipe, "auto", calibration=_auto_plan()):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            pipe("a cat", **CALL)  # a plan from step 0: no warning


# -- values checked before the work ---------------------------------------------------------------
@pytest.mark.parametrize("setting, message", [
    ("residual_diff_threshold=abc", "residual_diff_threshold: must be a finite number >= 0, got 'abc'"),
    ("residual_diff_threshold=nan", "residual_diff_threshold: must be a finite number >= 0"),
    ("Fn_compute_blocks=-1", "Fn_compute_blocks: must be an int >= 1, got -1"),
    ("max_warmup_steps=1e9", "max_warmup_steps: must be an int >= 0, got 1000000000.0"),
    ("max_warmup_steps=1000000000", "max_warmup_steps: must be at most the run's 2 steps"),
    ("bogus=1", "unknown DBCacheConfig field"),
])
def test_cache_values_are_checked_before_any_model_loads(setting, message, monkeypatch, capsys):
    """``--cache-set residual_diff_threshold=abc`` (``nan``, ``Fn_compute_blocks=-1``,
    ``max_warmup_steps=1e9``) failed with a TypeError / AssertionError after the dense run had
    finished; now a one-line error naming the flag before the model loads."""
    pytest.importorskip("cache_dit")
    from fastdit.cli import main
    from fastdit.pipelines import loading

    monkeypatch.setattr(loading, "load_pipeline", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(SystemExit) as exit_info:
        main(["compare", "--model", "tiny-wan", "--steps", "2", "--cache", "dbcache", "--cache-set", setting])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "argument --cache-set" in err[0] and message in err[0], err


def test_cache_warmup_past_the_models_default_steps_is_refused_before_the_run():
    """Without ``--steps`` the run's steps are known once the model is: ``cache_settings`` (called
    before any generation) refuses more warm-up steps than the run has."""
    pytest.importorskip("cache_dit")
    from fastdit.integrations.caches import cache_settings

    with pytest.raises(ValueError, match="max_warmup_steps: must be at most the run's 4 steps"):
        cache_settings("dbcache", _pipe(), 4, {"max_warmup_steps": 10})


@pytest.mark.parametrize("argv, message", [
    (["--dynamic-density", "2"], "argument --dynamic-density: expects a density in (0, 1]"),
    (["--dynamic-density", "-1"], "argument --dynamic-density"),
    (["--dynamic-density", "0"], "argument --dynamic-density"),
    (["--dynamic-density", "nan"], "argument --dynamic-density"),
    (["--hy-frames", "100000"], "argument --hy-frames: expects a frame count from 1 to 513"),
    (["--models", "wan,bogus"], "unknown model(s) ['bogus']"),
])
def test_predict_checks_its_values(argv, message, monkeypatch, capsys):
    """``python -m fastdit.eval.predict --dynamic-density 2`` (-1, 0) printed 296x speedups, ``nan``
    a traceback, ``--hy-frames 100000`` tried to allocate 250 GB."""
    from fastdit.eval import predict

    monkeypatch.setattr(predict, "model_shape", lambda *a, **k: pytest.fail("a model was built"))
    with pytest.raises(SystemExit) as exit_info:
        predict.main(argv)
    text = str(exit_info.value.code) if not isinstance(exit_info.value.code, int) else capsys.readouterr().err
    assert message in text, text


@pytest.mark.parametrize("argv, message", [
    (["--port", "-1"], "argument --port: expects a port number from 1 to 65535, got -1"),
    (["--port", "70000"], "argument --port"),
    (["--concurrency", "0"], "argument --concurrency: expects an integer >= 1, got 0"),
    (["--max-tokens", "0"], "argument --max-tokens"),
])
def test_app_checks_port_and_concurrency(argv, message, monkeypatch, capsys):
    """``fastdit app --port -1`` gave a raw OverflowError at launch; ``--concurrency 0`` was accepted."""
    from fastdit.app import launch
    from fastdit.cli import main

    monkeypatch.setattr(launch, "cmd_app", lambda args: pytest.fail("the app was built"))
    with pytest.raises(SystemExit) as exit_info:
        main(["app", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1], err


# -- quiet wrong turns ------------------------------------------------------------------------------
def _eval_config(argv):
    from fastdit.cli.eval import build_parser, config_from_args

    return config_from_args(build_parser().parse_args(argv))


def test_eval_tiny_shapes_defaults_to_its_held_out_captions():
    """``fastdit eval --model tiny-shapes --metrics adherence`` with the default prompts (COCO) gave
    ``adherence: None`` for every sample with no note: its default is now the shipped ``shapes`` set
    (32 held-out captions of its grammar), and other text is refused as ``fastdit compare`` does."""
    from fastdit.cli.common import CLIError

    cfg = _eval_config(["--model", "tiny-shapes", "--metrics", "adherence", "--out", "unused"])
    assert cfg.prompts_file == "shapes" and len(cfg.prompts) == 32
    with pytest.raises(CLIError, match="argument --prompts: tiny-shapes takes captions like"):
        _eval_config(["--model", "tiny-shapes", "--prompts", "coco", "--metrics", "adherence", "--out", "unused"])
    assert _eval_config(["--model", "tiny-wan", "--out", "unused"]).prompts_file == "coco"


def test_eval_says_why_adherence_is_none(capsys):
    """Adherence scores only captions of the shapes grammar: with other prompts the run says so
    instead of leaving ``None`` unexplained."""
    _eval_config(["--model", "tiny-wan", "--metrics", "psnr,adherence", "--out", "unused"])
    out = capsys.readouterr().out
    assert "adherence is scored only on captions of the tiny-shapes grammar" in out and "are not" in out
    _eval_config(["--model", "tiny-wan", "--prompts", "shapes", "--metrics", "adherence", "--out", "unused"])
    assert "adherence is scored only" not in capsys.readouterr().out


def test_calibrate_tiny_shapes_uses_its_own_captions(tmp_path, monkeypatch, capsys):
    """``fastdit calibrate --model tiny-shapes`` calibrated on COCO captions (which ``compare``
    refuses for this model): the default is now the training captions shipped beside its weights,
    and prompts outside its grammar are refused before the model loads."""
    import os

    from fastdit.cli import main
    from fastdit.eval.runner import prompts as prompt_module
    from fastdit.pipelines import loading

    class Loaded(Exception):
        pass

    read = []
    original = prompt_module.load_prompts
    monkeypatch.setattr(prompt_module, "load_prompts", lambda path: read.append(path) or original(path))
    monkeypatch.setattr(loading, "load_pipeline", lambda *a, **k: (_ for _ in ()).throw(Loaded()))
    out = str(tmp_path / "plan.json")
    with pytest.raises(SystemExit):  # the CLI reports the stand-in's exception as an error
        main(["calibrate", "--model", "tiny-shapes", "--budget", "0.1", "--out", out])
    assert "Loaded" in capsys.readouterr().err
    assert read == [os.path.join(loading.WEIGHTS_DIR, loading.TRAINED_MODELS["tiny-shapes"],
                                 "calibration_captions.txt")]
    with pytest.raises(SystemExit) as exit_info:
        main(["calibrate", "--model", "tiny-shapes", "--prompts", "coco", "--budget", "0.1", "--out", out])
    assert exit_info.value.code == 2
    assert "argument --prompts: tiny-shapes takes captions like" in capsys.readouterr().err


def test_optimize_noise_refuses_constant_latents_and_prompt_lists():
    """``optimize_noise(latents=torch.zeros(...))`` returned all-NaN latents; ``prompt=[...]`` raised
    an AttributeError: both are ValueErrors naming the argument."""
    import torch

    import fastdit

    pipe = _pipe()
    shape = (1, 16, 3, 4, 4)
    with pytest.raises(ValueError, match="latents: a sample is constant"):
        fastdit.optimize_noise(pipe, "a red circle moving left", latents=torch.zeros(shape), steps=1)
    with pytest.raises(ValueError, match="latents hold NaN or inf"):
        fastdit.optimize_noise(pipe, "a red circle moving left", latents=torch.full(shape, float("nan")), steps=1)
    with pytest.raises(ValueError, match="prompt must be one non-empty string"):
        fastdit.optimize_noise(pipe, ["a red circle moving left"], latents=torch.randn(shape), steps=1)


def test_tiny_pipelines_carry_their_native_call():
    """A bare embedded tiny pipeline (``load_pipeline("tiny-wan")``, or ``optimize_noise`` without
    latents) ran at diffusers' defaults (50 steps, 81 frames of 480 x 832). The pipeline now
    carries its native call; ``optimize_noise``, ``calibrate`` and ``compare`` fill what the caller
    leaves out from it (a bare ``pipe(prompt)`` cannot: the defaults are the class's)."""
    from fastdit.pipelines.loading import load_pipeline
    from fastdit.pipelines.tiny import TINY_DEFAULTS, native_call
    from fastdit.train.noise import _call_kwargs

    pipe = load_pipeline("tiny-wan", "cpu")
    native = {k: v for k, v in TINY_DEFAULTS["wan"].items()}
    assert pipe._fastdit_call_defaults == native
    kwargs = _call_kwargs(pipe, "a red circle moving left", None, None)
    assert (kwargs["num_frames"], kwargs["height"], kwargs["width"]) == (29, 384, 512)
    assert native_call(pipe, {"num_inference_steps": 2}) == {**native, "num_inference_steps": 2}
    assert native_call(object(), {"height": 8}) == {"height": 8}
    assert "image" not in load_pipeline("tiny-wan-i2v", "cpu")._fastdit_call_defaults


# -- engines and several GPUs -----------------------------------------------------------------------
def test_plugin_head_dim_mismatch_names_the_callers_shapes():
    """The head-dim mismatch message showed the internal (BHSD) layout and the sequence padded to
    whole tiles (116 for 80 tokens); it now names the caller's BSND shapes. A value head_dim other
    than the key's (which SDPA takes) runs dense with the reason."""
    import torch

    from fastdit.integrations.vllm_omni import SparseAttentionPlugin

    plugin = SparseAttentionPlugin("sta")
    params = {"latent_shape": torch.tensor([[3, 10, 10]]), "patch_size": torch.tensor([[1, 2, 2]]),
              "denoise_step_idx": torch.tensor([5]), "total_denoise_steps": torch.tensor([10]), "tile": (1, 2, 2),
              "window": (1, 1, 1), "full_attn_spans": [[[0, 5]]]}
    q, v = torch.randn(1, 80, 2, 48), torch.randn(1, 80, 2, 48)
    with pytest.raises(ValueError, match=r"key head_dim 40 differs from query head_dim 48 \(query \[1, 80, 2, 48\], "
                                         r"key \[1, 80, 2, 40\]") as raised:
        plugin(q, torch.randn(1, 80, 2, 40), v, params)
    assert "116" not in str(raised.value)
    with pytest.warns(UserWarning, match="value head_dim differs"):
        out = plugin(q, torch.randn(1, 80, 2, 48), torch.randn(1, 80, 2, 24), params)
    assert out.shape == (1, 80, 2, 24) and plugin.stats.fallback_calls == 1


def test_ulysses_degree_that_does_not_divide_the_heads_is_refused_before_any_run(monkeypatch, capsys):
    """``torchrun --nproc_per_node 3 -m fastdit.cli compare --cp 3`` on a 2-head model failed with a
    raw reshape error inside diffusers during the dense run; the heads are now checked when the
    pipeline is put under context parallelism, before any run (a one-line error naming --cp)."""
    import torch

    from fastdit import compare as compare_module
    from fastdit import parallel
    from fastdit.cli import main

    setup = parallel.ParallelSetup(0, 3, 3, 0, torch.device("cpu"), object(), 1)
    monkeypatch.setattr(parallel, "launched_world", lambda: (0, 3, 0))
    monkeypatch.setattr(parallel, "setup", lambda degree, ring=1: setup)
    monkeypatch.setattr(compare_module, "compare", lambda *a, **k: pytest.fail("a run started"))
    with pytest.raises(SystemExit) as exit_info:
        main(["compare", "--model", "tiny-wan", "--methods", "dense,sta", "--cp", "3", "--steps", "1"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "argument --cp 3: Ulysses splits each attention layer's heads" in err[-1]
    assert "have 2 heads" in err[-1] and "use --cp 1 or 2" in err[-1], err
    pipe = _pipe()
    parallel.check_heads(pipe, 2)  # 2 heads over 2 ranks: fine
    with pytest.raises(ValueError, match="--cp 3"):
        parallel.enable(pipe, setup)  # refused before anything changes


def test_cp_ring_help_names_every_ring_method():
    """``--cp-ring`` help omitted svg2, which works under ring: both commands now print the one list."""
    from fastdit.cli.eval import build_parser
    from fastdit.methods.parallel.ring import ring_methods

    names = ring_methods()
    assert "svg2" in names
    ring = next(a for a in build_parser()._actions if "--cp-ring" in a.option_strings)
    assert ", ".join(names) in ring.help
    import argparse

    from fastdit.cli.compare import add_compare_parser

    parser = argparse.ArgumentParser()
    compare = add_compare_parser(parser.add_subparsers())
    ring = next(a for a in compare._actions if "--cp-ring" in a.option_strings)
    assert ", ".join(names) in ring.help


def test_correction_none_is_accepted_on_the_command_line():
    """``--set sta.correction=none`` / ``--grid sta.correction=none,pooled`` were refused ("correction must be
    one of ('none', ...), got None": the command line reads ``none`` as None); None now means "none"."""
    import fastdit
    from fastdit.eval.runner.settings import build_settings

    cfg = _eval_config(["--model", "tiny-wan", "--methods", "dense,sta", "--grid", "sta.correction=none,pooled",
                        "--out", "unused"])
    settings = build_settings(cfg)
    assert len(settings) == 3 and settings[2].name == "sta[correction=pooled]"
    assert fastdit.methods.get_method("sta").make_config(None, **settings[1].options).correction == "none"
    cfg = _eval_config(["--model", "tiny-wan", "--methods", "dense,sta", "--set", "sta.correction=none",
                        "--out", "unused"])
    config = fastdit.methods.get_method("sta").make_config(None, **cfg.options["sta"])
    assert config.correction == "none"
    with pytest.raises(ValueError, match="correction must be one of"):
        fastdit.methods.get_method("sta").make_config(None, correction="nothing")
