"""Model coverage: every adapter family on a tiny random-weight transformer (CPU, fp32).

Nothing here trusts what the patch says about itself (no ``Patch.mask``, ``last_plan``,
``last_layout``): the layout of every patched attention call is OBSERVED in the unpatched model,
and every sparse layer is checked against a float64 reference built from that observation.

* Observation (``observe``): the model runs with its own code but its attention made token-wise
  (``layer_capture.observe_attention_calls``: self-attention returns ``value``, cross-attention
  zeros), so no layer mixes tokens and each row of each patched layer's ``q`` depends on its own
  token only. Run again with new latents: the rows that change are the video tokens (their count
  must be the grid's); the rows that do not are the text / conditioning tokens, and they must be
  one block at the start (prefix) or the end (suffix) of the sequence. Run again with new text
  embeddings: they must reach those rows. The observed text position is compared with the
  adapter's ``text_position``.
* Sparse run (sliding tile with a small tile and window, mask density < 0.7): every patched layer's
  output (captured at ``run_plan`` with ``LayerTrace``) equals float64 attention under
  ``sta_token_mask`` of the layout built from the input grid (the grid ``tiny_models`` built the
  inputs for) and the observed text rows, with the
  text-padding key mask read from the model's inputs; at two odd grids under one patch. Then
  ``remove()`` restores bit-identical outputs and leaves nothing installed.
* Every other method: each layer equals ``fastdit.attention`` on the observed layout; methods that
  do not apply to a family refuse with a clear error.
* Dense through the patch equals the unpatched model; fallbacks are counted with their reasons;
  bad input (UNet, unknown modules, unpatchable families), Wan 2.2's two transformers and a
  user-registered adapter.
"""
from __future__ import annotations

import math
import types
import warnings
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

import fastdit
from fastdit.layout import TokenLayout
from fastdit.methods import get_method, method_names
from fastdit.pipelines import Adapter, UnsupportedModelError, find_adapter, register_adapter
from fastdit.pipelines.adapters import unregister_adapter

from fastdit.pipelines import registered_adapters

from layer_capture import LayerTrace, assert_matches_masked_dense, changed_rows, observe_attention_calls, sta_token_mask
from tiny_models import TINY, run

# Test case -> adapter family (several cases can exercise one adapter, e.g. CogVideoX 1.0 and 1.5).
CASE_FAMILY = {name: name for name in TINY}
CASE_FAMILY["cogvideox15"] = "cogvideox"

UNPATCHABLE = {a.family for a in registered_adapters() if a.unsupported}
CASES = [name for name in TINY if CASE_FAMILY[name] not in UNPATCHABLE]
METHODS = list(method_names())  # queried at collection: new methods join the matrix automatically

#: Sliding tile small enough to be really sparse at tiny sizes (mask density < 0.7 at both grids).
#: The windows differ along H and W (1 and 3 tiles) and the second grid swaps H and W, so a
#: transposed grid shows.
STA = {"video": dict(tile=(1, 2, 2), window=(3, 1, 3)), "image": dict(tile=(1, 2, 2), window=(1, 1, 3))}
#: A second grid per kind, not a multiple of the tile, with H and W the other way round.
OTHER_GRID = {"video": (2, 7, 5), "image": (1, 7, 5)}
#: Options of the other methods, so their plans are sparse at tiny sizes.
OPTIONS = {"radial": {"video": dict(block_size=64)}}
COMMON = dict(dense_steps=0, dense_layers=0)
MAX_DENSITY = 0.7


def kind(case):
    return "video" if TINY[case].video else "image"


def grids(case):
    return (TINY[case].grid, OTHER_GRID[kind(case)])


def sta_options(case):
    return {**COMMON, **STA[kind(case)]}


def method_options(method, case):
    if method == "dense":
        return {}
    if method == "sta":
        return sta_options(case)
    cls = get_method(method)
    valid = {f for f in cls.config_cls.__dataclass_fields__}
    # The method's own tiny-model preset, then this file's choices for the tiny test grids.
    chosen = {**cls.tiny_options, **OPTIONS.get(method, {}).get(kind(case), {})}
    return {**COMMON, **{k: v for k, v in chosen.items() if k in valid}}


