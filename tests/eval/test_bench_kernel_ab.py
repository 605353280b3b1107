"""The kernel benchmark's block-size / key-validity A/B (``attention_kernel.block_size_ab_cases``):
CUDA-only cases, so here their plans are checked against a brute-force sliding window and a shrunken
copy runs through ``run_kernel`` on the CPU, the engine's arguments recorded."""
import math

import torch

from fastdit.eval.bench import attention_kernel as ak
from fastdit.eval.bench.common import BenchReport


def _brute_window(grid, window):
    """Key tiles of every query tile: the window clamped inside the grid, written out per axis."""
    out = []
    for t in range(grid[0]):
        for y in range(grid[1]):
            for x in range(grid[2]):
                lo = [min(max(c - w // 2, 0), g - w) for c, w, g in zip((t, y, x), window, grid)]
                out.append(sorted((a * grid[1] + b) * grid[2] + c
                                  for a in range(lo[0], lo[0] + window[0])
                                  for b in range(lo[1], lo[1] + window[1])
                                  for c in range(lo[2], lo[2] + window[2])))
    return out


def test_ab_cases_differ_by_block_size_or_key_validity_alone():
    cases = ak.block_size_ab_cases()
    assert [(c["block"], c["kv_valid"]) for c in cases] == [(384, False), (378, False), (378, True)]
    for case in cases:
        idx, cnt = case["plan"]("cpu")
        tiles = math.prod(case["tile_grid"])
        assert case["N"] == tiles * case["block"]  # whole blocks: only the block size differs
        got = [sorted(idx[0, 0, m, : cnt[0, 0, m]].tolist()) for m in range(tiles)]
        assert got == _brute_window(case["tile_grid"], case["window"])
        pairs = ak.computed_pairs(idx, cnt, case["N"], case["N"], case["block"], case["block"], 1, case["H"])
        assert pairs / (case["H"] * case["N"] ** 2) == 27 / 90
        assert case["flex"] is False
    # the two 378-token cases share their inputs' shape, so one dense baseline serves both
    assert cases[1]["dense_ref"] == cases[2]["dense_ref"] != cases[0]["dense_ref"]


def test_run_kernel_passes_an_all_true_kv_valid_only_to_the_kv_case(tmp_path, monkeypatch):
    small = []
    for case in ak.block_size_ab_cases():  # the same plans on 12- / 13-token blocks, H 2, D 16, float32
        block = 12 if case["block"] == 384 else 13
        small.append(dict(case, N=90 * block, block=block, H=2, D=16, dtype=torch.float32,
                          dense_ref=f"ab_n{90 * block}"))
    monkeypatch.setattr(ak, "base_cases", lambda quick: small)
    seen = []
    engine = ak.block_sparse_attention

    def recording(q, k, v, idx, cnt, block_m, block_n, **kw):
        seen.append((block_m, None if kw.get("kv_valid") is None else kw["kv_valid"].clone()))
        return engine(q, k, v, idx, cnt, block_m, block_n, **kw)

    monkeypatch.setattr(ak, "block_sparse_attention", recording)
    meta = {"timestamp": "t", "gpu": None, "cpu": "cpu", "torch": torch.__version__, "triton": None}
    report = BenchReport(str(tmp_path / "k.json"), meta)
    ak.run_kernel(torch.device("cpu"), quick=True, reps=1, warmup=0, report=report)
    rows = [r for r in report.rows if r["backend"].startswith("fastdit")]
    assert [(r["case"], r["backend"]) for r in rows] == [
        ("ab_sta_b384", "fastdit_torch"), ("ab_sta_b378", "fastdit_torch"), ("ab_sta_b378_kv", "fastdit_torch+kv_valid")]
    assert all(r["density"] == 27 / 90 and r["time_ms"] > 0 for r in rows)
    by_block = {}
    for block, kv_valid in seen:
        by_block.setdefault((block, kv_valid is not None), kv_valid)
    assert set(by_block) == {(12, False), (13, False), (13, True)}
    mask = by_block[(13, True)]
    assert mask.dtype == torch.bool and mask.shape == (1, 90 * 13) and bool(mask.all())
