"""Train the tiny-shapes video model (issue 24): ``python -m fastdit.pipelines.train_tiny``.

A ``WanPipeline`` made of diffusers / transformers components only, trained from scratch on the procedural
moving-shapes videos of :mod:`fastdit.pipelines.shapes_data`:

1. **VAE** (``AutoencoderKLWan``, spatial factor 4, temporal factor 2): trained on random 9-frame, 32 x 32 crops
   with an L1 + MSE reconstruction loss of the decoded posterior mean (pixels weighted by
   ``1 + vae_colour_weight * saturation``) and a small KL term.
2. **Latents**: ``num_videos`` videos (17 frames of ``height`` x ``width``) encoded once (posterior mean) and
   normalised per channel; the channel means / stds go into the VAE config (``latents_mean`` / ``latents_std``),
   which is where ``WanPipeline`` reads them when decoding.
3. **Transformer** (``WanTransformer3DModel``, patch (1, 1, 1)) and the tiny UMT5 text encoder
   (``fastdit.pipelines.tiny``'s, trained jointly): rectified flow matching as in Wan (Esser et al. 2024,
   "Scaling Rectified Flow Transformers"): ``x_s = (1 - s) x_0 + s eps``, target velocity ``eps - x_0``, ``s``
   drawn uniformly and shifted like the sampler's flow shift (``s' = k s / (1 + (k - 1) s)``, ``k = 3``),
   timestep ``1000 s'``.  Captions are dropped (replaced by ``""``, the pipeline's default negative prompt) with
   probability ``caption_dropout`` so that classifier-free guidance works.  Most steps train on a prefix of the
   latent video (fewer frames: cheaper), the rest on the whole clip; ``latent_crop`` cuts a square window holding
   every shape; ``image_prob`` trains that share of steps on first latent frames alone (images).  The batch, the
   noise draw and the loss with their options (``latent_crop``, ``high_noise_prob``, ``anchor_prob``, ``fg_weight``,
   ``direction_contrast``): :mod:`.train_loss`.  The exported weights are an EMA.

The ``short`` preset trains at 17 frames of 64 x 64 -> latent 9 x 16 x 16 (VAE: 2x2 patchify and
one 2x stage in space, 2x in time) -> patch (1, 1, 1) -> 2304 video tokens per transformer call;
``large`` (the shipped model, issue 40) continues from it at 128 x 128 -> 9 x 32 x 32 -> 9216 tokens.

Every phase checkpoints into ``--work`` and the run resumes from there (same seed -> same run); ``--out`` receives the
pipeline (``save_pretrained``, safetensors) every ``export_every`` steps and at the end, with a model card README and
the loss curve PNG. Presets: ``full`` (about 3 hours on 2 cores), ``short`` (64 x 64, stage 1 of the committed
weights), ``large`` (128 x 128, their later stages) and ``test`` (seconds; CI).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import numpy as np
import torch

from . import shapes_data
from .train_card import card_text, export_pipeline, plot_losses
from .train_loss import crop_batch, flow_matching_loss, noisy_batch, shapes_fit
from .warm_start import load_weights

#: Config fields a resumed run may change (more or fewer steps, bookkeeping).
RESUME_CHANGEABLE = {"vae_steps", "steps", "checkpoint_every", "export_every", "vae_colour_weight"}

#: Every word of the shapes caption grammar (``shapes_data.caption``), for ``caption_vocab``.
CAPTION_WORDS = ("a", "moving", "and", *shapes_data.COLORS, *shapes_data.SHAPES, *shapes_data.DIRECTIONS)

DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "weights", "tiny-shapes")

__all__ = ["TrainConfig", "PRESETS", "build_pipeline", "train", "main", "DEFAULT_OUT"]


@dataclasses.dataclass
class TrainConfig:
    seed: int = 0
    frames: int = 17
    height: int = 64
    width: int = 64
    # VAE (AutoencoderKLWan)
    vae_base_dim: int = 16
    vae_z_dim: int = 8
    vae_steps: int = 1200
    vae_batch: int = 3
    vae_clip_frames: int = 9
    vae_crop: int = 32  # square crops (the VAE is convolutional): 4x cheaper steps than full 64x64 frames
    vae_lr: float = 2e-3
    vae_kl_weight: float = 1e-6
    vae_colour_weight: float = 10.0
    num_videos: int = 1000  # latents: this many videos of the kind ``data``
    data: str = "full"  # shapes_data.DATA_KINDS: full, single, simplest (the direction curriculum, stop 61)
    speed_scale: float = 1.0  # shapes_data.sample_spec: 0.5 at 128 x 128 moves shapes as many latent cells as at 64
    # transformer (WanTransformer3DModel)
    heads: int = 2
    head_dim: int = 64
    layers: int = 4
    ffn_dim: int = 512
    max_sequence_length: int = 48
    # whole-word tokens, appended, for the grammar's words the tiny WordPiece lacks ("circle": spelt letter by letter)
    caption_vocab: bool = False
    steps: int = 4000
    batch: int = 2
    lr: float = 4e-4
    warmup: int = 200
    ema_decay: float = 0.999
    caption_dropout: float = 0.1
    # loss weight 1 + fg_weight on the shapes' latent cells (saturated pixels pooled to the latent grid, grown by
    # one cell): the shapes are ~10% of a frame, so the plain mean spends ~90% of the gradient on backgrounds
    fg_weight: float = 0.0
    full_clip_prob: float = 0.25  # else a prefix of 3 .. prefix_max latent frames (cheaper steps)
    prefix_max: int = 8
    # square latent windows this many cells a side, holding every shape (0: whole frames): the shapes at full scale
    # for a fraction of the tokens (the transformer has no absolute position); sampling stays whole-frame
    latent_crop: int = 0
    crop_prob: float = 1.0  # the share of cropped steps (the rest whole frames: a crop-only model fails at them)
    # image steps: with this probability a step trains on image_batch first latent frames alone (video frame 0, which
    # the causal VAE encodes on its own): shapes at full scale for 1/9 of the tokens and ~1/81 of the attention
    image_prob: float = 0.0
    image_batch: int = 16
    flow_shift: float = 3.0
    # a caption's direction decides a shape's path only at the top of the noise range (below s ~ 0.97 x_s shows
    # it), where the shifted uniform puts ~8% of samples: with this probability s is uniform in [high_noise_min, 1]
    high_noise_prob: float = 0.0
    high_noise_min: float = 0.9
    # hinge against the caption with its directions reversed (train_loss): plain flow matching leaves them unheard
    direction_contrast: float = 0.0
    direction_margin: float = 0.05
    # with this probability one random latent frame of a sample is less noisy (s u, per-token timesteps; train_loss)
    anchor_prob: float = 0.0
    # warm start from a saved tiny-shapes pipeline folder (its VAE kept: set vae_steps=0); the transformer (patch 1,
    # RoPE) and the VAE (convolutional) do not depend on the frame size: 64 x 64 weights go on at 128 x 128
    init_from: str = ""
    checkpoint_every: int = 100
    export_every: int = 500
    threads: int = 1

    def __post_init__(self):
        if min(self.fg_weight, self.direction_contrast, self.direction_margin) < 0:  # 1 + fg_weight stays > 0
            raise ValueError(f"fg_weight={self.fg_weight}, direction_contrast={self.direction_contrast}, "
                             f"direction_margin={self.direction_margin}: take weights >= 0 (0: off)")
        if not (0 <= self.high_noise_prob <= 1 and 0 <= self.high_noise_min < 1):
            raise ValueError(f"high_noise_prob={self.high_noise_prob}, high_noise_min={self.high_noise_min}: take "
                             "a probability in [0, 1] and a noise level in [0, 1)")
        shapes_data.check_data_options(self.data, self.speed_scale)
        probs = (self.anchor_prob, self.crop_prob, self.image_prob)
        if not all(0 <= p <= 1 for p in probs) or self.latent_crop < 0 or self.image_batch < 1:
            raise ValueError(f"anchor_prob={self.anchor_prob}, crop_prob={self.crop_prob}, image_prob={self.image_prob}"
                             f", latent_crop={self.latent_crop}, image_batch={self.image_batch}: take probabilities in "
                             "[0, 1], a crop side in latent cells and a batch >= 1")

    @property
    def latent_frames(self) -> int:
        return (self.frames - 1) // 2 + 1


PRESETS: dict[str, dict] = {
    "full": {},
    "short": dict(vae_steps=600, num_videos=250, steps=2000, lr=5e-4, warmup=100, ema_decay=0.995,
                  full_clip_prob=0.15, prefix_max=5, checkpoint_every=50, export_every=200),
    # issue 40: 17 frames of 128 x 128 (9216 video tokens), warm-started from the 64 x 64 model of
    # ``--preset short --out runs/tiny-shapes-64`` (the VAE and text encoder are kept; RoPE and the
    # convolutional VAE carry over to the larger frame)
    "large": dict(height=128, width=128, init_from="runs/tiny-shapes-64", vae_steps=0, num_videos=400, steps=700,
                  batch=2, lr=3e-4, warmup=50, ema_decay=0.995, full_clip_prob=0.3, prefix_max=5, checkpoint_every=25,
                  export_every=100),
    "test": dict(frames=5, height=32, width=32, vae_base_dim=4, vae_z_dim=4, vae_steps=2, vae_clip_frames=5,
                 vae_crop=16, num_videos=3, heads=1, head_dim=16, layers=1, ffn_dim=32, max_sequence_length=40, steps=3,
                 batch=1, warmup=1, checkpoint_every=2, export_every=2),
}


# --------------------------------------------------------------------------- #
# Components
# --------------------------------------------------------------------------- #


def build_pipeline(cfg: TrainConfig, latents_mean=None, latents_std=None):
    """A freshly initialised (seeded) ``WanPipeline`` of the configured sizes."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    from .tiny import _UMT5, _seeded, tiny_tokenizer

    z = cfg.vae_z_dim
    tokenizer = tiny_tokenizer("t5", extra_words=CAPTION_WORDS if cfg.caption_vocab else ())
    with _seeded(cfg.seed + 1):
        # Wan 2.2-style VAE: 2x2 patchify (12 input channels) and residual average-pool /
        # duplicate shortcuts (is_residual): colour passes through from the first step. The
        # Wan 2.1 style (no shortcuts) at this width learnt luminance only in our runs.
        vae = AutoencoderKLWan(base_dim=cfg.vae_base_dim, z_dim=z, dim_mult=[1, 1], num_res_blocks=1, attn_scales=[],
                               temperal_downsample=[True], is_residual=True, patch_size=2, in_channels=12,
                               out_channels=12, latents_mean=list(latents_mean or [0.0] * z),
                               latents_std=list(latents_std or [1.0] * z), scale_factor_temporal=2,
                               scale_factor_spatial=4)
    with _seeded(cfg.seed + 2):
        te_cfg = UMT5Config(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                            eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=tokenizer.pad_token_id, **_UMT5)
        text_encoder = UMT5EncoderModel(te_cfg)
    with _seeded(cfg.seed + 3):
        transformer = WanTransformer3DModel(
            patch_size=(1, 1, 1), num_attention_heads=cfg.heads, attention_head_dim=cfg.head_dim, in_channels=z,
            out_channels=z, text_dim=te_cfg.d_model, freq_dim=64, ffn_dim=cfg.ffn_dim, num_layers=cfg.layers,
            cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                        num_train_timesteps=1000, flow_shift=cfg.flow_shift)
    return WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer,
                       scheduler=scheduler)


