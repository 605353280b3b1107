"""``info["lse"]`` and ``info["kept_mass"]`` of ``fastdit.attention`` against float64 references built
from the plan's token mask (never from the engine)."""
from __future__ import annotations

import math

import pytest
import torch

import fastdit
from fastdit.eval.bench.structured import structured_qkv

CASES = [("sparge", {"tile": (2, 4, 4), "cdf": 0.9, "simthresh": -1.0, "dense_steps": 0}),
         ("svg2", {"q_clusters": 6, "k_clusters": 10, "top_p": 0.8, "dense_steps": 0, "dense_layers": 0}),
         ("sta", {"tile": (2, 4, 4), "window": (1, 1, 1), "dense_steps": 0})]


def reference(q, k, mask, key_mask, scale):
    """float64 ``(lse under mask, dense lse, kept fraction per row)`` of one (batch, head)."""
    scores = (q.double() @ k.double().T) * scale
    valid = key_mask[None, :].expand_as(scores)
    lse_kept = torch.logsumexp(scores.masked_fill(~(mask & valid), float("-inf")), -1)
    probs = torch.softmax(scores.masked_fill(~valid, float("-inf")), -1)
    return lse_kept, torch.logsumexp(scores.masked_fill(~valid, float("-inf")), -1), (probs * mask).sum(-1)


def token_mask(plan, head):
    if hasattr(plan, "q_order"):
        return plan.token_mask(head, None, 0)
    return plan.token_mask(head)


@pytest.mark.parametrize("name,options", CASES)
@pytest.mark.parametrize("seed", [0, None])
def test_lse_and_kept_mass_match_float64(name, options, seed):
    seed = int(torch.randint(1 << 30, ())) if seed is None else seed
    inputs = structured_qkv((4, 8, 12), heads=3, head_dim=16, text_len=5, seed=seed,
                            kinds=("spatial", "temporal", "global"))
    q, k, v, layout = inputs.q, inputs.k, inputs.v, inputs.layout
    gen = torch.Generator().manual_seed(seed)
    key_mask = torch.rand(1, layout.seq_len, generator=gen) > 0.15
    out, info = fastdit.attention(q, k, v, name, layout=layout, key_mask=key_mask, backend="torch",
                                  return_info="mass", **options)
    assert info["lse"].shape == q.shape[:3] and info["lse"].dtype == torch.float32
    plan = info["plan"]
    assert plan is not None and info["density"] < 0.9, (seed, info["density"])  # really sparse
    scale = 1 / math.sqrt(q.shape[-1])
    for head in range(q.shape[1]):
        mask = token_mask(plan, head)
        lse_kept, lse_dense, kept = reference(q[0, head], k[0, head], mask, key_mask[0], scale)
        torch.testing.assert_close(info["lse"][0, head].double(), lse_kept, atol=2e-5, rtol=1e-5)
        assert abs(info["kept_mass"][head] - float(kept.mean())) < 1e-5, (seed, head)
        assert 0.0 < info["kept_mass"][head] < 1.0


def test_dense_call_reports_dense_lse_and_full_mass():
    inputs = structured_qkv((2, 4, 8), heads=2, head_dim=16, seed=3)
    q, k, v, layout = inputs.q, inputs.k, inputs.v, inputs.layout
    _, info = fastdit.attention(q, k, v, "sparge", layout=layout, step=0, num_steps=4, dense_steps=1,
                                backend="torch", return_info="mass")
    assert info["dense"]
    scores = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    torch.testing.assert_close(info["lse"].double(), torch.logsumexp(scores, -1), atol=2e-5, rtol=1e-5)
    assert info["kept_mass"] == pytest.approx([1.0, 1.0], abs=1e-6)
    _, plain = fastdit.attention(q, k, v, "sparge", layout=layout, dense_steps=0, backend="torch", return_info=True)
    assert plain["kept_mass"] is None and plain["lse"] is not None


def test_token_methods_have_no_lse_and_refuse_mass():
    inputs = structured_qkv((2, 4, 8), heads=2, head_dim=16, seed=1)
    q, k, v, layout = inputs.q, inputs.k, inputs.v, inputs.layout
    _, info = fastdit.attention(q, k, v, "todo", layout=layout, return_info=True)
    assert info["lse"] is None and info["kept_mass"] is None
    with pytest.raises(ValueError, match="'todo'"):
        fastdit.attention(q, k, v, "todo", layout=layout, return_info="mass")
    with pytest.raises(ValueError, match="return_info"):
        fastdit.attention(q, k, v, "sta", layout=layout, return_info="yes")
