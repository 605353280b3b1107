"""CLIP score for text-image and text-video pairs (Hessel et al. 2021, torchmetrics' scaling).

``CLIPScore(I, T) = max(100 * cos(E_I, E_T), 0)`` with ``E_I``, ``E_T`` CLIP's projected image
and text embeddings (torchmetrics ``CLIPScore``; its default model is
``openai/clip-vit-large-patch14``). A video's score is the average of its frames' scores
against the prompt.

torchmetrics clamps the *batch mean* at 0 rather than each pair; the two agree whenever all
cosines are non-negative, which is the practical case for CLIP.

The model is loaded with ``local_files_only=True``: give a local folder in HF format
(``config.json``, weights, tokenizer files, ``preprocessor_config.json``) or a hub id already
in the HF cache. Nothing is downloaded.
"""

from __future__ import annotations

import os
from typing import Dict, List, Sequence, Tuple, Union

import numpy as np
import torch

from fastdit.media.video import to_uint8

PathLike = Union[str, os.PathLike]
DEFAULT_CLIP_MODEL = "openai/clip-vit-large-patch14"

__all__ = ["DEFAULT_CLIP_MODEL", "load_clip", "clip_scores", "clip_score", "clip_score_video"]

_CACHE: Dict[Tuple[str, str], tuple] = {}


def load_clip(model: PathLike = DEFAULT_CLIP_MODEL, device: Union[str, torch.device] = "cpu"):
    """(CLIPModel, tokenizer, CLIPImageProcessor) from a local folder or the HF cache (cached)."""
    from transformers import AutoTokenizer, CLIPModel

    try:  # transformers >= 5 names the PIL backend explicitly (the default one needs torchvision)
        from transformers import CLIPImageProcessorPil as CLIPImageProcessor
    except ImportError:
        from transformers import CLIPImageProcessor

    key = (str(model), str(device))
    if key not in _CACHE:
        looks_like_path = os.path.isabs(str(model)) or str(model).startswith((".", "~")) or os.path.exists(model)
        if looks_like_path and not os.path.isdir(os.path.expanduser(str(model))):
            raise FileNotFoundError(
                f"CLIP model folder {str(model)!r} does not exist. Place a HF-format CLIP model there "
                f"(config.json, model.safetensors, tokenizer files and preprocessor_config.json).")
        model = os.path.expanduser(str(model)) if looks_like_path else model
        try:
            net = CLIPModel.from_pretrained(model, local_files_only=True)
            tok = AutoTokenizer.from_pretrained(model, local_files_only=True)
            proc = CLIPImageProcessor.from_pretrained(model, local_files_only=True)
        except (OSError, ValueError) as e:
            raise FileNotFoundError(
                f"CLIP model {str(model)!r} is not available locally (no downloads are attempted): {e}\n"
                f"Pass model= a folder holding a HF-format CLIP model (config.json, model.safetensors, "
                f"tokenizer files and preprocessor_config.json), or fill the HF cache "
                f"(HF_HOME, default ~/.cache/huggingface) on a machine with network, e.g. "
                f"`huggingface-cli download {DEFAULT_CLIP_MODEL}`."
            ) from None
        _CACHE[key] = (net.eval().requires_grad_(False).to(device), tok, proc)
    return _CACHE[key]


def _features(out) -> torch.Tensor:
    # transformers < 5 returns the projected embedding; >= 5 an output whose pooler_output it is.
    return out if isinstance(out, torch.Tensor) else out.pooler_output


@torch.no_grad()
def _embed_images(frames: np.ndarray, model, device, batch_size: int) -> torch.Tensor:
    net, _, proc = load_clip(model, device)
    embs = []
    for i in range(0, len(frames), batch_size):
        pix = proc(images=list(frames[i:i + batch_size]), return_tensors="pt")["pixel_values"]
        e = _features(net.get_image_features(pixel_values=pix.to(device)))
        embs.append(torch.nn.functional.normalize(e.float(), dim=-1))
    return torch.cat(embs)


@torch.no_grad()
def _embed_texts(texts: Sequence[str], model, device) -> torch.Tensor:
    net, tok, _ = load_clip(model, device)
    # CLIP's text encoder has 77 positions; longer prompts are truncated (torchmetrics warns and
    # truncates the same way).
    max_len = getattr(net.config.text_config, "max_position_embeddings", 77)
    enc = tok(list(texts), padding=True, truncation=True, max_length=max_len, return_tensors="pt")
    e = _features(net.get_text_features(input_ids=enc["input_ids"].to(device),
                                        attention_mask=enc["attention_mask"].to(device)))
    return torch.nn.functional.normalize(e.float(), dim=-1)


def clip_scores(images, texts: Union[str, Sequence[str]], model: PathLike = DEFAULT_CLIP_MODEL,
                device: Union[str, torch.device] = "cpu", batch_size: int = 16) -> np.ndarray:
    """Per-pair scores ``max(100 cos, 0)``, shape (N,).

    ``images``: (N, H, W, 3) float [0, 1] or uint8 (or a list of images / PIL images);
    ``texts``: N strings, or one string used for every image.
    """
    frames = to_uint8(images)
    texts = [texts] * len(frames) if isinstance(texts, str) else list(texts)
    if len(texts) != len(frames):
        raise ValueError(f"got {len(frames)} images but {len(texts)} texts")
    img = _embed_images(frames, model, device, batch_size)
    uniq = sorted(set(texts))
    txt = _embed_texts(uniq, model, device)[[uniq.index(t) for t in texts]]
    cos = (img * txt).sum(-1).double()
    return (100.0 * cos.clamp(min=0)).cpu().numpy()


def clip_score(images, texts: Union[str, Sequence[str]], model: PathLike = DEFAULT_CLIP_MODEL,
               device: Union[str, torch.device] = "cpu", batch_size: int = 16) -> float:
    """Mean CLIP score over image-text pairs (see :func:`clip_scores`)."""
    return float(clip_scores(images, texts, model, device, batch_size).mean())


def clip_score_video(videos, prompts: Union[str, Sequence[str]], model: PathLike = DEFAULT_CLIP_MODEL,
                     device: Union[str, torch.device] = "cpu", batch_size: int = 16) -> Union[float, List[float]]:
    """Text-video CLIP score: the mean over frames of each frame's score against the prompt.

    ``videos``: one video (F, H, W, 3) with one prompt string -> float; or a list of videos with a
    list of prompts -> list of floats (one per video).
    """
    if isinstance(prompts, str):
        return float(clip_scores(videos, prompts, model, device, batch_size).mean())
    if len(videos) != len(prompts):
        raise ValueError(f"got {len(videos)} videos but {len(prompts)} prompts")
    return [float(clip_scores(v, p, model, device, batch_size).mean()) for v, p in zip(videos, prompts)]