def _video_tensor(video: np.ndarray) -> torch.Tensor:
    """uint8 [F, H, W, 3] -> float [3, F, H, W] in [-1, 1]."""
    return torch.from_numpy(video).permute(3, 0, 1, 2).float().div(127.5).sub(1.0)


def _data_kwargs(cfg: TrainConfig) -> dict:
    return dict(frames=cfg.frames, height=cfg.height, width=cfg.width, data=cfg.data, speed_scale=cfg.speed_scale)


def _save(obj, path):
    tmp = path + ".tmp"
    torch.save(obj, tmp)
    os.replace(tmp, path)  # a checkpoint is either the old one or the new one, never half written


def _log(work, record):
    with open(os.path.join(work, "log.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\n")


# --------------------------------------------------------------------------- #
# Phases
# --------------------------------------------------------------------------- #


def train_vae(cfg, pipe, work, progress=True):
    from tqdm import tqdm

    vae = pipe.vae
    path = os.path.join(work, "vae.pt")
    opt = torch.optim.AdamW(vae.parameters(), lr=cfg.vae_lr, weight_decay=0.0)
    state = {"step": 0, "losses": []}
    if os.path.exists(path):
        state = torch.load(path, weights_only=False)
        vae.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
    vae.train()
    bar = tqdm(range(state["step"], cfg.vae_steps), initial=state["step"], total=cfg.vae_steps, desc="vae",
               disable=not progress, mininterval=5)
    for step in bar:
        clips = []
        rng = np.random.default_rng([cfg.seed, 1, step])
        for b in range(cfg.vae_batch):
            video, _, _ = shapes_data.sample_video(cfg.seed + 10_000, step * cfg.vae_batch + b, **_data_kwargs(cfg))
            start = int(rng.integers(0, cfg.frames - cfg.vae_clip_frames + 1))
            crop = min(cfg.vae_crop, cfg.height, cfg.width)
            y, x = int(rng.integers(0, cfg.height - crop + 1)), int(rng.integers(0, cfg.width - crop + 1))
            clips.append(_video_tensor(video[start:start + cfg.vae_clip_frames, y:y + crop, x:x + crop]))
        x = torch.stack(clips)
        posterior = vae.encode(x).latent_dist
        # Decode the posterior mean, not a sample: at initialisation the posterior std is ~1, and
        # sampled noise of that size drowns the colour information (the first runs learnt grey
        # shapes only). The diffusion model is trained on the means as well (``encode_latents``).
        recon = vae.decode(posterior.mode()).sample
        # Pixels weighted by 1 + w * saturation (max - min over RGB): the coloured shapes are a
        # small part of each frame, and without the weight the VAE learnt grey shapes only.
        weight = 1 + cfg.vae_colour_weight * (x.amax(1, keepdim=True) - x.amin(1, keepdim=True))
        rec = (weight * ((recon - x).abs() + (recon - x).pow(2))).mean() / weight.mean()
        kl = posterior.kl().mean() / x[0].numel()
        loss = rec + cfg.vae_kl_weight * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 10.0)
        opt.step()
        state["losses"].append(rec.item())
        bar.set_postfix(rec=f"{rec.item():.4f}")
        state["step"] = step + 1
        if state["step"] % cfg.checkpoint_every == 0 or state["step"] == cfg.vae_steps:
            _save({"model": vae.state_dict(), "opt": opt.state_dict(), "step": state["step"],
                   "losses": state["losses"]}, path)
            _log(work, {"phase": "vae", "step": state["step"], "rec": float(np.mean(state["losses"][-50:])),
                        "time": time.time()})
    vae.eval()
    return state["losses"]


