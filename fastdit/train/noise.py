"""Attention-guided optimisation of the initial noise (``fastdit.optimize_noise``).

The noise half of "OptiPrune: Boosting Prompt-Image Consistency with Attention-Guided Noise and
Dynamic Token Selection" (2025), in the line of Attend-and-Excite (Chefer et al. 2023) and
initial-noise optimisation (InitNO, Guo et al. 2024): a few gradient steps on the initial latent
``z`` so that at the first denoising step the attention from the image / video tokens to each
subject token of the prompt has a strong peak and the subjects' maps overlap little, while ``z``
stays a draw of N(0, I). The formulas follow those papers; the code is this project's.

The maps. The pipeline runs its first transformer call on ``z`` (with gradients, guidance off so
the one call is the conditional branch) and every attention call between the ``N`` video tokens
and the ``L`` text tokens is read: cross-attention (``q`` of length ``N``, ``k`` of length ``L``:
Wan-like models) or the text columns of joint attention (``q`` and ``k`` of length ``N + L``:
Flux / SD3 / HunyuanVideo-like models, softmax over the text keys). For subject ``s`` with
prompt tokens ``T_s``::

    m_s(i) = mean over calls, heads, t in T_s of softmax_j(scale * q_i . k_j)[t],   i = 1..N

Loss (to minimise)::

    peak    = mean_s (1 - max_i m_s(i))                       (each subject attended strongly somewhere)
    overlap = mean_{s < s'} sum_i min(p_s(i), p_s'(i)),  p_s = m_s / sum_i m_s(i)   (maps apart)
    prior   = 0.5 * (mu^2 + sigma^2 - 1 - log sigma^2)        (KL of N(mu, sigma^2) fitted to z, to N(0, 1))
    loss    = peak + overlap + prior_weight * prior

After every Adam step ``z`` is renormalised per sample, ``z <- (z - mean) / std``, so the returned
latent has mean 0 and std 1 exactly and the Gaussian prior of the sampler holds.

Subjects: given (``subjects=["cat", "dog"]``) or found in the prompt: the prompt is cut at
" and ", commas and " with "; in each part the last word before the first verb-like word (ending in
"ing", or "is" / "are" / a preposition) is the subject ("a red circle moving left" -> "circle").
Each subject is located in the prompt's tokens (the tokenizer whose tokens are the text sequence
of the attention: ``tokenizer`` for Wan / HunyuanVideo / SD3's CLIP part, ``tokenizer_2`` (T5)
for Flux).

It works with or without a fastdit patch on the pipeline: an untrainable patch runs the model's
own attention under gradients (counted as fallbacks in its stats); a ``trainable=True`` patch runs
its method with gradients.
"""
from __future__ import annotations

import inspect
import re

import torch
from torch.overrides import TorchFunctionMode

from ..intercept import is_sdpa, sdpa_arguments
from ..methods.base import check_int, check_number

__all__ = ["optimize_noise", "noise_loss", "find_subjects"]

_STOP_WORDS = {"is", "are", "was", "were", "on", "in", "at", "of", "under", "over", "near", "behind", "next",
               "beside", "above", "below", "to", "from", "into", "by", "while"}
_ARTICLES = {"a", "an", "the", "one", "two", "some"}


class _Stop(Exception):
    """Raised after the first transformer call: the rest of the pipeline is not needed."""


def find_subjects(prompt):
    """Subject words of ``prompt`` by the rule of the module docstring (a list, maybe empty)."""
    subjects = []
    for part in re.split(r",| and | with |;", prompt.lower()):
        words = re.findall(r"[a-z][a-z'-]*", part)
        run = []
        for word in words:
            if word.endswith("ing") or word in _STOP_WORDS:
                break
            if word not in _ARTICLES:
                run.append(word)
        if run:
            subjects.append(run[-1])
    return subjects


def _text_tokenizer(pipe):
    if getattr(pipe, "tokenizer_2", None) is not None and getattr(pipe, "tokenizer_3", None) is None \
            and "T5" in type(getattr(pipe, "text_encoder_2", None)).__name__:
        return pipe.tokenizer_2  # Flux: the joint text is T5's
    tokenizer = getattr(pipe, "tokenizer", None)
    if tokenizer is None or getattr(pipe, "text_encoder", None) is None:
        raise ValueError(f"pipe: {type(pipe).__name__} has no text encoder / tokenizer; optimize_noise needs a "
                         "text-conditioned pipeline")
    return tokenizer


