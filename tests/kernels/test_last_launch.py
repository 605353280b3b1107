"""``block_sparse_triton.last_launch``: what the last forward launch ran (variant, how the tile was chosen,
tile), which benchmarks record per row. The first H200 run recorded the classic autotuner's memory
(``best_config``) for rows the TMA variant ran; this says what really launched."""
import pytest
import torch

from fastdit.kernels import block_sparse_attention
from fastdit.kernels import block_sparse_triton as bst

from kernel_backends import ON_GPU, TRITON_OK, TRITON_SKIP_REASON

pytestmark = [pytest.mark.skipif(not TRITON_OK, reason=TRITON_SKIP_REASON),
              pytest.mark.skipif(ON_GPU, reason="checks the interpreter's launches")]


def _call(**kw):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 200, 32, generator=g) for _ in range(3))
    idx = torch.arange(4, dtype=torch.int32).view(1, 1, 1, 4).expand(1, 1, 4, 4).contiguous()
    cnt = torch.full((1, 1, 4), 4, dtype=torch.int32)
    return block_sparse_attention(q, k, v, idx, cnt, 50, 50, backend="triton", **kw)


def test_each_variant_records_itself(monkeypatch):
    monkeypatch.delenv("FASTDIT_TRITON_VARIANT", raising=False)
    _call()
    first = bst.last_launch()
    assert first["variant"] == "cp_async" and first["how"] == "interpreter"
    assert first["tile"] == (bst._interpreter_block(50), bst._interpreter_block(50), 4, 1)
    _call(skip_threshold=3.0)
    assert bst.last_launch()["tile"][:2] == bst.skip_tile_sizes(50, 50, (64, 64))
    monkeypatch.setenv("FASTDIT_TRITON_VARIANT", "tma")
    _call()
    assert bst.last_launch()["variant"] == "tma"
    monkeypatch.setenv("FASTDIT_TRITON_VARIANT", "cp_async")
    _call()
    assert bst.last_launch()["variant"] == "cp_async"


def test_last_launch_is_a_copy():
    _call()
    got = bst.last_launch()
    got["variant"] = "changed"
    assert bst.last_launch()["variant"] != "changed"
