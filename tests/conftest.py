"""Test set-up: on a machine without CUDA, Triton kernels run in the interpreter.

TRITON_INTERPRET must be set before triton compiles (decorates) any kernel; fastdit imports its
Triton module lazily, so setting it here, before the tests import anything, is enough.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "guard_defaults: run with the methods' own quality-guard defaults")


@pytest.fixture(autouse=True)
def _methods_without_their_default_guard(request, monkeypatch):
    """The method tests check each method's own output against its mask rule, so the quality guard
    (on by default for the dynamic and token methods, which re-runs failing heads dense) is off by
    default here; tests marked ``guard_defaults`` (tests/test_guard.py, the pipeline-level guard
    tests) run with the shipped defaults, and any test may pass ``guard=`` itself."""
    if request.node.get_closest_marker("guard_defaults"):
        yield
        return
    from fastdit.methods import base

    for cls in list(base._REGISTRY.values()):
        monkeypatch.setattr(cls, "guard_default", False)
    yield