def method_applies(method, case):
    adapter = find_adapter(model(case))
    m = get_method(method)
    try:
        m.check_family(adapter, m.resolve(m.make_config(**method_options(method, case)), adapter.family))
    except ValueError:
        return False
    return True


_MODELS, _REFS, _OBSERVED = {}, {}, {}


def model(case):
    if case not in _MODELS:
        _MODELS[case] = TINY[case].build(0)
    return _MODELS[case]


def inputs(case, grid=None):
    return TINY[case].inputs(model(case), grid or TINY[case].grid)


def reference(case, grid=None):
    key = (case, grid)
    if key not in _REFS:
        _REFS[key] = run(model(case), inputs(case, grid))
    return _REFS[key]


def quiet_run(m, kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return run(m, kwargs)


# -- what fastdit may leave on a model ---------------------------------------------------------------

_MISSING = "<not set>"


def installed_state(module):
    """Per submodule: its hooks, whether it has an instance ``forward`` or the fastdit mark, and its
    processor's instance ``_attention_backend``."""
    state = {}
    for name, sub in module.named_modules():
        processor = getattr(sub, "processor", None)
        backend = None if processor is None else processor.__dict__.get("_attention_backend", _MISSING)
        state[name] = (tuple(sub._forward_pre_hooks), tuple(sub._forward_hooks), "forward" in sub.__dict__,
                       "_fastdit_patch" in sub.__dict__, backend)
    return state


def fastdit_backends_registered():
    """Private fastdit members still registered with diffusers' attention backends."""
    try:
        from diffusers.models.attention_dispatch import _AttentionBackendRegistry
    except ImportError:
        return []
    return [str(name) for name in _AttentionBackendRegistry._backends if "fastdit" in str(getattr(name, "value", name))]


def assert_clean(module, before=None):
    """Nothing of fastdit is left in ``module``: no forward hook or pre-hook, no instance ``forward``,
    no ``_fastdit_patch`` mark, no processor pinned to a fastdit backend; and with ``before`` (an
    ``installed_state`` taken before patching) every processor's backend is what it was."""
    for name, sub in module.named_modules():
        where = name or type(sub).__name__
        assert not sub._forward_pre_hooks, f"forward pre-hook left on {where}"
        assert not sub._forward_hooks, f"forward hook left on {where}"
        assert "forward" not in sub.__dict__, f"instance forward left on {where}"
        assert "_fastdit_patch" not in sub.__dict__, f"fastdit mark left on {where}"
        processor = getattr(sub, "processor", None)
        if processor is not None:
            backend = processor.__dict__.get("_attention_backend")
            assert "fastdit" not in str(getattr(backend, "value", backend)), f"fastdit backend left on {where}"
    assert not fastdit_backends_registered(), "fastdit backends left registered with diffusers"
    if before is not None:
        assert installed_state(module) == before


def assert_installed(module, layer_names):
    """While patched: each patched module has its instance ``forward`` (the "nothing left" checks
    look for what is really installed)."""
    modules = dict(module.named_modules())
    for name in layer_names:
        assert "forward" in modules[name].__dict__, f"{name} is not intercepted"
    assert module._forward_pre_hooks, "no forward pre-hook on the transformer"


# -- observing the model -------------------------------------------------------------------------------

@dataclass
class Observed:
    """One patched module's attention call in the unpatched model."""

    name: str
    q_len: int
    k_len: int
    video_rows: torch.Tensor  # bool (S,): rows that new latents change
    text_rows_changed: torch.Tensor  # bool (S,): rows that new text embeddings change

    @property
    def text_len(self):
        return int((~self.video_rows).sum())

    @property
    def position(self):
        rows = (~self.video_rows).nonzero().flatten().tolist()
        if not rows:
            return "none"
        if rows == list(range(len(rows))):
            return "prefix"
        if rows == list(range(self.q_len - len(rows), self.q_len)):
            return "suffix"
        return f"rows {rows}"

    def layout(self, grid):
        """The layout of this call: the test's grid and the observed text rows."""
        return TokenLayout(grid, self.text_len, self.position if self.text_len else "none")


def _fresh(tensor, seed):
    return torch.randn(tensor.shape, generator=torch.Generator().manual_seed(seed), dtype=tensor.dtype)


def observe_calls(m, modules, kwargs, latents="hidden_states", text="encoder_hidden_states"):
    """``{name: Observed}`` for each module in ``modules`` (``[(name, module)]``): three runs of the
    unpatched model with token-wise attention, the second with new latents, the third with new text
    embeddings (when the model takes ``text``)."""
    base = observe_attention_calls(m, modules, kwargs)
    new_latents = observe_attention_calls(m, modules, dict(kwargs, **{latents: _fresh(kwargs[latents], 1234)}))
    new_text = (observe_attention_calls(m, modules, dict(kwargs, **{text: _fresh(kwargs[text], 4321)}))
                if text in kwargs else base)
    assert [c[0] for c in base] == [c[0] for c in new_latents] == [c[0] for c in new_text]
    observed = {}
    for (name, q, k), (_, q_latents, _), (_, q_text, _) in zip(base, new_latents, new_text):
        assert name not in observed, f"{name}: more than one attention call per forward (batch 1)"
        observed[name] = Observed(name, q.shape[-2], k.shape[-2], changed_rows(q, q_latents), changed_rows(q, q_text))
    assert set(observed) == {name for name, _ in modules}, "a patched module made no attention call"
    return observed


def observe(case, grid=None):
    grid = grid or TINY[case].grid
    if (case, grid) not in _OBSERVED:
        m = model(case)
        _OBSERVED[(case, grid)] = observe_calls(m, find_adapter(m).attention_modules(m), inputs(case, grid))
    return _OBSERVED[(case, grid)]


# -- text padding, from the model's inputs ----------------------------------------------------------------

#: Families whose attention mask also drops padded query rows (HunyuanVideo 1.5's valid[q] & valid[k]).
QUERY_MASKED = {"hunyuan_video15"}


def text_validity(case, kwargs):
    """Bool validity of the non-video tokens of the joint attention calls, in sequence order, read
    from the inputs; None when every such token is valid."""
    family = CASE_FAMILY.get(case, case)
    if family == "hunyuan_video":
        return kwargs["encoder_attention_mask"][0].bool()
    if family == "qwen_image":
        return kwargs["encoder_hidden_states_mask"][0].bool()
    if family == "hunyuan_video15":
        # The model lines its conditioning up as [valid image, valid byT5, valid text, invalid image,
        # invalid byT5, invalid text]; image tokens are invalid for text-to-video (all-zero image_embeds).
        image = kwargs["image_embeds"][0]
        text, text_2 = kwargs["encoder_attention_mask"][0].bool(), kwargs["encoder_attention_mask_2"][0].bool()
        valid = int(text.sum()) + int(text_2.sum()) + (image.shape[0] if bool(image.any()) else 0)
        return torch.arange(image.shape[0] + text.numel() + text_2.numel()) < valid
    return None  # (Mochi drops its padded text tokens before attention: the ones it passes are valid)


def key_validity(case, kwargs, layout):
    """Bool ``(S,)`` key validity of a call with ``layout``, or None (all valid)."""
    text = text_validity(case, kwargs) if layout.text_len else None
    if text is None:
        return None
    assert text.numel() == layout.text_len, f"{layout.text_len} text rows observed, the inputs have {text.numel()}"
    valid = torch.ones(layout.seq_len, dtype=torch.bool)
    valid[layout.text_positions()] = text
    return valid


def reference_mask(case, kwargs, layout, tile, window):
    """The sliding-tile token mask of a call, built from the layout and the inputs alone."""
    valid = key_validity(case, kwargs, layout)
    mask = sta_token_mask(layout, tile, window, valid)
    if valid is not None and CASE_FAMILY.get(case, case) in QUERY_MASKED:
        mask &= valid[:, None]
    return mask


def check_sta_layers(case, kwargs, grid, observed, trace, tile, window):
    """Every traced sparse call == float64 attention under the independently built mask."""
    assert trace.calls, "no sparse attention call was made"
    densities = []
    for name, (q, k, v, scale, out) in zip(trace.layers, trace.calls):
        layout = observed[name].layout(grid)
        assert q.shape[0] == 1 and q.shape[2] == k.shape[2] == layout.seq_len, f"{name}: {tuple(q.shape)} vs {layout}"
        mask = reference_mask(case, kwargs, layout, tile, window)
        density = mask.double().mean().item()
        assert density < MAX_DENSITY, f"{name}: mask density {density:.2f}, not sparse enough to prove anything"
        densities.append(density)
        try:
            assert_matches_masked_dense(q, k, v, out, [mask] * q.shape[1], scale)
        except AssertionError as error:
            raise AssertionError(f"{name} ({layout.describe()}): {error}") from None
    return densities


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
                                         key_mask=None if valid is None else valid[None])
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


