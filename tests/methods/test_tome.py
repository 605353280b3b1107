"""Token merging ("tome"): against an independent float64 reference of the matching and merging
rule, exactness on duplicated tokens, identity at ratio 0, text untouched, masks, per-layer state,
bad options at patch time."""
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


def reference(q, k, v, layout, ratio, window, key_mask=None, scale=None):
    """The rule written out per (batch, head) with Python loops (float64): first token of each
    window is a destination; each source picks its most cosine-similar destination; the
    floor(ratio * N) best sources merge; groups average valid queries / keys / values; merged
    queries attend [merged keys + log(valid size) | text keys]; every member gets its group's output;
    text query rows are dense."""
    batch, heads, seq, dim = q.shape
    scale = 1 / math.sqrt(dim) if scale is None else scale
    valid = torch.ones(batch, seq, dtype=torch.bool) if key_mask is None else key_mask
    t_, h_, w_ = layout.grid
    st, sy, sx = (min(s, g) for s, g in zip(window, layout.grid))
    video = layout.video_positions().tolist()
    text = layout.text_positions().tolist()
    coords = [(i // (h_ * w_), (i // w_) % h_, i % w_) for i in range(len(video))]
    dst = [i for i, (t, h, w) in enumerate(coords) if t % st == 0 and h % sy == 0 and w % sx == 0]
    src = [i for i in range(len(video)) if i not in dst]
    merged = min(int(ratio * len(video)), len(src))
    out = torch.zeros(batch, heads, seq, dim, dtype=torch.float64)
    for b in range(batch):
        for head in range(heads):
            kv = k[b, head, video]
            cos = lambda i, j: float(kv[i] @ kv[j] / (kv[i].norm() * kv[j].norm()))  # noqa: E731
            choice = {}
            for i in src:
                candidates = [j for j in dst if valid[b, video[j]]] or dst
                best = max(candidates, key=lambda j: cos(i, j))
                choice[i] = (cos(i, best) if valid[b, video[i]] else -math.inf, best)
            ranked = sorted(src, key=lambda i: -choice[i][0])
            groups = {j: [j] for j in dst}
            for i in ranked[:merged]:
                groups[choice[i][1]].append(i)
            for i in ranked[merged:]:
                groups[i] = [i]
            group_list = list(groups.values())
            mq, mk, mv, bias = [], [], [], []
            for members in group_list:
                live = [m for m in members if valid[b, video[m]]]
                positions = [video[m] for m in members]
                mq.append(q[b, head, positions].mean(0))
                mk.append(k[b, head, [video[m] for m in live]].mean(0) if live else kv[0] * 0)
                mv.append(v[b, head, [video[m] for m in live]].mean(0) if live else kv[0] * 0)
                bias.append(math.log(len(live)) if live else -math.inf)
            keys = torch.stack(mk + [k[b, head, p] for p in text])
            values = torch.stack(mv + [v[b, head, p] for p in text])
            bias = torch.tensor(bias + [0.0 if valid[b, p] else -math.inf for p in text], dtype=torch.float64)
            group_out = ((scale * torch.stack(mq) @ keys.T + bias).softmax(-1) @ values)
            for g, members in enumerate(group_list):
                for m in members:
                    out[b, head, video[m]] = group_out[g]
            if text:
                scores = (scale * q[b, head, text] @ k[b, head].T).masked_fill(~valid[b], -math.inf)
                out[b, head, text] = scores.softmax(-1) @ v[b, head]
    return out


def run_with_context(method, q, k, v, layout, key_mask=None, query_mask=None, step=0, state=None, **options):
    cls = get_method(method)
    instance = cls(cls.resolve(cls.make_config(**options), None))
    mask = None if key_mask is None else key_mask[:, None, None, :]
    call = CallState()
    call.rounds = step
    ctx = AttentionContext(layer=0, layer_name="l0", step=step, num_steps=None, branch=0, layout=layout,
                           call=call, key_mask=key_mask, query_mask=query_mask, num_heads=q.shape[1],
                           total_heads=q.shape[1], state={} if state is None else state,
                           dense_fn=lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    return instance(ctx, q, k, v), ctx


CASES = [
    (TokenLayout((1, 5, 7)), 0.5, (1, 2, 2)),  # an image, odd grid
    (TokenLayout((3, 5, 4), 4, "prefix"), 0.4, (1, 2, 2)),
    (TokenLayout((3, 4, 5), 6, "suffix"), 0.6, (2, 2, 3)),  # frames too, partial windows everywhere
    (TokenLayout((2, 3, 7), 3, "prefix"), 0.9, (1, 3, 2)),  # more than the sources: capped
]


@pytest.mark.parametrize("layout, ratio, window", CASES, ids=lambda x: getattr(x, "describe", lambda: str(x))())
def test_equals_float64_reference_of_the_merging_rule(layout, ratio, window):
    q, k, v = rand(2, 2, layout, 8, seed=int(ratio * 10))
    st, sy, sx = window
    got, info = fastdit.attention(q, k, v, "tome", layout=layout, ratio=ratio, st=st, sy=sy, sx=sx, return_info=True)
    expected = reference(q, k, v, layout, ratio, window)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
    assert not torch.allclose(got, F.scaled_dot_product_attention(q, k, v), atol=1e-3)  # it really merges
    assert info["density"] < 1.0


def test_key_mask_reference_and_masked_keys_never_attended():
    layout = TokenLayout((2, 4, 6), 5, "suffix")
    q, k, v = rand(2, 2, layout, 8, seed=21)
    g = torch.Generator().manual_seed(22)
    key_mask = torch.rand(2, layout.seq_len, generator=g) > 0.35
    key_mask[:, 0] = True
    got = fastdit.attention(q, k, v, "tome", layout=layout, key_mask=key_mask, ratio=0.5)
    torch.testing.assert_close(got, reference(q, k, v, layout, 0.5, (1, 2, 2), key_mask=key_mask),
                               rtol=1e-10, atol=1e-12)
    poisoned = v.clone()
    poisoned[~key_mask[:, None, :].expand(-1, 2, -1)] = 1e6
    again = fastdit.attention(q, k, poisoned, "tome", layout=layout, key_mask=key_mask, ratio=0.5)
    torch.testing.assert_close(again, got, rtol=0, atol=1e-9)


@pytest.mark.parametrize("window", [(1, 2, 2), (2, 2, 2), (1, 3, 1)])
def test_duplicated_tokens_merge_exactly(window):
    """Every window holds copies of one token: merging everything gives unmerged attention."""
    layout = TokenLayout((2, 6, 4), 5, "prefix")
    batch, heads, dim = 2, 2, 8
    st, sy, sx = window
    g = torch.Generator().manual_seed(23)
    shape = (3, batch, heads, layout.frames // st, layout.grid[1] // sy, layout.grid[2] // sx, dim)
    per_window = torch.randn(*shape, generator=g, dtype=torch.float64)
    video = (per_window[:, :, :, :, None, :, None, :, None, :]
             .expand(3, batch, heads, shape[3], st, shape[4], sy, shape[5], sx, dim)
             .reshape(3, batch, heads, layout.video_len, dim))
    text = torch.randn(3, batch, heads, layout.text_len, dim, generator=g, dtype=torch.float64)
    q, k, v = torch.cat([text, video], dim=3)
    n_windows = layout.video_len // (st * sy * sx)
    ratio = (layout.video_len - n_windows) / layout.video_len  # every source merges
    got, ctx = run_with_context("tome", q, k, v, layout, ratio=ratio, st=st, sy=sy, sx=sx)
    torch.testing.assert_close(got, F.scaled_dot_product_attention(q, k, v), rtol=1e-12, atol=1e-12)
    assert ctx.info["attention_shape"] == (n_windows, n_windows + layout.text_len)
    got32, _ = run_with_context("tome", q.float(), k.float(), v.float(), layout, ratio=ratio, st=st, sy=sy, sx=sx)
    torch.testing.assert_close(got32, F.scaled_dot_product_attention(q.float(), k.float(), v.float()),
                               rtol=1e-5, atol=1e-6)


def test_ratio_zero_and_one_token_windows_equal_dense():
    layout = TokenLayout((2, 3, 5), 4, "suffix")
    q, k, v = rand(2, 2, layout, 8, seed=24, dtype=torch.float32)
    dense = F.scaled_dot_product_attention(q, k, v)
    out, info = fastdit.attention(q, k, v, "tome", layout=layout, ratio=0.0, return_info=True)
    assert torch.equal(out, dense) and info["dense"]
    assert torch.equal(fastdit.attention(q, k, v, "tome", layout=layout, ratio=0.5, sx=1, sy=1, st=1), dense)


def test_text_rows_untouched_and_query_mask():
    layout = TokenLayout((2, 4, 5), 6, "prefix")
    q, k, v = rand(2, 2, layout, 8, seed=25)
    query_mask = torch.ones(2, layout.seq_len, dtype=torch.bool)
    query_mask[0, :3] = False  # padded text queries
    query_mask[1, layout.video_start + 1] = False  # and a video query
    out, ctx = run_with_context("tome", q, k, v, layout, query_mask=query_mask, ratio=0.5)
    dense = F.scaled_dot_product_attention(q, k, v)
    text = layout.text_positions()
    torch.testing.assert_close(out[1][:, text], dense[1][:, text], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out[0][:, text[3:]], dense[0][:, text[3:]], rtol=1e-12, atol=1e-12)
    assert torch.equal(out[0, :, :3], torch.zeros_like(out[0, :, :3]))
    assert torch.equal(out[1, :, layout.video_start + 1], torch.zeros_like(out[1, :, 0]))
    assert torch.isfinite(out).all()
    merged = layout.video_len - int(0.5 * layout.video_len)
    assert ctx.info["attention_shape"] == (merged, merged + layout.text_len)
    assert ctx.info["performed"] == 2 * 2 * (merged * (merged + 6) + 6 * layout.seq_len)


def test_match_every_keeps_the_matching_in_layer_state():
    layout = TokenLayout((2, 4, 4), 3, "prefix")
    q, k, v = rand(1, 2, layout, 8, seed=26)
    q2, k2, v2 = rand(1, 2, layout, 8, seed=27)
    state = {}
    run_with_context("tome", q, k, v, layout, step=0, state=state, match_every=2)
    kept = state["tome"]["slot"]
    reused, _ = run_with_context("tome", q2, k2, v2, layout, step=1, state=state, match_every=2)
    assert state["tome"]["slot"] is kept
    fresh, _ = run_with_context("tome", q2, k2, v2, layout, step=1, match_every=2)
    assert not torch.allclose(reused, fresh)  # the step-0 matching really was reused
    run_with_context("tome", q2, k2, v2, layout, step=2, state=state, match_every=2)
    assert state["tome"]["slot"] is not kept and state["tome"]["step"] == 2


def test_bfloat16_runs_close_to_float32():
    layout = TokenLayout((2, 6, 6), 3, "prefix")
    q, k, v = rand(1, 2, layout, 16, seed=28, dtype=torch.float32)
    full = fastdit.attention(q, k, v, "tome", layout=layout)
    half = fastdit.attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), "tome", layout=layout)
    assert half.dtype == torch.bfloat16 and torch.isfinite(half).all()
    # bf16 keys may match a few tokens differently; the outputs stay close on average
    assert (half.float() - full).abs().mean() < 0.05


@pytest.fixture(scope="module")
def wan_model():
    return TINY["wan"].build(0)


@pytest.mark.parametrize("options, name", [
    (dict(ratio=1.0), "ratio"), (dict(ratio=-0.1), "ratio"), (dict(ratio=float("nan")), "ratio"),
    (dict(ratio="half"), "ratio"), (dict(sx=0), "sx"), (dict(sy=-1), "sy"), (dict(st=1.5), "st"),
    (dict(match_every=0), "match_every"),
])
def test_bad_options_raise_at_patch_time_and_leave_model_untouched(wan_model, options, name):
    with pytest.raises(ValueError, match=name):
        fastdit.patch(wan_model, "tome", **options)
    assert not any("forward" in m.__dict__ for m in wan_model.modules())
    assert getattr(wan_model, "_fastdit_patch", None) is None
