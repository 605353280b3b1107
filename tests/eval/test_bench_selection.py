"""eval.bench.selection: the oracle's block masks against direct checks, and a short run of the benchmark."""
from __future__ import annotations

import json

import torch

from fastdit.eval.bench import selection as bench


def test_oracle_masks_fit_the_budget_and_keep_the_most_mass():
    gen = torch.Generator().manual_seed(0)
    seq, n = 64, 8
    probs = torch.softmax(3 * torch.randn(seq, seq, generator=gen, dtype=torch.float64), -1)
    index = torch.arange(seq) // (seq // n)
    for density in (0.2, 0.5):
        masks = bench.oracle_masks(probs, index, n, index, n, density)
        for mask in masks:
            assert float(mask.double().mean()) <= density + 1e-9
            # each query block keeps its key block of largest true mass
            mass, _, _ = bench.block_mass(probs, index, n, index, n)
            blocks = mask.view(n, seq // n, n, seq // n)[:, 0, :, 0]
            assert blocks[torch.arange(n), mass.argmax(1)].all()
        # No mask of whole blocks at this density keeps more mass than the greedy one by much:
        # compare with random masks of the same block count.
        greedy_kept = float((probs * masks[0]).sum())
        count = int(masks[0].view(n, seq // n, n, seq // n)[:, 0, :, 0].sum())
        for _ in range(20):
            pick = torch.zeros(n * n, dtype=torch.bool)
            pick[torch.randperm(n * n, generator=gen)[:count]] = True
            random_mask = pick.view(n, n)[index][:, index]
            assert float((probs * random_mask).sum()) <= greedy_kept + 1e-9
    full = bench.oracle_masks(probs, index, n, index, n, 1.0)
    assert all(bool(m.all()) for m in full)


def test_short_run_writes_rows_claims_and_plot(tmp_path):
    out = tmp_path / "sel.json"
    bench.main(["--frames", "2", "--height", "8", "--width", "16", "--kinds", "spatial,rotary", "--heads", "1",
                "--head-dim", "32", "--thresholds", "0.9,0.95", "--oracle-densities", "0.25,0.5",
                "--methods", "sparge,svg2:q_clusters=8:k_clusters=16", "--runs", "1", "--warmup", "0",
                "--json", str(out)])
    data = json.loads(out.read_text())
    assert len(data["rows"]) == 2 * 2 * 2 and len(data["oracle_curve"]) == 4
    for row in data["rows"]:
        assert 0.0 < row["density"] <= 1.0 and 0.0 < row["kept"] <= 1.0 + 1e-6
        assert row["error"] >= 0.0 and row["oracle"] >= 0.0
    assert {c["kind"] for c in data["claims"]} == {"spatial", "rotary"}
    assert (tmp_path / "sel.png").stat().st_size > 1000
