"""sparge: the dynamic block selection against a direct float64 implementation of the rule."""
from __future__ import annotations

import math

import pytest
import torch

import fastdit
from fastdit.layout import TokenLayout
from fastdit.methods.sparge import Sparge
from fastdit.eval.bench.structured import structured_qkv

from tiny_models import TINY


def inputs(layout, heads=3, dim=16, seed=0, offsets=(0.0, 1.0, 3.0)):
    """Random q, k, v whose heads are more or less self-similar: a shared offset of increasing size."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, heads, layout.seq_len, dim, generator=gen) for _ in range(3))
    shift = torch.tensor([offsets[h % len(offsets)] for h in range(heads)]).view(1, heads, 1, 1)
    direction_q, direction_k = (torch.randn(1, heads, 1, dim, generator=gen) for _ in range(2))
    return q + shift * direction_q, k + shift * direction_k, v


def tile_blocks(layout, tile):
    """Model token lists of each kernel block, built from grid coordinates (not the permutation)."""
    t_, h_, w_ = layout.grid
    n = [-(-g // s) for g, s in zip(layout.grid, tile)]
    blocks = []
    for a in range(n[0]):
        for b in range(n[1]):
            for c in range(n[2]):
                blocks.append([layout.video_start + (t * h_ + h) * w_ + w
                               for t in range(t_) for h in range(h_) for w in range(w_)
                               if (t // tile[0], h // tile[1], w // tile[2]) == (a, b, c)])
    n_video, size = len(blocks), math.prod(tile)
    text = layout.text_positions().tolist()
    blocks += [text[i:i + size] for i in range(0, len(text), size)]
    return blocks, n_video


def reference_rows(q, k, layout, tile, cfg, key_mask=None):
    """``rows[b][h][m]`` = the set of key blocks the rule keeps, in float64 with loops."""
    blocks, n_video = tile_blocks(layout, tile)
    n = len(blocks)
    scale = 1 / math.sqrt(q.shape[-1])
    rows = []
    for b in range(q.shape[0]):
        rows.append([])
        for h in range(q.shape[1]):
            def pool(x, valid):
                means, sims = [], []
                for tokens in blocks:
                    tokens = [t for t in tokens if valid[t]]
                    if not tokens:
                        means.append(None)
                        sims.append(1.0)
                        continue
                    xs = x[b, h, tokens].double()
                    mean = xs.mean(0)
                    means.append(mean)
                    sims.append(float(torch.nn.functional.cosine_similarity(xs, mean[None], dim=1).mean()))
                return means, sims

            key_valid = [True] * layout.seq_len if key_mask is None else key_mask[b].tolist()
            q_means, q_sims = pool(q, [True] * layout.seq_len)
            k_means, k_sims = pool(k, key_valid)
            forced = {j for j in range(n) if j >= n_video or k_sims[j] < cfg["simthresh"]}
            if cfg.get("sink"):
                forced.add(0)
            head_rows = []
            for m in range(n):
                if m >= n_video or q_sims[m] < cfg["simthresh"]:
                    head_rows.append(set(range(n)))
                    continue
                scores = torch.tensor([-math.inf if km is None else scale * float(q_means[m] @ km) for km in k_means],
                                      dtype=torch.float64)
                probs = torch.softmax(scores, 0).tolist()
                ranked = sorted(range(n), key=lambda j: -probs[j])
                if cfg.get("topk") is not None:
                    chosen = ranked[: math.ceil(cfg["topk"] * n)]
                else:
                    chosen, mass = [], 0.0
                    for j in ranked:
                        if mass >= cfg["cdf"]:
                            break
                        chosen.append(j)
                        mass += probs[j]
                chosen = ranked[: max(len(chosen), cfg.get("min_blocks", 1))]
                head_rows.append(set(chosen) | forced)
            rows[b].append(head_rows)
    return rows


CASES = [
    (TokenLayout((3, 7, 5)), dict(tile=(2, 3, 2), cdf=0.8, simthresh=0.3)),
    (TokenLayout((4, 5, 6), 7, "suffix"), dict(tile=(2, 2, 3), cdf=0.6, simthresh=0.5, min_blocks=3, sink=True)),
    (TokenLayout((2, 6, 5), 9, "prefix"), dict(tile=(1, 3, 3), topk=0.3, simthresh=0.2)),
    (TokenLayout((1, 9, 7), 5, "prefix"), dict(tile=(1, 3, 4), cdf=0.9, simthresh=-1.0)),
]


@pytest.mark.parametrize("layout,options", CASES)
def test_selection_equals_the_direct_rule(layout, options):
    """SpargeAttn's published rule (``estimator="pooled"``)."""
    method = Sparge(dense_steps=0, estimator="pooled", **options)
    q, k, _ = inputs(layout, seed=sum(layout.grid))
    key_mask = torch.ones(2, layout.seq_len, dtype=torch.bool)
    if layout.text_len:
        key_mask[1, layout.text_positions()[-3:]] = False  # padded text of the second prompt
    static = method.prepared(layout, 1, "cpu")
    plan, parts = method.predict(static, q, k, key_mask=key_mask)
    cfg = {"simthresh": method.config.simthresh, "cdf": method.config.cdf, "topk": method.config.topk,
           "min_blocks": method.config.min_blocks, "sink": method.config.sink}
    expected = reference_rows(q, k, layout, plan.info["tile"], cfg, key_mask)
    assert plan.dynamic and plan.kv_indices.shape == (2, 3, static.num_kv_blocks, static.num_kv_blocks)
    sparse_rows = 0
    for b in range(2):
        for h in range(3):
            for m, want in enumerate(expected[b][h]):
                count = int(plan.kv_counts[b, h, m])
                got = plan.kv_indices[b, h, m, :count].tolist()
                assert len(set(got)) == count and set(got) == want, (b, h, m)
                sparse_rows += count < static.num_kv_blocks
    assert sparse_rows > 0  # the selection really drops blocks
    # Kept blocks come in descending predicted score.
    probs = parts["probs"].gather(-1, plan.kv_indices.long())
    used = torch.arange(probs.shape[-1]) < plan.kv_counts[..., None]
    assert (probs[..., 1:] <= probs[..., :-1] + 1e-7)[used[..., 1:]].all()


