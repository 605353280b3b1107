"""fastdit.pipelines: per-family adapters for diffusers transformers and tiny built-in pipelines."""
from . import families  # noqa: F401 - registers the built-in families
from .adapters import (
    Adapter,
    UnsupportedModelError,
    adapters,
    find_adapter,
    register_adapter,
    supported_families,
    unregister_adapter,
)


def tiny(name, **overrides):
    """A runnable diffusers pipeline with random weights and no downloads (see ``tiny.py``)."""
    from .tiny import tiny as _tiny

    return _tiny(name, **overrides)


__all__ = ["Adapter", "UnsupportedModelError", "adapters", "find_adapter", "register_adapter",
           "supported_families", "tiny", "unregister_adapter"]
