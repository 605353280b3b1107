"""Model coverage: every adapter family x every method, on tiny random-weight transformers (CPU, fp32).

For every family (``tests/tiny_models.py``):
  * the ``dense`` method through the patch equals the unpatched model;
  * every method available to the family runs, and each patched layer's output equals dense
    attention under the mask it recorded (``record_masks=True`` + ``Patch.mask``); methods that do
    not apply to the family refuse with a clear error;
  * ``remove()`` restores identical outputs and leaves no hook behind;
  * grids that no tile or block size divides work, also when the shape changes under one patch.
Plus bad input (UNet, unknown modules, unpatchable families), Wan 2.2's two transformers and a
user-registered adapter.
"""
from __future__ import annotations

import math
import types
import warnings

import pytest
import torch
import torch.nn.functional as F

import fastdit
import fastdit.methods.base as patch_module  # where methods call run_plan
from fastdit.kernels import dense_reference
from fastdit.methods import get_method
from fastdit.pipelines import Adapter, UnsupportedModelError, adapters, find_adapter, register_adapter
from fastdit.pipelines.adapters import unregister_adapter

from tiny_models import TINY, run

# Test case -> adapter family (several cases can exercise one adapter, e.g. CogVideoX 1.0 and 1.5).
CASE_FAMILY = {name: name for name in TINY}
CASE_FAMILY["cogvideox15"] = "cogvideox"

UNPATCHABLE = {a.family for a in adapters() if a.unsupported}
CASES = [name for name in TINY if CASE_FAMILY[name] not in UNPATCHABLE]
METHODS = list(fastdit.methods())  # queried at collection: new methods join the matrix automatically

#: Small tiles / blocks so plans are truly sparse at tiny sizes; no dense steps or layers.
OPTIONS = {
    "dense": {},
    "sta": {"video": dict(tile=(2, 2, 2), window=(1, 3, 3)), "image": dict(tile=(1, 2, 2), window=(1, 3, 3))},
    "radial": {"video": dict(block_size=64)},
}
COMMON = dict(dense_steps=0, dense_layers=0)

#: Cases whose sparse calls currently fall back to dense (see the reason).
DENSE_FALLBACK = {}


def method_options(method, case):
    options = OPTIONS.get(method, {})
    if method == "dense":
        return {}
    kind = "video" if TINY[case].video else "image"
    valid = {f for f in get_method(method).config_cls.__dataclass_fields__}
    chosen = {k: v for k, v in options.get(kind, {}).items() if k in valid}
    return {**COMMON, **chosen}


def method_applies(method, case):
    adapter = find_adapter(model(case))
    m = get_method(method)
    try:
        m.check_family(adapter, m.resolve(m.make_config(**method_options(method, case)), adapter.family))
    except ValueError:
        return False
    return True


_MODELS, _REFS = {}, {}


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


def assert_clean(module):
    """No fastdit hook, mark or pinned backend is left anywhere in ``module``."""
    for name, sub in module.named_modules():
        assert not sub._forward_pre_hooks, f"forward pre-hook left on {name or type(sub).__name__}"
        assert not sub._forward_hooks, f"forward hook left on {name or type(sub).__name__}"
        assert "_fastdit_patch" not in sub.__dict__, f"fastdit mark left on {name}"
        processor = getattr(sub, "processor", None)
        if processor is not None:
            assert "_attention_backend" not in processor.__dict__ or processor.__dict__["_attention_backend"] != "native" \
                or getattr(type(processor), "_attention_backend", None) == "native", f"backend left pinned on {name}"


class Recorder:
    """Captures ``run_plan``'s q, k, v, key mask and output per patched layer (sparse calls)."""

    def __init__(self, monkeypatch, patch, transformer_modules):
        self.calls = []
        self.current = None
        self.handles = []
        for layer, module in transformer_modules:
            self.handles.append(module.register_forward_pre_hook(lambda m, a, layer=layer: self._enter(layer)))
        original = patch_module.run_plan

        def recording(q, k, v, plan, key_mask=None, scale=None, **kwargs):
            result = original(q, k, v, plan, key_mask=key_mask, scale=scale, **kwargs)
            out = result[0] if isinstance(result, tuple) else result
            self.calls.append((self.current, q.detach().clone(), k.detach().clone(), v.detach().clone(), scale,
                               out.detach().clone()))
            return result

        monkeypatch.setattr(patch_module, "run_plan", recording)

    def _enter(self, layer):
        self.current = layer

    def remove(self):
        for handle in self.handles:
            handle.remove()


def patched_modules(patch):
    """``[(layer name, module)]`` in the patch's layer naming."""
    found = []
    multi = len(patch._transformers) > 1
    for attr, transformer in patch._transformers:
        for name, module in patch.adapter.attention_modules(transformer):
            found.append((f"{attr}.{name}" if multi else name, module))
    return found


