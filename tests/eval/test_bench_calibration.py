"""``python -m fastdit.eval.bench.calibration --quick``: the calibration evidence script runs, its plan meets
the budget on the calibration prompt, and its equal-density comparison interpolates correctly."""
import json
import math

import pytest

from fastdit.eval.bench.calibration import interpolate, main


def test_interpolate_the_global_curve():
    curve = [{"density": 0.5, "err": 0.4}, {"density": 0.1, "err": 1.2}, {"density": 1.0, "err": 0.0}]
    assert interpolate(curve, 0.3, "err") == pytest.approx(0.8)  # halfway between 0.1 and 0.5
    assert interpolate(curve, 0.75, "err") == pytest.approx(0.2)
    assert interpolate(curve, 0.05, "err") is None  # outside the measured densities: no claim


def test_quick_run_writes_rows_and_meets_the_budget_on_calibration(tmp_path):
    out = tmp_path / "bench.json"
    main(["--quick", "--methods", "sparge", "--backend", "torch", "--budget", "sparge=0.9", "--json", str(out)])
    result = json.loads(out.read_text())["methods"]["sparge"]
    rows = result["rows"]
    assert {r["group"] for r in rows} == {"calibration", "held-out"} and len(rows) == 2 * (1 + 3)
    for row in rows:
        assert 0 < row["density"] <= 1 and math.isfinite(row["attn_err"]) and row["worst"] >= 0
    sparse = [r for r in rows if r["setting"] != "plan"]
    assert all(r["density"] < 1 and r["attn_err"] > 0 for r in sparse)  # the candidates are really sparse
    summary = result["summary"]["calibration"]
    # the calibration measured every query row of the same dense run: the budget holds exactly there
    assert summary["plan_worst"] <= 0.9 + 1e-6 and summary["meets_budget"]
    assert set(result["summary"]) == {"calibration", "held-out"}
    structured = json.loads(out.read_text())["structured"]["sparge"]["summary"]["calibration"]
    assert structured["plan_worst"] <= structured_budget() + 1e-9 and 0 < structured["plan_density"] <= 1


def structured_budget():
    from fastdit.eval.bench.calibration import STRUCTURED_BUDGET

    return STRUCTURED_BUDGET["sparge"]
