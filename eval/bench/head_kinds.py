"""Which kinds of heads a model really has: the structured generator's kinds, measured on real attention maps.

    python -m fastdit.eval.bench.head_kinds [--model tiny-shapes] [--prompts 4] [--json FILE]

The structured inputs (``fastdit.eval.bench.structured``) build heads of known kinds (spatial,
temporal, global, semantic, ...) and the project's method findings are stated per kind. This
benchmark asks which of those kinds a model's layers actually have. The pipeline runs densely,
patched with calibration's ``DenseProbe`` (every attention call returns the model's own attention,
so the run is the dense run), and on every self-attention call the probe measures the dense
attention of each head with ``structured.attention_masses`` (the same measures and thresholds
``check_kinds`` applies to the generated heads), averaged over the video query rows, the batch
(both CFG branches), the calls of a step bucket and the prompts:

* ``local``: mass on video keys with ``|dt| <= 1`` and ``|dh|, |dw| <= 2`` latent tokens;
* ``same_position``: mass on keys at the query's ``(h, w)`` in the *other* frames;
* ``entropy``: the row entropy over ``log`` of the key count (1: uniform);
* ``top5``: mass on the row's 5% largest keys, wherever they are.

A head is labelled by the first rule it meets: ``spatial`` (local >= 0.8), ``temporal``
(same_position >= 0.6 (T - 1) / T), ``global`` (entropy >= 0.85): the thresholds ``check_kinds``
applies to the generated kinds; then ``wide-local`` (local >= 0.3, the threshold of the generator's
smooth and rotary kinds: local, but wider or leakier than a spatial head), ``sharp-nonlocal``
(top5 >= 0.5: concentrated away from the query, as a semantic head is; object labels, which the
generator's semantic check uses, do not exist for a real model), else ``mixed``. ``local_uniform``
is the local share a uniform head would have (the local window's key count over all keys).

Every video query row counts; the scores are computed ``--chunk`` rows at a time, so memory stays
at chunk x S per head.
"""
from __future__ import annotations

import argparse
import math

import torch

import fastdit
from fastdit.calibration.search import DenseProbe
from fastdit.eval.bench.structured import (MIN_GLOBAL_ENTROPY, MIN_SMOOTH_LOCAL, MIN_SPATIAL_LOCAL,
                                           MIN_TEMPORAL_SAME_POSITION, attention_masses)
from fastdit.jsonutil import dump_json

#: A head that is neither local nor global but puts this much mass on its 5% largest keys is sharp
#: somewhere else: what a semantic head (attention to similar content) looks like without labels.
SHARP_TOP5 = 0.5
MEASURES = ("local", "same_position", "entropy", "top5")


def label(mass, frames):
    """The kind ``check_kinds`` would accept for a head with these measures, else ``mixed``."""
    if mass["local"] >= MIN_SPATIAL_LOCAL:
        return "spatial"
    if frames > 1 and mass["same_position"] >= MIN_TEMPORAL_SAME_POSITION * (frames - 1) / frames:
        return "temporal"
    if mass["entropy"] >= MIN_GLOBAL_ENTROPY:
        return "global"
    if mass["local"] >= MIN_SMOOTH_LOCAL:
        return "wide-local"
    if mass["top5"] >= SHARP_TOP5:
        return "sharp-nonlocal"
    return "mixed"


def local_uniform(grid, radius=2):
    """The local share of a uniform head: keys in the local window (averaged over queries) / all keys."""
    def span(n, r):  # mean count of positions within distance r on an axis of n positions
        return sum(min(i + r, n - 1) - max(i - r, 0) + 1 for i in range(n)) / n
    t_, h_, w_ = grid
    return span(t_, 1) * span(h_, radius) * span(w_, radius) / (t_ * h_ * w_)


