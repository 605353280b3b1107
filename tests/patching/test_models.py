"""Model coverage, the matrix: every adapter family on a tiny random-weight transformer (CPU, fp32)
against every registered method (helpers and the observation approach: model_matrix.py).

* Registry: every family has a tiny model; adapters are buildable, find their model and patch only
  self / joint attention modules.
* Text position: the rows new latents do not reach are one block at the start (prefix) or the end
  (suffix) of the sequence, reached by new text embeddings, as the adapter's ``text_position`` says.
* Sparse run (sliding tile with a small tile and window, mask density < 0.7): every patched layer's
  output (captured at ``run_plan`` with ``LayerTrace``) equals float64 attention under
  ``sta_token_mask`` of the layout built from the input grid and the observed text rows, with the
  text-padding key mask read from the model's inputs; at two odd grids under one patch. Then
  ``remove()`` restores bit-identical outputs and leaves nothing installed.
* Every other method: each layer equals ``fastdit.attention`` on the observed layout; methods that
  do not apply to a family refuse with a clear error.
* Dense through the patch equals the unpatched model.

Family specifics are in test_model_families.py, bad input in test_model_bad_input.py.
"""
from __future__ import annotations

import math

import pytest
import torch

import fastdit
from fastdit.pipelines import UnsupportedModelError, find_adapter, registered_adapters

from layer_capture import LayerTrace
from model_matrix import (
    CASE_FAMILY, CASES, METHODS, QUERY_MASKED, UNPATCHABLE, assert_clean, assert_installed, check_sta_layers, grids,
    inputs, installed_state, key_validity, method_applies, method_options, model, observe, quiet_run, reference,
    sta_options,
)
from tiny_models import TINY, run

# -- registry --------------------------------------------------------------------------------------

def test_every_family_has_a_tiny_model():
    families = {a.family for a in registered_adapters()}
    assert families <= set(CASE_FAMILY.values()), f"families without a tiny test model: {families - set(CASE_FAMILY.values())}"


def test_adapters_are_buildable_and_consistent():
    import diffusers

    for adapter in registered_adapters():
        assert adapter.classes(), f"{adapter.family}: no transformer class found in diffusers"
        assert adapter.text_position in ("none", "prefix", "suffix")
        for pipeline in adapter.pipelines:
            assert hasattr(diffusers, pipeline), f"{adapter.family}: diffusers has no {pipeline}"
        assert adapter.notes


@pytest.mark.parametrize("case", list(TINY))
def test_adapter_found_and_modules_are_self_or_joint(case):
    m = model(case)
    if CASE_FAMILY[case] in UNPATCHABLE:
        with pytest.raises(UnsupportedModelError, match="linear"):
            find_adapter(m)
        return
    adapter = find_adapter(m)
    assert adapter.family == CASE_FAMILY[case]
    modules = adapter.attention_modules(m)
    assert modules
    # cross-attention modules (attn2 everywhere but SD3.5's dual image self-attention) stay unpatched
    names = [n for n, _ in modules]
    assert not any(n.endswith("cross_attention") for n in names)
    if CASE_FAMILY[case] != "sd3":
        assert not any(n.endswith("attn2") for n in names)


# -- the text position, observed ---------------------------------------------------------------------

@pytest.mark.parametrize("case", CASES)
def test_text_position_observed_in_the_model_matches_the_adapter(case):
    adapter = find_adapter(model(case))
    grid = TINY[case].grid
    observed = observe(case)
    seen = {}
    for name, call in observed.items():
        # every patched module is self / joint attention (a cross-attention call has fewer keys)
        assert call.q_len == call.k_len, f"{name}: {call.q_len} queries, {call.k_len} keys: cross-attention patched"
        assert int(call.video_rows.sum()) == math.prod(grid), (
            f"{name}: new latents change {int(call.video_rows.sum())} rows, the grid {grid} has {math.prod(grid)} tokens")
        assert call.position in ("none", "prefix", "suffix"), (
            f"{name}: the rows the latents do not reach are not one block at either end: {call.position}")
        if call.text_len:
            text_rows = ~call.video_rows
            assert call.text_rows_changed[text_rows].any(), f"{name}: new text embeddings change none of the text rows"
        seen[name] = (call.position, call.text_len)
    positions = {position for position, text_len in seen.values() if text_len}
    assert positions <= {adapter.text_position}, (
        f"{adapter.family}: observed text {seen}, the adapter says text_position={adapter.text_position!r}")
    if adapter.text_position != "none":
        assert positions, f"{adapter.family}: the adapter says {adapter.text_position!r}, no text rows observed: {seen}"


