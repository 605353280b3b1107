"""The tiny-shapes transformer's training batch and loss (``train_tiny``): flow matching, optionally with anchoring
(:func:`noisy_batch`) and a direction contrast.

**Flow matching** (Esser et al. 2024, rectified flow as in Wan): with ``x_s = (1 - s) x_0 + s eps`` the transformer
predicts the velocity ``eps - x_0``; the per-sample loss is the mean squared error, weighted by ``w`` (1 + fg_weight
on the shapes' latent cells) and normalised by the weight's mean.

**Direction contrast** (``direction_contrast`` = lambda > 0): the same ``x_s`` is also fed with the caption whose
directions are all reversed (``shapes_data.opposite_directions``: the caption of the clip played backwards), and
the per-sample hinge

    h = relu(l_true - l_reversed + margin * l_true)        (l_true detached inside the margin)

is added with weight lambda, averaged over the samples that kept their caption (a dropped caption has no
reverse). It asks that the wrong direction word predict the clip worse than the right one by ``margin`` of the
loss. Why: the plain loss leaves direction words unheard on this model (stop 58: reversing "left" changes the
output by 1e-4 of the loss, a colour word by 0.005-0.06), because below s ~ 0.97 the noisy clip already shows its
path and above it the loss is mostly unpredictable noise; the contrast is a gradient that only the direction word
can answer. A contrastive flow-matching term in the spirit of Stoica et al. 2025 ("Contrastive Flow Matching"),
with a hinge instead of an unbounded negative term, and the reversed caption (not another sample's target) as
the negative.
"""
from __future__ import annotations

import torch

from . import shapes_data

__all__ = ["crop_batch", "shapes_fit", "flow_matching_loss", "noisy_batch", "token_timesteps"]


def _shape_spans(mask: torch.Tensor) -> list[torch.Tensor]:
    """First row, last row, first column, last column of each sample's shapes over its frames (``mask [N, F, H,
    W]``), ``[N]`` each; a sample without shapes has first = the grid's size, last = -1."""
    spans = []
    for occupied in (mask.any(3).any(1), mask.any(2).any(1)):  # [N, H], [N, W]
        index = torch.arange(occupied.shape[1])
        spans += [torch.where(occupied, index, occupied.shape[1]).amin(1), torch.where(occupied, index, -1).amax(1)]
    return spans


def shapes_fit(mask: torch.Tensor, side: int) -> torch.Tensor:
    """``[N]`` bool: whether all of sample n's shapes (``mask [N, F, H, W]``, over all its frames) fit in one
    ``side`` x ``side`` window of the grid."""
    top, bottom, left, right = _shape_spans(mask)
    return ((bottom - top + 1).clamp(min=0) <= side) & ((right - left + 1).clamp(min=0) <= side)


def crop_batch(x0, mask, side, rng):
    """One random ``side`` x ``side`` window of the latent grid per sample, among the windows that hold all its
    shapes (``mask [B, F, H, W]``: :func:`shapes_fit` must hold for every sample), the mask cut alike; ``x0
    [B, C, F, H, W]``.  Why whole shapes: a window that cuts a shape shows it entering or leaving across an edge
    the transformer cannot see (RoPE, patch 1: no absolute position); trained on such cuts (stop 65), the model
    made shapes fade in and out of whole frames.  A side at least the grid's keeps the whole frame."""
    height, width = x0.shape[-2:]
    if side >= height and side >= width:
        return x0, mask
    h, w = min(side, height), min(side, width)
    windows = []
    for top, bottom, left, right in zip(*(span.tolist() for span in _shape_spans(mask))):
        # top row y: y <= the first shape row and y + h - 1 >= the last, inside the grid (no shape: anywhere)
        y_lo, y_hi = max(0, bottom - h + 1), min(top, height - h)
        x_lo, x_hi = max(0, right - w + 1), min(left, width - w)
        if y_lo > y_hi or x_lo > x_hi:
            raise ValueError(f"the shapes of a sample span more than {side} latent cells: draw from shapes_fit")
        windows.append((int(rng.integers(y_lo, y_hi + 1)), int(rng.integers(x_lo, x_hi + 1))))
    x0 = torch.stack([x[..., y:y + h, x_:x_ + w] for x, (y, x_) in zip(x0, windows)])
    mask = torch.stack([m[..., y:y + h, x_:x_ + w] for m, (y, x_) in zip(mask, windows)])
    return x0, mask


