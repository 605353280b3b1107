"""Hardening, third round (issue 45): each test names the finding it covers.

1. the README's training command and docs/training.md's config (fractional dense_steps, options
   that fit the tiny grid); 2. dense_steps after a scheduler swap; 3. copies of a patched model;
4. INT8 with non-finite values; 5. training that diverges, resume, atomic checkpoints; and the
later findings (values checked before any work).
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


# -- 1. the README's training command ---------------------------------------------------------------
def test_item1_readme_training_command_learns(tmp_path, capsys):
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


def test_item1_docs_config_with_the_default_fraction_trains(tmp_path):
    """docs/training.md's ``LoraTrainConfig(method="sta", options={"tile": ..., "window": ...})``
    (sta's default dense_steps is a fraction) trains, and the result says dense_steps was 0."""
    pytest.importorskip("peft")
    from fastdit.train import train_lora

    result = train_lora(_pipe(), _train_config(), tmp_path / "run", progress=False)
    assert all(math.isfinite(x) for x in result["losses"]) and any(result["losses"])
    assert result["options_trained"]["dense_steps"] == 0
    assert any("dense_steps" in note for note in result["notes"])


def test_item1_a_mask_covering_the_grid_is_reported(tmp_path):
    """sta's default window on a 3 x 4 x 4 grid covers every token: the run says the adapter
    learns nothing instead of reporting zero losses silently."""
    pytest.importorskip("peft")
    from fastdit.train import train_lora

    with pytest.warns(UserWarning, match="density 1"):
        result = train_lora(_pipe(), _train_config(options={"dense_steps": 0}, steps=1), tmp_path / "run",
                            progress=False)
    assert any("learns nothing" in note for note in result["notes"])


# -- 2. dense_steps after a scheduler swap -------------------------------------------------------
def _run_counts(pipe, patch):
    patch.reset_stats()
    pipe("a cat", **{**CALL, "num_inference_steps": 4}, output_type="latent", generator=torch.Generator().manual_seed(0))
    return patch.stats.dense_calls, patch.stats.sparse_calls


@pytest.mark.parametrize("dense_steps", [0.5, 2])
def test_item2_dense_steps_survive_a_scheduler_swap(dense_steps):
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