@torch.no_grad()
def encode_latents(cfg, pipe, work, progress=True):
    """Encode ``num_videos`` videos; returns (latents [N, z, T, h, w] normalised, captions, mean, std,
    object masks [N, T, h, w])."""
    from tqdm import tqdm

    path = os.path.join(work, "latents.pt")
    state = {"latents": [], "captions": []}
    if os.path.exists(path):
        state = torch.load(path, weights_only=False)
        if "mean" in state:
            if "masks" not in state:  # a file written before the masks existed
                state["masks"] = _object_masks(cfg, state)
                _save(state, path)
            return state["latents"], state["captions"], state["mean"], state["std"], state["masks"]
    bar = tqdm(range(len(state["latents"]), cfg.num_videos), initial=len(state["latents"]), total=cfg.num_videos,
               desc="latents", disable=not progress, mininterval=5)
    for i in bar:
        video, text, _ = shapes_data.sample_video(cfg.seed, i, **_data_kwargs(cfg))
        state["latents"].append(pipe.vae.encode(_video_tensor(video)[None]).latent_dist.mode()[0].half())
        state["captions"].append(text)
        if (i + 1) % 100 == 0:
            _save(state, path)
    lat = torch.stack(state["latents"]).float()
    mean = lat.mean(dim=(0, 2, 3, 4))
    std = lat.std(dim=(0, 2, 3, 4)).clamp_min(1e-3)
    lat = ((lat - mean.view(1, -1, 1, 1, 1)) / std.view(1, -1, 1, 1, 1)).half()
    state = {"latents": lat, "captions": state["captions"], "mean": mean.tolist(), "std": std.tolist()}
    state["masks"] = _object_masks(cfg, state)
    _save(state, path)
    return state["latents"], state["captions"], state["mean"], state["std"], state["masks"]


