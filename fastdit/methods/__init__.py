"""Attention methods, one per file; ``fastdit.method_names()`` lists the registered names.

Every module of this package is imported below (``pkgutil``), so a new method file registers itself
(with ``@register_method``) and is offered wherever its capabilities say (``methods_with``) without
editing any list; the config classes imported by name here are the public ones of the built-in
methods (``fastdit.STAConfig`` and friends). docs/adding_a_method.md.
"""
import importlib
import pkgutil

from .base import (Method, MethodConfig, OptionError, get_method, method_names, methods_taking, methods_with, option,
                   register_method, runnable_method_names, tiny_presets, unregister_method)
from .block_sparse import BlockSparseConfig, BlockSparseMethod
from .dense import DenseConfig
from .prune import PruneConfig
from .radial import RadialConfig
from .sla import SLAConfig
from .sparge import SpargeConfig
from .sta import STAConfig
from .svg import SVGConfig
from .svg2 import SVG2Config
from .tokens import OptiPruneConfig, ToDoConfig, ToMeConfig
from .vsa import VSAConfig
from .window import WindowConfig

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
del _module

__all__ = ["BlockSparseConfig", "BlockSparseMethod", "DenseConfig", "Method", "MethodConfig", "OptionError",
           "OptiPruneConfig", "PruneConfig", "RadialConfig", "SLAConfig", "STAConfig", "SVG2Config", "SVGConfig",
           "SpargeConfig", "ToDoConfig", "ToMeConfig", "VSAConfig", "WindowConfig", "get_method", "method_names",
           "methods_taking", "methods_with", "option", "register_method", "runnable_method_names", "tiny_presets",
           "unregister_method"]
