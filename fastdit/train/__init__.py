"""Fine-tuning with sparse attention: a LoRA recipe that adapts a DiT to its sparse mask.

``train_lora(pipe, LoraTrainConfig(...), out)`` (``recipe.py``): sparse distillation, the target
of the sparse, LoRA-adapted transformer being the dense transformer's output on the same noisy
latents and timesteps; ``load_lora(pipe, out)`` loads the result (diffusers' LoRA format).
``evaluate.py``: PSNR / SSIM against the dense pipeline and per-layer attention errors.
Command line: ``python -m fastdit.train --help``. Needs ``peft`` (``pip install 'fastdit[train]'``).
The gradients come from ``fastdit.patch(..., trainable=True)``; see docs/training.md.
"""
from .evaluate import dense_videos, layer_errors, output_error, video_fidelity
from .recipe import LoraTrainConfig, add_lora, load_lora, make_samples, train_lora

__all__ = ["LoraTrainConfig", "add_lora", "dense_videos", "layer_errors", "load_lora", "make_samples", "output_error",
           "train_lora", "video_fidelity"]
