"""Radial attention in numbers and pictures: densities against video length, the reference settings'
densities, and a picture of the block mask.

    python -m fastdit.eval.bench.radial_report --table            # Wan 480p densities against frame count
    python -m fastdit.eval.bench.radial_report --reference        # the published settings, block by block
    python -m fastdit.eval.bench.radial_report --frames 21 --height 30 --width 52 --out radial.png

The mask rule itself lives in ``fastdit/methods/radial.py``; this module only measures and draws it
(family defaults come from the model adapters, as in a patched pipeline).
"""
from __future__ import annotations

import argparse
import math
import sys

from fastdit.layout import TokenLayout
from fastdit.media.pictures import mask_picture, pooled_mask
from fastdit.methods.radial import ADJACENT_RULES, SUPPORTED_BLOCK_SIZES, Radial, block_counts, block_mask

# ---------------------------------------------------------------------------------------------
# Command line: a picture of the mask, the density table, the reference settings.
# ---------------------------------------------------------------------------------------------

#: The reference's published settings (its Wan2.1-14B and HunyuanVideo scripts, current mask code).
#: The helpers below use them for these two families, whatever the patch defaults say.
REFERENCE_SETTINGS = {
    "wan": {"decay": 0.2, "sink": True, "adjacent": "dense", "block_size": 128},
    "hunyuan_video": {"decay": 0.95, "sink": False, "adjacent": "dense", "block_size": 128},
}


def _config_for(family, **options):
    """Resolved config for ``family``: ``options``, then the reference's settings for Wan and
    HunyuanVideo (``REFERENCE_SETTINGS``), then the family defaults."""
    method = Radial()
    options = {**REFERENCE_SETTINGS.get(family, {}), **{k: v for k, v in options.items() if v is not None}}
    return method.resolve(method.make_config(**options), family)


def _dense_step_count(config, num_steps):
    steps = config.dense_steps
    return min(math.ceil(steps * num_steps) if isinstance(steps, float) else steps, num_steps)


def density_table(grid_hw=(30, 52), frames=(21, 41, 81, 161), family="wan", num_layers=40, num_steps=50, **options):
    """One row per frame count at a fixed resolution: block density, computed token pairs, ideal
    speedups (attention only: per sparse layer, and over a whole run with the config's dense steps
    and layers out of ``num_layers`` / ``num_steps``)."""
    config = _config_for(family, **options)
    dense_steps = _dense_step_count(config, num_steps) / num_steps
    dense_layers = min(config.dense_layers / num_layers, 1.0)
    rows = []
    for t in frames:
        layout = TokenLayout((t, *grid_hw))
        allowed, forced, real = block_counts(t, layout.frame_len, config)
        mask = ((allowed > 0) & (allowed.double() >= config.block_fill * real.double())) | forced
        n = layout.video_len
        pairs = float((real * mask).double().sum())
        density = float(mask.double().mean())
        run = dense_steps + (1 - dense_steps) * (dense_layers + (1 - dense_layers) * density)
        rows.append({"frames": t, "tokens": n, "density": density, "pairs": pairs, "keys_per_query": pairs / n,
                     "pairs_per_nlogn": pairs / (n * math.log2(n)), "speedup": 1.0 / density, "run_speedup": 1.0 / run})
    return rows, config


def format_table(rows, config, grid_hw, num_layers=40, num_steps=50):
    lines = [
        f"Radial attention at {grid_hw[0]}x{grid_hw[1]} latent tokens per frame: decay {config.decay:g}, "
        f"block {config.block_size}, adjacent={config.adjacent}, sink={config.sink}, "
        f"block_fill={config.block_fill:.3g}; "
        f"whole run = {_dense_step_count(config, num_steps):g} of {num_steps} steps and {config.dense_layers} of "
        f"{num_layers} layers dense",
        "",
        "| latent frames | tokens n | block density | computed pairs | keys per query | pairs / (n log2 n) "
        "| ideal speedup, sparse layer | ideal speedup, whole run |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['frames']} | {r['tokens']} | {100 * r['density']:.1f}% | {r['pairs']:.3g} | "
                     f"{r['keys_per_query']:.0f} | {r['pairs_per_nlogn']:.0f} | {r['speedup']:.2f}x | "
                     f"{r['run_speedup']:.2f}x |")
    return "\n".join(lines)


