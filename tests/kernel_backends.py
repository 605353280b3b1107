"""Which engine backends the kernel tests can run here, for ``@pytest.mark.parametrize("backend", BACKENDS)``.

The Triton backend runs on CUDA, or on the CPU under the Triton interpreter (``TRITON_INTERPRET=1``
set before triton is first imported; tests/conftest.py sets it on machines without CUDA); without
either it is skipped with the reason.
"""
import importlib

import pytest
import torch

import fastdit.kernels as fk

try:
    importlib.import_module("triton")
    HAS_TRITON = True
except Exception:  # pragma: no cover - platform without triton
    HAS_TRITON = False

ON_GPU = torch.cuda.is_available() and not fk.triton_interpreter_enabled()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
TRITON_OK = HAS_TRITON and (ON_GPU or fk.triton_interpreter_enabled())
TRITON_SKIP_REASON = (
    "Triton backend needs a CUDA GPU or the Triton CPU interpreter: run with TRITON_INTERPRET=1 set "
    "before pytest starts (e.g. `TRITON_INTERPRET=1 python -m pytest tests/kernels/test_kernel.py`)"
)

BACKENDS = [
    pytest.param("torch", id="torch"),
    pytest.param("triton", id="triton", marks=pytest.mark.skipif(not TRITON_OK, reason=TRITON_SKIP_REASON)),
]


def seeded(seed):
    """A CPU ``torch.Generator`` seeded with ``seed``."""
    return torch.Generator().manual_seed(seed)


def to_device(device, *tensors):
    """``tensors`` moved to ``device`` (anything that is not a tensor passes through)."""
    return [t.to(device) if isinstance(t, torch.Tensor) else t for t in tensors]
