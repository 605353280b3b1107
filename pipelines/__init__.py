"""fastdit.pipelines: per-family adapters for diffusers transformers and tiny built-in pipelines
(``fastdit.pipelines.tiny.tiny(name)``)."""
from . import families  # noqa: F401 - registers the built-in families
from .adapters import (
    Adapter,
    UnsupportedModelError,
    find_adapter,
    register_adapter,
    registered_adapters,
    supported_families,
    unregister_adapter,
)

__all__ = ["Adapter", "UnsupportedModelError", "find_adapter", "register_adapter", "registered_adapters",
           "supported_families", "unregister_adapter"]
