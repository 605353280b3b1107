"""Model coverage, family specifics: padded text never attended, a user's attention backend
restored, fallbacks counted with their reasons, Wan 2.2's two transformers on one step counter, the
grids of Flux (Kontext), Qwen-Image and LTX-Video, positional call arguments, Kandinsky 5's NABLA
checkpoints refused, and an adapter registered by a user for a new model (helpers:
model_matrix.py).
"""
from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

import fastdit
from fastdit.pipelines import Adapter, UnsupportedModelError, find_adapter, register_adapter
from fastdit.pipelines.adapters import unregister_adapter

from layer_capture import LayerTrace
from model_matrix import (
    NOT_SET, assert_clean, check_sta_layers, fresh_like, inputs, installed_state, model, observe_calls, quiet_run,
    reference, sta_options, text_validity,
)
from tiny_models import TINY, run

# -- family specifics ------------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["hunyuan_video", "qwen_image"])
def test_padded_text_is_never_attended(case):
    """New values in the padded text tokens change nothing, in the model and through the patch."""
    m, kwargs = model(case), inputs(case)
    valid = text_validity(case, kwargs)
    assert valid is not None and not valid.all()
    text = kwargs["encoder_hidden_states"].clone()
    text[:, ~valid] = fresh_like(text[:, ~valid], 99) * 10
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
        assert any(b not in (None, NOT_SET) for *_, b in before.values())
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
