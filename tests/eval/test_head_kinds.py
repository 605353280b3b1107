"""fastdit.eval.bench.head_kinds: labelling real heads with the structured generator's kinds."""
from __future__ import annotations

import math

import torch

from fastdit.eval.bench.head_kinds import label, local_uniform, measure
from fastdit.eval.bench.structured import attention_masses, structured_qkv


def test_generated_heads_get_their_own_kind():
    """Heads built to be spatial / temporal / global are labelled so; the labeller never sees the kinds."""
    grid = (4, 6, 8)
    x = structured_qkv(grid, heads=3, head_dim=32, kinds=("spatial", "temporal", "global"), seed=5)
    masses = attention_masses(x.q, x.k, x.layout)
    assert [label(m, grid[0]) for m in masses] == ["spatial", "temporal", "global"]


def test_top5_against_a_direct_float64_computation():
    grid = (2, 3, 5)
    x = structured_qkv(grid, heads=2, head_dim=16, kinds=("semantic", "global"), seed=int(torch.randint(0, 999, ())),
                       objects=3)
    masses = attention_masses(x.q, x.k, x.layout)
    probs = torch.softmax(x.q.double() @ x.k.double().transpose(-1, -2) / math.sqrt(16), dim=-1)
    top = math.ceil(0.05 * probs.shape[-1])
    expected = probs.sort(dim=-1, descending=True).values[..., :top].sum(-1).mean(dim=(0, 2))
    assert torch.allclose(torch.tensor([m["top5"] for m in masses], dtype=torch.float64), expected, atol=1e-5)


def test_local_uniform_counts_the_window():
    grid = (3, 5, 4)
    t, h, w = torch.meshgrid(*(torch.arange(n) for n in grid), indexing="ij")
    coords = torch.stack([t.flatten(), h.flatten(), w.flatten()], 1)
    d = (coords[:, None] - coords[None]).abs()
    inside = ((d[..., 0] <= 1) & (d[..., 1] <= 2) & (d[..., 2] <= 2)).double()
    assert abs(local_uniform(grid) - float(inside.mean())) < 1e-12


def test_labels_of_a_tiny_pipeline_run():
    """The probe runs inside a real (tiny, random-weight) pipeline: every layer and head of the
    self-attention calls is measured, with finite measures in range."""
    from fastdit.pipelines.tiny import tiny

    pipe = tiny("wan")
    pipe.set_progress_bar_config(disable=True)
    meter = measure(pipe, ["a cat"], dict(num_frames=5, height=32, width=32, num_inference_steps=2,
                                          guidance_scale=1.0, max_sequence_length=8), buckets=2)
    rows = meter.table()
    layers = pipe.transformer.config.num_layers
    heads = pipe.transformer.config.num_attention_heads
    assert len(rows) == 2 * layers * heads
    for r in rows:
        assert all(0.0 <= r[m] <= 1.0 + 1e-6 for m in ("local", "same_position", "entropy", "top5"))
        assert r["kind"] in ("spatial", "temporal", "global", "wide-local", "sharp-nonlocal", "mixed")
