"""bench_methods at a tiny size: every column, the same-density companions, corrections, claims."""
from __future__ import annotations

import json

import pytest

from fastdit.eval import bench_methods


def test_bench_methods_tiny(tmp_path, capsys):
    out = tmp_path / "bench.json"
    results = bench_methods.main([
        "--methods", "sta:tile=(1,2,2):window=(1,1,3),sparge,nosuch", "--match", "x:tile=(1,2,2)",
        "--kinds", "temporal",
        "--corrections", "pooled", "--frames", "3", "--height", "4", "--width", "8", "--text", "5",
        "--heads", "2", "--head-dim", "16", "--runs", "1", "--warmup", "0", "--backend", "torch",
        "--json", str(out)])
    printed = capsys.readouterr().out
    assert "unknown method 'nosuch'" in printed and "claim: sparge lower error than sta" in printed
    saved = json.loads(out.read_text())
    rows = {(r["method"], r["kind"]): r for r in saved["rows"]}
    for kind in ("temporal",):
        sta, sparge = rows[("sta:tile=(1,2,2):window=(1,1,3)", kind)], rows[("sparge@sta", kind)]
        assert 0 < sta["density"] < 1 and 0 <= sta["rel_l2"] < 2 and sta["finite"]
        assert sparge["options"]["topk"] == pytest.approx(sta["density"]) and sparge["options"]["tile"] == [1, 2, 2]
        assert sparge["select_ms"] > 0 and sparge["attention_ms"] > 0 and sparge["total_ms"] > 0
        assert sparge["outside_ms"] == pytest.approx(sparge["total_ms"] - sparge["attention_ms"])
        pooled = rows[("sparge@sta:correction=pooled", kind)]
        assert pooled["density"] == pytest.approx(sparge["density"])
        assert rows[("dense", kind)]["rel_l2"] == 0.0
    claim = results["claims"]["sparge lower error than sta at the same density on temporal heads"]
    assert claim.startswith(("holds", "fails"))
    assert results["claims"]["sparge@sta:correction=pooled lowers the error on temporal heads"].startswith(
        ("holds", "fails"))
    assert saved["skipped"] and "nosuch" in next(iter(saved["skipped"]))


def test_method_list_parsing():
    specs = bench_methods.parse_methods("sta:tile=(4,4,8):window=(3,3,3),sparge:topk=0.2, svg")
    assert specs == [("sta:tile=(4,4,8):window=(3,3,3)", "sta", {"tile": (4, 4, 8), "window": (3, 3, 3)}),
                     ("sparge:topk=0.2", "sparge", {"topk": 0.2}), ("svg", "svg", {})]
    with pytest.raises(ValueError, match="option=value"):
        bench_methods.parse_methods("sparge:topk")