# -- family specifics ------------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["hunyuan_video", "qwen_image"])
def test_padded_text_is_never_attended(case):
    """New values in the padded text tokens change nothing, in the model and through the patch."""
    m, kwargs = model(case), inputs(case)
    valid = text_validity(case, kwargs)
    assert valid is not None and not valid.all()
    text = kwargs["encoder_hidden_states"].clone()
    text[:, ~valid] = _fresh(text[:, ~valid], 99) * 10
    changed = dict(kwargs, encoder_hidden_states=text)
    assert torch.allclose(run(m, changed), reference(case), rtol=0, atol=1e-5), "the model itself attends padding"
    with fastdit.patch(m, "sta", backend="torch", **sta_options(case)) as p:
        patched = quiet_run(m, kwargs)
        assert p.stats.sparse_calls == len(p.layers)
        assert torch.allclose(quiet_run(m, changed), patched, rtol=0, atol=1e-5), "padded text keys were attended"
    assert_clean(m)


def test_remove_restores_a_users_attention_backend():
    m = model("wan")
    m.set_attention_backend("native")
    try:
        before = installed_state(m)
        assert any(b not in (None, _MISSING) for *_, b in before.values())
        with fastdit.patch(m, "sta", backend="torch", **sta_options("wan")) as p:
            assert installed_state(m) != before
            quiet_run(m, inputs("wan"))
            assert p.stats.sparse_calls == len(p.layers)
        assert_clean(m, before)
    finally:
        for sub in m.modules():
            processor = getattr(sub, "processor", None)
            if processor is not None:
                processor.__dict__.pop("_attention_backend", None)
    assert torch.equal(run(m, inputs("wan")), reference("wan"))