def subject_tokens(pipe, prompt, subjects=None):
    """``{subject: [token positions in the prompt's text sequence]}``; ValueError naming ``subjects``
    when one is not found (or none is given / found)."""
    tokenizer = _text_tokenizer(pipe)
    words = list(subjects) if subjects is not None else find_subjects(prompt)
    if not words:
        raise ValueError(f"subjects: none found in the prompt {prompt!r}; pass subjects=[...] (words of the prompt)")
    ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    found = {}
    for word in words:
        piece = tokenizer(word, add_special_tokens=False)["input_ids"]
        spans = [i for i in range(len(ids) - len(piece) + 1) if piece and ids[i:i + len(piece)] == piece]
        if not spans:
            raise ValueError(f"subjects: {word!r} is not among the tokens of the prompt {prompt!r}; "
                             "give words that occur in the prompt")
        found[word] = list(range(spans[0], spans[0] + len(piece)))
    return found


class _AttentionMaps(TorchFunctionMode):
    """Collects ``softmax(scale q k_text^T)`` (video rows, text columns) of every attention call
    between ``n_video`` video tokens and ``n_text`` text tokens (cross or joint)."""

    def __init__(self, n_video, n_text, text_prefix):
        super().__init__()
        self.n_video, self.n_text, self.text_prefix = n_video, n_text, text_prefix
        self.maps = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if is_sdpa(func):
            call = sdpa_arguments(args, kwargs)
            self._read(call["query"], call["key"], call["scale"], call["attn_mask"])
        return func(*args, **kwargs)

    def _read(self, q, k, scale, mask):
        n, length = self.n_video, self.n_text
        if q.dim() != 4 or n == 0:
            return
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        if q.shape[2] == n and k.shape[2] == length:  # cross-attention
            qv, kt = q, k
        elif q.shape[2] == k.shape[2] == n + length:  # joint attention
            video = slice(length, None) if self.text_prefix else slice(0, n)
            text = slice(0, length) if self.text_prefix else slice(n, None)
            qv, kt = q[:, :, video], k[:, :, text]
            if mask is not None and mask.dim() == 4 and mask.shape[-1] == n + length:
                mask = mask[..., text]
        else:
            return
        scores = scale * qv.float() @ kt.float().transpose(-1, -2)
        if mask is not None and mask.shape[-1] == kt.shape[2]:
            scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
        self.maps.append(scores.softmax(-1)[-1].mean(0))  # last batch element (conditional), mean of heads: (N, L)


def _video_tokens(pipe, latents):
    patch = getattr(pipe.transformer.config, "patch_size", 1) or 1
    if latents.dim() == 3:  # packed (Flux): one token per row
        return latents.shape[1]
    spatial = latents.shape[2:]
    patch = tuple(patch) if isinstance(patch, (tuple, list)) else (1,) * (len(spatial) - 2) + (patch, patch)
    patch = patch[-len(spatial):]
    count = 1
    for size, p in zip(spatial, patch):
        count *= size // p
    return count


def _call_kwargs(pipe, prompt, latents, generator):
    """Arguments of a pipeline call whose first transformer call runs on ``latents`` (conditional
    branch only: guidance off where the pipeline has classifier-free guidance)."""
    params = set(inspect.signature(pipe.__call__).parameters)
    kwargs = {"prompt": prompt, "output_type": "latent", "generator": generator}
    if latents is not None:
        kwargs["latents"] = latents
        if latents.dim() == 5 and "num_frames" in params:
            temporal = getattr(pipe, "vae_scale_factor_temporal", 1) or 1
            kwargs["num_frames"] = (latents.shape[2] - 1) * temporal + 1
        if latents.dim() in (4, 5) and "height" in params:
            spatial = getattr(pipe, "vae_scale_factor_spatial", None) or getattr(pipe, "vae_scale_factor", 8)
            kwargs["height"], kwargs["width"] = latents.shape[-2] * spatial, latents.shape[-1] * spatial
    if "guidance_scale" in params and hasattr(type(pipe), "do_classifier_free_guidance"):
        kwargs["guidance_scale"] = 1.0
    # A pipeline loaded by name carries its native call (tiny-shapes: 48 text tokens, 17 frames of 128 x 128)
    native = getattr(pipe, "_fastdit_call_defaults", {})
    for key in ("max_sequence_length", *(("num_frames", "height", "width") if latents is None else ())):
        if key in native:
            kwargs[key] = native[key]
    return {k: v for k, v in kwargs.items() if k in params}


