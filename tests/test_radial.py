"""Radial attention (issue 4): the mask rule, the block plan, and the patched layers (CPU, fp32)."""
import types

import pytest
import torch

import fastdit
from fastdit.layout import TokenLayout
from fastdit.methods import radial as R

from layer_capture import LayerCapture, assert_matches_masked_dense
from tiny_transformers import hunyuan_inputs, tiny_hunyuan, tiny_wan
from tiny_transformers import wan_inputs as _wan_inputs


def wan_inputs(frames=9, height=10, width=14, timestep=900.0, i2v=False, seed=1):
    return _wan_inputs(frames, height, width, batch=1, timestep=timestep, i2v=i2v, seed=seed)


# -- a direct token-level statement of the rule (the semantics, written independently) --

def token_rule(layout, decay, block_size, adjacent, sink):
    """``(allowed, forced)`` ``(S, S)`` in model order: the radial rule and its must-keep pairs."""
    t_, h_, w_ = layout.grid
    s = h_ * w_
    P = 1
    while P < s:
        P *= 2
    p = torch.arange(s)
    dp = (p[:, None] - p[None, :]).abs()
    v = layout.video_len
    allowed = torch.zeros(v, v, dtype=torch.bool)
    forced = torch.zeros(v, v, dtype=torch.bool)
    for i in range(t_):
        for j in range(t_):
            d = abs(i - j)
            if d == 0:
                local = torch.ones(s, s, dtype=torch.bool)
            elif d == 1:
                local = torch.ones(s, s, dtype=torch.bool) if adjacent == "dense" else dp <= s // 2
            else:
                L = P / 2 ** d.bit_length()
                local = dp <= max(decay * L, block_size)
                if L < block_size and d % int(block_size / L) != 0:
                    local = torch.zeros(s, s, dtype=torch.bool)
            if sink and j == 0:
                local = torch.ones(s, s, dtype=torch.bool)
            allowed[i * s:(i + 1) * s, j * s:(j + 1) * s] = local
            forced[i * s:(i + 1) * s, j * s:(j + 1) * s] = d == 0 or (sink and j == 0)
    return allowed, forced