def test_fallbacks_are_counted_with_their_reasons():
    # Flux ids that are not one frame-major grid: no layout, every layer runs the model's own attention
    m = model("flux")
    kwargs = inputs("flux")
    kwargs["img_ids"] = kwargs["img_ids"].flip(0)
    ref = run(m, kwargs)
    with fastdit.patch(m, "sta", backend="torch", **sta_options("flux")) as p:
        out = quiet_run(m, kwargs)
        assert p.stats.sparse_calls == 0 and p.stats.fallback_calls == len(p.layers)
        ((reason, count),) = p.stats.fallbacks.items()
        assert "grid" in reason and count == len(p.layers)
        assert p.stats.effective_density == 1.0
    assert torch.allclose(out, ref, rtol=0, atol=1e-6)
    assert_clean(m)

    # an adapter that (wrongly) also names PixArt's cross-attention: those calls fall back, counted
    register_adapter(Adapter(family="pixart_with_cross", transformer_classes=("PixArtTransformer2DModel",),
                             attention_pattern=r"transformer_blocks\.\d+\.attn[12]", video=False, round_up=False,
                             notes="test adapter"), first=True)
    try:
        m = model("pixart_sigma")
        with fastdit.patch(m, "sta", backend="torch", **sta_options("pixart_sigma")) as p:
            quiet_run(m, inputs("pixart_sigma"))
            cross = sum(name.endswith("attn2") for name in p.layers)
            assert cross and p.stats.sparse_calls == len(p.layers) - cross
            assert p.stats.fallback_calls == cross
            ((reason, count),) = p.stats.fallbacks.items()
            assert "cross-attention" in reason and count == cross
        assert_clean(m)
    finally:
        unregister_adapter("pixart_with_cross")
    assert find_adapter(model("pixart_sigma")).family == "pixart_sigma"


def _submodule(target, name):
    if isinstance(target, torch.nn.Module):
        return target.get_submodule(name)
    attr, rest = name.split(".", 1)
    return getattr(target, attr).get_submodule(rest)


