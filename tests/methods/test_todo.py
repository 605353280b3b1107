"""Token downsampling ("todo"): against an independent float64 reference of the pooling rule,
identity at factor 1, uneven grids, text untouched, masks, bad options at patch time."""
import math

import pytest
import torch
import torch.nn.functional as F

import fastdit
from fastdit.context import AttentionContext, CallState
from fastdit.layout import TokenLayout
from fastdit.methods import get_method

from tiny_models import TINY


def rand(batch, heads, layout, dim, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, heads, layout.seq_len, dim, generator=g, dtype=dtype) for _ in range(3)]


def sparse_key_mask(batch, layout, seed, drop=0.3):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(batch, layout.seq_len, generator=g) > drop
    mask[:, layout.video_start] = True  # at least one valid key per batch element
    return mask


def reference(q, k, v, layout, factor, t_factor, mode="mean", key_mask=None, proportional=True, scale=None):
    """The rule written out token by token (float64): pool membership from grid coordinates,
    pooled keys/values over valid members, + log(valid members) on their scores, text as it is,
    text query rows dense."""
    batch, heads, seq, dim = q.shape
    scale = 1 / math.sqrt(dim) if scale is None else scale
    q, k, v = q.double(), k.double(), v.double()
    valid = torch.ones(batch, seq, dtype=torch.bool) if key_mask is None else key_mask
    t_, h_, w_ = layout.grid
    pt, ph, pw = min(t_factor, t_), min(factor, h_), min(factor, w_)
    video = layout.video_positions().tolist()
    text = layout.text_positions().tolist()
    pools = {}
    for index, position in enumerate(video):
        t, rest = divmod(index, h_ * w_)
        h, w = divmod(rest, w_)
        pools.setdefault((t // pt, h // ph, w // pw), []).append(position)
    out = torch.zeros(batch, heads, seq, dim, dtype=torch.float64)
    for b in range(batch):
        keys, values, bias = [], [], []
        for members in pools.values():
            live = [m for m in members if valid[b, m]]
            if mode == "nearest":
                live = live if valid[b, members[0]] else []
                rep = members[0]
                keys.append(k[b, :, rep]), values.append(v[b, :, rep])
            else:
                keys.append(k[b, :, live].mean(1) if live else k[b, :, members[0]] * 0)
                values.append(v[b, :, live].mean(1) if live else v[b, :, members[0]] * 0)
            bias.append(math.log(len(live)) if live and proportional else (0.0 if live else -math.inf))
        for position in text:
            keys.append(k[b, :, position]), values.append(v[b, :, position])
            bias.append(0.0 if valid[b, position] else -math.inf)
        keys, values = torch.stack(keys, 1), torch.stack(values, 1)
        bias = torch.tensor(bias, dtype=torch.float64)
        scores = scale * q[b, :, video] @ keys.transpose(-1, -2) + bias
        out[b, :, video] = scores.softmax(-1) @ values
        if text:
            dense = (scale * q[b, :, text] @ k[b].transpose(-1, -2)).masked_fill(~valid[b], -math.inf)
            out[b, :, text] = dense.softmax(-1) @ v[b]
    return out


def run_with_context(method, q, k, v, layout, key_mask=None, query_mask=None, **options):
    """One call through the method protocol with a query mask (``fastdit.attention`` has none)."""
    cls = get_method(method)
    instance = cls(cls.resolve(cls.make_config(**options), None))
    mask = None if key_mask is None else key_mask[:, None, None, :]
    ctx = AttentionContext(layer=0, layer_name="l0", step=0, num_steps=None, branch=0, layout=layout,
                           call=CallState(), key_mask=key_mask, query_mask=query_mask, num_heads=q.shape[1],
                           total_heads=q.shape[1],
                           dense_fn=lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    return instance(ctx, q, k, v), ctx


LAYOUTS = [
    TokenLayout((3, 5, 7)),  # no text, nothing divides
    TokenLayout((2, 6, 4), 5, "prefix"),
    TokenLayout((3, 4, 5), 6, "suffix"),
    TokenLayout((1, 7, 5), 4, "prefix"),  # an image
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: l.describe())
@pytest.mark.parametrize("factor, t_factor", [(2, 1), (3, 2), (2, 3)])
def test_equals_float64_reference_of_the_pooling_rule(layout, factor, t_factor):
    q, k, v = rand(2, 3, layout, 8, seed=factor * 10 + t_factor)
    got, info = fastdit.attention(q, k, v, "todo", layout=layout, factor=factor, t_factor=t_factor, return_info=True)
    expected = reference(q, k, v, layout, factor, t_factor)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
    assert not torch.allclose(got, F.scaled_dot_product_attention(q, k, v), atol=1e-3)  # it really pools
    pools = math.prod(-(-g // p) for g, p in zip(layout.grid, (min(t_factor, layout.frames), factor, factor)))
    keys = pools + layout.text_len
    expected_pairs = layout.video_len * keys + layout.text_len * layout.seq_len
    assert info["density"] == pytest.approx(expected_pairs / layout.seq_len ** 2)


@pytest.mark.parametrize("mode", ["mean", "nearest"])
@pytest.mark.parametrize("proportional", [True, False])
def test_key_mask_modes_and_float32(mode, proportional):
    layout = TokenLayout((2, 5, 6), 7, "suffix")
    q, k, v = rand(2, 2, layout, 16, seed=3)
    key_mask = sparse_key_mask(2, layout, seed=4)
    # A whole pool of invalid keys: it must never be attended.
    key_mask[0, :2], key_mask[0, 6:8] = False, False
    options = dict(factor=2, mode=mode, proportional=proportional)
    got = fastdit.attention(q, k, v, "todo", layout=layout, key_mask=key_mask, **options)
    expected = reference(q, k, v, layout, 2, 1, mode=mode, key_mask=key_mask, proportional=proportional)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
    got32 = fastdit.attention(q.float(), k.float(), v.float(), "todo", layout=layout, key_mask=key_mask, **options)
    assert got32.dtype == torch.float32 and torch.isfinite(got32).all()
    torch.testing.assert_close(got32.double(), expected, rtol=1e-4, atol=1e-5)


def test_masked_keys_never_attended():
    layout = TokenLayout((2, 4, 6), 5, "prefix")
    q, k, v = rand(1, 2, layout, 8, seed=5)
    key_mask = sparse_key_mask(1, layout, seed=6, drop=0.5)
    out = fastdit.attention(q, k, v, "todo", layout=layout, key_mask=key_mask)
    poisoned_k, poisoned_v = k.clone(), v.clone()
    poisoned_k[:, :, ~key_mask[0]] = 1e3
    poisoned_v[:, :, ~key_mask[0]] = 1e6  # (NaN would poison dense attention too: 0 * NaN)
    again = fastdit.attention(q, poisoned_k, poisoned_v, "todo", layout=layout, key_mask=key_mask)
    assert torch.isfinite(again).all()
    torch.testing.assert_close(again, out, rtol=0, atol=1e-12)


def test_factor_one_equals_dense():
    for layout in LAYOUTS:
        q, k, v = rand(2, 2, layout, 8, seed=7, dtype=torch.float32)
        out, info = fastdit.attention(q, k, v, "todo", layout=layout, factor=1, return_info=True)
        assert torch.equal(out, F.scaled_dot_product_attention(q, k, v)) and info["dense"]
    image = TokenLayout((1, 4, 4))  # a frame factor on one frame pools nothing either
    q, k, v = rand(1, 1, image, 8, seed=8, dtype=torch.float32)
    assert torch.equal(fastdit.attention(q, k, v, "todo", layout=image, factor=1, t_factor=4),
                       F.scaled_dot_product_attention(q, k, v))


def test_text_rows_untouched_and_query_mask():
    layout = TokenLayout((2, 4, 5), 6, "suffix")
    q, k, v = rand(2, 2, layout, 8, seed=9)
    key_mask = sparse_key_mask(2, layout, seed=10)
    query_mask = key_mask.clone()
    out, ctx = run_with_context("todo", q, k, v, layout, key_mask=key_mask, query_mask=query_mask)
    dense = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask[:, None, None, :])
    text = layout.text_positions()
    rows = query_mask[:, None, :, None]
    torch.testing.assert_close((out * rows)[:, :, text], (dense * rows)[:, :, text], rtol=1e-12, atol=1e-12)
    assert torch.equal(out[~query_mask[:, None, :].expand(-1, 2, -1)], torch.zeros_like(out[0, 0, :0]).new_zeros(
        int((~query_mask).sum()) * 2, 8))
    assert ctx.info["attention_shape"] == (layout.video_len, 2 * 2 * 3 + layout.text_len)


def test_attention_shape_and_pairs_recorded():
    layout = TokenLayout((3, 6, 8), 4, "prefix")
    q, k, v = rand(2, 3, layout, 8, seed=11, dtype=torch.float32)
    _, ctx = run_with_context("todo", q, k, v, layout, factor=2, t_factor=3)
    pooled = 1 * 3 * 4
    assert ctx.info["attention_shape"] == (layout.video_len, pooled + 4)
    assert ctx.info["performed"] == 2 * 3 * (layout.video_len * (pooled + 4) + 4 * layout.seq_len)
    assert ctx.info["total"] == 2 * 3 * layout.seq_len ** 2


def test_bfloat16_runs_close_to_float32():
    layout = TokenLayout((2, 6, 6), 3, "prefix")
    q, k, v = rand(1, 2, layout, 16, seed=12, dtype=torch.float32)
    full = fastdit.attention(q, k, v, "todo", layout=layout)
    half = fastdit.attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), "todo", layout=layout)
    assert half.dtype == torch.bfloat16 and torch.isfinite(half).all()
    assert (half.float() - full).abs().max() < 0.05


@pytest.fixture(scope="module")
def wan_model():
    return TINY["wan"].build(0)


@pytest.mark.parametrize("options, name", [
    (dict(factor=0), "factor"), (dict(factor=-2), "factor"), (dict(factor=1.5), "factor"),
    (dict(t_factor=0), "t_factor"), (dict(mode="bilinear"), "mode"), (dict(proportional="yes"), "proportional"),
    (dict(factor=True), "factor"),
])
def test_bad_options_raise_at_patch_time_and_leave_model_untouched(wan_model, options, name):
    model = wan_model
    with pytest.raises(ValueError, match=name):
        fastdit.patch(model, "todo", **options)
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert getattr(model, "_fastdit_patch", None) is None
