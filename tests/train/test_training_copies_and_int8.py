"""Training through sparse attention and what surrounds it, by subject: the README's training
command and docs/training.md's config (fractional dense_steps, options that fit the tiny grid);
dense_steps after a scheduler swap; copies of a patched model (unpatched copies and checkpoints);
INT8 with non-finite values; training that diverges, resume, atomic checkpoints; ``auto``
calibration keys and encodings; values checked before any work.
"""
from __future__ import annotations

import json
import math

import pytest
import torch

from fastdit.pipelines.tiny import tiny

CALL = {"num_frames": 9, "height": 64, "width": 64, "num_inference_steps": 2, "guidance_scale": 1.0,
        "max_sequence_length": 16}  # a 3 x 4 x 4 latent grid


def _pipe():
    pipe = tiny("wan", seed=0, num_layers=2)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _train_config(**overrides):
    from fastdit.train import LoraTrainConfig

    fields = dict(method="sta", options={"tile": (1, 2, 2), "window": (1, 1, 1)}, prompts=("a cat",), seeds=(0,),
                  samples=2, steps=2, lr=1e-2, rank=4, call_kwargs=CALL, backend="torch")
    return LoraTrainConfig(**{**fields, **overrides})


# -- the README's training command ------------------------------------------------------------------
def test_readme_training_command_learns(tmp_path, capsys):
    """``python -m fastdit.train --tiny wan --method sta --steps 2 --out tr`` as in the README: it
    crashed at the first step on sta's fractional dense_steps; now it trains sparse, with options
    that fit the tiny grid, and says why the options differ from the method's defaults."""
    pytest.importorskip("peft")
    from fastdit.train.__main__ import main

    out = tmp_path / "tr"
    assert main(["--tiny", "wan", "--method", "sta", "--steps", "2", "--out", str(out), "--no-progress"]) == 0
    record = json.loads((out / "losses.json").read_text())
    losses = record["losses"]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses) and any(losses)
    assert record["stats"]["sparse_calls"] > 0 and record["stats"]["sparse_density"] < 0.9
    assert record["options_trained"]["dense_steps"] == 0
    err = capsys.readouterr().err
    assert "dense_steps=0.25" in err and "--tiny" in err


def test_docs_config_with_the_default_fraction_trains(tmp_path):
    """docs/training.md's ``LoraTrainConfig(method="sta", options={"tile": ..., "window": ...})``
    (sta's default dense_steps is a fraction) trains, and the result says dense_steps was 0."""
    pytest.importorskip("peft")
    from fastdit.train import train_lora

    result = train_lora(_pipe(), _train_config(), tmp_path / "run", progress=False)
    assert all(math.isfinite(x) for x in result["losses"]) and any(result["losses"])
    assert result["options_trained"]["dense_steps"] == 0
    assert any("dense_steps" in note for note in result["notes"])


def test_a_mask_covering_the_grid_is_reported(tmp_path):
    """sta's default window on a 3 x 4 x 4 grid covers every token: the run says the adapter
    learns nothing instead of reporting zero losses silently."""
    pytest.importorskip("peft")
    from fastdit.train import train_lora

    with pytest.warns(UserWarning, match="density 1"):
        result = train_lora(_pipe(), _train_config(options={"dense_steps": 0}, steps=1), tmp_path / "run",
                            progress=False)
    assert any("learns nothing" in note for note in result["notes"])


# -- dense_steps after a scheduler swap ----------------------------------------------------------
def _run_counts(pipe, patch):
    patch.reset_stats()
    pipe("a cat", **{**CALL, "num_inference_steps": 4}, output_type="latent", generator=torch.Generator().manual_seed(0))
    return patch.stats.dense_calls, patch.stats.sparse_calls


@pytest.mark.parametrize("dense_steps", [0.5, 2])
def test_dense_steps_survive_a_scheduler_swap(dense_steps):
    """``pipe.scheduler = type(s).from_config(s.config)`` after patching (diffusers' idiom): the
    dense steps are honoured on the first run after the swap (in a fresh context, where a fraction
    used to raise 'a bare transformer was patched') and on later runs (where the previous run's
    step counter used to go on: no dense call at all)."""
    import contextvars

    import fastdit

    reference_pipe = _pipe()
    with fastdit.patch(reference_pipe, "sta", tile=(1, 2, 2), window=(1, 1, 1), dense_steps=dense_steps) as p:
        expected = _run_counts(reference_pipe, p)
    assert expected[0] > 0 and expected[1] > 0

    pipe = _pipe()
    p = fastdit.patch(pipe, "sta", tile=(1, 2, 2), window=(1, 1, 1), dense_steps=dense_steps)
    try:
        pipe.scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config)
        assert contextvars.Context().run(_run_counts, pipe, p) == expected  # first run, fresh context
        assert _run_counts(pipe, p) == expected
        pipe.scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config)  # swapped after a run
        assert _run_counts(pipe, p) == expected
        assert _run_counts(pipe, p) == expected
    finally:
        p.remove()
    swapped = pipe.scheduler
    assert "step" not in swapped.__dict__ and "set_timesteps" not in swapped.__dict__  # untracked on remove