def test_wan22_two_transformers_share_one_step_counter(monkeypatch):
    high, low = TINY["wan"].build(0), TINY["wan"].build(1)
    pipe = types.SimpleNamespace(transformer=high, transformer_2=low, scheduler=None)
    kwargs, grid = inputs("wan"), TINY["wan"].grid
    refs = run(high, kwargs), run(low, kwargs)
    adapter = find_adapter(high)
    observed = {}
    for attr, transformer in (("transformer", high), ("transformer_2", low)):
        for name, call in observe_calls(transformer, adapter.attention_modules(transformer), kwargs).items():
            observed[f"{attr}.{name}"] = call
    options = sta_options("wan")
    p = fastdit.patch(pipe, "sta", backend="torch", **options)
    trace = LayerTrace(monkeypatch, [(name, _submodule(pipe, name)) for name in p.layers])
    try:
        assert p.layers[0].startswith("transformer.") and p.layers[-1].startswith("transformer_2.")
        assert sorted(p.layers) == sorted(observed)
        # Wan 2.2: the high-noise expert runs the early steps, the low-noise expert the late ones;
        # one counter spans both, so dense_steps counts pipeline steps, not per-expert calls.
        run(high, dict(kwargs, timestep=torch.tensor([900])))
        assert p.step == 0
        run(low, dict(kwargs, timestep=torch.tensor([100])))
        assert p.step == 1
        assert sorted(trace.layers) == sorted(p.layers)
        check_sta_layers("wan", kwargs, grid, observed, trace, options["tile"], options["window"])
    finally:
        trace.remove()
        p.remove()
    assert torch.equal(run(high, kwargs), refs[0]) and torch.equal(run(low, kwargs), refs[1])
    assert_clean(high)
    assert_clean(low)


def test_flux_grid_from_img_ids_and_kontext_reference():
    m = model("flux")
    adapter = find_adapter(m)
    kwargs = inputs("flux", (1, 3, 5))
    assert adapter.grid(m, (), kwargs) == (1, 3, 5)
    # Kontext: a same-size reference image with t = 1 appended -> two frames
    ref_ids = kwargs["img_ids"].clone()
    ref_ids[:, 0] = 1
    kontext = dict(kwargs, img_ids=torch.cat([kwargs["img_ids"], ref_ids]))
    assert adapter.grid(m, (), kontext) == (2, 3, 5)
    # ids that are not one full grid: None (the call runs dense)
    assert adapter.grid(m, (), dict(kwargs, img_ids=kwargs["img_ids"][:-1])) is None


def test_qwen_image_grid_from_img_shapes():
    m = model("qwen_image")
    adapter = find_adapter(m)
    assert adapter.grid(m, (), dict(inputs("qwen_image"), img_shapes=[[(1, 4, 6)]])) == (1, 4, 6)
    assert adapter.grid(m, (), dict(inputs("qwen_image"), img_shapes=[[(1, 4, 6), (1, 4, 6)]])) == (2, 4, 6)
    assert adapter.grid(m, (), dict(inputs("qwen_image"), img_shapes=[[(1, 4, 6), (1, 2, 2)]])) is None


def test_ltx_grid_from_kwargs_or_video_coords():
    m = model("ltx_video")
    adapter = find_adapter(m)
    kwargs = inputs("ltx_video", (2, 3, 4))
    assert adapter.grid(m, (), kwargs) == (2, 3, 4)
    t, h, w = torch.meshgrid(torch.arange(2), torch.arange(3), torch.arange(4), indexing="ij")
    coords = torch.stack([t.flatten(), h.flatten(), w.flatten()])[None].float()
    no_sizes = {k: v for k, v in kwargs.items() if k not in ("num_frames", "height", "width")}
    assert adapter.grid(m, (), dict(no_sizes, video_coords=coords)) == (2, 3, 4)


def test_positional_call_arguments_are_bound():
    m = model("cogvideox")
    adapter = find_adapter(m)
    kwargs = inputs("cogvideox")
    latents = kwargs.pop("hidden_states")
    assert adapter.grid(m, (latents,), kwargs) == TINY["cogvideox"].grid


def test_kandinsky5_nabla_checkpoint_is_rejected():
    m = model("kandinsky5")
    m.register_to_config(attention_type="nabla")
    try:
        with pytest.raises(UnsupportedModelError, match="nabla"):
            fastdit.patch(m, "sta")
        assert_clean(m)
    finally:
        m.register_to_config(attention_type="regular")
    fastdit.patch(m, "dense").remove()