def expected_block_mask(layout, decay, block_size, adjacent, sink, block_fill):
    """Video block mask from the token rule, summed per block (kernel order = model order)."""
    allowed, forced = token_rule(layout, decay, block_size, adjacent, sink)
    v = layout.video_len
    n = -(-v // block_size)
    pad = n * block_size - v

    def per_block(m):
        m = torch.nn.functional.pad(m.long(), (0, pad, 0, pad))
        return m.view(n, block_size, n, block_size).sum((1, 3))

    count, real = per_block(allowed), per_block(torch.ones(v, v))
    return ((count > 0) & (count.double() >= block_fill * real.double())) | (per_block(forced) > 0), per_block(allowed)


RULE_CASES = [
    # (T, H, W, decay, block, adjacent, sink, fill)
    (2, 3, 5, 0.2, 64, "band", True, 1 / 3),
    (9, 5, 7, 0.2, 64, "band", True, 1 / 3),      # s = 35 < block: frame-pair thinning
    (17, 5, 6, 0.95, 64, "dense", False, 0.5),
    (5, 12, 12, 0.2, 64, "band", True, 0.25),     # s = 144: bands inside frames
    (9, 11, 13, 0.5, 64, "band", False, 0.0),
    (6, 16, 16, 3.0, 128, "dense", True, 1 / 3),  # s = 256 = P, decay > 1
    (7, 13, 17, 0.95, 128, "band", False, 1.0),
    (12, 9, 10, 0.2, 128, "dense", False, 1 / 3),
]


@pytest.mark.parametrize("t,h,w,decay,block,adjacent,sink,fill", RULE_CASES)
def test_block_rule_matches_token_level(t, h, w, decay, block, adjacent, sink, fill):
    layout = TokenLayout((t, h, w))
    config = R.RadialConfig(decay=decay, block_size=block, adjacent=adjacent, sink=sink, block_fill=fill)
    expected, expected_counts = expected_block_mask(layout, decay, block, adjacent, sink, fill)
    allowed, _, _ = R.block_counts(t, h * w, config)
    assert torch.equal(allowed, expected_counts)  # closed-form counts are exact
    plan = R.Radial().plan(layout, config, num_heads=2, device="cpu")
    assert plan.block_m == plan.block_n == block and plan.perm is None
    n = expected.shape[0]
    got = fastdit.kernels.plan_to_token_mask(plan.kv_indices, plan.kv_counts, n, n, 1, 1)[0, 0]
    assert torch.equal(got, expected)
    # block_fill = 0: the computed mask covers every allowed token pair.
    if fill == 0.0:
        assert bool((plan.token_mask() | ~token_rule(layout, decay, block, adjacent, sink)[0]).all())


@pytest.mark.parametrize("position", ["suffix", "prefix"])
def test_text_blocks_and_padding(position):
    layout = TokenLayout((5, 7, 9), text_len=23, text_position=position)  # 315 video tokens: ragged
    config = R.RadialConfig(decay=0.95, block_size=64, adjacent="dense", sink=False)
    plan = R.Radial().plan(layout, config, num_heads=2, device="cpu")
    assert plan.perm is not None and plan.kernel_len == 5 * 64 + 23
    expected, _ = expected_block_mask(TokenLayout((5, 7, 9)), 0.95, 64, "dense", False, 1 / 3)
    video_mask = expected.repeat_interleave(64, 0).repeat_interleave(64, 1)[:315, :315]
    mask = plan.token_mask()
    vpos, tpos = layout.video_positions(), layout.text_positions()
    assert torch.equal(mask[vpos[:, None], vpos[None, :]], video_mask)
    assert bool(mask[vpos[:, None], tpos[None, :]].all()) and bool(mask[tpos].all())
    key_valid = torch.ones(1, layout.seq_len, dtype=torch.bool)
    key_valid[0, tpos[-5:]] = False  # padded text keys are never attended
    masked = plan.token_mask(key_mask=key_valid)
    assert not bool(masked[:, tpos[-5:]].any()) and torch.equal(masked[:, tpos[:-5]], mask[:, tpos[:-5]])


def test_density_falls_with_frames_and_plans_fast():
    config = R.RadialConfig(decay=0.2, block_size=128, adjacent="band", sink=True)
    densities = [R.Radial().plan(TokenLayout((t, 30, 52)), config, 1, "cpu").density for t in (11, 21, 41, 81)]
    assert all(a > b for a, b in zip(densities, densities[1:])), densities
    # HunyuanVideo 720p: 115200 video tokens + text, 900 video blocks of 128, no token-level mask.
    import time

    start = time.perf_counter()
    plan = R.Radial().plan(TokenLayout((30, 48, 80), 256, "suffix"),
                           R.RadialConfig(decay=0.95, adjacent="dense", sink=False), 24, "cpu")
    assert time.perf_counter() - start < 20  # about 0.2 s on an idle core; generous for loaded CI
    assert plan.perm is None and plan.kv_counts.shape[-1] == 902
    assert abs(plan.info["video_density"] - 0.275) < 0.2 * 0.275


# -- patched tiny transformers ------------------------------------------------------------------

def check_layers(p, capture, layout, sink):
    """Each sparse layer: output == dense attention under p.mask; d = 0 pairs and sink keys kept."""
    assert len(capture.calls) == len(p.layers)
    frame = torch.full((layout.seq_len,), -1)
    frame[layout.video_positions()] = torch.arange(layout.video_len) // layout.frame_len
    same_frame = (frame[:, None] == frame[None, :]) & (frame[:, None] >= 0)
    for layer, (q, k, v, scale, out) in enumerate(capture.calls):
        masks = [p.mask(layer, h) for h in range(q.shape[1])]
        assert masks[0].shape == (layout.seq_len, layout.seq_len)
        assert_matches_masked_dense(q, k, v, out, masks, scale)
        for m in masks:
            assert bool(m[same_frame].all())
            if sink:
                assert bool(m[:, frame == 0].all())
        assert p.last_plan(layer).density < 1.0


@pytest.mark.parametrize("i2v", [False, True])
def test_wan_layers_equal_masked_dense(monkeypatch, i2v):
    model = tiny_wan(i2v=i2v)
    capture = LayerCapture(monkeypatch)
    p = fastdit.patch(model, "radial", dense_steps=0, dense_layers=0, block_size=64, record_masks=True, backend="torch")
    assert (p.config.decay, p.config.sink, p.config.adjacent) == (0.2, True, "band")
    with torch.no_grad():
        model(**wan_inputs(i2v=i2v))
    check_layers(p, capture, TokenLayout((9, 5, 7)), sink=True)  # 315 tokens: odd, not a block multiple
    p.remove()


@pytest.mark.parametrize("sink", [False, True])
def test_hunyuan_layers_equal_masked_dense(monkeypatch, sink):
    model = tiny_hunyuan()
    capture = LayerCapture(monkeypatch)
    p = fastdit.patch(model, "radial", dense_steps=0, dense_layers=0, block_size=64, sink=sink,
                      record_masks=True, backend="torch")
    assert (p.config.decay, p.config.adjacent) == (0.95, "dense")
    with torch.no_grad():
        model(**hunyuan_inputs(frames=9, batch=1))
    layout = TokenLayout((9, 5, 7), 9, "suffix")
    check_layers(p, capture, layout, sink=sink)
    mask = p.mask(0)
    tpos = layout.text_positions()
    assert bool(mask[:, tpos[:6]].all()) and not bool(mask[:, tpos[6:]].any())  # valid / padded text keys
    assert bool(mask[tpos][:, torch.cat([layout.video_positions(), tpos[:6]])].all())
    p.remove()


def test_resolution_change_rebuilds_plan():
    model = tiny_wan()
    p = fastdit.patch(model, "radial", dense_steps=0, dense_layers=0, block_size=64, record_masks=True)
    with torch.no_grad():
        model(**wan_inputs(frames=9, height=10, width=14))
        assert p.stats.plans_built == 1  # one plan shared by both layers
        assert p.mask(1).shape == (315, 315)
        model(**wan_inputs(frames=7, height=12, width=10, timestep=800.0))
        assert p.stats.plans_built == 2 and p.mask(1).shape == (210, 210)
        assert p.last_plan(1).info["frames"] == 7 and p.last_plan(1).info["frame_len"] == 30
        model(**wan_inputs(frames=9, height=10, width=14, timestep=700.0))
        assert p.stats.plans_built == 2  # cached per layout
    p.remove()


def test_dense_steps_and_layers():
    model = tiny_wan()
    p = fastdit.patch(model, "radial", dense_steps=1, dense_layers=1, block_size=64, record_masks=True)
    with torch.no_grad():
        model(**wan_inputs(timestep=900.0))  # step 0: dense
        assert p.stats.dense_calls == 2 and p.stats.sparse_calls == 0
        assert bool(p.mask(1).all())
        model(**wan_inputs(timestep=800.0))  # step 1: layer 0 dense, layer 1 sparse
        assert p.stats.dense_calls == 3 and p.stats.sparse_calls == 1
        assert p.last_plan(0) is None and p.last_plan(1) is not None and not bool(p.mask(1).all())
    p.remove()
    # Family defaults: 12 of 50 steps dense (a fraction) and one dense layer for Wan.
    p = fastdit.patch(model, "radial", block_size=64)
    assert (p.config.dense_steps, p.config.dense_layers) == (0.24, 1)
    p.set_num_steps(4)  # steps 0 (0 < 0.96) dense, 1.. sparse
    with torch.no_grad():
        model(**wan_inputs(timestep=900.0))
        model(**wan_inputs(timestep=800.0))
    assert p.stats.dense_calls == 3 and p.stats.sparse_calls == 1
    p.remove()


def test_bad_input():
    model = tiny_wan()
    for options in (dict(decay=0), dict(decay=-0.5), dict(decay="fast"), dict(block_size=32), dict(block_size=256),
                    dict(block_fill=1.5), dict(adjacent="ring"), dict(sink="yes"), dict(window=(3, 3, 3))):
        with pytest.raises(ValueError):
            fastdit.patch(model, "radial", **options)
    with pytest.raises(ValueError, match="video model"):
        R.Radial().check_family(types.SimpleNamespace(video=False, family="flux"), R.RadialConfig())
    # A single frame has no temporal decay: the call runs the model's own (dense) attention.
    inputs = wan_inputs(frames=1)
    with torch.no_grad():
        reference = model(**inputs).sample
        p = fastdit.patch(model, "radial", dense_steps=0, dense_layers=0, block_size=64)
        assert torch.equal(model(**inputs).sample, reference)
        assert p.stats.sparse_calls == 0 and p.stats.dense_calls == len(p.layers)
    p.remove()
    assert fastdit.RadialConfig is R.RadialConfig and "radial" in fastdit.methods()


def test_mask_picture(tmp_path):
    out = tmp_path / "radial.png"
    assert R.main(["--frames", "9", "--height", "6", "--width", "10", "--block-size", "64", "--out", str(out)]) == 0
    assert out.stat().st_size > 0
    big = torch.rand(2500, 2500) > 0.5
    assert R.save_mask_picture(big, tmp_path / "big.png", max_side=1024) == 3
