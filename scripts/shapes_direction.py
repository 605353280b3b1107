"""Does a tiny-shapes model hear a caption's direction?  The first denoising call, read per direction.

    python scripts/shapes_direction.py --model tiny-shapes --out runs/direction.json
    python scripts/shapes_direction.py --model runs/tiny-shapes-new --seeds 8 --sigmas 1.0,0.98
    python scripts/shapes_direction.py --model runs/tiny-shapes-new --sampled --size 64 [--negative opposite]

A sampler's path for a shape is settled in its first calls: below s ~ 0.97 the noisy latent already shows
where the shape goes.  So the direction word matters only through the model's first predictions
``x0 = x_s - s v(x_s, s, caption)`` (flow matching, ``x_s = (1 - s) x0 + s eps``; at ``s = 1`` the sampler's
first call, ``x_s = eps``).  For "a yellow circle moving {left, right, up, down}" and the same noises, this
script decodes that prediction and follows the yellow in it: the saturation-weighted centroid of the pixels in
the adherence metric's yellow hue range, frame by frame; the least-squares slope over the frames times
``frames - 1`` is the predicted travel ``(dx, dy)`` in pixels.

It prints, per noise level: the mean travel per direction, the **hit rate** (share of direction x noise
pairs whose travel is mostly along the caption's axis, in its sense; chance 0.25 when the caption is
ignored), the **caption effect** (mean over noises of the travel's distance from the four directions' mean:
what the words move) and the **noise effect** (the same over noises for one caption: what the noise
moves).  A model that ignores direction words has caption effect ~0 and a hit rate near chance.

``--sampled`` reads the same numbers from what a user gets: the whole sampler (the model's native call: 17 frames,
12 UniPC steps, guidance 4, at ``--size``) from seeds ``0 .. seeds - 1`` instead of one call at fixed levels.
``--negative opposite`` makes the negative prompt the caption with its direction reversed
(``shapes_data.opposite_directions``): classifier-free guidance then amplifies the direction word's effect alone.

``--anchored`` samples with a clear first frame: latent frame 0 is a rendered yellow circle at the centre (VAE
encoded, kept at level 0 and told so through Wan 2.2's per-token timesteps), every other frame starts as noise;
Euler steps on the native call's shifted schedule, guidance against the empty caption.  With a shape's place
given, the direction word is the only thing that says where it goes: the read of a model trained with anchoring
(``train_tiny --set anchor_prob=P``), and of whether any model uses the word once the place is fixed.

``--equivariance`` measures how far the transformer is from translation-equivariant: one call on a noise, the same
noise rolled by 3 latent cells in width (1 frame in time), and the relative difference of the two outputs in the
interior, against the difference for another noise.  Near 0: the model cannot place a path absolutely, so where
the clip is still undecided its best prediction is the same position-averaged haze for every direction word.
"""
from __future__ import annotations

import argparse
import json

import numpy as np

from fastdit.eval.metrics.adherence import HUE_RANGES
from fastdit.pipelines.shapes_data import DIRECTIONS as HEADINGS

DIRECTIONS = tuple(HEADINGS)  # left, right, up, down
ROLL_CELLS = 3  # --equivariance: latent cells the input rolls in width


def travel(video: np.ndarray, hue_range=HUE_RANGES["yellow"][0]) -> tuple[float, float]:
    """Predicted travel (dx, dy) in pixels of the saturation-weighted centroid of ``hue_range`` pixels
    (OpenCV hue, 0..179) over a ``[F, H, W, 3]`` uint8 video."""
    import cv2

    xs, ys = [], []
    yy, xx = np.mgrid[: video.shape[1], : video.shape[2]]
    for frame in video:
        hsv = cv2.cvtColor(np.ascontiguousarray(frame), cv2.COLOR_RGB2HSV).astype(np.float64)
        weight = ((hsv[..., 0] >= hue_range[0]) & (hsv[..., 0] <= hue_range[1])) * hsv[..., 1] / 255.0 + 1e-9
        xs.append(float((weight * xx).sum() / weight.sum()))
        ys.append(float((weight * yy).sum() / weight.sum()))
    t = np.arange(len(xs))
    span = len(xs) - 1
    return float(np.polyfit(t, xs, 1)[0] * span), float(np.polyfit(t, ys, 1)[0] * span)


