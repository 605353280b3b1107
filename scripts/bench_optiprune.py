"""Subject neglect and prompt adherence on the trained tiny model (issue 30): dense vs optiprune,
each with and without ``fastdit.optimize_noise``, on two-object captions.

    nice -n 10 python scripts/bench_optiprune.py --captions 32 --seeds 0 1 --json runs/optiprune.json

For every (seed, caption): one N(0, I) latent ``z0`` (seeded), ``z* = optimize_noise(pipe, caption,
latents=z0)`` (computed once, without a patch: an untrainable patch gives the same result), then
five videos at the model's native call (17 frames of 64 x 64, 12 steps, guidance 4): dense(z0),
dense(z*), optiprune(z0), optiprune(z*) and tome(z0) (tome at its defaults prunes the same fraction
as optiprune's: ratio 0.5 of 2 x 2 windows). Each is scored with ``fastdit.eval.metrics.adherence``;
an object is **neglected** when its colour is found in fewer than half of the frames (the
metric's colour term < 0.5), and a video neglects a subject when any of its objects is neglected.
tome(z0) and optiprune(z0) are also compared with dense(z0) (PSNR, SSIM over all frames), and each
config's seconds per video (the whole pipeline call, decode included) give the speedups; the
process's peak resident memory is recorded after every caption.

``--resume`` keeps the (seed, caption) pairs already in ``--json`` and runs only the others.

``--deadline HH:MM`` (UTC) stops before starting a (seed, caption) that would not finish in time;
the JSON is rewritten after every caption, so a partial run keeps what it did. The table printed
at the end (markdown) says how many videos each row holds.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import resource
import time
from datetime import datetime, timezone

import numpy as np
import torch

CONFIGS = ("dense", "dense+noise", "optiprune", "optiprune+noise", "tome")


def two_object_captions(count, seed=2026):
    from fastdit.pipelines.shapes_data import distinct_captions, parse_caption

    return list(distinct_captions(count, seed, accept=lambda text: len(parse_caption(text)) == 2, max_shapes=2,
                                  shape_probs=(0.0, 1.0)))


def summarise(records):
    rows = []
    for config in CONFIGS:
        done = [r[config] for r in records if config in r]
        if not done:
            continue
        scores = np.array([d["score"] for d in done])
        neglect = np.array([d["neglect"] for d in done], float)
        se = scores.std(ddof=1) / math.sqrt(len(scores)) if len(scores) > 1 else float("nan")
        rows.append({"config": config, "videos": len(done), "adherence": float(scores.mean()),
                     "adherence_se": float(se),
                     "neglect_rate": float(neglect.mean()), "colour": float(np.mean([d["colour"] for d in done])),
                     "shape": float(np.mean([d["shape"] for d in done])),
                     "motion": float(np.mean([d["motion"] for d in done])),
                     "seconds_per_video": float(np.mean([d["seconds"] for d in done])),
                     "psnr_vs_dense": _mean_or_none(done, "psnr"), "ssim_vs_dense": _mean_or_none(done, "ssim"),
                     "density": _mean_or_none(done, "density")})
    return rows


def _mean_or_none(done, key):
    values = [d[key] for d in done if d.get(key) is not None]
    return float(np.mean(values)) if values else None


def _fmt(value, spec):
    return "-" if value is None else format(value, spec)


def table(rows):
    lines = ["| config | videos | adherence (+- s.e.) | subject-neglect rate | colour | shape | motion | s / video | "
             "PSNR vs dense (dB) | SSIM vs dense | density |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['config']} | {r['videos']} | {r['adherence']:.3f} +- {r['adherence_se']:.3f} | "
                     f"{r['neglect_rate']:.3f} | {r['colour']:.3f} | {r['shape']:.3f} | {r['motion']:.3f} | "
                     f"{r['seconds_per_video']:.1f} | {_fmt(r.get('psnr_vs_dense'), '.2f')} | "
                     f"{_fmt(r.get('ssim_vs_dense'), '.4f')} | {_fmt(r.get('density'), '.3f')} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-shapes")
    parser.add_argument("--captions", type=int, default=32)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--noise-steps", type=int, default=5)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--steps", type=int, default=None, help="denoising steps (default: the model's native call)")
    parser.add_argument("--frames", type=int, default=None)
    parser.add_argument("--deadline", default=None, help="HH:MM UTC: start no caption that would end after it")
    parser.add_argument("--json", default=None)
    parser.add_argument("--resume", action="store_true", help="keep the pairs already in --json")
    args = parser.parse_args(argv)

    import fastdit
    from fastdit.eval.metrics.adherence import adherence
    from fastdit.eval.metrics.fidelity import psnr, ssim
    from fastdit.pipelines.loading import TRAINED_DEFAULTS, load_pipeline

    pipe = load_pipeline(args.model)
    pipe.set_progress_bar_config(disable=True)
    call = dict(TRAINED_DEFAULTS.get(args.model, {}))
    if args.steps is not None:
        call["num_inference_steps"] = args.steps
    if args.frames is not None:
        call["num_frames"] = args.frames
    temporal = pipe.vae_scale_factor_temporal
    spatial = pipe.vae_scale_factor_spatial
    shape = (1, pipe.transformer.config.in_channels, (call["num_frames"] - 1) // temporal + 1,
             call["height"] // spatial, call["width"] // spatial)
    deadline = None
    if args.deadline:
        hour, minute = map(int, args.deadline.split(":"))
        now = datetime.now(timezone.utc)
        deadline = now.replace(hour=hour, minute=minute, second=0, microsecond=0).timestamp()
    captions = two_object_captions(args.captions)
    result = {"model": args.model, "call": call, "noise_steps": args.noise_steps, "lr": args.lr,
              "captions": captions, "seeds": args.seeds, "records": [], "load_average": [], "stopped": None}
    done = set()
    if args.resume and args.json and os.path.exists(args.json):
        with open(args.json) as handle:
            previous = json.load(handle)
        result["records"] = [r for r in previous["records"] if all(c in r for c in CONFIGS)]
        result["load_average"] = previous.get("load_average", [])[:len(result["records"])]
        done = {(r["seed"], r["caption"]) for r in result["records"]}
    started = time.time()
    per_pair = None
    for seed in args.seeds:
        for caption in captions:
            if (seed, caption) in done:
                continue
            if deadline is not None and per_pair is not None and time.time() + per_pair > deadline:
                result["stopped"] = f"deadline {args.deadline} UTC reached before seed {seed}, caption {caption!r}"
                break
            t0 = time.time()
            z0 = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
            t_noise = time.time()
            z_opt = fastdit.optimize_noise(pipe, caption, latents=z0, steps=args.noise_steps, lr=args.lr)
            noise_seconds = time.time() - t_noise
            record = {"seed": seed, "caption": caption, "noise_seconds": noise_seconds,
                      "noise_loss": [h["loss"] for h in z_opt.loss_history]}
            reference = None
            for config in CONFIGS:
                latents = z_opt if config.endswith("+noise") else z0
                method = config.split("+")[0]
                patch = None if method == "dense" else fastdit.patch(pipe, method)
                t1 = time.time()
                try:
                    frames = pipe(prompt=caption, latents=latents.clone(), output_type="np", **call).frames[0]
                    density = None if patch is None else float(patch.stats.effective_density)
                finally:
                    if patch is not None:
                        patch.remove()
                score = adherence(frames, caption)
                colours = [obj[3] for obj in score.objects]
                record[config] = {"score": score.score, "colour": score.colour, "shape": score.shape,
                                  "motion": score.motion, "object_colour": colours,
                                  "neglect": bool(min(colours) < 0.5), "density": density,
                                  "seconds": time.time() - t1}
                if config == "dense":
                    reference = frames
                elif latents is z0:
                    record[config]["psnr"] = float(psnr(frames, reference))
                    record[config]["ssim"] = float(ssim(frames, reference))
            per_pair = time.time() - t0
            result["records"].append(record)
            result["load_average"].append(os.getloadavg()[0])
            result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            result["summary"] = summarise(result["records"])
            result["elapsed_s"] = time.time() - started
            if args.json:
                os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
                with open(args.json, "w") as handle:
                    json.dump(result, handle, indent=1)
            listing = ", ".join(f"{c} {record[c]['score']:.3f}{' N' if record[c]['neglect'] else ''}" for c in CONFIGS)
            print(f"seed {seed} {caption!r}: {listing} ({per_pair:.0f} s)", flush=True)
        if result["stopped"]:
            break
    print(table(summarise(result["records"])))
    if result["stopped"]:
        print(result["stopped"])
    return result


if __name__ == "__main__":
    main()