# -- copies of a patched model -----------------------------------------------------------------
def _transformer_output(transformer):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, transformer.config.in_channels, 3, 8, 8, generator=gen)
    text = torch.randn(1, 16, transformer.config.text_dim, generator=gen)
    with torch.no_grad():
        return transformer(hidden_states=x, timestep=torch.tensor([500.0]), encoder_hidden_states=text,
                           return_dict=False)[0]


@pytest.mark.parametrize("trainable", [False, True])
def test_a_patched_transformer_copies_and_saves_unpatched(tmp_path, trainable):
    """``copy.deepcopy`` and ``torch.save`` of a patched transformer (an EMA copy during training)
    used to fail on the patch's lock / bound hook; the copy (and the saved model) is now the
    unpatched model, the original stays patched, and the copy can be patched on its own."""
    import copy

    import fastdit

    transformer = _pipe().transformer
    options = dict(tile=(1, 2, 2), window=(1, 1, 1), dense_steps=0)
    dense = _transformer_output(transformer)
    with fastdit.patch(transformer, "sta", trainable=trainable, **options) as p:
        sparse = _transformer_output(transformer)
        assert (sparse - dense).abs().max() > 1e-4
        clone = copy.deepcopy(transformer)
        torch.save(transformer, tmp_path / "model.pt")
        shallow = copy.copy(transformer)
        assert getattr(clone, "_fastdit_patch", None) is None and getattr(shallow, "_fastdit_patch", None) is None
        calls = p.stats.sparse_calls
        torch.testing.assert_close(_transformer_output(clone), dense)
        assert p.stats.sparse_calls == calls  # the copy's calls are not the patch's
        torch.testing.assert_close(_transformer_output(transformer), sparse)  # the original is still patched
        assert p.stats.sparse_calls > calls
        with fastdit.patch(clone, "sta", **options):
            torch.testing.assert_close(_transformer_output(clone), sparse)
        torch.testing.assert_close(_transformer_output(clone), dense)
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    assert getattr(loaded, "_fastdit_patch", None) is None
    torch.testing.assert_close(_transformer_output(loaded), dense)
    assert "__getstate__" not in transformer.__dict__  # remove() takes everything off
    torch.testing.assert_close(_transformer_output(transformer), dense)


# -- INT8 with non-finite values -------------------------------------------------------------
def _quant_inputs(mode):
    gen = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(1, 2, 128, 32, generator=gen).to(torch.bfloat16) for _ in range(3))
    if mode == "k_inf":
        k[0, 0, 5, 3] = float("inf")  # key block 0 of head 0
    elif mode == "k_nan":
        k[0, 1, 70, 0] = float("nan")  # key block 2 of head 1
    elif mode == "v_nan":
        v[0, 0, 40, 7] = float("nan")  # key block 1 of head 0
    elif mode == "v_inf":
        v[0, 1, 100, 2] = float("-inf")  # key block 3 of head 1
    # query block m attends key blocks m and (m + 1) % 4
    m = torch.arange(4, dtype=torch.int32)
    idx = torch.stack([m, (m + 1) % 4], -1).expand(1, 1, 4, 2).contiguous()
    cnt = torch.full((1, 1, 4), 2, dtype=torch.int32)
    return q, k, v, idx, cnt


def _affected(out, clean, tol):
    """Rows (and channels) with a non-finite output or one that moved by more than ``tol``."""
    out, clean = out.float(), clean.float()
    return ~torch.isfinite(out) | ((out - clean).abs() > tol)


