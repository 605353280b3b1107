"""Hardening, second round (issue 31): plans only where they mean what they were calibrated for,
bounded state on bare transformers, a functional API that never silently drops keys or goes dense,
one rule for options beside a plan, and CLI details."""
import pytest
import torch

import fastdit
from fastdit.methods.base import OptionError

SPARSE_METHODS = [m for m in fastdit.method_names() if m != "dense"]


# -- item 3: the functional API runs sparse by default ------------------------------------------------
@pytest.mark.parametrize("method", SPARSE_METHODS)
def test_functional_attention_runs_sparse_by_default(method):
    layout = fastdit.TokenLayout((3, 8, 8))
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, layout.seq_len, 16) for _ in range(3))
    out, info = fastdit.attention(q, k, v, method, layout=layout, return_info=True)
    assert not info["dense"], f"{method} ran dense outside a pipeline (a pipeline default applied)"
    assert torch.isfinite(out).all()


def test_functional_attention_fraction_needs_num_steps():
    layout = fastdit.TokenLayout((3, 8, 8))
    q = torch.randn(1, 2, layout.seq_len, 16)
    with pytest.raises(OptionError, match="num_steps"):
        fastdit.attention(q, q, q, "sta", layout=layout, dense_steps=0.5)
    _, info = fastdit.attention(q, q, q, "sta", layout=layout, dense_steps=0.5, num_steps=4, step=1, return_info=True)
    assert info["dense"]
    _, info = fastdit.attention(q, q, q, "sta", layout=layout, dense_steps=0.5, num_steps=4, step=2, return_info=True)
    assert not info["dense"]
    _, info = fastdit.attention(q, q, q, "svg", layout=layout, dense_layers=1, layer=0, return_info=True)
    assert info["dense"]
