"""Keep the repository's ``kernels/`` folder from shadowing the installed top-level ``kernels`` package.

fastdit's Triton kernels live in the repository's ``kernels/`` folder, installed as ``fastdit.kernels``.
Python run from the repository root (``python -m pytest``, ``python -m fastdit.cli ...``, ``python -c``)
puts the root on ``sys.path`` first, so a bare ``import kernels`` finds that folder. Hugging Face's
``kernels`` package (its kernel hub; transformers 5 requires it) is imported by diffusers whenever it is
installed (``diffusers.loaders.peft`` asks ``kernels`` for ``CUDAProperties``), and failed with
"cannot import name 'CUDAProperties' from 'kernels' (.../kernels/__init__.py)" before any model loaded.

:func:`import_installed_kernels` imports the installed package first, with the repository root off the
path for that one import, so ``sys.modules["kernels"]`` is the real one for everyone after. Nothing is
done where no package of that name is installed or where the folder does not shadow it.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import sys

#: the repository root of an editable install (the folder holding ``fastdit/`` and ``kernels/``)
REPOSITORY_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _is_repository_root(entry):
    """Whether the ``sys.path`` entry (``""`` is the working folder) names the repository root."""
    return os.path.abspath(entry or os.getcwd()) == REPOSITORY_ROOT


def import_installed_kernels():
    """Import the installed top-level ``kernels`` package if the repository's ``kernels/`` folder would
    shadow it; returns the module imported, else None (nothing shadowed, already imported, or not installed)."""
    folder = os.path.join(REPOSITORY_ROOT, "kernels")
    bound = sys.modules.get("kernels")
    if bound is not None:
        if os.path.dirname(os.path.abspath(getattr(bound, "__file__", None) or "")) != folder:
            return None  # already the installed package (or another): nothing to do
        # the folder was bound first (transformers probes the name); it is inert there, exports nothing
        # anyone could hold, so it gives way to the installed package below
    try:
        importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        return None  # not installed: diffusers does not look for it either
    if bound is None:
        try:
            spec = importlib.util.find_spec("kernels")
        except (ImportError, ValueError):
            return None
        if spec is None or not spec.origin or os.path.dirname(os.path.abspath(spec.origin)) != folder:
            return None  # the name is not the repository's folder here: nothing to guard against
    else:
        del sys.modules["kernels"]
    saved = list(sys.path)
    sys.path[:] = [entry for entry in saved if not _is_repository_root(entry)]
    try:
        import kernels  # noqa: F401 - the installed package, now first in sys.modules
    except ImportError:
        sys.modules.pop("kernels", None)
        return None
    finally:
        sys.path[:] = saved
    module = sys.modules.get("kernels")
    origin = getattr(module, "__file__", None)
    if module is not None and (not origin or os.path.dirname(os.path.abspath(origin)) == folder):
        del sys.modules["kernels"]  # the folder again, or a namespace folder: leave the name unbound
        return None
    return module
