"""The claims and the table of ``fastdit.eval.bench.methods`` (see its docstring).

Same-density rule of the svg2 claim (one pair: svg2 at density ``d`` and error ``e``, a companion
at ``d'`` and ``e'``; ``tol(d) = max(SAME_DENSITY_REL * min(d, 1 - d), SAME_DENSITY_ABS)``: relative
to the kept fraction at low density and to the dropped fraction at high density, so a dense
companion (``d' = 1``) is never "the same budget" as ``d = 0.9``):

* ``|d' - d| <= tol``: the same budget; svg2 wins the pair iff ``e < e'``;
* ``d' > d + tol`` (the companion could not get down to svg2's density): svg2 wins iff ``e < e'``
  (lower error on less budget), otherwise the pair is undecided;
* ``d' < d - tol``: svg2 loses iff ``e > e'`` (higher error on more budget), otherwise undecided.

A kind's verdict is "fails" when any pair is lost, "holds" when every pair is won, else
"undecided" (a companion that cannot reach svg2's density and is better at its own). Only
finite outputs count (a NaN error loses).
"""
from __future__ import annotations

import math
import sys

from fastdit.eval.bench import common

#: The sta claim's slack on density (unchanged).
CLAIM_SLACK = 0.02
SAME_DENSITY_REL = 0.25
SAME_DENSITY_ABS = 0.003
#: The svg2 claim (issue 17) compares against these companions; sta@svg2 is reported alongside.
SVG2_RIVALS = ("svg", "sparge")
SVG2_CLAIM_KINDS = ("spatial", "temporal")
SVG2_EXTRA_KINDS = ("semantic",)


def density_tolerance(density):
    return max(SAME_DENSITY_REL * min(density, 1.0 - density), SAME_DENSITY_ABS)


def _ok(row):
    return row is not None and "rel_l2" in row and row.get("finite", True) and math.isfinite(row["rel_l2"])


def _find(rows, method, kind):
    return next((r for r in rows if r["method"] == method and r["kind"] == kind and "rel_l2" in r), None)


def pair_verdict(own, other):
    """``True`` (svg2 wins), ``False`` (loses) or ``None`` (undecided) by the docstring's rule."""
    if not _ok(own):
        return False
    if not _ok(other):
        return True if other is not None and not other.get("finite", True) else None
    gap = other["density"] - own["density"]
    better = own["rel_l2"] < other["rel_l2"]
    if abs(gap) <= density_tolerance(own["density"]):
        return better
    if gap > 0:
        return True if better else None
    return False if own["rel_l2"] > other["rel_l2"] else None


def svg2_kind_claim(rows, reference, kind, rivals=SVG2_RIVALS, also=("sta",)):
    """The verdict line of svg2 ``reference`` (its row label) against its companions on ``kind``."""
    own = _find(rows, reference, kind)
    if own is None:
        return "not run"
    verdicts, notes = [], [f"svg2 density {own['density']:.3f} error {own['rel_l2']:.4f}"]
    for name in rivals + tuple(also):
        other = next((r for r in rows if r.get("same_as") == reference and r["kind"] == kind
                      and r["method"].split("@")[0] == name and "rel_l2" in r), None)
        if other is None:
            if name in rivals:
                notes.append(f"{name} not run")
                verdicts.append(None)
            continue
        verdict = pair_verdict(own, other)
        if name in rivals:
            verdicts.append(verdict)
        word = {True: "svg2 better", False: "svg2 worse", None: "undecided"}[verdict]
        reach = "" if abs(other["density"] - own["density"]) <= density_tolerance(own["density"]) else \
            " (density not matched)"
        notes.append(f"{name}{'' if name in rivals else ' [not in the claim]'} density {other['density']:.3f}"
                     f"{reach} error {other['rel_l2']:.4f}: {word}")
    if not verdicts:
        return "not run"
    word = "fails" if False in verdicts else "holds" if all(verdicts) else "undecided"
    return f"{word} ({'; '.join(notes)})"


def svg2_claims(rows):
    """Per svg2 reference run and kind: ``{claim: verdict}`` (issue 17's kinds, then the extra ones)."""
    found = {}
    references = [r["method"] for r in rows if r.get("same_density_reference") and
                  r["method"].split(":")[0] == "svg2"]
    for reference in dict.fromkeys(references):
        overall = []
        for kind in SVG2_CLAIM_KINDS + SVG2_EXTRA_KINDS:
            if _find(rows, reference, kind) is None:
                continue
            verdict = svg2_kind_claim(rows, reference, kind)
            found[f"{reference} lower error than svg and sparge at the same density on {kind} heads"] = verdict
            if kind in SVG2_CLAIM_KINDS:
                overall.append(verdict.split(" ")[0])
        if overall:
            word = "fails" if "fails" in overall else "holds" if set(overall) == {"holds"} else "undecided"
            found[f"{reference}: issue 17 (spatial and temporal heads)"] = word
    if not found:
        found["svg2 lower error than svg and sparge at the same density"] = "not run"
    return found