def _object_masks(cfg, state):
    """The videos' :func:`shapes_data.latent_object_mask` ``[N, T, h, w]``: the videos are rendered again
    (milliseconds each, against the VAE encode; a resumed encode no longer holds the earlier ones)."""
    grid = tuple(state["latents"].shape[2:])
    videos = (shapes_data.sample_video(cfg.seed, i, **_data_kwargs(cfg))[0] for i in range(len(state["captions"])))
    return torch.stack([shapes_data.latent_object_mask(video, grid) for video in videos])


def _ema_update(ema, model, decay):
    with torch.no_grad():
        for e, p in zip(ema.values(), model.state_dict().values()):
            if e.dtype.is_floating_point:
                e.mul_(decay).add_(p, alpha=1 - decay)
            else:
                e.copy_(p)


def train_transformer(cfg, pipe, latents, captions, work, out, card, progress, masks):
    from tqdm import tqdm

    tr, te = pipe.transformer, pipe.text_encoder
    params = list(tr.parameters()) + list(te.parameters())
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.01, betas=(0.9, 0.99))
    path = os.path.join(work, "dit.pt")
    ema = {"transformer": {k: v.detach().clone() for k, v in tr.state_dict().items()},
           "text_encoder": {k: v.detach().clone() for k, v in te.state_dict().items()}}
    state = {"step": 0, "losses": [], "seconds": 0.0}
    if os.path.exists(path):
        ckpt = torch.load(path, weights_only=False)
        tr.load_state_dict(ckpt["transformer"])
        te.load_state_dict(ckpt["text_encoder"])
        opt.load_state_dict(ckpt["opt"])
        ema = ckpt["ema"]
        state = {k: ckpt[k] for k in ("step", "losses", "seconds")}
    tr.train()
    te.train()
    n, T = latents.shape[0], latents.shape[2]

    def checkpoint():
        _save({"transformer": tr.state_dict(), "text_encoder": te.state_dict(), "opt": opt.state_dict(), "ema": ema,
               **state}, path)

    def export():
        export_pipeline(cfg, pipe, ema, out, card(state), os.path.join(work, "loss_curve.png"))

    start_step = state["step"]

    bar = tqdm(range(state["step"], cfg.steps), initial=state["step"], total=cfg.steps, desc="transformer",
               disable=not progress, mininterval=5)
    t_last, ratios = time.time(), []  # ratios: l_reversed / l_true per step (direction contrast)
    for step in bar:
        rng = np.random.default_rng([cfg.seed, 2, step])
        gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + 7 * step + 1)
        image = cfg.image_prob > 0 and rng.random() < cfg.image_prob  # no draw when off: earlier runs replay
        idx = rng.integers(0, n, size=cfg.image_batch if image else cfg.batch)
        prefix_max = max(3, min(cfg.prefix_max, T - 1))
        frames = 1 if image else T if (rng.random() < cfg.full_clip_prob or T <= 3) else int(
            rng.integers(3, prefix_max + 1))
        cropped = not image and cfg.latent_crop and (cfg.crop_prob == 1 or rng.random() < cfg.crop_prob)
        pool = np.flatnonzero(shapes_fit(masks[:, :frames], cfg.latent_crop).numpy()) if cropped else []
        if len(pool):  # a cropped step draws among the videos whose shapes fit one window over these frames
            idx = pool[rng.integers(0, len(pool), size=cfg.batch)]
        x0, mask = latents[idx, :, :frames].float(), masks[idx, :frames]
        x0, mask = crop_batch(x0, mask, cfg.latent_crop, rng) if len(pool) else (x0, mask)
        texts = ["" if rng.random() < cfg.caption_dropout else captions[i] for i in idx]
        xt, sigma, target = noisy_batch(cfg, x0, gen)
        weight = 1 + cfg.fg_weight * mask[:, None].float() if cfg.fg_weight else None
        loss, stats = flow_matching_loss(pipe, xt, sigma, target, texts, cfg.max_sequence_length, weight,
                                         cfg.direction_contrast, cfg.direction_margin)
        ratios += [stats["reversed_over_true"]] if stats else []
        for g in opt.param_groups:
            g["lr"] = cfg.lr * min(1.0, (step + 1) / max(1, cfg.warmup))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        decay = min(cfg.ema_decay, (1 + step) / (10 + step))
        _ema_update(ema["transformer"], tr, decay)
        _ema_update(ema["text_encoder"], te, decay)
        now = time.time()
        state["seconds"] += now - t_last
        t_last = now
        state["losses"].append(loss.item())
        state["step"] = step + 1
        bar.set_postfix(loss=f"{np.mean(state['losses'][-50:]):.4f}")
        if state["step"] % cfg.checkpoint_every == 0 or state["step"] == cfg.steps:
            checkpoint()
            _log(work, {"phase": "transformer", "step": state["step"], "loss": float(np.mean(state["losses"][-100:])),
                        "seconds": state["seconds"], "time": now, **({"reversed_over_true": np.mean(ratios[-100:])}
                                                                     if ratios else {})})
        if state["step"] % cfg.export_every == 0 or state["step"] == cfg.steps:
            export()
    if start_step == state["step"] == cfg.steps:  # the loop did not run, so it did not export
        export()  # e.g. a resumed run whose steps were lowered to the last checkpoint: export it as final
    return state


