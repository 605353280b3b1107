"""Dense prompt adherence of a tiny-shapes model on held-out captions, with its colour / shape / motion parts.

    python scripts/shapes_adherence.py --model tiny-shapes --seeds 0,1 --out runs/adherence
    python scripts/shapes_adherence.py --model tiny-shapes --seeds 0,1 --shard 0/2 --out runs/adherence &
    python scripts/shapes_adherence.py --model tiny-shapes --seeds 0,1 --shard 1/2 --out runs/adherence
    python scripts/shapes_adherence.py --out runs/adherence --merge

``fastdit eval --metrics adherence`` reports the score alone; this script keeps its parts (what
issue 40's targets are stated in), one JSON per sample under ``--out`` (a rerun skips those done, so
shards can run as separate processes, one per core), and ``--merge`` prints the means and the
standard error over captions and writes ``summary.json``, with ``shape_drawn``: for each shape word of the
captions, the share of the frames (where its object was found) whose blob is classed circle / square / triangle
(a shape score near chance then says whether the shapes are drawn alike or drawn at random). Each sample is the
pipeline's native call (``TRAINED_DEFAULTS``; 12 UniPC steps, guidance 4) with
``torch.Generator().manual_seed(seed)``.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import time


def _samples(prompts, seeds, shard):
    index, count = shard
    pairs = [(p, text, seed) for seed in seeds for p, text in enumerate(prompts)]
    return [pair for i, pair in enumerate(pairs) if i % count == index]


def run(args):
    import torch

    from fastdit.eval.metrics.adherence import adherence
    from fastdit.eval.runner.prompts import load_prompts
    from fastdit.pipelines.loading import TRAINED_DEFAULTS, load_pipeline

    prompts = [p.text for p in load_prompts(args.prompts)][: args.max_prompts]
    seeds = [int(s) for s in args.seeds.split(",")]
    shard = tuple(int(v) for v in args.shard.split("/"))
    os.makedirs(args.out, exist_ok=True)
    pipe = load_pipeline(args.model, "cpu")
    # a pipeline folder (e.g. a training run's export) runs at tiny-shapes' native call
    call = dict(TRAINED_DEFAULTS.get(args.model, TRAINED_DEFAULTS["tiny-shapes"]))
    if args.size:  # e.g. a quick read at 64 x 64 during training (shapes and speeds scale with the frame)
        call.update(height=args.size, width=args.size)
    if args.guidance is not None:
        call.update(guidance_scale=args.guidance)
    torch.set_num_threads(args.threads)
    pipe.set_progress_bar_config(disable=True)
    for index, text, seed in _samples(prompts, seeds, shard):
        path = os.path.join(args.out, f"{index:03d}_{seed}.json")
        if os.path.exists(path):
            continue
        start = time.perf_counter()
        with torch.no_grad():
            frames = pipe(prompt=text, generator=torch.Generator().manual_seed(seed), output_type="np",
                          **call).frames[0]
        result = adherence(frames, text)
        record = {"prompt": index, "caption": text, "seed": seed, "score": result.score, "colour": result.colour,
                  "shape": result.shape, "motion": result.motion, "seconds": time.perf_counter() - start,
                  "objects": [dict(zip(("colour", "shape", "direction", "colour_score", "shape_score", "motion_score",
                                        "drawn"), row)) for row in result.objects]}
        with open(path + ".tmp", "w") as f:
            json.dump(record, f)
        os.replace(path + ".tmp", path)
        print(f"{index:3d} seed {seed}: {result.score:.3f} (colour {result.colour:.2f}, shape {result.shape:.2f}, "
              f"motion {result.motion:.2f}) {record['seconds']:.0f} s  {text}", flush=True)


def merge(args):
    import numpy as np

    records = [json.load(open(p)) for p in sorted(glob.glob(os.path.join(args.out, "[0-9]*_*.json")))]
    if not records:
        raise SystemExit(f"no samples in {args.out}")
    by_prompt = {}
    for r in records:
        by_prompt.setdefault(r["prompt"], []).append(r)
    summary = {"samples": len(records), "captions": len(by_prompt),
               "seeds": sorted({r["seed"] for r in records})}
    for key in ("score", "colour", "shape", "motion"):
        per_caption = np.array([np.mean([r[key] for r in rs]) for rs in by_prompt.values()])
        summary[key] = float(per_caption.mean())
        if len(per_caption) > 1:
            summary[key + "_se"] = float(per_caption.std(ddof=1) / np.sqrt(len(per_caption)))
        else:
            summary[key + "_se"] = None
    summary["seconds_per_sample"] = float(np.median([r["seconds"] for r in records]))
    summary["shape_drawn"] = shape_drawn(records)
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(f"{summary['samples']} samples ({summary['captions']} captions x seeds {summary['seeds']}): adherence "
          f"{summary['score']:.3f} (s.e. {summary['score_se'] or 0:.3f}; colour {summary['colour']:.3f}, shape "
          f"{summary['shape']:.3f}, motion {summary['motion']:.3f}); median {summary['seconds_per_sample']:.0f} s "
          f"per video")
    for word, shares in summary["shape_drawn"].items():
        print(f"  {word} drawn as " + ", ".join(f"{c} {v:.2f}" for c, v in shares.items()))
    return summary


def shape_drawn(records):
    """{caption shape word: {class: share of the found frames}} over the records' objects (records written before
    the objects were kept have none and are left out)."""
    from fastdit.pipelines.shapes_data import SHAPES

    counts = {}
    for record in records:
        for obj in record.get("objects", []):
            word = counts.setdefault(obj["shape"], dict.fromkeys(SHAPES, 0))
            for cls, frames in obj["drawn"].items():
                word[cls] += frames
    return {word: {cls: n / max(sum(classes.values()), 1) for cls, n in classes.items()}
            for word, classes in sorted(counts.items())}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-shapes", help="tiny-shapes or a pipeline folder of its training")
    parser.add_argument("--prompts", default="shapes", help="prompt file or 'shapes' (the 32 held-out captions)")
    parser.add_argument("--max-prompts", type=int, default=None)
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--shard", default="0/1", help="I/N: this process runs every N-th sample from the I-th")
    parser.add_argument("--out", required=True)
    parser.add_argument("--size", type=int, default=None, help="frame side in pixels (default: the native call's)")
    parser.add_argument("--guidance", type=float, default=None, help="guidance scale (default: the native call's)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of this process")
    parser.add_argument("--merge", action="store_true", help="summarise the samples under --out")
    args = parser.parse_args(argv)
    if args.size is not None and (args.size < 16 or args.size % 16):
        parser.error(f"argument --size: {args.size} is not a positive multiple of 16 (e.g. 64 or 128)")
    if args.threads < 1:
        parser.error(f"argument --threads: {args.threads} is not a positive count")
    if args.guidance is not None and args.guidance < 0:
        parser.error(f"argument --guidance: {args.guidance} is negative (at most 1 turns guidance off)")
    return merge(args) if args.merge else run(args)


if __name__ == "__main__":
    main()