def hit(direction: str, dx: float, dy: float) -> bool:
    """The travel is mostly along the direction's axis and in its sense (image y grows downwards)."""
    ux, uy = HEADINGS[direction]
    along, across = (dx * ux, dy) if ux else (dy * uy, dx)
    return along > abs(across)


def summarise(travels: dict) -> dict:
    """travels[direction] = [(dx, dy) per noise seed] -> mean travel, hit rate, caption and noise effects."""
    arr = np.array([travels[d] for d in DIRECTIONS], dtype=np.float64)  # [4 directions, seeds, 2]
    caption_effect = np.linalg.norm(arr - arr.mean(axis=0, keepdims=True), axis=-1).mean()
    noise_effect = np.linalg.norm(arr - arr.mean(axis=1, keepdims=True), axis=-1).mean()
    hits = [hit(d, dx, dy) for d in DIRECTIONS for dx, dy in travels[d]]
    return {"mean_travel": {d: arr[i].mean(axis=0).round(2).tolist() for i, d in enumerate(DIRECTIONS)},
            "hit_rate": float(np.mean(hits)), "caption_effect_px": float(caption_effect),
            "noise_effect_px": float(noise_effect)}


def _embed(pipe, call: dict, text: str):
    """The caption's text-encoder states, as the native call makes them."""
    return pipe.encode_prompt(text, do_classifier_free_guidance=False, device="cpu",
                              max_sequence_length=call["max_sequence_length"])[0]


def _latent_grid(pipe, call: dict, side: int) -> tuple[int, int]:
    """(latent frames, latent cells a side) of the native call's frames at ``side`` x ``side`` pixels."""
    return (call["num_frames"] - 1) // pipe.vae_scale_factor_temporal + 1, side // pipe.vae_scale_factor_spatial


def _latent_stats(vae):
    """The VAE's per-channel latent mean and std, shaped to broadcast over ``[B, C, F, H, W]``."""
    import torch

    return (torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1),
            torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1))


def _pixels(video) -> np.ndarray:
    """A decoded ``[C, F, H, W]`` video in [-1, 1] as ``[F, H, W, 3]`` uint8."""
    return ((video.clamp(-1, 1) + 1) * 127.5).round().byte().permute(1, 2, 3, 0).numpy()


def sampled(pipe, call: dict, side: int, seeds: int, negative: str) -> dict:
    """The whole sampler's travels per direction x seed (``--sampled``)."""
    import torch

    from fastdit.pipelines.shapes_data import opposite_directions

    travels = {}
    for direction in DIRECTIONS:
        travels[direction] = []
        caption = f"a yellow circle moving {direction}"
        negative_prompt = opposite_directions(caption) if negative == "opposite" else None
        for seed in range(seeds):
            video = pipe(prompt=caption, negative_prompt=negative_prompt,
                         num_frames=call["num_frames"], height=side, width=side,
                         num_inference_steps=call["num_inference_steps"], guidance_scale=call["guidance_scale"],
                         max_sequence_length=call["max_sequence_length"], output_type="np",
                         generator=torch.Generator().manual_seed(seed)).frames[0]
            travels[direction].append(travel((np.asarray(video) * 255).round().astype(np.uint8)))
    return summarise(travels)