# --------------------------------------------------------------------------- #
# Driver
# --------------------------------------------------------------------------- #


def train(cfg: TrainConfig, work: str, out: str = DEFAULT_OUT, preset: str = "custom", progress: bool = True):
    """Run (or resume) all phases; returns the final transformer state dict of ``train_transformer``."""
    torch.set_num_threads(cfg.threads)
    os.makedirs(work, exist_ok=True)
    meta_path = os.path.join(work, "config.json")
    times = {}
    if os.path.exists(meta_path):
        with open(meta_path) as f:
            saved = json.load(f)
        defaults = dataclasses.asdict(TrainConfig())  # a field added since that run had its default then
        changed = {k for k, v in dataclasses.asdict(cfg).items() if saved["config"].get(k, defaults[k]) != v}
        if changed - RESUME_CHANGEABLE:
            raise ValueError(f"{work} holds a run with a different config ({', '.join(sorted(changed))} differ; "
                             f"{meta_path}); pass another --work or delete that folder to start over")
        times = saved.get("times", {})
    def save_meta():
        with open(meta_path, "w") as f:
            json.dump({"config": dataclasses.asdict(cfg), "preset": preset, "times": times}, f, indent=1)
    save_meta()

    pipe = build_pipeline(cfg)
    if cfg.init_from:
        load_weights(pipe, cfg.init_from)
    t0 = time.time()
    vae_losses = train_vae(cfg, pipe, work, progress)
    times["vae"] = times.get("vae", 0.0) + (time.time() - t0) if "vae_done" not in times else times["vae"]
    times["vae_done"] = True
    save_meta()
    t0 = time.time()
    latents, captions, mean, std, masks = encode_latents(cfg, pipe, work, progress)
    times["latents"] = (times.get("latents", 0.0) + (time.time() - t0) if "latents_done" not in times
                        else times["latents"])
    times["latents_done"] = True
    save_meta()
    pipe.vae.register_to_config(latents_mean=list(mean), latents_std=list(std))
    counts = {k: sum(p.numel() for p in getattr(pipe, k).parameters()) for k in ("transformer", "vae", "text_encoder")}

    def card(state):
        plot_losses(vae_losses, state["losses"], os.path.join(work, "loss_curve.png"))
        return card_text(cfg, preset, vae_losses, times["vae"], times["latents"], state, counts)

    state = train_transformer(cfg, pipe, latents, captions, work, out, card, progress, masks)
    plot_losses(vae_losses, state["losses"], os.path.join(work, "loss_curve.png"))
    return state


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m fastdit.pipelines.train_tiny",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="full")
    parser.add_argument("--work", default="runs/train_tiny", help="checkpoints, logs, latents, loss curve (resumes)")
    parser.add_argument("--out", default=DEFAULT_OUT, help="where the pipeline is written (save_pretrained)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a TrainConfig field, e.g. --set steps=3000 (repeatable)")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    fields = {f.name: f.type for f in dataclasses.fields(TrainConfig)}
    values = dict(PRESETS[args.preset])
    for item in args.set:
        key, _, value = item.partition("=")
        if key not in fields or not _:
            parser.error(f"--set {item!r}: expected KEY=VALUE with KEY one of {', '.join(fields)}")
        default = getattr(TrainConfig(), key)
        if isinstance(default, bool):  # bool("False") is True
            if value.lower() not in ("true", "false", "1", "0"):
                parser.error(f"--set {item!r}: {key} takes true or false")
            values[key] = value.lower() in ("true", "1")
            continue
        try:
            values[key] = type(default)(value)
        except ValueError:
            parser.error(f"--set {item!r}: {key} takes {type(default).__name__} values")
    try:
        cfg = TrainConfig(**values)  # its own checks (a negative fg_weight), before any work
    except ValueError as error:
        parser.error(f"--set: {error}")
    state = train(cfg, args.work, args.out, args.preset, progress=not args.no_progress)
    print(f"trained {state['step']} transformer steps in {state['seconds'] / 60:.1f} min; pipeline in {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