@pytest.mark.parametrize("mode", ["k_inf", "k_nan", "v_nan", "v_inf"])
@pytest.mark.parametrize("quant", ["int8", "int8-fp8"])
def test_a_nonfinite_input_affects_the_same_rows_under_quant(mode, quant):
    """One inf in K used to turn the whole head NaN under ``quant`` (the key mean used for smoothing
    became inf); one NaN in V every row of the emulation. Now the rows affected (for V: the rows
    and channels) are exactly those the unquantised engine changes, they are non-finite (an inf
    key is not hidden: the engine itself may return those rows finite but wrong), and the other
    rows keep their quantised values (up to one INT8 step where the key mean moved)."""
    from fastdit.kernels import block_sparse_attention
    from fastdit.kernels.quant.emulation import allowed_blocks, fixed_blocks, quant_attention_emulated

    q, k, v, idx, cnt = _quant_inputs(mode)
    q0, k0, v0, _, _ = _quant_inputs("none")
    plain = block_sparse_attention(q, k, v, idx, cnt, 32, 32, backend="torch", return_lse=False)
    plain_clean = block_sparse_attention(q0, k0, v0, idx, cnt, 32, 32, backend="torch", return_lse=False)
    allowed = allowed_blocks(idx, cnt, 1, 2, 4)
    blocks = fixed_blocks(128, 32, q.device)
    # int8-fp8 runs on sm_89+ only: its formulas are checked through the emulation directly
    out = quant_attention_emulated(q, k, v, blocks, blocks, allowed, 32 ** -0.5, None, quant)[0]
    clean = quant_attention_emulated(q0, k0, v0, blocks, blocks, allowed, 32 ** -0.5, None, quant)[0]
    expected = _affected(plain, plain_clean, 0)
    if mode.startswith("k"):
        expected = expected.any(-1, keepdim=True).expand_as(expected)  # a key moves whole rows
    assert expected.any() and not expected.all()
    assert torch.equal(_affected(out, clean, 0.05), expected)
    assert torch.equal(~torch.isfinite(out.float()), expected)
    if mode.startswith("v"):  # V's other keys and channels are untouched: bit for bit
        assert torch.equal(out[~expected], clean[~expected])


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_inf_key_under_the_engine_op_leaves_the_other_heads_and_rows(backend):
    """Through ``block_sparse_attention(..., quant="int8")`` (Triton: in the interpreter on a CPU):
    only head 0's rows that attend the inf key's block are NaN (it was the whole head); their lse
    is NaN too (a merge through the lse cannot hide them), the others are finite."""
    from fastdit.kernels import available_backends, block_sparse_attention

    if backend not in available_backends():
        pytest.skip(f"{backend} backend not available here")
    q, k, v, idx, cnt = _quant_inputs("k_inf")
    out, lse = block_sparse_attention(q, k, v, idx, cnt, 32, 32, backend=backend, quant="int8")
    bad_rows = ~torch.isfinite(out.float()).all(-1)
    expected = torch.zeros_like(bad_rows)
    expected[0, 0, :32] = expected[0, 0, 96:] = True  # query blocks 0 and 3 list key block 0
    assert torch.equal(bad_rows, expected)
    assert torch.isnan(lse[expected]).all() and torch.isfinite(lse[~expected]).all()


# -- training that diverges, resume, checkpoints ---------------------------------------------------
def test_a_diverging_run_stops_and_keeps_the_last_good_checkpoint(tmp_path):
    """``lr=1e8``: the losses went ``[0.0008, nan, nan, ...]`` with NaN adapters and checkpoints
    saved. Now the run stops at the first non-finite loss or gradient, before the optimizer step,
    naming the step and lr; every checkpoint left holds finite weights, and no adapter is saved."""
    pytest.importorskip("peft")
    from fastdit.train import train_lora
    from fastdit.train.recipe import TrainingDiverged

    out = tmp_path / "run"
    with pytest.raises(TrainingDiverged, match=r"training diverged at step \d+: .*lr=100000000.0"):
        train_lora(_pipe(), _train_config(lr=1e8, steps=6, checkpoint_every=1), out, progress=False)
    assert not (out / "pytorch_lora_weights.safetensors").exists() and not (out / "losses.json").exists()
    for path in (out / "checkpoints").glob("step-*.pt"):
        state = torch.load(path, weights_only=False)
        assert all(torch.isfinite(t).all() for t in state["lora"].values()), path
        assert all(math.isfinite(x) for x in state["losses"]), path


