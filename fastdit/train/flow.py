"""The ordinary flow-matching loss on user videos, mixed into sparse distillation
(``LoraTrainConfig.videos`` / ``flow_weight``).

A video ``V`` (frames in ``[0, 1]``) is encoded the way the pipeline's own decode inverts it:
``x0 = (E(2 V - 1) - mu) / sigma`` with the VAE's mode ``E`` and its per-channel ``latents_mean`` /
``latents_std`` (diffusers' Wan video-to-video ``prepare_latents``). A sample is
``x_t = (1 - s) x0 + s eps`` (``s ~ U(0, 1)``, timestep ``1000 s``) with the caption's embeddings,
and its target the flow-matching velocity ``eps - x0`` (what Wan-family transformers predict; the
target of diffusers' flow-matching training scripts). Loss per step: distillation + ``flow_weight
x mean((student(x_t) - (eps - x0))^2)``.

Supported: pipelines whose VAE has ``latents_mean`` / ``latents_std`` and a 5-D latent (the Wan
family). Frames beyond the last count the VAE accepts (``1 + 4k`` for Wan) are dropped and the
frame is cropped to a multiple of the VAE's and the patch's spatial factors (bottom and right
edges): never rejected, and what was kept is returned with the samples.
"""
from __future__ import annotations

import numpy as np
import torch


def read_frames(video):
    """``(F, H, W, 3)`` float32 in ``[0, 1]`` from an array / tensor (uint8 or float in [0, 1]) or
    a video file (RGB, read with imageio)."""
    if isinstance(video, (str, bytes)) or hasattr(video, "__fspath__"):
        import imageio.v2 as imageio

        try:
            frames = np.stack([np.asarray(f)[..., :3] for f in imageio.get_reader(str(video))])
        except Exception as error:  # noqa: BLE001 - surfaced with the file name
            raise ValueError(f"videos: cannot read {video}: {error}") from error
    else:
        frames = video.detach().cpu().numpy() if torch.is_tensor(video) else np.asarray(video)
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"videos: a video must be frames of shape (F, H, W, 3), got {tuple(frames.shape)}")
    frames = frames.astype(np.float32) / 255.0 if frames.dtype == np.uint8 else frames.astype(np.float32)
    if not np.isfinite(frames).all() or frames.min() < 0.0 or frames.max() > 1.0:
        raise ValueError("videos: frames must be uint8 or floats in [0, 1] (no NaN)")
    return frames


def encode_video(pipe, frames):
    """Latent ``x0`` ``(1, C, T, h, w)`` of ``frames`` (``read_frames``) and the ``(F, H, W)``
    actually encoded (trimmed / cropped to what the VAE and the patch accept)."""
    vae = pipe.vae
    config = getattr(vae, "config", None)
    if config is None or getattr(config, "latents_mean", None) is None or getattr(config, "latents_std", None) is None:
        raise ValueError(f"videos: flow-matching on user videos needs a VAE with latents_mean / latents_std "
                         f"(the Wan family); {type(pipe).__name__}'s {type(vae).__name__} has none")
    temporal = int(getattr(pipe, "vae_scale_factor_temporal", 4))
    patch = getattr(pipe.transformer.config, "patch_size", (1, 1, 1))
    spatial = int(getattr(pipe, "vae_scale_factor_spatial", 8)) * int(patch[-1])
    count = (frames.shape[0] - 1) // temporal * temporal + 1
    height, width = frames.shape[1] // spatial * spatial, frames.shape[2] // spatial * spatial
    if height == 0 or width == 0:
        raise ValueError(f"videos: frames of {frames.shape[1]} x {frames.shape[2]} are smaller than one latent "
                         f"patch ({spatial} x {spatial} pixels)")
    x = torch.from_numpy(frames[:count, :height, :width]).permute(3, 0, 1, 2)[None] * 2.0 - 1.0
    param = next(vae.parameters())
    with torch.no_grad():
        latent = vae.encode(x.to(param.device, param.dtype)).latent_dist.mode()
    mean = torch.tensor(config.latents_mean).view(1, -1, 1, 1, 1).to(latent)
    std = torch.tensor(config.latents_std).view(1, -1, 1, 1, 1).to(latent)
    return ((latent - mean) / std).detach(), (count, height, width)


def flow_samples(pipe, config, embed):
    """``config.samples`` flow-matching samples ``{"hidden_states", "timestep",
    "encoder_hidden_states", "target"}`` from ``config.videos`` (round robin; sigmas and noises
    from ``config.seed + 1``), and the ``(F, H, W)`` kept of each video. ``embed(prompt)``: the
    caption's embeddings."""
    gen = torch.Generator().manual_seed(config.seed + 1)
    encoded = []
    for prompt, video in config.videos:
        x0, kept = encode_video(pipe, read_frames(video))
        encoded.append((x0, embed(prompt), kept))
    samples = []
    for i in range(config.samples):
        x0, embeds, _ = encoded[i % len(encoded)]
        sigma = float(torch.rand((), generator=gen))
        noise = torch.randn(x0.shape, generator=gen).to(x0)
        samples.append({"hidden_states": (1 - sigma) * x0 + sigma * noise,
                        "timestep": torch.tensor([1000.0 * sigma], device=x0.device),
                        "encoder_hidden_states": embeds, "target": (noise - x0).detach()})
    return samples, [kept for _, _, kept in encoded]
