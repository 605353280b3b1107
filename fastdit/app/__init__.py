"""The fastdit Gradio app: dense and accelerated generation side by side.

    python app.py                 # or: fastdit app [--host 0.0.0.0] [--port 7860] [--share]

It opens on tiny-shapes (a small video model trained in this repository, with method presets
calibrated on it), runs out of the box on the embedded random-weight tiny models too (no downloads)
and takes a hub id or a local folder for real models. "Compare" runs the dense pipeline and the
chosen method with the same seed and shows both videos, latency and speedup, PSNR/SSIM (LPIPS when
its weights are present) against dense, a contact sheet (first, middle and last frame of both,
labelled with the run's speedup and PSNR), the effective density and fallbacks of the patch, the
attention mask of a chosen layer and head, and a table and a speed-against-quality scatter of the
session's runs.

Layers, each importing only those below it:

* ``launch`` - the command line (``fastdit app``, ``python app.py``);
* ``ui`` - the Gradio page: widgets and events only (the one module that imports gradio);
* ``views`` - what a run looks like on the page (HTML cards, tables) as plain values;
* ``service`` - ``Runner``: pipeline cache, runs, cancellation, results (tests drive it directly);
* ``models``, ``method_options``, ``masks`` - pipelines and sizes, method options read from the
  config dataclasses, mask pictures (``Patch.mask``);
* ``errors`` - ``AppError`` and ``RunCancelled``.

Importing this package does not import gradio (``build_app`` loads it on first use).
"""
from .errors import AppError, RunCancelled
from .launch import add_app_parser, cmd_app, main
from .masks import draw_patch_mask, mask_picture, pooled_mask
from .method_options import OptionSpec, method_choices, option_specs, parse_option, parse_options
from .models import PipelineCache, plan_call
from .service import MAX_SEED, RunRequest, RunResult, Runner, check_seed

__all__ = ["AppError", "MAX_SEED", "OptionSpec", "PipelineCache", "RunCancelled", "RunRequest", "RunResult", "Runner",
           "add_app_parser", "build_app", "check_seed", "cmd_app", "draw_patch_mask", "main", "mask_picture",
           "method_choices", "option_specs", "parse_option", "parse_options", "plan_call", "pooled_mask"]


def build_app(default_model="tiny-shapes", device=None, dtype=None, max_tokens=None, concurrency=1, calibration=None,
              plan=None):
    """The Gradio app (``fastdit.app.ui.build_app``; imports gradio). ``plan``: ``calibration``'s earlier name."""
    from .ui import build_app as build

    return build(default_model, device=device, dtype=dtype, max_tokens=max_tokens, concurrency=concurrency,
                 calibration=calibration, plan=plan)
