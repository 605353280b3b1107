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


def _in_kernels_folder(path):
    """Whether the module file ``path`` (None for a namespace folder) is not a real package outside the
    repository's ``kernels/`` folder: the folder's own ``__init__.py``, or no file at all."""
    return not path or os.path.dirname(os.path.abspath(path)) == os.path.join(REPOSITORY_ROOT, "kernels")


def import_installed_kernels():
    """Import the installed top-level ``kernels`` package if the repository's ``kernels/`` folder would
    shadow it, or was bound to the name already (transformers probes it; the folder is inert there and
    exports nothing anyone could hold); returns the module imported, else None (nothing shadowed, the
    installed package already imported, or none installed)."""
    bound = sys.modules.get("kernels")
    if bound is not None:
        if not _in_kernels_folder(getattr(bound, "__file__", None)):
            return None  # already the installed package (or another): nothing to do
    else:
        try:
            spec = importlib.util.find_spec("kernels")
        except (ImportError, ValueError):
            return None
        if spec is None or not spec.origin or not _in_kernels_folder(spec.origin):
            return None  # the name is not the repository's folder here: nothing to guard against
    try:  # only now the metadata scan: most imports of fastdit stop above
        importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        return None  # not installed: diffusers does not look for it either
    sys.modules.pop("kernels", None)
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
    if module is not None and _in_kernels_folder(getattr(module, "__file__", None)):
        del sys.modules["kernels"]  # the folder again, or a namespace folder: leave the name unbound
        return None
    return module
