"""Test set-up: on a machine without CUDA, Triton kernels run in the interpreter.

TRITON_INTERPRET must be set before triton compiles (decorates) any kernel; fastdit imports its
Triton module lazily, so setting it here, before the tests import anything, is enough.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
