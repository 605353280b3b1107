"""``python -m fastdit.eval.bench.varlen --quick --check`` in-process: the JSON holds the three forms
with finite times, the token-pair densities it promises, the check against the float64 reference,
and the variable form on the fixed form's own boundaries gives the fixed form's output."""
import json
import math

from fastdit.eval.bench import varlen as bench_varlen


def test_bench_varlen_quick(tmp_path):
    out = tmp_path / "varlen.json"
    assert bench_varlen.main(["--quick", "--check", "--runs", "1", "--warmup", "0", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["check"]["passed"] and report["check"]["rel_error"] < 1e-4
    rows = {row["form"]: row for row in report["rows"]}
    assert set(rows) == {"fixed", "varlen_same", "varlen_random"}
    for row in rows.values():
        assert row["load"]["cpu_count"] >= 1 and "shared" in row["load"]  # every timed row says how loaded the CPU was
        assert math.isfinite(row["ms"]) and row["ms"] > 0 and math.isfinite(row["ratio_vs_fixed"])
        assert abs(row["density"] - 0.25) < 0.05, row
    assert rows["fixed"]["ratio_vs_fixed"] == 1.0
    assert rows["varlen_same"]["rel_err_vs_fixed"] < 1e-5
    assert report["meta"]["n"] == 1024 and report["meta"]["blocks"] == [64]


def test_bench_varlen_pair_density():
    """``pair_density`` counts attended pairs from block sizes: a hand-made plan."""
    import torch

    q_off = torch.tensor([[[0, 2, 5]]])
    k_off = torch.tensor([[[0, 1, 4]]])
    idx = torch.tensor([[[[1, 0], [0, 7]]]])
    cnt = torch.tensor([[[2, 1]]])
    assert bench_varlen.pair_density(q_off, k_off, idx, cnt) == (2 * 4 + 3 * 1) / (5 * 4)