def test_resume_refuses_another_configuration_and_skips_a_truncated_checkpoint(tmp_path):
    """``resume`` with another method or lr silently mixed two runs; a truncated latest
    ``step-*.pt`` failed with a raw ``PytorchStreamReader`` error although an earlier one was
    intact. Now the differing settings are named (before any work), the truncated file is skipped
    with a warning naming it, and checkpoints are written through a rename."""
    pytest.importorskip("peft")
    from fastdit.train import train_lora

    out = tmp_path / "run"
    first = train_lora(_pipe(), _train_config(steps=2, checkpoint_every=1), out, progress=False)
    assert not list((out / "checkpoints").glob("*.partial"))
    with pytest.raises(ValueError, match=r"lr: checkpoint 0\.01, this run 0\.1"):
        train_lora(_pipe(), _train_config(steps=3, lr=0.1), out, resume=True, progress=False)
    with pytest.raises(ValueError, match=r"method: checkpoint 'sta', this run 'window'"):
        train_lora(_pipe(), _train_config(steps=3, method="window"), out, resume=True, progress=False)
    latest = out / "checkpoints" / "step-000002.pt"
    latest.write_bytes(latest.read_bytes()[:200])  # truncated
    with pytest.warns(UserWarning, match="skipped unreadable checkpoint.*step-000002.pt.*step-000001.pt"):
        resumed = train_lora(_pipe(), _train_config(steps=2, checkpoint_every=1), out, resume=True, progress=False)
    assert resumed["resumed_from"] == 1
    assert resumed["losses"] == pytest.approx(first["losses"], rel=1e-6, abs=1e-9)
    json.loads((out / "losses.json").read_text(), parse_constant=lambda name: pytest.fail(f"non-standard {name}"))


