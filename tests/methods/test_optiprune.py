"""OptiPrune's token pruning ("optiprune"): against an independent float64 reference of the base
choice (patch-wise key similarity, written out with loops) and of the whole rule; exactness on
tokens duplicated within each window; determinism and seeded reproducibility; text untouched;
per-layer state; bad options."""
import math

import pytest
import torch
import torch.nn.functional as F

import fastdit
from fastdit.context import AttentionContext, CallState
from fastdit.layout import TokenLayout
from fastdit.methods import get_method
from fastdit.methods.tokens.optiprune import choose_bases, window_index

from tiny_models import TINY


def rand(batch, heads, layout, dim, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, heads, layout.seq_len, dim, generator=g, dtype=dtype) for _ in range(3)]


def windows_of(grid, window):
    """Token indices (frame-major) of each window, in grid order, by plain loops."""
    t_, h_, w_ = grid
    st, sy, sx = (min(s, g) for s, g in zip(window, grid))
    groups = {}
    for i in range(t_ * h_ * w_):
        t, h, w = i // (h_ * w_), (i // w_) % h_, i % w_
        groups.setdefault((t // st, h // sy, w // sx), []).append(i)
    return [groups[key] for key in sorted(groups)]


def reference_bases(kv, grid, window, ratio):
    """Base tokens of one (batch, head) at randomness 0: per window the ``w - floor(ratio * w)``
    tokens with the highest mean cosine similarity of keys to the window's tokens (ties: first)."""
    size = math.prod(min(s, g) for s, g in zip(window, grid))
    keep = max(1, size - int(ratio * size))
    cos = lambda i, j: float(kv[i] @ kv[j] / (kv[i].norm() * kv[j].norm()))  # noqa: E731
    bases = []
    for members in windows_of(grid, window):
        rep = {i: sum(cos(i, j) for j in members) / len(members) for i in members}
        bases += sorted(members, key=lambda i: -rep[i])[:keep]
    return bases


def reference(q, k, v, layout, ratio, window, scale=None):
    """The rule per (batch, head) in float64 with loops: bases as above; each pruned token copies
    the most cosine-similar base of its window; base queries attend [base keys + log(tokens copied) | text keys];
    text query rows are dense."""
    batch, heads, seq, dim = q.shape
    scale = 1 / math.sqrt(dim) if scale is None else scale
    video = layout.video_positions().tolist()
    text = layout.text_positions().tolist()
    out = torch.zeros(batch, heads, seq, dim, dtype=torch.float64)
    for b in range(batch):
        for head in range(heads):
            kv = k[b, head, video]
            cos = lambda i, j: float(kv[i] @ kv[j] / (kv[i].norm() * kv[j].norm()))  # noqa: E731
            bases = reference_bases(kv, layout.grid, window, ratio)
            window_of = {i: n for n, members in enumerate(windows_of(layout.grid, window)) for i in members}
            owner = {i: (i if i in bases else max((j for j in bases if window_of[j] == window_of[i]),
                                                  key=lambda j: cos(i, j))) for i in range(len(video))}
            sizes = [sum(1 for i in owner if owner[i] == j) for j in bases]
            keys = torch.stack([k[b, head, video[j]] for j in bases] + [k[b, head, p] for p in text])
            values = torch.stack([v[b, head, video[j]] for j in bases] + [v[b, head, p] for p in text])
            bias = torch.tensor([math.log(s) for s in sizes] + [0.0] * len(text), dtype=torch.float64)
            queries = torch.stack([q[b, head, video[j]] for j in bases])
            base_out = (scale * queries @ keys.T + bias).softmax(-1) @ values
            for i in range(len(video)):
                out[b, head, video[i]] = base_out[bases.index(owner[i])]
            if text:
                out[b, head, text] = (scale * q[b, head, text] @ k[b, head].T).softmax(-1) @ v[b, head]
    return out


def dense64(q, k, v):
    scale = 1 / math.sqrt(q.shape[-1])
    return (scale * q @ k.transpose(-1, -2)).softmax(-1) @ v


def run_with_context(q, k, v, layout, step=0, state=None, **options):
    cls = get_method("optiprune")
    instance = cls(cls.resolve(cls.make_config(**options), None))
    call = CallState()
    call.rounds = step
    ctx = AttentionContext(layer=0, layer_name="l0", step=step, num_steps=None, branch=0, layout=layout,
                           call=call, key_mask=None, query_mask=None, num_heads=q.shape[1],
                           total_heads=q.shape[1], state={} if state is None else state,
                           dense_fn=lambda: F.scaled_dot_product_attention(q, k, v))
    return instance(ctx, q, k, v), ctx


CASES = [
    (TokenLayout((1, 5, 7), 3, "prefix"), 0.5, (1, 2, 2)),  # an image, odd grid, partial windows
    (TokenLayout((3, 4, 5), 6, "suffix"), 0.75, (2, 2, 3)),  # frames too
    (TokenLayout((2, 3, 7)), 0.9, (1, 3, 2)),  # no text; one base per window
]


@pytest.mark.parametrize("layout, ratio, window", CASES, ids=str)
def test_base_choice_and_output_equal_float64_reference(layout, ratio, window):
    q, k, v = rand(2, 2, layout, 8, seed=int(ratio * 100))
    st, sy, sx = window
    got, info = fastdit.attention(q, k, v, "optiprune", layout=layout, ratio=ratio, st=st, sy=sy, sx=sx,
                                  randomness=0.0, return_info=True)
    # The base choice itself, against the loop computation of patch-wise similarity.
    video_k = k[:, :, layout.video_positions()]
    win = tuple(min(s, g) for s, g in zip(window, layout.grid))
    size = math.prod(win)
    base, _ = choose_bases(video_k, window_index(layout.grid, win, "cpu"), max(1, size - int(ratio * size)), 0.0, None)
    for b in range(2):
        for head in range(2):
            expected = reference_bases(video_k[b, head], layout.grid, window, ratio)
            assert sorted(x for x in base[b, head].tolist() if x >= 0) == sorted(expected)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, reference(q, k, v, layout, ratio, window), rtol=1e-10, atol=1e-12)
    assert not torch.allclose(got, dense64(q, k, v), atol=1e-3)  # it really prunes
    assert info["density"] < 0.6


@pytest.mark.parametrize("layout, window", [(TokenLayout((2, 6, 4), 5, "prefix"), (1, 2, 2)),
                                            (TokenLayout((3, 5, 7), 4, "suffix"), (2, 2, 3))], ids=str)
@pytest.mark.parametrize("randomness", [0.0, 0.7])
def test_duplicated_tokens_within_windows_equal_dense(layout, window, randomness):
    """Every window (partial ones too) holds copies of one token: the copy recovers dense exactly."""
    g = torch.Generator().manual_seed(31)
    groups = windows_of(layout.grid, window)
    per_window = torch.randn(3, 2, 2, len(groups), 8, generator=g, dtype=torch.float64)
    owner = torch.empty(layout.video_len, dtype=torch.long)
    for n, members in enumerate(groups):
        owner[members] = n
    text = torch.randn(3, 2, 2, layout.text_len, 8, generator=g, dtype=torch.float64)
    video = per_window[:, :, :, owner]
    parts = [text, video] if layout.text_position == "prefix" else [video, text]
    q, k, v = torch.cat(parts, dim=3)
    st, sy, sx = window
    got, ctx = run_with_context(q, k, v, layout, ratio=0.9, st=st, sy=sy, sx=sx, randomness=randomness)
    torch.testing.assert_close(got, dense64(q, k, v), rtol=1e-12, atol=1e-12)
    keep = max(1, math.prod(window) - int(0.9 * math.prod(window)))
    assert ctx.info["attention_shape"][0] == sum(min(keep, len(m)) for m in groups)  # bases only
    got32, _ = run_with_context(q.float(), k.float(), v.float(), layout, ratio=0.9, st=st, sy=sy, sx=sx,
                                randomness=randomness)
    torch.testing.assert_close(got32, dense64(q, k, v).float(), rtol=1e-5, atol=1e-6)


def test_randomness_zero_is_deterministic_and_seeds_reproduce():
    layout = TokenLayout((2, 6, 6), 4, "prefix")
    q, k, v = rand(1, 2, layout, 8, seed=32, dtype=torch.float32)
    run = lambda **o: fastdit.attention(q, k, v, "optiprune", layout=layout, **o)  # noqa: E731
    assert torch.equal(run(randomness=0.0, seed=1), run(randomness=0.0, seed=2))
    assert torch.equal(run(randomness=0.5, seed=3), run(randomness=0.5, seed=3))
    assert not torch.equal(run(randomness=0.5, seed=3), run(randomness=0.5, seed=4))
    assert not torch.equal(run(randomness=0.5, seed=3), run(randomness=0.0))
    # the draw depends on the step too (a fresh perturbation per denoising step), reproducibly
    a, _ = run_with_context(q, k, v, layout, step=1, randomness=0.5)
    b, _ = run_with_context(q, k, v, layout, step=1, randomness=0.5)
    c, _ = run_with_context(q, k, v, layout, step=2, randomness=0.5)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_ratio_zero_text_rows_and_refresh_every():
    layout = TokenLayout((2, 4, 5), 6, "prefix")
    q, k, v = rand(2, 2, layout, 8, seed=33)
    dense = F.scaled_dot_product_attention(q, k, v)
    out, info = fastdit.attention(q, k, v, "optiprune", layout=layout, ratio=0.0, return_info=True)
    assert torch.equal(out, dense) and info["dense"]
    out = fastdit.attention(q, k, v, "optiprune", layout=layout)
    text = layout.text_positions()
    torch.testing.assert_close(out[:, :, text], dense64(q, k, v)[:, :, text], rtol=1e-12, atol=1e-12)
    q2, k2, v2 = rand(2, 2, layout, 8, seed=34)
    state = {}
    run_with_context(q, k, v, layout, step=0, state=state, refresh_every=2)
    kept = state["optiprune"]["slot"]
    reused, _ = run_with_context(q2, k2, v2, layout, step=1, state=state, refresh_every=2)
    assert state["optiprune"]["slot"] is kept
    fresh, _ = run_with_context(q2, k2, v2, layout, step=1, refresh_every=2)
    assert not torch.allclose(reused, fresh)
    run_with_context(q2, k2, v2, layout, step=2, state=state, refresh_every=2)
    assert state["optiprune"]["slot"] is not kept


def test_key_mask_masked_keys_never_attended():
    layout = TokenLayout((2, 4, 6), 5, "suffix")
    q, k, v = rand(2, 2, layout, 8, seed=35)
    key_mask = torch.rand(2, layout.seq_len, generator=torch.Generator().manual_seed(36)) > 0.35
    got = fastdit.attention(q, k, v, "optiprune", layout=layout, key_mask=key_mask)
    poisoned = v.clone()
    poisoned[~key_mask[:, None, :].expand(-1, 2, -1)] = 1e6
    again = fastdit.attention(q, k, poisoned, "optiprune", layout=layout, key_mask=key_mask)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(again, got, rtol=0, atol=1e-9)


@pytest.fixture(scope="module")
def wan_model():
    return TINY["wan"].build(0)


@pytest.mark.parametrize("options, name", [
    (dict(ratio=1.0), "ratio"), (dict(ratio=-0.1), "ratio"), (dict(ratio=float("nan")), "ratio"),
    (dict(sx=0), "sx"), (dict(sy=0), "sy"), (dict(st=0), "st"), (dict(randomness=1.5), "randomness"),
    (dict(randomness=-0.1), "randomness"), (dict(randomness=float("nan")), "randomness"),
    (dict(refresh_every=0), "refresh_every"),
])
def test_bad_options_raise_at_patch_time_and_leave_model_untouched(wan_model, options, name):
    with pytest.raises(ValueError, match=name):
        fastdit.patch(wan_model, "optiprune", **options)
    assert not any("forward" in m.__dict__ for m in wan_model.modules())
    assert getattr(wan_model, "_fastdit_patch", None) is None
