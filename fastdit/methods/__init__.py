"""Attention methods, one per file. ``fastdit.methods()`` lists their names.

This package is also callable: ``fastdit.methods()`` returns the registered method names, while
``fastdit.methods.sta`` and friends stay importable as modules.
"""
import sys
import types

from .base import Method, MethodConfig, get_method, method_names, register_method
from .dense import DenseConfig
from .radial import RadialConfig
from .sta import STAConfig

__all__ = ["DenseConfig", "Method", "MethodConfig", "RadialConfig", "STAConfig", "get_method", "method_names", "register_method"]


class _CallableModule(types.ModuleType):
    def __call__(self):
        """Names of the available attention methods."""
        return method_names()


sys.modules[__name__].__class__ = _CallableModule