def reference_densities():
    """Block densities at the paper's two reference settings (per sparse layer and step), with the
    reference mask code's own video block densities as ``target``."""
    wan = _config_for("wan")
    hy = _config_for("hunyuan_video")
    wan_layout = TokenLayout((18, 48, 80))
    hy_layout = TokenLayout((30, 48, 80), text_len=256, text_position="suffix")
    out = {}
    for name, layout, config, target in (("wan2.1-14b 69x768x1280", wan_layout, wan, 0.2871),
                                         ("hunyuan_video 117x768x1280", hy_layout, hy, 0.2746)):
        mask, _, n_video = block_mask(layout, config)
        out[name] = {"density": float(mask.double().mean()),
                     "video_density": float(mask[:n_video, :n_video].double().mean()),
                     "target": target, "layout": layout.describe()}
    return out


def save_mask_picture(mask, path, max_side=1024, title=None):
    """Save a boolean block mask as a picture (``fastdit.media.pictures``: attended = dark), max-pooled to
    at most ``max_side`` cells a side; returns the pooling factor. ``title`` is printed by the caller."""
    pooled, factor = pooled_mask(mask, size=max_side)
    mask_picture(pooled, factor, path, size=max_side)
    return factor


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m fastdit.methods.radial", description=__doc__.split("\n")[0])
    parser.add_argument("--frames", type=int, default=21, help="latent frames (after patchification)")
    parser.add_argument("--height", type=int, default=30, help="latent tokens per frame, vertically")
    parser.add_argument("--width", type=int, default=52, help="latent tokens per frame, horizontally")
    parser.add_argument("--text", type=int, default=0, help="text tokens after the video (HunyuanVideo-style)")
    parser.add_argument("--family", default="wan",
                        help="wan / hunyuan_video: the reference's settings; other names: that family's defaults")
    parser.add_argument("--decay", type=float)
    parser.add_argument("--block-size", type=int, choices=SUPPORTED_BLOCK_SIZES)
    parser.add_argument("--sink", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--adjacent", choices=ADJACENT_RULES)
    parser.add_argument("--block-fill", type=float)
    parser.add_argument("--out", default="radial.png", help="picture of the block mask")
    parser.add_argument("--table", action="store_true", help="print the density table (Wan 480p, 21..161 frames)")
    parser.add_argument("--reference", action="store_true", help="print the densities at the reference settings")
    args = parser.parse_args(argv)
    options = dict(decay=args.decay, block_size=args.block_size, sink=args.sink, adjacent=args.adjacent,
                   block_fill=args.block_fill)
    if args.table or args.reference:
        if args.table:
            grid_hw = (args.height, args.width)
            rows, config = density_table(grid_hw, family=args.family, **options)
            print(format_table(rows, config, grid_hw))
        if args.reference:
            for name, r in reference_densities().items():
                print(f"{name} ({r['layout']}): block density {100 * r['density']:.1f}% "
                      f"(video blocks only {100 * r['video_density']:.1f}%), reference {100 * r['target']:.1f}%")
        return 0
    config = _config_for(args.family, **options)
    layout = TokenLayout((args.frames, args.height, args.width), args.text, "suffix" if args.text else "none")
    mask, _, _ = block_mask(layout, config)
    title = (f"radial {layout.describe()}, decay {config.decay:g}, block {config.block_size}: "
             f"{100 * float(mask.double().mean()):.1f}% of blocks")
    factor = save_mask_picture(mask, args.out, title=title)
    print(f"{title}; {mask.shape[0]}x{mask.shape[1]} blocks"
          + (f" (drawn max-pooled by {factor})" if factor > 1 else "") + f" -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