def claims(rows):
    """The claims of bench.methods' docstring: ``{claim: "holds" | "fails ..." | ...}``."""
    found = {}
    sta_label = next((r["method"] for r in rows if r.get("same_density_reference") and
                      r["method"].split(":")[0] == "sta"), "sta")
    sta = _find(rows, sta_label, "temporal")
    for name in ("sparge@sta", "svg@sta"):
        other = _find(rows, name, "temporal")
        key = f"{name.split('@')[0]} lower error than sta at the same density on temporal heads"
        if sta is None or other is None:
            found[key] = "not run"
        elif other["density"] > sta["density"] + CLAIM_SLACK:
            found[key] = f"fails: density {other['density']:.3f} above sta's {sta['density']:.3f}"
        else:
            found[key] = ("holds" if other["rel_l2"] < sta["rel_l2"] else "fails") + (
                f" ({other['rel_l2']:.4f} vs {sta['rel_l2']:.4f})")
    found.update(svg2_claims(rows))
    for row in rows:
        label = row["method"]
        if ":correction=" not in label or "rel_l2" not in row:
            continue
        base = _find(rows, label.split(":correction=")[0], row["kind"])
        key = f"{label} lowers the error on {row['kind']} heads"
        if base is None:
            found[key] = "not run"
        elif base["rel_l2"] < 1e-6:
            found[key] = "not run (no error to lower: the plan is dense)"
        else:
            found[key] = ("holds" if row["rel_l2"] < base["rel_l2"] else "fails") + (
                f" ({row['rel_l2']:.4f} vs {base['rel_l2']:.4f})")
    return found


def print_table(results, file=None):
    file = sys.stdout if file is None else file
    meta = results["meta"]
    print(f"structured inputs {meta['grid']} + {meta['text']} text = {meta['tokens']} tokens, {meta['heads']} heads, "
          f"D={meta['head_dim']}, {meta['dtype']}, {meta['device']}; median of {meta['runs']} runs", file=file)
    width = max([34] + [len(row["method"]) for row in results["rows"]])
    header = (f"{'method':{width}} {'kind':8} {'density':>7} {'kept':>6} {'rel_l2':>8} {'select':>8} {'attn':>8} "
              f"{'total':>8} {'outside':>8} {'saved':>8} {'sel/dns':>7} {'peakMB':>7}")
    print(header, file=file)
    print("-" * len(header), file=file)
    f = common.fmt
    for row in results["rows"]:
        if "error" in row:
            print(f"{row['method']:{width}} {row['kind']:8} ERROR {row['error']}", file=file)
            continue
        print(f"{row['method']:{width}} {row['kind']:8} {f(row.get('density'), '7.3f')} "
              f"{f(row.get('kept_mass'), '6.3f')} {f(row.get('rel_l2'), '8.4f')} "
              f"{f(row.get('select_ms'), '8.2f')} {f(row.get('attention_ms'), '8.2f')} "
              f"{f(row.get('total_ms'), '8.2f')} {f(row.get('outside_ms'), '8.2f')} {f(row.get('saved_ms'), '8.2f')} "
              f"{f(row.get('select_over_dense'), '7.3f')} {f(row.get('peak_mb'), '7.1f')}", file=file)
    split = [row for row in results["rows"] if "cluster_ms" in row]
    if split:
        print(f"{'method':{width}} {'kind':8} {'cluster':>8} {'cold':>8} {'score':>8} {'cl+sc/dns':>9} "
              f"{'cold/dns':>8}", file=file)
        for row in split:
            print(f"{row['method']:{width}} {row['kind']:8} {f(row['cluster_ms'], '8.2f')} "
                  f"{f(row['cluster_cold_ms'], '8.2f')} {f(row['score_ms'], '8.2f')} "
                  f"{f(row['cluster_over_dense'], '9.3f')} {f(row['cold_over_dense'], '8.3f')}", file=file)
    print("times in ms per call (all heads of the kind)", file=file)
    for row in results["rows"]:
        if row.get("match_note"):
            print(f"matched {row['method']} on {row['kind']}: {row['match_note']}", file=file)
    for claim, verdict in results["claims"].items():
        print(f"claim: {claim}: {verdict}", file=file)
    for label, message in results["skipped"].items():
        print(f"skipped {label}: {message}", file=file)