# -- sparse layers against an independent reference ------------------------------------------------------

@pytest.mark.parametrize("case", CASES)
def test_sta_layers_equal_independent_masked_reference_and_remove_restores(case, monkeypatch):
    m, options = model(case), sta_options(case)
    tile, window = options["tile"], options["window"]
    modules = find_adapter(m).attention_modules(m)
    observed = {grid: observe(case, grid) for grid in grids(case)}  # the unpatched model, before patching
    ref = reference(case)
    before = installed_state(m)
    p = fastdit.patch(m, "sta", backend="torch", **options)
    trace = LayerTrace(monkeypatch, modules)
    try:
        assert p.layers == [name for name, _ in modules]
        assert_installed(m, p.layers)
        # the case grid, then another odd grid under the same patch
        for grid in grids(case):
            assert any(g % t for g, t in zip(grid, tile)), "the grid should not be a multiple of the tile"
            kwargs = inputs(case, grid)
            trace.clear()
            p.reset_stats()
            out = quiet_run(m, kwargs)
            assert torch.isfinite(out).all()
            # one sparse call per patched layer and no fallback
            assert p.stats.sparse_calls == len(p.layers), p.stats.fallbacks
            assert p.stats.fallback_calls == 0 and not p.stats.fallbacks
            assert sorted(trace.layers) == sorted(p.layers)
            check_sta_layers(case, kwargs, grid, observed[grid], trace, tile, window)
            if grid == TINY[case].grid:
                assert not torch.allclose(out, ref, rtol=0, atol=1e-5), "sparse attention changed nothing"
    finally:
        trace.remove()
        p.remove()
    p.remove()  # idempotent
    assert not p.active
    assert torch.equal(run(m, inputs(case)), ref)
    assert_clean(m, before)
    fastdit.patch(m, "dense").remove()  # and it can be patched again
    assert_clean(m, before)


@pytest.mark.parametrize("method", [name for name in METHODS if name not in ("dense", "sta")])
@pytest.mark.parametrize("case", CASES)
def test_other_methods_equal_functional_attention_on_the_observed_layout(case, method, monkeypatch):
    m, options = model(case), method_options(method, case)
    if not method_applies(method, case):
        with pytest.raises(ValueError, match=CASE_FAMILY[case]):
            fastdit.patch(m, method, backend="torch", **options)
        assert_clean(m)
        return
    grid = TINY[case].grid
    observed, kwargs = observe(case), inputs(case)
    modules = find_adapter(m).attention_modules(m)
    p = fastdit.patch(m, method, backend="torch", **options)
    trace = LayerTrace(monkeypatch, modules)
    try:
        out = quiet_run(m, kwargs)
        assert torch.isfinite(out).all()
        assert p.stats.sparse_calls == len(p.layers) and p.stats.fallback_calls == 0, p.stats.fallbacks
        assert sorted(trace.layers) == sorted(p.layers)
        # (a copy: fastdit.attention below goes through the traced run_plan too)
        for name, (q, k, v, scale, got) in list(zip(trace.layers, trace.calls)):
            layout = observed[name].layout(grid)
            valid = key_validity(case, kwargs, layout)
            expected = fastdit.attention(q, k, v, method, p.config, layout=layout, scale=scale, backend="torch",
                                         key_mask=None if valid is None else valid[None],
                                         timestep=kwargs.get("timestep"))  # optiprune's draw is keyed to it
            rows = valid if valid is not None and CASE_FAMILY[case] in QUERY_MASKED else slice(None)
            assert torch.allclose(got[:, :, rows], expected[:, :, rows], rtol=1e-5, atol=1e-6), name
    finally:
        trace.remove()
        p.remove()
    assert_clean(m)


@pytest.mark.parametrize("case", CASES)
def test_dense_patch_equals_unpatched(case):
    m, kwargs, ref = model(case), inputs(case), reference(case)
    before = installed_state(m)
    with fastdit.patch(m, "dense") as p:
        out = quiet_run(m, kwargs)
        assert p.stats.dense_calls == len(p.layers) and p.stats.sparse_calls == 0 and p.stats.fallback_calls == 0
    assert (out - ref).abs().max().item() <= 1e-5
    assert torch.equal(run(m, kwargs), ref)
    assert_clean(m, before)
