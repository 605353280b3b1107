"""Test set-up: on a machine without CUDA, Triton kernels run in the interpreter.

TRITON_INTERPRET must be set before triton compiles (decorates) any kernel; fastdit imports its
Triton module lazily, so setting it here, before the tests import anything, is enough.

The test files sit in sub-folders by subject (tests/kernels/, tests/methods/, ...), while the helper
modules they import by bare name (helpers, tiny_transformers, tiny_models, model_matrix, cp_worker,
layer_capture, kernel_backends, app_harness, comfyui_models) stay here in tests/. pytest runs in its
default ``prepend`` import mode (no ``--import-mode`` in pyproject.toml) and there is no
``__init__.py`` under tests/, so pytest puts each test file's own folder on ``sys.path`` (tests/
itself only as a side effect of importing this file, which another import mode would not do);
tests/ is put there explicitly below, before any test module is collected, so ``from helpers
import ...`` works from every sub-folder (and in the spawned gloo workers, which inherit
``sys.path``). Test file basenames stay unique across the sub-folders, as that import mode needs.
"""
import os
import sys

import torch

TESTS = os.path.dirname(os.path.abspath(__file__))
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

# python -m pytest runs from the repository root, whose kernels/ folder would shadow the installed `kernels`
# package that diffusers imports (fastdit.import_guard); importing fastdit imports the real one first
import fastdit  # noqa: E402,F401


def pytest_configure(config):
    config.addinivalue_line("markers", "guard_defaults: run with the methods' own quality-guard defaults")


@pytest.fixture(autouse=True)
def _methods_without_their_default_guard(request, monkeypatch):
    """The method tests check each method's own output against its mask rule, so the quality guard
    (on by default for the dynamic and token methods, which re-runs failing heads dense) is off by
    default here; tests marked ``guard_defaults`` (tests/methods/test_guard.py, the pipeline-level guard
    tests) run with the shipped defaults, and any test may pass ``guard=`` itself."""
    if request.node.get_closest_marker("guard_defaults"):
        yield
        return
    from fastdit.methods import base

    for cls in list(base._REGISTRY.values()):
        monkeypatch.setattr(cls, "guard_default", False)
    yield


@pytest.fixture
def no_model(monkeypatch):
    """Fail the test if a pipeline is loaded or built (the CLI tests: bad arguments are refused before any
    model loads)."""
    import fastdit.pipelines.loading as loading
    import fastdit.pipelines.tiny as tiny
    from fastdit.eval.runner import generation

    def fail(*args, **kwargs):
        pytest.fail("a model was loaded despite the bad arguments")

    monkeypatch.setattr(loading, "load_pipeline", fail)
    monkeypatch.setattr(tiny, "tiny", fail)
    monkeypatch.setattr(generation, "load_pipe", fail)