def noisy_batch(cfg, x0: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x_s, sigma, target)`` of clean latents ``x0 [B, C, F, H, W]``: noise levels drawn as ``cfg`` says.

    ``s`` is uniform, shifted like the sampler (``s' = k s / (1 + (k - 1) s)``, ``k = cfg.flow_shift``); with
    probability ``cfg.high_noise_prob`` uniform in ``[cfg.high_noise_min, 1]`` instead.  **Anchoring** (with
    probability ``cfg.anchor_prob``): one latent frame, drawn at random, gets the lower level ``s u`` (u uniform),
    the others keep ``s``; then ``sigma`` is per frame, ``[B, F]`` (else ``[B]``), and the transformer is told each
    token's level (Wan 2.2's per-token timesteps).  Why: a shape's place in a clearer frame plus the caption's
    direction says where it is in every other frame, so the direction word pays at every ``s``; with one level
    for the whole clip the noisy clip itself shows the path below s ~ 0.97 and the word is never needed
    (stop 58).  The target is the velocity ``eps - x0`` whatever the level.
    """
    batch = x0.shape[0]
    u = torch.rand(batch, generator=gen)
    sigma = cfg.flow_shift * u / (1 + (cfg.flow_shift - 1) * u)
    if cfg.high_noise_prob:  # drawn only when asked: earlier runs keep their random stream (resume)
        high = torch.rand(batch, generator=gen) < cfg.high_noise_prob
        sigma = torch.where(high, cfg.high_noise_min + (1 - cfg.high_noise_min) * u, sigma)
    noise = torch.randn(x0.shape, generator=gen)
    if cfg.anchor_prob:
        frames = x0.shape[2]
        anchored = torch.rand(batch, generator=gen) < cfg.anchor_prob
        frame = torch.randint(0, frames, (batch,), generator=gen)
        lower = sigma * torch.rand(batch, generator=gen)
        sigma = sigma[:, None].repeat(1, frames)
        rows = torch.arange(batch)[anchored]
        sigma[rows, frame[anchored]] = lower[anchored]
        s = sigma.view(batch, 1, frames, 1, 1)
    else:
        s = sigma.view(-1, 1, 1, 1, 1)
    return (1 - s) * x0 + s * noise, sigma, noise - x0


def token_timesteps(pipe, sigma: torch.Tensor, xt: torch.Tensor) -> torch.Tensor:
    """``1000 sigma``: ``[B]``, or per token ``[B, F' H' W']`` (patchified grid order) for per-frame ``sigma``."""
    if sigma.dim() == 1:
        return sigma * 1000.0
    pt, ph, pw = pipe.transformer.config.patch_size
    frames, height, width = xt.shape[2] // pt, xt.shape[3] // ph, xt.shape[4] // pw
    per_frame = sigma[:, ::pt][:, :frames] * 1000.0
    return per_frame[:, :, None].expand(-1, -1, height * width).reshape(sigma.shape[0], -1)


def flow_matching_loss(pipe, xt: torch.Tensor, sigma: torch.Tensor, target: torch.Tensor, texts: list[str],
                       max_sequence_length: int, weight: torch.Tensor | None = None, contrast: float = 0.0,
                       margin: float = 0.05) -> tuple[torch.Tensor, dict]:
    """``(loss, stats)`` of one batch; ``stats["reversed_over_true"]``: mean l_reversed / l_true (contrast on).

    ``sigma``: the batch's noise levels s in [0, 1] (timestep ``1000 s``), ``[B]`` or per frame ``[B, F]``
    (:func:`noisy_batch`); ``weight``: broadcastable to ``target``.
    """
    turned = [shapes_data.opposite_directions(t) if t else "" for t in texts] if contrast else []
    embeds = pipe._get_t5_prompt_embeds(texts + turned, max_sequence_length=max_sequence_length, device="cpu")
    copies = 2 if turned else 1  # one call on the true and the reversed captions together
    rep = (copies,) + (1,) * (xt.dim() - 1)
    timestep = token_timesteps(pipe, sigma, xt)
    pred = pipe.transformer(xt.repeat(rep), timestep.repeat((copies,) + (1,) * (timestep.dim() - 1)), embeds,
                            return_dict=False)[0]
    error = (pred - target.repeat(rep)).pow(2)
    if weight is not None:
        error = weight.repeat(rep) * error / weight.mean()
    per_sample = error.flatten(1).mean(1)
    n = len(texts)
    loss = per_sample[:n].mean()
    stats = {}
    if turned:
        true, reversed_ = per_sample[:n], per_sample[n:]
        kept = torch.tensor([bool(t) for t in texts], dtype=true.dtype)
        hinge = torch.relu(true - reversed_ + margin * true.detach())
        loss = loss + contrast * (hinge * kept).sum() / kept.sum().clamp(min=1)
        stats["reversed_over_true"] = float(((reversed_ / true).detach() * kept).sum() / kept.sum().clamp(min=1))
    return loss, stats
