"""The patcher and sliding-tile attention on tiny Wan and HunyuanVideo transformers (CPU, fp32)."""
import pytest
import torch

import fastdit
from fastdit.layout import TokenLayout
from fastdit.pipelines import UnsupportedModelError

from layer_capture import LayerCapture, assert_matches_masked_dense, sta_token_mask
from tiny_transformers import hunyuan_inputs, tiny_hunyuan, tiny_wan, wan_inputs


FAMILIES = {"wan": (tiny_wan, wan_inputs), "hunyuan_video": (tiny_hunyuan, hunyuan_inputs)}


def run(model, inputs):
    with torch.no_grad():
        return model(**inputs).sample


@pytest.mark.parametrize("family", FAMILIES)
def test_dense_through_patch_equals_unpatched_and_remove_restores(family):
    build, make_inputs = FAMILIES[family]
    model, inputs = build(), make_inputs()
    reference = run(model, inputs)
    hooks_before = [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in model.modules()]
    p = fastdit.patch(model, "dense", record_masks=True)
    assert p.layers and p.family == family
    patched = run(model, inputs)
    assert (patched - reference).abs().max().item() <= 1e-5
    p.remove()
    assert torch.equal(run(model, inputs), reference)
    assert [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in model.modules()] == hooks_before
    assert not hasattr(model, "_fastdit_patch")
    for module in model.modules():
        processor = getattr(module, "processor", None)
        assert processor is None or "_attention_backend" not in processor.__dict__


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("grid_hw", [(14, 18), (12, 22)])
def test_sta_layers_equal_dense_under_recorded_mask(family, grid_hw, monkeypatch):
    build, make_inputs = FAMILIES[family]
    model = build()
    inputs = make_inputs(height=grid_hw[0], width=grid_hw[1])
    capture = LayerCapture(monkeypatch)
    tile, window = (2, 2, 3), (1, 3, 3)
    with fastdit.patch(model, "sta", tile=tile, window=window, dense_steps=0, record_masks=True) as p:
        run(model, inputs)
        assert len(capture.calls) == len(p.layers)
        text_mask = inputs.get("encoder_attention_mask")
        for layer, (q, k, v, scale, out) in enumerate(capture.calls):
            masks = [p.mask(layer, head) for head in range(q.shape[1])]
            plan = p.last_plan(layer)
            layout = TokenLayout(plan_grid(inputs), q.shape[2] - prod(plan_grid(inputs)),
                                 "suffix" if family == "hunyuan_video" else "none")
            key_valid = None
            if text_mask is not None:
                key_valid = torch.cat([torch.ones(layout.video_len, dtype=torch.bool), text_mask[0]])
            expected = sta_token_mask(layout, tile, window, key_valid)
            assert torch.equal(masks[0], expected), "recorded mask differs from the STA rule"
            assert 0 < masks[0].float().mean() < 1
            # Batch element 0 against the recorded (batch-0) mask.
            assert_matches_masked_dense(q[:1], k[:1], v[:1], out[:1], masks, scale)
            assert plan.density < 1.0


def prod(grid):
    return grid[0] * grid[1] * grid[2]