def test_self_dissimilar_blocks_are_never_skipped():
    layout = TokenLayout((3, 6, 6))
    q, k, _ = inputs(layout, offsets=(0.0, 0.0, 0.0))  # random tokens: cosine to the mean is low
    method = Sparge(dense_steps=0, tile=(1, 3, 3), cdf=0.5, simthresh=0.6)
    plan, parts = method.predict(method.prepared(layout, 1, "cpu"), q, k)
    assert (parts["q_similarity"] < 0.6).all()
    assert (plan.kv_counts == plan.num_kv_blocks).all()
    plan, _ = Sparge(dense_steps=0, tile=(1, 3, 3), cdf=0.5, simthresh=-1.0).predict(
        method.prepared(layout, 1, "cpu"), q, k)
    assert (plan.kv_counts < plan.num_kv_blocks).any()


def dense64(q, k, v, key_mask=None):
    mask = None if key_mask is None else key_mask[:, None, None, :]
    return torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask)


@pytest.mark.parametrize("options", [dict(cdf=1.0), dict(topk=1.0)])
def test_full_mass_or_full_fraction_is_dense(options):
    layout = TokenLayout((3, 5, 7), 6, "suffix")
    q, k, v = inputs(layout, seed=4)
    key_mask = torch.ones(2, layout.seq_len, dtype=torch.bool)
    key_mask[0, -2:] = False
    out, info = fastdit.attention(q, k, v, "sparge", layout=layout, backend="torch", key_mask=key_mask,
                                  return_info=True, dense_steps=0, tile=(2, 2, 3), **options)
    assert info["density"] == pytest.approx(1.0)
    assert torch.allclose(out.double(), dense64(q, k, v, key_mask), atol=1e-5)


