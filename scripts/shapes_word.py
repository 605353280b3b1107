"""Does a tiny-shapes model hear a caption's shape word?  One-frame generations read per shape word.

    python scripts/shapes_word.py --model tiny-shapes --out runs/word.json [--png runs/word.png]
    python scripts/shapes_word.py --model runs/sA/out --seeds 2 --size 128

For "a <colour> <shape> moving <direction>" with every shape word x colour x seed, the pipeline generates one frame
(``num_frames=1``: latent frame 0, which Wan's causal VAE decodes on its own; otherwise the model's native call) and
the adherence metric's ``detect`` finds the caption colour's largest blob.  It reports:

* the **word effect**: mean |pixel| difference (0-255) between the images of two shape words at the same colour and
  seed, against the **seed effect**, the same between two seeds of one caption.  A model deaf to the word draws the
  same picture for every word: word effect ~0 while the seed effect stays large;
* the blob's **area per word** and its ratio to the circle's, beside the same measured on the first frames of
  rendered one-shape videos (``data_areas``: a square of half side r covers 4 r^2, a circle pi r^2, the triangle
  less): a model that hears the word draws these proportions before it draws the outlines;
* the **classes** (``classify_shape``, from the fill ratio) of the blobs drawn for each word.

Stop 66 (BENCHMARKS.md, "image steps, and the shape word the model did not hear") used it to find that the shipped
weights draw the same picture for every shape word (area ratio 1 : 1.07 : 0.95 against the data's 1 : 1.23 : 0.65).
"""
from __future__ import annotations

import argparse
import json
from collections import Counter

import numpy as np

from fastdit.eval.metrics.adherence import classify_shape, detect
from fastdit.pipelines.shapes_data import COLORS, DIRECTIONS, SHAPES, sample_video

__all__ = ["summarise", "data_areas", "probe", "main"]


def _ratios(values) -> list[float]:
    """Each value over the first (the circle's); 0 where the first is 0 (no blob found)."""
    return [float(v / values[0]) if values[0] else 0.0 for v in values]


def summarise(images: np.ndarray, areas: np.ndarray, classes: list) -> dict:
    """``images`` [word, colour, seed, H, W, 3], ``areas`` [word, colour, seed] (0: no blob found), ``classes``
    nested the same way (a class name or None) -> word / seed effects, area per word, classes per word."""
    x = np.asarray(images, float)
    words, _, seeds = x.shape[:3]
    word = [np.abs(x[i] - x[j]).mean() for i in range(words) for j in range(i + 1, words)]
    seed = [np.abs(x[:, :, i] - x[:, :, j]).mean() for i in range(seeds) for j in range(i + 1, seeds)]
    area = np.asarray(areas, float).reshape(words, -1).mean(axis=1)
    return {"word_effect": float(np.mean(word)) if word else 0.0, "seed_effect": float(np.mean(seed)) if seed else 0.0,
            "area": [float(a) for a in area], "area_ratio": _ratios(area),
            "classes": [dict(Counter(c or "none" for row in per_word for c in row)) for per_word in classes]}


def data_areas(samples: int = 300, size: int = 128, seed: int = 0) -> list[float]:
    """Mean blob area (pixels) per shape word (``SHAPES`` order) on frame 0 of rendered one-shape videos."""
    found = {s: [] for s in SHAPES}
    for i in range(samples):
        video, _, spec = sample_video(seed, i, height=size, width=size, data="single", speed_scale=0.5)
        shape = spec.shapes[0]
        blob = detect(video[0], shape.color)
        if blob is not None:
            found[shape.shape].append(blob.area)
    return [float(np.mean(found[s])) if found[s] else 0.0 for s in SHAPES]


def probe(pipe, seeds: int = 2, size: int | None = None, call: dict | None = None):
    """One frame per shape word x colour x seed -> (images, areas, classes) in :func:`summarise`'s layout."""
    import torch

    call = dict(call or {}, num_frames=1, output_type="np")
    if size:
        call.update(height=size, width=size)
    directions = list(DIRECTIONS)
    images, areas, classes = [], [], []
    for shape in SHAPES:
        for k, colour in enumerate(COLORS):
            for s in range(seeds):
                text = f"a {colour} {shape} moving {directions[(k + s) % len(directions)]}"
                with torch.no_grad():
                    frames = pipe(prompt=text, generator=torch.Generator().manual_seed(s), **call).frames[0]
                image = (np.clip(frames[0], 0, 1) * 255).round().astype(np.uint8)
                blob = detect(image, colour)
                images.append(image)
                areas.append(blob.area if blob else 0.0)
                classes.append(classify_shape(blob) if blob else None)
    layout = (len(SHAPES), len(COLORS), seeds)
    nested = np.array(classes, dtype=object).reshape(layout).tolist()
    return np.stack(images).reshape(*layout, *images[0].shape), np.array(areas).reshape(layout), nested


def main(argv=None) -> dict:
    import torch

    from fastdit.pipelines.loading import TRAINED_DEFAULTS, load_pipeline

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-shapes", help="tiny-shapes or a pipeline folder of its training")
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--size", type=int, default=None, help="frame side (default: the native call's)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", required=True, help="JSON report")
    parser.add_argument("--png", default=None, help="contact sheet: a row per shape word, a column per colour x seed")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    pipe = load_pipeline(args.model, "cpu")
    pipe.set_progress_bar_config(disable=True)
    images, areas, classes = probe(pipe, args.seeds, args.size, TRAINED_DEFAULTS["tiny-shapes"])
    report = {"model": args.model, "seeds": args.seeds, "words": list(SHAPES), **summarise(images, areas, classes),
              "data_area": data_areas(size=images.shape[-2])}
    report["data_area_ratio"] = _ratios(report["data_area"])
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    if args.png:
        from PIL import Image

        w, c, s = images.shape[:3]
        rows = [np.concatenate(list(images[i].reshape(c * s, *images.shape[3:])), axis=1) for i in range(w)]
        Image.fromarray(np.concatenate(rows, axis=0)).save(args.png)
    print(f"word effect {report['word_effect']:.1f} / seed effect {report['seed_effect']:.1f}; area "
          + " / ".join(f"{n} {a:.0f}" for n, a in zip(SHAPES, report["area"]))
          + " (ratio " + " : ".join(f"{r:.2f}" for r in report["area_ratio"]) + "; data "
          + " : ".join(f"{r:.2f}" for r in report["data_area_ratio"]) + ")")
    for name, got in zip(SHAPES, report["classes"]):
        print(f"  {name} drawn as {got}")
    return report


if __name__ == "__main__":
    main()