# -- bad input -------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", [c for c in TINY if CASE_FAMILY[c] in UNPATCHABLE])
@pytest.mark.parametrize("method", METHODS)
def test_unpatchable_family_clear_error_nothing_patched(case, method):
    m = model(case)
    with pytest.raises(UnsupportedModelError, match="linear"):
        fastdit.patch(m, method)
    assert_clean(m)


def _tiny_unet():
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    return UNet2DConditionModel(sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
                                block_out_channels=(8, 16), down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=8,
                                attention_head_dim=2, norm_num_groups=4).eval()


def test_unet_model_clear_error_nothing_patched():
    unet = _tiny_unet()
    with pytest.raises(ValueError, match="UNet") as info:
        fastdit.patch(unet, "sta")
    for family in ("wan", "flux", "sd3"):
        assert family in str(info.value)
    assert "register_adapter" in str(info.value)
    assert_clean(unet)


def test_unet_pipeline_clear_error_nothing_patched():
    unet = _tiny_unet()
    pipe = types.SimpleNamespace(unet=unet, scheduler=types.SimpleNamespace())
    with pytest.raises(ValueError, match="UNet"):
        fastdit.patch(pipe, "sta")
    assert_clean(unet)
    assert "set_timesteps" not in vars(pipe.scheduler)


def test_unknown_module_clear_error_lists_families():
    module = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(UnsupportedModelError) as info:
        fastdit.patch(module, "sta")
    message = str(info.value)
    for adapter in registered_adapters():
        if not adapter.unsupported:
            assert adapter.family in message
    assert "register_adapter" in message
    assert_clean(module)


# -- a user-registered adapter, as the adapters docstring shows --------------------------------------

class _ToyAttention(torch.nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads, self.qkv = heads, torch.nn.Linear(dim, 3 * dim)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, d)


class ToyDiT(torch.nn.Module):
    """A minimal video DiT: (B, C, T, H, W) latents, 1x1x1 patches, self-attention blocks."""

    def __init__(self, channels=4, dim=32, heads=2, depth=2):
        super().__init__()
        self.embed = torch.nn.Linear(channels, dim)
        self.blocks = torch.nn.ModuleList(torch.nn.ModuleDict({"attn": _ToyAttention(dim, heads)}) for _ in range(depth))

    def forward(self, hidden_states, timestep=None):
        x = self.embed(hidden_states.flatten(2).transpose(1, 2))
        for block in self.blocks:
            x = x + block["attn"](x)
        return x


def test_register_adapter_for_a_new_model(monkeypatch):
    register_adapter(Adapter(
        family="toy_dit",
        transformer_classes=(ToyDiT,),
        attention_pattern=r"blocks\.\d+\.attn",
        grid_fn=lambda adapter, transformer, call: tuple(call["hidden_states"].shape[2:]),
        notes="test adapter",
    ))
    try:
        torch.manual_seed(0)
        toy = ToyDiT().eval()
        x = torch.randn(1, 4, 3, 5, 7)
        with torch.no_grad():
            ref = toy(x)
        modules = [(f"blocks.{i}.attn", block["attn"]) for i, block in enumerate(toy.blocks)]
        observed = observe_calls(toy, modules, {"hidden_states": x})
        tile, window = (2, 2, 2), (1, 3, 3)
        p = fastdit.patch(toy, "sta", backend="torch", tile=tile, window=window, dense_steps=0, dense_layers=0)
        trace = LayerTrace(monkeypatch, modules)
        try:
            assert p.layers == [name for name, _ in modules]
            with torch.no_grad():
                toy(x)
            assert p.stats.sparse_calls == len(p.layers) and trace.layers == p.layers
            check_sta_layers("toy_dit", {}, (3, 5, 7), observed, trace, tile, window)
        finally:
            trace.remove()
            p.remove()
        with torch.no_grad():
            assert torch.equal(toy(x), ref)
        assert_clean(toy)
    finally:
        unregister_adapter("toy_dit")
    with pytest.raises(UnsupportedModelError):
        find_adapter(ToyDiT())
