"""Model card text, loss-curve plot and pipeline export of the tiny-shapes training run (``train_tiny``)."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil

import numpy as np

__all__ = ["plot_losses", "card_text", "export_pipeline"]


def _smooth(values, k=50):
    v = np.asarray(values, dtype=float)
    if len(v) < 2:
        return v
    k = max(1, min(k, len(v) // 4 or 1))
    return np.convolve(v, np.ones(k) / k, mode="valid")


def plot_losses(vae_losses, dit_losses, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    for ax, values, title in ((axes[0], vae_losses, "VAE reconstruction (weighted L1 + MSE)"),
                              (axes[1], dit_losses, "transformer flow-matching MSE")):
        if len(values):
            ax.plot(values, alpha=0.25, lw=0.6)
            sm = _smooth(values)
            ax.plot(np.arange(len(sm)) + (len(values) - len(sm)), sm, lw=1.5)
            ax.set_yscale("log")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def card_text(cfg, preset, vae_losses, vae_seconds, latent_seconds, state, param_counts):
    def tail(values, k=100):
        return f"{np.mean(values[-k:]):.4f}" if len(values) else "n/a"

    dit = state["losses"]
    warm = ""
    if getattr(cfg, "init_from", ""):
        kept = "; its VAE kept as it was (no VAE steps)" if not vae_losses else ""
        warm = (f"- Warm start: the VAE, text encoder and transformer weights of `{cfg.init_from}` (a pipeline saved "
                f"by this script at another frame size){kept}; the loss curve below starts there.\n")
    tokens = cfg.latent_frames * (cfg.height // 4) * (cfg.width // 4)  # VAE factor 4, patch 1
    return f"""# tiny-shapes

A tiny text-to-video `WanPipeline` trained from scratch on CPU by `python -m fastdit.pipelines.train_tiny`
(fastdit issue 24), on procedural videos of one to three coloured shapes moving in straight lines
(`fastdit.pipelines.shapes_data`: colours red, green, blue, yellow; shapes circle, square, triangle;
directions left, right, up, down; plain or softly textured grey-ish backgrounds).  Captions follow one
grammar: "a red circle moving left and a blue square moving down".

Load it offline: `fastdit.pipelines.loading.load_pipeline("tiny-shapes")` (or `--model tiny-shapes`).

## Sizes
- Native call: {cfg.frames} frames of {cfg.height} x {cfg.width}; VAE factors 4 (space: 2x2 patchify, one 2x stage)
  x 2 (time) -> latent {cfg.latent_frames} x {cfg.height // 4} x {cfg.width // 4} x {cfg.vae_z_dim} channels; \
patch (1, 1, 1) ->
  **{tokens} video tokens** per transformer call.
- Transformer (`WanTransformer3DModel`): {cfg.layers} layers, {cfg.heads} heads x {cfg.head_dim}, FFN {cfg.ffn_dim};
  {param_counts['transformer'] / 1e6:.2f} M parameters.
- VAE (`AutoencoderKLWan`, Wan 2.2 style: patch 2, residual shortcuts): base dim {cfg.vae_base_dim}, \
z {cfg.vae_z_dim}; {param_counts['vae'] / 1e6:.2f} M parameters.
- Text encoder: the tiny 2-layer UMT5 (d=32) of `fastdit.pipelines.tiny` with its WordPiece tokenizer,
  trained jointly with the transformer; {param_counts['text_encoder'] / 1e6:.2f} M parameters;
  `max_sequence_length={cfg.max_sequence_length}`.
- Scheduler: `UniPCMultistepScheduler`, flow prediction, flow shift {cfg.flow_shift}.

## Training (preset `{preset}`, seed {cfg.seed}, {cfg.threads} torch thread(s))
{warm}- VAE: {len(vae_losses)} steps x batch {cfg.vae_batch} of {cfg.vae_clip_frames}-frame \
{cfg.vae_crop} x {cfg.vae_crop} crops, AdamW lr {cfg.vae_lr};
  {vae_seconds / 60:.1f} min; reconstruction loss (saturation-weighted L1 + MSE on [-1, 1] pixels) \
first {vae_losses[0] if vae_losses else float('nan'):.4f},
  last-100 mean {tail(vae_losses)}.
- Latents: {cfg.num_videos} videos encoded (posterior mean) in {latent_seconds / 60:.1f} min, normalised per channel.
- Transformer + text encoder: {state['step']} of {cfg.steps} planned steps x batch {cfg.batch}, AdamW lr {cfg.lr}
  (warm-up {cfg.warmup}), EMA {cfg.ema_decay}, caption dropout {cfg.caption_dropout}, full clip with probability
  {cfg.full_clip_prob} (else a prefix of 3..{cfg.prefix_max} latent frames); {state['seconds'] / 60:.1f} min;
  flow-matching MSE first-100 mean {np.mean(dit[:100]) if dit else float('nan'):.4f}, last-100 mean {tail(dit)}.
- Loss curves: `loss_curve.png` (this folder).

Wall times were taken on a shared 2-core machine (other jobs running beside it).

## Config
```json
{json.dumps(dataclasses.asdict(cfg), indent=1)}
```
"""


def export_pipeline(cfg, pipe, ema, out, card, curve=None):
    """Write the pipeline with the EMA weights into ``out`` (safetensors) plus the model card."""
    import copy

    tr = copy.deepcopy(pipe.transformer)
    te = copy.deepcopy(pipe.text_encoder)
    tr.load_state_dict(ema["transformer"])
    te.load_state_dict(ema["text_encoder"])
    from diffusers import WanPipeline

    exported = WanPipeline(tokenizer=pipe.tokenizer, text_encoder=te.eval(), vae=pipe.vae.eval(),
                           transformer=tr.eval(), scheduler=pipe.scheduler)
    os.makedirs(out, exist_ok=True)
    exported.save_pretrained(out, safe_serialization=True)
    if curve and os.path.exists(curve):
        shutil.copyfile(curve, os.path.join(out, "loss_curve.png"))
    with open(os.path.join(out, "README.md"), "w") as f:
        f.write(card)
