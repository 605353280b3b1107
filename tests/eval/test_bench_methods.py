"""bench_methods at a tiny size: every column, the same-density companions, corrections, claims."""
from __future__ import annotations

import json

import pytest

from fastdit.eval.bench import methods as bench_methods
from fastdit.eval.bench import methods_claims as claims_module


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
    assert all(r["load"]["cpu_count"] >= 1 for r in saved["rows"] if "error" not in r)
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


def test_bench_methods_svg2_points_companions_and_claims(tmp_path, capsys):
    """Two svg2 operating points, each with its own sta / svg / sparge companions matched to its
    density on every kind (semantic included), the split columns, and a verdict per kind."""
    out = tmp_path / "bench_svg2.json"
    first, second = "svg2:q_clusters=6:k_clusters=12:top_p=0.9:init_iters=3", "svg2:q_clusters=8:k_clusters=16:top_p=0.99"
    results = bench_methods.main([
        "--methods", f"{first},{second}", "--match", "x:tile=(1,2,4):block_size=32",
        "--kinds", "spatial,temporal,semantic", "--objects", "4", "--frames", "4", "--height", "4", "--width", "8",
        "--text", "3", "--heads", "2", "--head-dim", "16", "--runs", "1", "--warmup", "0", "--backend", "torch",
        "--json", str(out)])
    printed = capsys.readouterr().out
    assert "cold/dns" in printed and "matched svg@svg2 on spatial: block_size=" in printed
    rows = {(r["method"], r["kind"]): r for r in json.loads(out.read_text())["rows"]}
    for kind in ("spatial", "temporal", "semantic"):
        for reference, tag in ((first, "svg2"), (second, second)):
            own = rows[(reference, kind)]
            assert own["same_density_reference"] and 0 < own["density"] < 1 and own["finite"]
            assert own["cluster_ms"] > 0 and own["cluster_cold_ms"] > 0 and own["score_ms"] > 0
            assert own["cluster_over_dense"] > 0 and own["attention_ms"] > 0
            sta, svg, sparge = (rows[(f"{name}@{tag}", kind)] for name in ("sta", "svg", "sparge"))
            assert sta["same_as"] == svg["same_as"] == sparge["same_as"] == reference
            assert svg["options"]["density"] == pytest.approx(own["density"])
            assert svg["options"]["block_size"] in (32, 16)  # from --match's 32 down, never above it
            assert sparge["options"]["tile"] == [1, 2, 4] and 0 < sparge["options"]["topk"] <= 1
            assert sta["options"]["tile"] == [1, 2, 4] and len(sta["options"]["window"]) == 3
            for row in (sta, svg, sparge):
                assert row["finite"] and "plan density" in row["match_note"] and "cluster_ms" not in row
            # sparge's topk is rescaled until its plan is near svg2's density (when its blocks allow)
            assert abs(sparge["density"] - own["density"]) <= abs(svg["density"] - own["density"]) + 0.1
    claims = results["claims"]
    for reference in (first, second):
        for kind in ("spatial", "temporal", "semantic"):
            verdict = claims[f"{reference} lower error than svg and sparge at the same density on {kind} heads"]
            assert verdict.startswith(("holds", "fails", "undecided")) and "sparge density" in verdict
        assert claims[f"{reference}: issue 17 (spatial and temporal heads)"] in ("holds", "fails", "undecided")
    # the semantic inputs: svg2 groups by content, sta by position, so svg2 has the lower error
    assert rows[(first, "semantic")]["rel_l2"] < rows[("sta@svg2", "semantic")]["rel_l2"]


def test_companion_matching_reaches_the_density():
    """match_companion against plan densities computed independently (run the method, count pairs)."""
    args = bench_methods.build_parser().parse_args(["--frames", "4", "--height", "8", "--width", "8",
                                                    "--head-dim", "16", "--backend", "torch"])
    import torch
    inputs = bench_methods.kind_inputs("spatial", args, torch.device("cpu"), torch.float32)
    for name, option, extra in (("svg", "density", {}), ("sparge", "topk", {"tile": (1, 4, 4)}),
                                ("sta", "window", {"tile": (1, 4, 4)})):
        options, note = bench_methods.match_companion(name, option, 0.3, extra, inputs, args, "x")
        method = bench_methods.build_method(name, options)
        ctx, run = bench_methods.make_call(method, inputs.layout, inputs.q, inputs.k, inputs.v, backend="torch")
        with torch.no_grad():
            run()
        plan = ctx.info["plan"]
        pairs = float(plan.pair_counts().double().mean()) / inputs.layout.seq_len ** 2
        assert f"plan density {pairs:.3f}" in note and "x's 0.300" in note
        assert abs(pairs - 0.3) <= 0.1, (name, options, pairs)


def test_svg2_claim_rule():
    def row(method, kind, density, err, **extra):
        return {"method": method, "kind": kind, "density": density, "rel_l2": err, **extra}

    def verdict(rows):
        return claims_module.svg2_kind_claim(rows, "svg2", "spatial")

    rows = [row("svg2", "spatial", 0.1, 0.1, same_density_reference=True)]
    rows += [row(name, "spatial", 0.11, 0.2, same_as="svg2") for name in ("svg@svg2", "sparge@svg2")]
    assert verdict(rows).startswith("holds")
    rows[-1]["rel_l2"] = 0.05  # sparge better at the same budget
    assert verdict(rows).startswith("fails")
    rows[-1].update(rel_l2=0.05, density=0.3)  # better, but on three times the budget: nothing shown
    assert verdict(rows).startswith("undecided")
    rows[-1].update(rel_l2=0.2, density=0.3)  # worse on more budget: svg2 wins the pair
    assert verdict(rows).startswith("holds")
    rows[-1].update(rel_l2=0.15, density=0.02)  # worse on less budget: undecided
    assert verdict(rows).startswith("undecided")
    rows[-1].update(rel_l2=0.05, density=0.02)  # better on less budget: svg2 loses
    assert verdict(rows).startswith("fails")
    rows[-1].update(rel_l2=float("nan"), density=0.1, finite=False)  # a NaN output never wins
    assert verdict(rows).startswith("holds")
    high = [row("svg2", "spatial", 0.9, 0.01, same_density_reference=True)]
    high += [row(name, "spatial", 1.0, 0.0, same_as="svg2") for name in ("svg@svg2", "sparge@svg2")]
    assert verdict(high).startswith("undecided")  # dense companions are not svg2's budget of 0.9
    rows[0]["rel_l2"] = float("nan")
    assert verdict(rows).startswith("fails")
    assert verdict(rows[:1]).startswith("undecided") and claims_module.svg2_kind_claim(rows, "other", "spatial") == "not run"
    found = claims_module.svg2_claims([row("svg2", k, 0.1, 0.1, same_density_reference=True) for k in
                                       ("spatial", "temporal")] +
                                      [row(n, k, 0.1, 0.2, same_as="svg2") for n in ("svg@svg2", "sparge@svg2")
                                       for k in ("spatial", "temporal")])
    assert found["svg2: issue 17 (spatial and temporal heads)"] == "holds"
