"""The tiny-shapes transformer's training loss (``train_tiny``): flow matching, optionally with a direction contrast.

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

__all__ = ["flow_matching_loss"]


def flow_matching_loss(pipe, xt: torch.Tensor, sigma: torch.Tensor, target: torch.Tensor, texts: list[str],
                       max_sequence_length: int, weight: torch.Tensor | None = None, contrast: float = 0.0,
                       margin: float = 0.05) -> tuple[torch.Tensor, dict]:
    """``(loss, stats)`` of one batch; ``stats["reversed_over_true"]``: mean l_reversed / l_true (contrast on).

    ``sigma``: the batch's noise levels s in [0, 1] (timestep ``1000 s``); ``weight``: broadcastable to ``target``.
    """
    turned = [shapes_data.opposite_directions(t) if t else "" for t in texts] if contrast else []
    embeds = pipe._get_t5_prompt_embeds(texts + turned, max_sequence_length=max_sequence_length, device="cpu")
    copies = 2 if turned else 1  # one call on the true and the reversed captions together
    rep = (copies,) + (1,) * (xt.dim() - 1)
    pred = pipe.transformer(xt.repeat(rep), (sigma * 1000.0).repeat(copies), embeds, return_dict=False)[0]
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
