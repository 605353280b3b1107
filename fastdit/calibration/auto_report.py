"""``method="auto"``: scoring calls outside a pipeline, the single-method comparison, and the report.

* ``score_call(q, k, v, layout, candidates, gpu)``: what ``fastdit.calibrate(pipe, "auto", ...)``
  records for one attention call (the same probe: every candidate run on the same ``q, k, v``
  through ``fastdit.attention``; per (head, candidate) the squared error against the dense output
  on the sampled rows, the density and the predicted time), for inputs that come from no pipeline
  (the structured inputs of ``fastdit.eval.bench.structured``);
* ``compare_single(results, candidates, budget)``: auto's choice against every single method with
  its own per-head choice (its candidates only, dense where none meets the budget), all at the
  same budget: predicted time, worst error, heads per method;
* ``summary(calibration)`` (text lines: heads per method, predicted speedup on the calibration's GPU, measured
  error) and ``heatmap(calibration, path)`` (a PNG: the chosen method per (layer, head), one panel per
  step bucket): what ``fastdit calibrate --method auto`` prints and draws.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from fastdit.calibration.candidates import select_auto
from fastdit.calibration.search import _Recorder
from fastdit.costmodel import gpu_named

__all__ = ["compare_single", "heatmap", "method_of", "score_call", "summary"]


def score_call(q, k, v, layout, candidates, gpu, rows=None, layer=0, key_mask=None, scale=None, backend="auto",
               seed=0):
    """``{"0_<layer>": {err2, ref2, density, time, dense_time, calls}}`` of one call (a result as
    ``select_auto`` reads it), ``rows`` sampled video query rows (None: every video row)."""
    recorder = _Recorder("auto", {}, list(candidates), 1, rows or layout.video_len, seed, None, gpu_named(gpu))
    ctx = SimpleNamespace(layout=layout, layer=layer, step=0, num_steps=1, branch=0, key_mask=key_mask,
                          backend=backend, scale=scale)
    mask = None if key_mask is None else key_mask[:, None, None, :]
    dense = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    recorder.observe(ctx, q, k, v, dense)
    return recorder.results()


def method_of(candidates, index):
    """The method name of a choice (``"dense"`` for None)."""
    return "dense" if index is None else candidates[index]["method"]


def compare_single(results, candidates, budget):
    """Rows ``{label, predicted_ms, dense_ms, speedup, worst_error, heads}`` for ``auto`` and for
    each single method of ``candidates`` (its own per-head choice at ``budget``), ``results`` a
    list of per-prompt results (``score_call``'s, merged over layers)."""
    rows = []
    methods = sorted({c["method"] for c in candidates})
    for label, allowed in [("auto", None)] + [(m, {m}) for m in methods]:
        choice, measured = select_auto(results, candidates, budget, allowed=allowed)
        predicted = sum(sum(m["head_time"]) for m in measured.values())
        dense = sum(sum(m["dense_time"]) for m in measured.values())
        heads = {}
        for index in choice.values():
            name = method_of(candidates, index)
            heads[name] = heads.get(name, 0) + 1
        rows.append({"label": label, "predicted_ms": predicted, "dense_ms": dense, "speedup": dense / predicted,
                     "worst_error": max(m["error"] for m in measured.values()), "heads": heads, "choice": choice})
    return rows


def _grid(calibration):
    """Per step bucket, a (layers x heads) list of method names."""
    layers, heads = calibration["model"]["layers"], calibration["model"]["heads"]
    out = {}
    for key, index in calibration["choices"].items():
        step, layer, head = map(int, key.split("_"))
        step_table = out.setdefault(step, [["dense"] * heads for _ in range(layers)])
        step_table[layer][head] = method_of(calibration["candidates"], index)
    return out


def summary(calibration):
    """Text lines: heads per method (over buckets, layers, heads), the predicted speedup of the
    calibrated attention calls on the calibration's GPU, and the measured worst error and mean density."""
    counts = {}
    for index in calibration["choices"].values():
        name = method_of(calibration["candidates"], index)
        counts[name] = counts.get(name, 0) + 1
    measured = calibration["measured"]
    lines = [f"auto calibration: {len(calibration['choices'])} (step bucket, layer, head) choices at budget "
             f"{calibration['budget']}: "
             + ", ".join(f"{name} {n}" for name, n in sorted(counts.items(), key=lambda kv: -kv[1]))]
    if "predicted_speedup" in measured:
        lines.append(f"predicted attention time on {calibration.get('gpu')}: {measured['predicted_ms']:.4g} ms vs "
                     f"dense {measured['dense_ms']:.4g} ms over the calibrated calls (speedup "
                     f"{measured['predicted_speedup']:.2f}x, fastdit.costmodel)")
    lines.append(f"measured worst relative error {measured['error']:.4f} (budget {calibration['budget']}), mean "
                 f"density {measured['density']:.3f} (dense heads count 1)")
    for step, grid in sorted(_grid(calibration).items()):
        lines.append(f"step bucket {step}: layer: methods per head")
        lines += [f"  {layer}: {' '.join(row)}" for layer, row in enumerate(grid)]
    return lines


def heatmap(calibration, path):
    """Draw the chosen method per (layer, head) as a PNG at ``path`` (one panel per step bucket)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    grids = _grid(calibration)
    names = sorted({n for grid in grids.values() for row in grid for n in row} | {"dense"})
    colors = plt.get_cmap("tab10").colors
    cmap = ListedColormap([colors[i % len(colors)] for i in range(len(names))])
    layers, heads = calibration["model"]["layers"], calibration["model"]["heads"]
    fig, axes = plt.subplots(1, len(grids), figsize=(max(4.5, 2.5 + 0.35 * heads * len(grids)),
                                                     max(2.5, 1.4 + 0.3 * layers)), squeeze=False)
    for axis, (step, grid) in zip(axes[0], sorted(grids.items())):
        values = [[names.index(n) for n in row] for row in grid]
        axis.imshow(values, cmap=cmap, vmin=-0.5, vmax=len(names) - 0.5, aspect="auto", interpolation="nearest")
        axis.set_title(f"steps from {step}", fontsize=8)
        axis.set_xlabel("head", fontsize=8)
        axis.set_ylabel("layer", fontsize=8)
        axis.set_xticks(range(heads))
        axis.set_yticks(range(layers))
        axis.tick_params(labelsize=6)
    handles = [matplotlib.patches.Patch(color=cmap(i), label=n) for i, n in enumerate(names)]
    fig.legend(handles=handles, loc="center right", fontsize=7)
    measured = calibration["measured"]
    speed = measured.get("predicted_speedup")
    predicted = f"predicted {speed:.2f}x on {calibration.get('gpu')}\n" if speed else ""
    fig.suptitle(f"auto at budget {calibration['budget']}: " + predicted + f"worst error {measured['error']:.3f}",
                 fontsize=8, x=0.02, ha="left")
    fig.tight_layout(rect=(0, 0, 0.75, 0.88))
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