class KindMeter:
    """The probe's observer: per (bucket, layer), sums of each measure per head and the call count."""

    def __init__(self, buckets, chunk=1024):
        self.buckets, self.chunk = buckets, chunk
        self.sums, self.grid = {}, None

    def bucket(self, step, num_steps):
        starts = sorted({int(i * max(num_steps or 1, 1) // self.buckets) for i in range(self.buckets)})
        return max(s for s in starts if s <= (step or 0))

    def observe(self, ctx, q, k, v, dense_out):
        layout = ctx.layout
        if layout.grid is None or layout.video_len < 2 or k.shape[-2] != q.shape[-2]:
            return  # cross-attention or no video grid: not a self-attention map over the video
        self.grid = tuple(layout.grid)
        masses = attention_masses(q, k, layout, scale=ctx.scale, chunk=self.chunk)
        key = (self.bucket(ctx.step, ctx.num_steps), ctx.layer)
        entry = self.sums.setdefault(key, {"calls": 0, **{m: [0.0] * len(masses) for m in MEASURES}})
        for head, mass in enumerate(masses):
            for m in MEASURES:
                entry[m][head] += mass[m]
        entry["calls"] += 1

    def table(self):
        """Rows per (bucket, layer, head) with the mean measures and the label."""
        frames = self.grid[0]
        out = []
        for (bucket, layer), entry in sorted(self.sums.items()):
            for head in range(len(entry["local"])):
                mass = {m: entry[m][head] / entry["calls"] for m in MEASURES}
                out.append({"bucket": bucket, "layer": layer, "head": head, **mass, "kind": label(mass, frames),
                            "calls": entry["calls"]})
        return out


def measure(pipe, prompts, call, buckets=2, chunk=1024, seed=0):
    """Run ``pipe`` densely on each prompt (seed ``seed + index``) with the probe; returns the ``KindMeter``."""
    meter = KindMeter(buckets, chunk)
    probe = fastdit.patch(pipe, DenseProbe, observer=meter, dense_steps=0, dense_layers=0)
    try:
        with torch.inference_mode():
            for index, prompt in enumerate(prompts):
                pipe(prompt=prompt, generator=torch.Generator().manual_seed(seed + index), output_type="latent",
                     **call)
    finally:
        probe.remove()
    return meter


def build_parser():
    parser = argparse.ArgumentParser(prog="python -m fastdit.eval.bench.head_kinds", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny-shapes", help="a model name of fastdit.pipelines.loading")
    parser.add_argument("--prompts", type=int, default=4, help="how many of the shipped held-out shapes captions")
    parser.add_argument("--buckets", type=int, default=2, help="step buckets (early / late denoising)")
    parser.add_argument("--chunk", type=int, default=1024, help="query rows scored at a time")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the table here")
    return parser


def main(argv=None):
    from fastdit.eval.runner.prompts import load_prompts
    from fastdit.pipelines.loading import TRAINED_DEFAULTS, load_pipeline

    args = build_parser().parse_args(argv)
    pipe = load_pipeline(args.model)
    pipe.set_progress_bar_config(disable=True)
    call = dict(TRAINED_DEFAULTS.get(args.model, {}))
    prompts = [p.text for p in load_prompts("shapes")[: args.prompts]]
    meter = measure(pipe, prompts, call, args.buckets, args.chunk, args.seed)
    rows = meter.table()
    uniform = local_uniform(meter.grid)
    print(f"{args.model}: latent grid {meter.grid}, {len(prompts)} prompts, {call.get('num_inference_steps')} steps, "
          f"CFG {call.get('guidance_scale')}; all video query rows; a uniform head's local "
          f"share is {uniform:.3f}")
    print("| step bucket | layer | head | local | same position | entropy | top 5% | kind |")
    print("|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['bucket']} | {r['layer']} | {r['head']} | {r['local']:.3f} | {r['same_position']:.3f} | "
              f"{r['entropy']:.3f} | {r['top5']:.3f} | {r['kind']} |")
    result = {"model": args.model, "grid": meter.grid, "call": call, "prompts": prompts, "rows": rows,
              "local_uniform": uniform, "args": vars(args)}
    if args.json:
        dump_json(args.json, result, indent=1)
        print(f"wrote {args.json}")
    return result


if __name__ == "__main__":
    main()