def check_layers_against_masks(patch, recorder):
    """Every sparse call's output == dense attention under the layer's recorded mask, per head."""
    assert recorder.calls, "no sparse attention call was made"
    for layer, q, k, v, scale, out in recorder.calls:
        assert layer in patch.layers
        batch, heads, seq, _ = q.shape
        assert batch == 1
        for head in range(heads):
            mask = patch.mask(layer, head)
            assert mask.shape == (seq, seq)
            ref, _ = dense_reference(q[:, head:head + 1], k[:, head:head + 1], v[:, head:head + 1], mask[None, None], scale)
            got = out[:, head:head + 1].double()
            err = (got - ref).abs().max().item() / max(ref.abs().max().item(), 1e-12)
            assert err < 1e-4, f"{layer} head {head}: relative error {err:.2e} against dense under its mask"


# -- registry --------------------------------------------------------------------------------------

def test_every_family_has_a_tiny_model():
    families = {a.family for a in adapters()}
    assert families <= set(CASE_FAMILY.values()), f"families without a tiny test model: {families - set(CASE_FAMILY.values())}"


def test_adapters_are_buildable_and_consistent():
    import diffusers

    for adapter in adapters():
        assert adapter.classes(), f"{adapter.family}: no transformer class found in diffusers"
        assert adapter.text_position in ("none", "prefix", "suffix")
        for pipeline in adapter.pipelines:
            assert hasattr(diffusers, pipeline), f"{adapter.family}: diffusers has no {pipeline}"
        assert adapter.notes


@pytest.mark.parametrize("case", list(TINY))
def test_adapter_found_and_modules_are_self_or_joint(case):
    m = model(case)
    adapter = find_adapter(m) if case not in {c for c in TINY if CASE_FAMILY[c] in UNPATCHABLE} else None
    if adapter is None:
        with pytest.raises(UnsupportedModelError, match="linear"):
            find_adapter(m)
        return
    assert adapter.family == CASE_FAMILY[case]
    modules = adapter.attention_modules(m)
    assert modules
    # cross-attention modules (attn2 everywhere but SD3.5's dual image self-attention) stay unpatched
    names = [n for n, _ in modules]
    assert not any(n.endswith("cross_attention") for n in names)
    if CASE_FAMILY[case] != "sd3":
        assert not any(n.endswith("attn2") for n in names)


# -- the family x method matrix ------------------------------------------------------------------

@pytest.mark.parametrize("case", CASES)
def test_dense_patch_equals_unpatched(case):
    m, kwargs, ref = model(case), inputs(case), reference(case)
    with fastdit.patch(m, "dense") as p:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = run(m, kwargs)
        assert p.stats.dense_calls + p.stats.fallback_calls > 0 and p.stats.sparse_calls == 0
    assert (out - ref).abs().max().item() <= 1e-5
    assert torch.equal(run(m, kwargs), ref)
    assert_clean(m)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("case", CASES)
def test_method_layers_match_dense_under_recorded_mask(case, method, monkeypatch):
    m, kwargs = model(case), inputs(case)
    options = method_options(method, case)
    if not method_applies(method, case):
        with pytest.raises(ValueError, match=CASE_FAMILY[case]):
            fastdit.patch(m, method, backend="torch", **options)
        assert_clean(m)
        return
    if method == "dense":
        pytest.skip("covered by test_dense_patch_equals_unpatched")
    p = fastdit.patch(m, method, record_masks=True, backend="torch", **options)
    recorder = Recorder(monkeypatch, p, patched_modules(p))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = run(m, kwargs)
        assert torch.isfinite(out).all()
        if case in DENSE_FALLBACK:
            assert p.stats.sparse_calls == 0 and p.stats.fallback_calls > 0
            pytest.xfail(DENSE_FALLBACK[case])
        # one sparse call per patched layer and no fallback: every patched module is self/joint
        # attention whose sequence fits the adapter's layout (a cross-attention would fall back)
        assert p.stats.sparse_calls == len(p.layers) and p.stats.fallback_calls == 0
        check_layers_against_masks(p, recorder)
        if method == "sta":
            assert p.stats.mean_density < 1.0, "the sta plans are not sparse at this size"
    finally:
        recorder.remove()
        p.remove()
    assert_clean(m)


@pytest.mark.parametrize("case", CASES)
def test_remove_restores_identical_outputs(case):
    m, kwargs, ref = model(case), inputs(case), reference(case)
    p = fastdit.patch(m, "sta", backend="torch", **method_options("sta", case))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        patched = run(m, kwargs)
    if case not in DENSE_FALLBACK:
        assert not torch.equal(patched, ref), "sparse attention changed nothing: the test would prove nothing"
    p.remove()
    p.remove()  # idempotent
    assert not p.active
    assert torch.equal(run(m, kwargs), ref)
    assert_clean(m)
    # and it can be patched again
    fastdit.patch(m, "dense").remove()