def plan_grid(inputs):
    _, _, f, h, w = inputs["hidden_states"].shape
    return (f, -(-h // 2), -(-w // 2))


def test_sta_batch_items_use_their_own_text_padding(monkeypatch):
    model, inputs = tiny_hunyuan(), hunyuan_inputs()
    capture = LayerCapture(monkeypatch)
    with fastdit.patch(model, "sta", tile=(1, 2, 3), window=(1, 3, 3), dense_steps=0, record_masks=True):
        run(model, inputs)
    q, k, v, scale, out = capture.calls[0]
    grid = plan_grid(inputs)
    layout = TokenLayout(grid, q.shape[2] - prod(grid), "suffix")
    key_valid = torch.cat([torch.ones(layout.video_len, dtype=torch.bool), inputs["encoder_attention_mask"][1]])
    mask = sta_token_mask(layout, (1, 2, 3), (1, 3, 3), key_valid)
    assert_matches_masked_dense(q[1:], k[1:], v[1:], out[1:], [mask, mask], scale)


def test_window_covering_everything_equals_dense():
    model, inputs = tiny_wan(), wan_inputs()
    reference = run(model, inputs)
    with fastdit.patch(model, "sta", tile=(2, 3, 3), window=(5, 5, 5), dense_steps=0) as p:
        out = run(model, inputs)
        assert p.stats.sparse_calls == len(p.layers)
    assert (out - reference).abs().max().item() <= 1e-5


def test_sta_per_head_windows(monkeypatch):
    model, inputs = tiny_wan(), wan_inputs(frames=4, height=16, width=20)
    capture = LayerCapture(monkeypatch)
    windows = [(1, 1, 1), (3, 3, 3)]
    with fastdit.patch(model, "sta", tile=(1, 2, 2), window=windows, dense_steps=0, record_masks=True) as p:
        run(model, inputs)
        layout = TokenLayout((4, 8, 10))
        for head, window in enumerate(windows):
            assert torch.equal(p.mask(0, head), sta_token_mask(layout, (1, 2, 2), window))
        q, k, v, scale, out = capture.calls[0]
        assert_matches_masked_dense(q, k, v, out, [p.mask(0, 0), p.mask(0, 1)], scale)


def test_resolution_change_builds_new_plan():
    model = tiny_wan()
    with fastdit.patch(model, "sta", tile=(1, 2, 2), window=(1, 3, 3), dense_steps=0, record_masks=True) as p:
        run(model, wan_inputs(frames=3, height=12, width=12))
        first = p.mask(0)
        assert first.shape == (3 * 6 * 6,) * 2
        run(model, wan_inputs(frames=2, height=10, width=14))
        second = p.mask(0)
        assert second.shape == (2 * 5 * 7,) * 2
        assert torch.equal(second, sta_token_mask(TokenLayout((2, 5, 7)), (1, 2, 2), (1, 3, 3)))
        assert p.stats.plans_built == 2
        run(model, wan_inputs(frames=3, height=12, width=12))
        assert p.stats.plans_built == 2  # cached by layout


def test_odd_grid_padding_is_reported_and_masked(monkeypatch):
    model, inputs = tiny_wan(), wan_inputs(frames=3, height=10, width=14)  # grid 3x5x7
    capture = LayerCapture(monkeypatch)
    with fastdit.patch(model, "sta", tile=(2, 2, 2), window=(1, 1, 3), dense_steps=0, record_masks=True) as p:
        run(model, inputs)
        plan = p.last_plan(0)
        assert plan.padding_fraction == pytest.approx(4 * 6 * 8 / (3 * 5 * 7) - 1)
        q, k, v, scale, out = capture.calls[0]
        assert_matches_masked_dense(q, k, v, out, [p.mask(0, h) for h in range(2)], scale)


def test_dense_steps_and_layers_on_bare_transformer():
    model = tiny_wan()
    with fastdit.patch(model, "sta", tile=(1, 2, 2), window=(1, 3, 3), dense_steps=2, dense_layers=1) as p:
        for t in (900.0, 900.0, 700.0, 500.0, 300.0):  # a repeated timestep is one step (CFG as two calls)
            inputs = wan_inputs(frames=2, height=8, width=8)
            inputs["timestep"] = torch.full((2,), t)
            run(model, inputs)
        # steps 0 (two calls) and 1 dense in both layers; steps 2, 3: layer 0 dense, layer 1 sparse
        assert p.stats.dense_calls == 2 * 3 + 2
        assert p.stats.sparse_calls == 2
    with fastdit.patch(model, "sta", tile=(1, 2, 2), window=(1, 3, 3), dense_steps=0.5) as p:
        with pytest.raises(RuntimeError, match="set_num_steps"):
            run(model, wan_inputs(frames=2, height=8, width=8))
    with fastdit.patch(model, "sta", tile=(1, 2, 2), window=(1, 3, 3), dense_steps=0.5) as p:
        p.set_num_steps(4)
        for t in (900.0, 700.0, 500.0, 300.0):
            inputs = wan_inputs(frames=2, height=8, width=8)
            inputs["timestep"] = torch.full((2,), t)
            run(model, inputs)
        assert p.stats.dense_calls == 2 * 2 and p.stats.sparse_calls == 2 * 2


def test_config_object_and_options():
    model = tiny_wan()
    config = fastdit.STAConfig(tile=(1, 2, 2), window=(1, 3, 3), dense_steps=1)
    with fastdit.patch(model, "sta", config, dense_layers=1) as p:
        assert p.config.tile == (1, 2, 2) and p.config.dense_layers == 1 and p.config.dense_steps == 1
    with fastdit.patch(model, "sta") as p:
        assert p.config.dense_steps == 0.25 and p.config.window == (3, 3, 3)


@pytest.mark.parametrize(
    "options, match",
    [
        (dict(window=(2, 3, 3)), "odd"),
        (dict(window=(0, 3, 3)), "odd"),
        (dict(window=(-1, 3, 3)), "odd"),
        (dict(window=(3, 3)), "three"),
        (dict(tile=(0, 8, 8)), "tile"),
        (dict(tile=(6, 8)), "tile"),
        (dict(dense_steps=1.5), "fraction"),
        (dict(dense_steps=-1), "dense_steps"),
        (dict(dense_layers=-2), "dense_layers"),
        (dict(bogus=1), "unknown option.*valid options"),
    ],
)
def test_bad_options_name_the_problem(options, match):
    model = tiny_wan()
    with pytest.raises(ValueError, match=match):
        fastdit.patch(model, "sta", **options)
    assert not hasattr(model, "_fastdit_patch")


def test_bad_method_backend_and_double_patch():
    model = tiny_wan()
    with pytest.raises(ValueError, match="available methods"):
        fastdit.patch(model, "nope")
    with pytest.raises(ValueError, match="backend"):
        fastdit.patch(model, "sta", backend="cuda")
    p = fastdit.patch(model, "sta")
    with pytest.raises(fastdit.AlreadyPatchedError):
        fastdit.patch(model, "dense")
    p.remove()
    p.remove()  # idempotent
    fastdit.patch(model, "dense").remove()


def test_per_head_window_count_must_match_heads():
    """Checked at patch time against the model's head count; nothing is left installed."""
    model = tiny_wan()
    with pytest.raises(ValueError, match="3 triples.*2 heads"):
        fastdit.patch(model, "sta", tile=(1, 2, 2), window=[(1, 1, 1)] * 3, dense_steps=0)
    assert "_fastdit_patch" not in model.__dict__ and not model._forward_pre_hooks
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_unsupported_model_lists_families():
    with pytest.raises(UnsupportedModelError, match="wan.*hunyuan_video"):
        fastdit.patch(torch.nn.Linear(2, 2), "sta")

    class FakeUNetPipe:
        unet = torch.nn.Linear(2, 2)

    with pytest.raises(ValueError, match="UNet"):
        fastdit.patch(FakeUNetPipe(), "sta")


def test_methods_listing_and_module_access():
    assert {"dense", "sta"} <= set(fastdit.method_names())
    import fastdit.methods.sta as sta_module

    assert sta_module.STAConfig is fastdit.STAConfig


def test_choose_tile_keeps_padding_low_at_standard_resolutions():
    from fastdit.methods.sta import choose_tile, padding_fraction

    standard = {
        "wan 1.3B 480p 81f": (21, 30, 52), "wan 14B 720p 81f": (21, 45, 80), "wan 2.2 5B 704p 121f": (31, 22, 40),
        "hunyuan 720p 129f": (33, 45, 80), "hunyuan 768x1280 117f": (30, 48, 80), "hunyuan 544p 129f": (33, 34, 60),
        "wan 14B 768x1280 69f": (18, 48, 80),
    }
    for name, grid in standard.items():
        tile = choose_tile(grid)
        assert padding_fraction(grid, tile) < 0.10, (name, tile)
    assert choose_tile((30, 48, 80)) == (6, 8, 8)  # the published tile fits exactly
