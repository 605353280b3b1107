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


def test_bench_methods_svg2_split_companions_and_claim(tmp_path, capsys):
    out = tmp_path / "bench_svg2.json"
    results = bench_methods.main([
        "--methods", "svg2:q_clusters=6:k_clusters=12:top_p=0.9:init_iters=3",
        "--match", "x:tile=(1,2,4):block_size=16",
        "--kinds", "spatial,temporal", "--frames", "4", "--height", "4", "--width", "8", "--text", "3",
        "--heads", "2", "--head-dim", "16", "--runs", "1", "--warmup", "0", "--backend", "torch", "--json", str(out)])
    printed = capsys.readouterr().out
    assert "cold/dns" in printed
    rows = {(r["method"], r["kind"]): r for r in json.loads(out.read_text())["rows"]}
    for kind in ("spatial", "temporal"):
        own = rows[("svg2:q_clusters=6:k_clusters=12:top_p=0.9:init_iters=3", kind)]
        assert own["same_density_reference"] and 0 < own["density"] < 1 and own["finite"]
        assert own["cluster_ms"] > 0 and own["cluster_cold_ms"] > 0 and own["score_ms"] > 0
        assert own["cluster_over_dense"] > 0 and own["attention_ms"] > 0
        svg, sparge = rows[("svg@svg2", kind)], rows[("sparge@svg2", kind)]
        assert svg["options"] == {"density": pytest.approx(own["density"]), "block_size": 16}
        assert sparge["options"] == {"topk": pytest.approx(own["density"]), "tile": [1, 2, 4]}
        assert "cluster_ms" not in svg and sparge["rel_l2"] >= 0
    claim = results["claims"]["svg2 lower error than svg and sparge at the same density on spatial and temporal heads"]
    assert claim.startswith(("holds", "fails")) and "temporal" in claim


def test_svg2_claim_rule():
    def row(method, kind, density, err, **extra):
        return {"method": method, "kind": kind, "density": density, "rel_l2": err, **extra}

    rows = [row("svg2", kind, 0.3, 0.1, same_density_reference=True) for kind in ("spatial", "temporal")]
    rows += [row(name, kind, 0.31, 0.2) for name in ("svg@svg2", "sparge@svg2") for kind in ("spatial", "temporal")]
    assert bench_methods.svg2_claim(rows).startswith("holds")
    rows[-1]["rel_l2"] = 0.05  # sparge better on temporal heads
    assert bench_methods.svg2_claim(rows).startswith("fails")
    rows[-1].update(rel_l2=0.2, density=0.2)  # another budget than svg2's proves nothing
    assert bench_methods.svg2_claim(rows).startswith("fails") and "not within" in bench_methods.svg2_claim(rows)
    rows[-1].update(density=0.4)
    assert bench_methods.svg2_claim(rows).startswith("fails")
    assert bench_methods.svg2_claim(rows[:2]) == "not run"
