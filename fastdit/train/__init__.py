"""Fine-tuning with sparse attention: a LoRA recipe that adapts a DiT to its sparse mask.

``train_lora(pipe, LoraTrainConfig(...), out)`` (``recipe.py``): sparse distillation, the target
of the sparse, LoRA-adapted transformer being the dense transformer's output on the same noisy
latents and timesteps; ``load_lora(pipe, out)`` loads the result (diffusers' LoRA format).
``evaluate.py``: PSNR / SSIM against the dense pipeline and per-layer attention errors.
Command line: ``python -m fastdit.train --help``. Needs ``peft`` (``pip install 'fastdit[train]'``).
``noise.py``: ``fastdit.optimize_noise``, attention-guided initial noise (OptiPrune's second half).
The gradients come from ``fastdit.patch(..., trainable=True)``; see docs/training.md.
"""
from .noise import find_subjects, noise_loss, optimize_noise
from .evaluate import dense_videos, layer_errors, output_error, video_fidelity
from .recipe import LoraTrainConfig, add_lora, load_lora, make_samples, train_lora

__all__ = ["LoraTrainConfig", "add_lora", "dense_videos", "find_subjects", "layer_errors", "load_lora", "make_samples",
           "noise_loss", "optimize_noise", "output_error", "train_lora", "video_fidelity"]