def _first_call(pipe, kwargs, maps=None):
    """Run the pipeline up to (and including) its first transformer call, with gradients.
    Returns that call's ``hidden_states`` and ``encoder_hidden_states``."""
    seen = {}

    def pre(module, args, kw):
        seen["hidden"] = kw.get("hidden_states", args[0] if args else None)
        seen["text"] = kw.get("encoder_hidden_states")
        if maps is not None:
            maps.n_text = seen["text"].shape[1] if seen["text"] is not None else 0
            maps.__enter__()

    def post(module, args, output):
        if maps is not None:
            maps.__exit__(None, None, None)
        raise _Stop

    hooks = [pipe.transformer.register_forward_pre_hook(pre, with_kwargs=True),
             pipe.transformer.register_forward_hook(post)]
    config = dict(getattr(pipe, "_progress_bar_config", {}))
    pipe.set_progress_bar_config(disable=True)
    call = getattr(pipe.__call__, "__wrapped__", None)
    try:
        with torch.enable_grad():
            if call is not None:
                call(pipe, **kwargs)
            else:
                pipe(**kwargs)
    except _Stop:
        pass
    finally:
        for hook in hooks:
            hook.remove()
        pipe._progress_bar_config = config
    if "hidden" not in seen:
        raise RuntimeError(f"{type(pipe).__name__}: the pipeline never called its transformer")
    return seen["hidden"], seen["text"]


def _text_prefix(pipe):
    # Flux / HunyuanVideo / Qwen put the text first in joint attention; SD3 / CogVideoX after the image
    name = type(pipe.transformer).__name__
    return not any(tag in name for tag in ("SD3", "CogVideoX"))


def noise_loss(pipe, prompt, latents, subjects=None, *, prior_weight=1.0, _tokens=None):
    """``(loss, parts)`` of the module docstring for ``latents`` (differentiable in ``latents``);
    ``parts``: float ``peak``, ``overlap``, ``prior``."""
    tokens = _tokens or subject_tokens(pipe, prompt, subjects)
    maps = _AttentionMaps(_video_tokens(pipe, latents), 0, _text_prefix(pipe))
    _first_call(pipe, _call_kwargs(pipe, prompt, latents, None), maps)
    if maps.n_text == 0:
        raise ValueError(f"pipe: {type(pipe).__name__}'s transformer got no text conditioning "
                         "(encoder_hidden_states); optimize_noise needs a text-conditioned pipeline")
    if not maps.maps:
        raise RuntimeError(f"no attention call between the {maps.n_video} video tokens and the {maps.n_text} text "
                           f"tokens was seen in {type(pipe.transformer).__name__}")
    attention = torch.stack(maps.maps).mean(0)  # (N, L)
    per_subject = torch.stack([attention[:, positions].mean(-1) for positions in tokens.values()])  # (S, N)
    peak = (1 - per_subject.max(dim=-1).values).mean()
    spread = per_subject / per_subject.sum(-1, keepdim=True).clamp(min=1e-12)
    pairs = [(a, b) for a in range(len(tokens)) for b in range(a + 1, len(tokens))]
    overlap = torch.stack([torch.minimum(spread[a], spread[b]).sum() for a, b in pairs]).mean() if pairs \
        else peak.new_zeros(())
    flat = latents.float().flatten(1)
    mu, var = flat.mean(-1), flat.var(-1)
    prior = (0.5 * (mu ** 2 + var - 1 - var.log())).mean()
    loss = peak + overlap + prior_weight * prior
    return loss, {"peak": float(peak.detach()), "overlap": float(overlap.detach()), "prior": float(prior.detach())}