def anchored(pipe, call: dict, side: int, seeds: int) -> dict:
    """Travels of the clear-first-frame sampler (``--anchored``) per direction x seed."""
    import dataclasses

    import torch

    from fastdit.pipelines import shapes_data
    from fastdit.pipelines.train_loss import token_timesteps

    vae, transformer = pipe.vae.eval(), pipe.transformer.eval()
    mean, std = _latent_stats(vae)
    frames, cells = _latent_grid(pipe, call, side)
    steps, shift = call["num_inference_steps"], pipe.scheduler.config.flow_shift
    u = torch.linspace(1, 0, steps + 1)
    levels = shift * u / (1 + (shift - 1) * u)  # the flow-shifted schedule, 1 -> 0

    empty, travels = _embed(pipe, call, ""), {}
    for direction in DIRECTIONS:
        travels[direction], caption = [], _embed(pipe, call, f"a yellow circle moving {direction}")
        for seed in range(seeds):
            _, _, spec = shapes_data.sample_video(99, seed, data="simplest", frames=call["num_frames"], height=side,
                                                  width=side)
            circle = dataclasses.replace(spec.shapes[0], x=side / 2, y=side / 2)
            first = shapes_data.render(dataclasses.replace(spec, shapes=(circle,)))[:1]
            pixels = torch.from_numpy(first).float().div(127.5).sub(1).permute(3, 0, 1, 2)[None]
            with torch.no_grad():
                anchor = (vae.encode(pixels).latent_dist.mean - mean) / std
            x = torch.randn((1, anchor.shape[1], frames, cells, cells), generator=torch.Generator().manual_seed(seed))
            for i in range(steps):
                x[:, :, :1] = anchor
                per_frame = torch.full((1, frames), float(levels[i]))
                per_frame[:, 0] = 0.0
                timestep = token_timesteps(pipe, per_frame, x)
                with torch.no_grad():
                    cond = transformer(x, timestep, caption, return_dict=False)[0]
                    uncond = transformer(x, timestep, empty, return_dict=False)[0]
                x = x + (levels[i + 1] - levels[i]) * (uncond + call["guidance_scale"] * (cond - uncond))
            x[:, :, :1] = anchor
            with torch.no_grad():
                video = vae.decode(x * std + mean, return_dict=False)[0][0]
            travels[direction].append(travel(_pixels(video)))
    return summarise(travels)


def equivariance(pipe, call: dict, side: int) -> dict:
    """Relative output change under a roll of the input (``--equivariance``), per noise level."""
    import torch

    transformer = pipe.transformer.eval()
    caption = _embed(pipe, call, "a yellow circle moving left")
    frames, cells = _latent_grid(pipe, call, side)
    gen = torch.Generator().manual_seed(0)
    noise, other = (torch.randn((1, transformer.config.in_channels, frames, cells, cells), generator=gen)
                    for _ in range(2))
    k = ROLL_CELLS  # compared where neither output holds the wrapped-around columns' own cells
    w0, w1, t0, t1 = cells // 4, min(cells - cells // 4, cells - k), 2, frames - 3

    def rel(a, b):
        return float((a - b).norm() / b.norm())

    report = {}
    for sigma in (1.0, 0.9, 0.5):
        with torch.no_grad():
            def call_at(x):
                return transformer(x, torch.tensor([sigma * 1000.0]), caption, return_dict=False)[0]
            base = call_at(noise)
            width = call_at(torch.roll(noise, k, dims=-1))[..., w0 + k:w1 + k]
            time = call_at(torch.roll(noise, 1, dims=2))[:, :, t0 + 1:t1 + 1]
            report[str(sigma)] = {"width_roll": rel(width, base[..., w0:w1]), "time_roll": rel(time, base[:, :, t0:t1]),
                                  "another_noise": rel(call_at(other)[..., w0:w1], base[..., w0:w1])}
    return report


def _print(label: str, summary: dict) -> None:
    print(f"{label}: hit rate {summary['hit_rate']:.2f} (chance 0.25), caption effect "
          f"{summary['caption_effect_px']:.1f} px, noise effect {summary['noise_effect_px']:.1f} px; mean travel "
          + ", ".join(f"{d} ({x:+.1f}, {y:+.1f})" for d, (x, y) in summary["mean_travel"].items()), flush=True)


