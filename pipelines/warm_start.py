"""Warm starts of ``train_tiny``: the weights of a saved tiny-shapes pipeline folder start a run
(``init_from``), at another frame size or with a grown caption vocabulary."""
from __future__ import annotations

import json
import os

__all__ = ["load_weights"]


def load_weights(pipe, folder: str) -> None:
    """Copy the VAE, text encoder and transformer weights of a saved pipeline folder into ``pipe``.

    Raises ``FileNotFoundError`` naming the missing file and ``ValueError`` naming the component
    whose shapes differ (a folder of another model size)."""
    from safetensors.torch import load_file

    files = {"vae": "vae/diffusion_pytorch_model.safetensors", "text_encoder": "text_encoder/model.safetensors",
             "transformer": "transformer/diffusion_pytorch_model.safetensors"}
    for name, rel in files.items():
        path = os.path.join(folder, rel)
        if not os.path.exists(path):
            raise FileNotFoundError(f"init_from={folder!r}: {path} is missing "
                                    "(a pipeline saved by train_tiny holds it)")
        state = load_file(path)
        module = getattr(pipe, name)
        own = module.state_dict()
        if name == "text_encoder":
            _grow_vocabulary(state, own)
        wrong = sorted(k for k in own if k in state and state[k].shape != own[k].shape)
        if wrong:
            raise ValueError(f"init_from={folder!r}: {name} has other shapes ({wrong[0]}: "
                             f"{tuple(state[wrong[0]].shape)} vs {tuple(own[wrong[0]].shape)}); "
                             "same model sizes needed")
        # tied / shared weights may be stored once: non-strict, then check nothing of ours is left out
        missing, _ = module.load_state_dict(state, strict=False)
        missing = [k for k in missing if k not in ("shared.weight",) and not k.endswith("embed_tokens.weight")]
        if missing:
            raise ValueError(f"init_from={folder!r}: {name} lacks {missing[:3]}")
    if os.path.exists(os.path.join(folder, "vae", "config.json")):
        with open(os.path.join(folder, "vae", "config.json")) as f:
            vae_cfg = json.load(f)
        pipe.vae.register_to_config(latents_mean=vae_cfg.get("latents_mean"), latents_std=vae_cfg.get("latents_std"))


def _grow_vocabulary(state: dict, own: dict) -> None:
    """A text encoder saved with a smaller vocabulary (``caption_vocab`` added words after it): its
    embedding rows are kept for the ids they had and the new rows keep this model's initialisation."""
    for key, value in list(state.items()):
        mine = own.get(key)
        if (mine is not None and key.endswith(("shared.weight", "embed_tokens.weight")) and value.ndim == 2
                and value.shape[1] == mine.shape[1] and value.shape[0] < mine.shape[0]):
            grown = mine.clone()
            grown[: value.shape[0]] = value
            state[key] = grown