@pytest.mark.parametrize("position", ["prefix", "suffix"])
def test_text_rows_and_columns_stay_dense_and_output_is_finite(position):
    layout = TokenLayout((4, 6, 5), 11, position)
    x = structured_qkv(layout.grid, heads=3, head_dim=24, batch=2, text_len=11, text_position=position, seed=2)
    method = Sparge(dense_steps=0, tile=(2, 3, 3), topk=0.3)
    static = method.prepared(x.layout, 1, "cpu")
    plan, _ = method.predict(static, x.q, x.k)
    text = x.layout.text_positions()
    video = x.layout.video_positions()
    for head in range(3):
        mask = plan.token_mask(head)
        assert mask[text].all() and mask[:, text].all()
        assert mask[video][:, video].float().mean() < 0.5  # the video part is really sparse
    out, info = fastdit.attention(x.q, x.k, x.v, "sparge", layout=x.layout, backend="torch", return_info=True,
                                  dense_steps=0, tile=(2, 3, 3), topk=0.3)
    assert torch.isfinite(out).all() and info["density"] < 0.6
    # Each head's dynamic plan follows its own attention: the plans differ across heads.
    masks = [plan.token_mask(h) for h in range(3)]
    assert not torch.equal(masks[0], masks[1]) and not torch.equal(masks[1], masks[2])
    # The output equals float64 attention under the plan's own mask (batch 0: token_mask's batch).
    for head in range(3):
        expected = torch.nn.functional.scaled_dot_product_attention(
            x.q[0, head].double(), x.k[0, head].double(), x.v[0, head].double(), attn_mask=plan.token_mask(head))
        assert torch.allclose(out[0, head].double(), expected, atol=1e-5)


def test_heads_sliced_by_context_parallelism_get_their_own_plans():
    layout = TokenLayout((3, 6, 4), 4, "prefix")
    q, k, _ = inputs(layout, heads=4, seed=9)
    method = Sparge(dense_steps=0, tile=(1, 3, 4), cdf=0.7, simthresh=0.0)
    static = method.prepared(layout, 1, "cpu")
    whole, _ = method.predict(static, q, k)
    part, _ = method.predict(static, q[:, 1:3], k[:, 1:3])
    assert torch.equal(whole.kv_counts[:, 1:3], part.kv_counts)
    for h in range(2):
        for m in range(part.kv_counts.shape[2]):
            count = int(part.kv_counts[0, h, m])
            assert torch.equal(part.kv_indices[0, h, m, :count], whole.kv_indices[0, h + 1, m, :count])


def test_empty_key_block_is_never_scored():
    """A text block whose keys are all masked gets no predicted mass and no NaN."""
    layout = TokenLayout((2, 4, 4), 8, "suffix")
    q, k, v = inputs(layout, seed=5)
    key_mask = torch.ones(2, layout.seq_len, dtype=torch.bool)
    key_mask[:, layout.text_positions()] = False
    method = Sparge(dense_steps=0, tile=(1, 2, 4), cdf=0.9, simthresh=-1.0)
    plan, parts = method.predict(method.prepared(layout, 1, "cpu"), q, k, key_mask=key_mask)
    assert torch.isfinite(parts["probs"]).all() and (parts["probs"][..., -1] == 0).all()
    out = fastdit.attention(q, k, v, "sparge", layout=layout, backend="torch", key_mask=key_mask, dense_steps=0,
                            tile=(1, 2, 4), cdf=0.9, simthresh=-1.0)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("option,value", [("cdf", 0.0), ("cdf", 1.5), ("topk", 0.0), ("topk", 2.0),
                                          ("simthresh", 1.5), ("simthresh", float("nan")), ("min_blocks", 0),
                                          ("sink", "yes"), ("tile", (2, 0, 2)), ("correction", "magic")])
def test_bad_options_raise_naming_the_option_at_patch_time(option, value):
    model = TINY["wan"].build(0)
    with pytest.raises(ValueError, match=option):
        fastdit.patch(model, "sparge", **{option: value})


def test_image_layout_and_default_tile():
    method = Sparge(dense_steps=0)
    assert method.tile_for(TokenLayout((1, 32, 32))) == (1, 8, 16)
    assert method.tile_for(TokenLayout((8, 32, 48))) == (2, 8, 8)
    layout = TokenLayout((1, 9, 11), 5, "prefix")
    q, k, v = inputs(layout, seed=3)
    out = fastdit.attention(q, k, v, "sparge", layout=layout, backend="torch", dense_steps=0, topk=0.5,
                            simthresh=-1.0)
    assert torch.isfinite(out).all()