def run(args) -> dict:
    import torch

    from fastdit.pipelines.loading import TRAINED_DEFAULTS, load_pipeline

    torch.set_num_threads(args.threads)
    pipe = load_pipeline(args.model, "cpu")
    call = TRAINED_DEFAULTS["tiny-shapes"]
    side = args.size or call["height"]
    if args.equivariance:
        report = {"model": args.model, "size": side, "equivariance": equivariance(pipe, call, side)}
        for sigma, r in report["equivariance"].items():
            print(f"s = {sigma}: output change when the input rolls {ROLL_CELLS} cells in width "
                  f"{r['width_roll']:.3f}, 1 frame in time {r['time_roll']:.3f}; another noise "
                  f"{r['another_noise']:.3f}", flush=True)
        return _write(report, args.out)
    if args.sampled or args.anchored:
        pipe.set_progress_bar_config(disable=True)
        mode = "anchored" if args.anchored else "sampled"
        report = {"model": args.model, "seeds": args.seeds, "size": side, "negative": args.negative,
                  mode: anchored(pipe, call, side, args.seeds) if args.anchored
                  else sampled(pipe, call, side, args.seeds, args.negative)}
        _print(f"{mode} ({call['num_inference_steps']} steps, guidance {call['guidance_scale']})", report[mode])
        return _write(report, args.out)
    vae, transformer = pipe.vae.eval(), pipe.transformer.eval()
    frames, cells = _latent_grid(pipe, call, side)
    shape = (1, vae.config.z_dim, frames, cells, cells)
    mean, std = _latent_stats(vae)
    report = {"model": args.model, "seeds": args.seeds, "size": side, "sigmas": {}}
    embeds = {d: _embed(pipe, call, f"a yellow circle moving {d}") for d in DIRECTIONS}
    for sigma in [float(s) for s in args.sigmas.split(",")]:
        travels = {}
        for direction in DIRECTIONS:
            travels[direction] = []
            for seed in range(args.seeds):
                eps = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
                with torch.no_grad():  # x_s of a pure-noise start at level s; x0 = x_s - s v
                    velocity = transformer(sigma * eps, torch.tensor([sigma * 1000.0]), embeds[direction],
                                           return_dict=False)[0]
                    video = vae.decode((sigma * eps - sigma * velocity) * std + mean, return_dict=False)[0][0]
                travels[direction].append(travel(_pixels(video)))
        report["sigmas"][str(sigma)] = summarise(travels)
        _print(f"s = {sigma}", report["sigmas"][str(sigma)])
    return _write(report, args.out)


def _write(report: dict, out) -> dict:
    if out:
        with open(out, "w") as f:
            json.dump(report, f, indent=1)
    return report


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-shapes", help="tiny-shapes or a pipeline folder of its training")
    parser.add_argument("--seeds", type=int, default=4, help="noises per direction")
    parser.add_argument("--sigmas", default="1.0,0.98", help="noise levels s of the call, comma-separated")
    parser.add_argument("--size", type=int, default=None, help="frame side in pixels (default: the native call's)")
    parser.add_argument("--sampled", action="store_true", help="read the whole sampler's videos, not one call")
    parser.add_argument("--anchored", action="store_true", help="sample with a clear first frame (see above)")
    parser.add_argument("--equivariance", action="store_true", help="how far the transformer is from "
                        "translation-equivariant")
    parser.add_argument("--negative", choices=("empty", "opposite"), default="empty",
                        help="with --sampled: the negative prompt, the pipeline's empty one or the reversed caption")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="JSON report")
    args = parser.parse_args(argv)
    if args.anchored and (args.sampled or args.negative != "empty"):
        parser.error("--anchored is its own sampler: not with --sampled or --negative")
    if args.seeds < 1:
        parser.error(f"--seeds {args.seeds}: at least one noise per direction")
    return run(args)


if __name__ == "__main__":
    main()