# -- values checked before any work ---------------------------------------------------------------
@pytest.mark.parametrize("argv, flag", [
    (["--options", "{bad"], "--options: not valid JSON"),
    (["--options", "[1, 2]"], "--options must be a JSON object"),
    (["--options", '{"tile": 5}'], "--options: tile must be"),
    (["--method", "bogus"], "--method: unknown method"),
    (["--eval-seeds", "abc"], "--eval-seeds must be comma-separated integers"),
    (["--prompts", '"abc"'], "--prompts must be a JSON list of non-empty strings"),
    (["--held-out", "[1]"], "--held-out must be a JSON list"),
    (["--call", "[]"], "--call must be a JSON object"),
    (["--videos", '[["a car", "/nonexistent.mp4"]]'], "--videos: '/nonexistent.mp4' is not a file"),
    (["--steps", "0"], "--steps: steps must be an int >= 1"),
    (["--lr", "-1"], "--lr: lr must be a number > 0"),
    (["--time-dense", "-2"], "--time-dense must be >= 0"),
])
def test_train_command_checks_every_value_before_loading(argv, flag, tmp_path, monkeypatch, capsys):
    """Every ``python -m fastdit.train`` input error was a raw traceback (some only after training);
    now a one-line error naming the flag, before any model loads."""
    import fastdit.train.__main__ as train_main

    monkeypatch.setattr(train_main, "_pipeline", lambda args: pytest.fail("a model was loaded"))
    with pytest.raises(SystemExit) as exit_info:
        train_main.main(["--tiny", "wan", "--out", str(tmp_path / "run"), *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert flag in err[-1], err


def test_train_out_that_is_a_file_is_refused_before_loading(tmp_path, monkeypatch, capsys):
    import fastdit.train.__main__ as train_main

    monkeypatch.setattr(train_main, "_pipeline", lambda args: pytest.fail("a model was loaded"))
    existing = tmp_path / "a_file"
    existing.write_text("x")
    with pytest.raises(SystemExit):
        train_main.main(["--tiny", "wan", "--out", str(existing)])
    assert "--out" in capsys.readouterr().err and existing.read_text() == "x"


@pytest.mark.parametrize("argv, flag", [
    (["--kernels", "bogus"], "--kernels: unknown ['bogus']"),
    (["--head-dims", "0"], "--head-dims: a comma list of positive ints"),
    (["--targets", ""], "--targets: none given"),
    (["--table", "/nonexistent.json"], "--table '/nonexistent.json': no such file"),
    (["--dtypes", "int8"], "--dtypes: unknown ['int8']"),
])
def test_offline_compile_checks_its_values(argv, flag, capsys):
    """``python -m fastdit.kernels.offline --kernels bogus`` (``--head-dims 0``, ``--targets ""``,
    ``--table /nonexistent.json``) exited 0 with 0 cases, ``--dtypes int8`` a KeyError."""
    from fastdit.kernels import offline

    with pytest.raises(SystemExit) as exit_info:
        offline.main(argv)
    assert exit_info.value.code == 2
    assert flag in capsys.readouterr().err


# -- auto calibrations: keys and encodings ------------------------------------------------------------
AUTO_CANDIDATES = [{"method": "sta", "tile": (1, 2, 2), "window": (1, 1, 1)}, {"method": "todo", "factor": 2}]


def _auto_plan(choices):
    return {"format": "fastdit-plan", "version": 2, "method": "auto", "step_buckets": [0], "options": {},
            "model": {"family": "wan", "transformer": "WanTransformer3DModel", "layers": 1, "heads": 1, "grids": []},
            "candidates": AUTO_CANDIDATES, "choices": choices}


@pytest.mark.parametrize("key", ["\u00b2_0_0", "\u0660_0_0", "00_0_0"])
def test_calibration_keys_are_ascii_decimal(key):
    """A choices key ``"²_0_0"`` gave a raw ``int()`` error; ``"٠_0_0"`` (Arabic-Indic zero) was
    accepted as a second ``0_0_0``. Both, and leading zeros, are refused naming the entry."""
    from fastdit.calibration.calibration_file import CalibrationError, load_calibration
    from fastdit.methods.base import get_method

    with pytest.raises(CalibrationError, match="choices entry .*ASCII digits"):
        load_calibration(_auto_plan({"0_0_0": 0, key: 1}))
    with pytest.raises(ValueError, match="choices entry .*ASCII digits"):
        get_method("auto").make_config(candidates=AUTO_CANDIDATES, choices={key: 0})


def test_a_non_utf8_calibration_file_is_a_calibration_error(tmp_path):
    """A non-UTF-8 plan file gave a raw ``UnicodeDecodeError``; docs promise a CalibrationError naming the file."""
    from fastdit.calibration.calibration_file import CalibrationError, load_calibration

    path = tmp_path / "plan.json"
    path.write_bytes(b'{"format": "fastdit-plan", "method": "\xff\xfe"}')
    with pytest.raises(CalibrationError, match=r"calibration file .*plan\.json: not UTF-8"):
        load_calibration(path)


def test_set_applies_on_top_of_an_auto_calibration(tmp_path):
    """``fastdit compare --methods dense,auto --plan auto.json --set auto.dense_steps=1`` was refused
    with "method 'auto' needs a calibration" although --calibration was given (docs/calibration.md: --set applies
    on top); the options are now checked with the plan's under them."""
    from fastdit.cli.common import CLIError, parse_options

    path = tmp_path / "auto.json"
    path.write_text(json.dumps(_auto_plan({"0_0_0": 0})))
    assert parse_options(["auto.dense_steps=1"], ["dense", "auto"], str(path)) == {"auto": {"dense_steps": 1}}
    with pytest.raises(CLIError, match="needs a calibration"):  # without --calibration it is still refused
        parse_options(["auto.dense_steps=1"], ["dense", "auto"])
    with pytest.raises(CLIError, match="argument --calibration: .*not UTF-8"):
        (tmp_path / "bad.json").write_bytes(b"\xff\xfe")
        parse_options(["auto.dense_steps=1"], ["dense", "auto"], str(tmp_path / "bad.json"))


# -- quiet wrong turns ------------------------------------------------------------------------------
def test_an_empty_set_value_means_none():
    """``--set sparge.topk=`` was refused though the option table says "empty: use cdf"."""
    from fastdit.cli.common import CLIError, parse_options

    assert parse_options(["sparge.topk="], ["sparge"]) == {"sparge": {"topk": None}}
    with pytest.raises(CLIError, match="--set sparge.topk=2"):
        parse_options(["sparge.topk=2"], ["sparge"])


@pytest.mark.parametrize("method, beside", [("sta", "plan.json.partial.json"), ("auto", "plan.png")])
def test_calibrate_refuses_a_folder_where_it_writes_beside_out(method, beside, tmp_path, capsys, monkeypatch):
    """``OUT.partial.json`` or (auto) ``OUT.png`` existing as a folder failed late, left temp files
    or exited 1 after writing the plan; now refused before any model loads."""
    from fastdit.cli import main
    from fastdit.pipelines import loading

    monkeypatch.setattr(loading, "load_pipeline", lambda *a, **k: pytest.fail("a model was loaded"))
    (tmp_path / beside).mkdir()
    with pytest.raises(SystemExit) as exit_info:
        main(["calibrate", "--method", method, "--budget", "0.1", "--out", str(tmp_path / "plan.json")])
    assert exit_info.value.code == 2 and f"{beside}, which is a folder" in capsys.readouterr().err
