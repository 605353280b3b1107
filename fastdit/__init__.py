"""fastdit: sparse attention for diffusers DiT pipelines, in one line.

    import fastdit
    p = fastdit.patch(pipe, "sta")      # sliding-tile attention on pipe.transformer
    video = pipe(prompt).frames
    p.remove()                          # everything restored

``fastdit.method_names()`` lists the methods; each has a config dataclass (``fastdit.STAConfig``, ...).
"""
from .import_guard import import_installed_kernels

import_installed_kernels()  # before diffusers is imported: the repository's kernels/ folder must not shadow it

from . import methods  # noqa: E402
from . import pipelines  # noqa: F401 - registers the model families' method defaults
from .context import AttentionContext
from .calibration.search import calibrate
from .train.noise import optimize_noise
from .functional import attention
from .layout import TokenLayout
from .methods import (BlockSparseConfig, DenseConfig, Method, MethodConfig, OptiPruneConfig, PruneConfig, RadialConfig,
                      SLAConfig, SpargeConfig,
                      STAConfig, SVG2Config, SVGConfig, ToDoConfig, ToMeConfig, VSAConfig, WindowConfig, method_names)
from .apply import patch
from .patching import AlreadyPatchedError, Patch
from .stats import PatchStats
from .plan import BlockPlan, run_plan

__version__ = "0.1.0"

__all__ = ["AlreadyPatchedError", "AttentionContext", "BlockPlan", "BlockSparseConfig", "DenseConfig", "Method",
           "MethodConfig", "OptiPruneConfig", "Patch", "PatchStats", "PruneConfig", "RadialConfig", "SLAConfig",
           "STAConfig", "SVG2Config", "SVGConfig", "SpargeConfig", "ToDoConfig", "ToMeConfig", "TokenLayout",
           "VSAConfig", "WindowConfig", "attention", "calibrate", "method_names", "methods", "optimize_noise", "patch",
           "run_plan"]
