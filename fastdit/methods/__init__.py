"""Attention methods, one per file; ``fastdit.method_names()`` lists the registered names."""
from .base import Method, MethodConfig, OptionError, get_method, method_names, option, register_method
from .dense import DenseConfig
from .radial import RadialConfig
from .sta import STAConfig

__all__ = ["DenseConfig", "Method", "MethodConfig", "OptionError", "RadialConfig", "STAConfig", "get_method",
           "method_names", "option", "register_method"]