#: A second grid per kind, again not a multiple of any tile or block, and with another text length.
OTHER_GRID = {"video": (2, 3, 5), "image": (1, 3, 5)}


@pytest.mark.parametrize("case", CASES)
def test_shapes_not_multiple_of_tile_and_reshape_under_one_patch(case, monkeypatch):
    if case in DENSE_FALLBACK:
        pytest.xfail(DENSE_FALLBACK[case])
    m = model(case)
    kind = "video" if TINY[case].video else "image"
    # default tile (chosen per resolution) on the case grid, then a new grid under the same patch
    p = fastdit.patch(m, "sta", record_masks=True, backend="torch", dense_steps=0, dense_layers=0,
                      tile=(2, 2, 2) if kind == "video" else (1, 2, 2), window=(1, 3, 3))
    recorder = Recorder(monkeypatch, p, patched_modules(p))
    try:
        for grid in (TINY[case].grid, OTHER_GRID[kind]):
            assert any(g % 2 for g in grid[1:])
            recorder.calls.clear()
            out = run(m, inputs(case, grid))
            assert torch.isfinite(out).all()
            check_layers_against_masks(p, recorder)
            record = p._records[0]
            assert record.layout.grid == tuple(grid), f"layout {record.layout.grid} != input grid {grid}"
    finally:
        recorder.remove()
        p.remove()
    assert_clean(m)


# -- family specifics ------------------------------------------------------------------------------

def test_layouts_per_family():
    """Text position and text length as the adapters state them, checked on the recorded layouts."""
    expected = {  # case -> (text_position, text tokens seen by the patched layers)
        "wan": ("none", 0), "wan_vace": ("none", 0), "skyreels_v2": ("none", 0), "ltx_video": ("none", 0),
        "cosmos": ("none", 0), "allegro": ("none", 0), "kandinsky5": ("none", 0), "pixart_sigma": ("none", 0),
        "hunyuan_video": ("suffix", 6), "mochi": ("suffix", 4), "cogvideox": ("prefix", 6),
        "cogvideox15": ("prefix", 6), "flux": ("prefix", 6), "flux2": ("prefix", 6), "sd3": ("suffix", 6),
        "qwen_image": ("prefix", 6),
    }
    for case, (position, text_len) in expected.items():
        m = model(case)
        with fastdit.patch(m, "dense", record_masks=True) as p:
            run(m, inputs(case))
            layout = p._records[0].layout
        assert layout.grid == TINY[case].grid, case
        assert (layout.text_position, layout.text_len) == (position, text_len), case


def test_hunyuan_text_padding_is_never_attended(monkeypatch):
    m = model("hunyuan_video")
    p = fastdit.patch(m, "sta", record_masks=True, backend="torch", **method_options("sta", "hunyuan_video"))
    try:
        run(m, inputs("hunyuan_video"))
        mask = p.mask(0, 0)
        video = math.prod(TINY["hunyuan_video"].grid)
        assert not mask[:, video + 4:].any()  # the last 2 of 6 text tokens are padding
        assert mask[:, video:video + 4].all()
    finally:
        p.remove()


def test_wan22_two_transformers_share_one_step_counter(monkeypatch):
    high, low = TINY["wan"].build(0), TINY["wan"].build(1)
    pipe = types.SimpleNamespace(transformer=high, transformer_2=low, scheduler=None)
    kwargs = inputs("wan")
    refs = run(high, kwargs), run(low, kwargs)
    p = fastdit.patch(pipe, "sta", record_masks=True, backend="torch", **method_options("sta", "wan"))
    recorder = Recorder(monkeypatch, p, patched_modules(p))
    try:
        assert p.layers[0].startswith("transformer.") and p.layers[-1].startswith("transformer_2.")
        # Wan 2.2: the high-noise expert runs the early steps, the low-noise expert the late ones;
        # one counter spans both, so dense_steps counts pipeline steps, not per-expert calls.
        run(high, dict(kwargs, timestep=torch.tensor([900])))
        assert p.step == 0
        run(low, dict(kwargs, timestep=torch.tensor([100])))
        assert p.step == 1
        check_layers_against_masks(p, recorder)
        assert {c[0].split(".")[0] for c in recorder.calls} == {"transformer", "transformer_2"}
    finally:
        recorder.remove()
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
    for adapter in adapters():
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
        p = fastdit.patch(toy, "sta", record_masks=True, backend="torch", tile=(2, 2, 2), window=(1, 3, 3),
                          dense_steps=0, dense_layers=0)
        recorder = Recorder(monkeypatch, p, patched_modules(p))
        with torch.no_grad():
            toy(x)
        check_layers_against_masks(p, recorder)
        recorder.remove()
        p.remove()
        with torch.no_grad():
            assert torch.equal(toy(x), ref)
        assert_clean(toy)
    finally:
        unregister_adapter("toy_dit")
    with pytest.raises(UnsupportedModelError):
        find_adapter(ToyDiT())