def _normalise(z):
    flat = z.flatten(1)
    return ((flat - flat.mean(-1, keepdim=True)) / flat.std(-1, keepdim=True)).view_as(z)


def _check_latents(latents):
    """``latents`` must be a finite float tensor whose every sample varies: each step renormalises a
    sample to mean 0 and std 1, which divides by zero on a constant one (``torch.zeros`` gave
    all-NaN latents) and spreads a NaN or inf over the whole sample."""
    if not isinstance(latents, torch.Tensor) or not latents.is_floating_point() or latents.dim() < 2:
        raise ValueError(f"latents must be a float tensor (batch, channels, ...) such as the pipeline's initial "
                         f"noise, got {type(latents).__name__} {getattr(latents, 'shape', '')}")
    if not bool(torch.isfinite(latents).all()):
        raise ValueError("latents hold NaN or inf values; pass finite noise (e.g. torch.randn of the latent shape)")
    flat = latents.detach().float().flatten(1)
    if flat.shape[1] < 2 or bool((flat.std(-1) == 0).any()):
        raise ValueError("latents: a sample is constant (e.g. torch.zeros), so it cannot be renormalised to mean 0 "
                         "and std 1 (that gave all-NaN latents); pass noise, e.g. torch.randn of the latent shape, "
                         "or latents=None for the pipeline's own draw")


def optimize_noise(pipe, prompt, *, latents=None, steps=5, lr=0.05, subjects=None, generator=None):
    """Initial latents for ``pipe(prompt, latents=...)`` optimised against subject neglect.

    ``steps`` Adam steps of rate ``lr`` on the loss of the module docstring (peak + overlap of the
    subjects' first-step attention maps + the N(0, I) prior), each followed by renormalisation to
    mean 0 and std 1. ``latents``: the starting noise (default: the pipeline's own draw of its
    default call size with ``generator``). ``subjects``: words of the prompt (default: found in it).
    Shows a progress bar with the loss; the returned tensor carries ``loss_history`` (one dict per
    evaluation: ``steps + 1``, the last after the final step) for the report.

    Raises ValueError naming ``pipe`` (no text conditioning), ``prompt`` (not one string), ``latents``
    (not finite, or a constant sample), ``subjects`` (not found), ``steps`` or ``lr``. Without
    ``latents``, a built-in model's native call sizes (``pipe._fastdit_call_defaults``) are used.
    """
    from tqdm.auto import tqdm

    check_int("steps", steps, low=0)
    check_number("lr", lr, 0, low_open=True)
    if getattr(pipe, "transformer", None) is None:
        raise ValueError(f"pipe: {type(pipe).__name__} has no transformer")
    # one sample's noise for one caption: a list of prompts gave an AttributeError deep in the subject search
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError(f"prompt must be one non-empty string (optimize_noise optimises one sample's noise; "
                         f"call it per prompt), got {type(prompt).__name__} {str(prompt)[:60]!r}")
    if latents is not None:
        _check_latents(latents)
    tokens = subject_tokens(pipe, prompt, subjects)
    if latents is None:
        latents, _ = _first_call(pipe, _call_kwargs(pipe, prompt, None, generator))
        latents = latents[-1:].detach()
    dtype = latents.dtype
    z = _normalise(latents.detach().float()).requires_grad_(True)
    optimiser = torch.optim.Adam([z], lr=lr)
    history = []
    bar = tqdm(range(steps + 1), desc="optimize_noise", disable=getattr(pipe, "_progress_bar_config", {}).get(
        "disable", False))
    for step in bar:
        loss, parts = noise_loss(pipe, prompt, z.to(dtype), _tokens=tokens)
        history.append({"step": step, "loss": float(loss.detach()), **parts})
        bar.set_postfix(loss=f"{float(loss.detach()):.4f}", peak=f"{parts['peak']:.3f}",
                        overlap=f"{parts['overlap']:.3f}")
        if step == steps:
            break
        (grad,) = torch.autograd.grad(loss, z)  # gradients of z only, never into the model's weights
        optimiser.zero_grad()
        z.grad = grad
        optimiser.step()
        with torch.no_grad():
            z.copy_(_normalise(z))
    out = z.detach().to(dtype)
    out.loss_history = history
    return out
