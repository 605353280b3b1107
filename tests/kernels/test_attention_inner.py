"""The shared Triton helpers of the forward kernels (``kernels/triton_attention_inner.py``).

Every forward kernel builds its key-tile step and epilogue from the helpers (checked on the jitted
functions each kernel is made of, as the offline compile check sees them), no forward kernel module
spells the online-softmax or log-sum-exp math out again, and the helpers' numerics (fully masked
rows included) match a float64 reference. The numerics case runs on CUDA or under the Triton
interpreter (``TRITON_INTERPRET=1``), else it is skipped.
"""
from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

from fastdit.kernels import offline
from fastdit.kernels import triton_attention_inner as inner

from kernel_backends import DEVICE, TRITON_OK, TRITON_SKIP_REASON, seeded

KERNELS = Path(__file__).resolve().parents[2] / "kernels"
#: the forward kernels of the offline table and the modules that define them
FORWARD = ("fixed", "skip", "fixed_tma", "varlen", "quant", "quant_fp8", "quant_varlen")
FORWARD_MODULES = ("block_sparse_triton.py", "block_sparse_tma.py", "block_sparse_varlen_triton.py",
                   "quant/triton_fixed.py", "quant/triton_varlen.py")


@pytest.mark.parametrize("kernel", FORWARD)
def test_forward_kernel_is_built_from_the_shared_helpers(kernel):
    names = {fn.__name__ for fn in offline.dependencies(kernel)}
    shared = {"softmax_state", "online_softmax_step", "normalise_rows", "row_lse", "store_out", "store_lse"}
    if kernel in ("fixed", "skip", "varlen"):  # TMA: Q through its descriptor; quantised: INT8 Q
        shared.add("load_rows")
    if not kernel.startswith("quant"):  # the quantised kernels scale the output before the lse
        shared.add("attention_epilogue")
    assert shared <= names, f"{kernel} does not call the shared helpers {sorted(shared - names)}"
    assert kernel in offline.KERNELS


@pytest.mark.parametrize("module", FORWARD_MODULES)
def test_forward_modules_do_not_repeat_the_softmax_math(module):
    """exp2 / log2 (the update and the lse), the state's ``-inf`` start and the ``acc / l``
    normalisation live in the helpers only."""
    source = (KERNELS / module).read_text()
    patterns = (r"tl\.(math\.)?(exp2|log2|exp|log)\(", r"tl\.full\(\[BLOCK_M\], float\(\"-inf\"\)", r"acc / tl\.where")
    for pattern in patterns:
        assert not re.search(pattern, source), f"{module} repeats {pattern!r}: call triton_attention_inner"
    assert re.search(r"from \.+triton_attention_inner import", source), module


def _reference(s, v, valid):
    """float64 ``(out, lse)`` of log2-domain scores ``s`` (M x N), values ``v`` (N x D), key mask
    ``valid``: a row without a valid key gives 0 and ``-inf``."""
    nat = torch.where(valid, s.double() * math.log(2.0), float("-inf"))
    lse = torch.logsumexp(nat, dim=1)
    p = torch.where(valid, torch.exp(nat - lse[:, None].nan_to_num(neginf=0.0)), 0.0)
    return p @ v.double(), lse


if TRITON_OK:
    import triton
    import triton.language as tl

    @triton.jit
    def _two_tiles_kernel(S, V, Out, Lse, M: tl.constexpr, N: tl.constexpr, D: tl.constexpr,
                          MASKED: tl.constexpr):
        rows = tl.arange(0, M)
        cols = tl.arange(0, N)
        offs_d = tl.arange(0, D)
        m_i, l_i, acc = inner.softmax_state(M, D)
        for t in range(0, 2):
            s = tl.load(S + t * M * N + rows[:, None] * N + cols[None, :])
            v = tl.load(V + t * N * D + cols[:, None] * D + offs_d[None, :])
            acc, l_i, m_i = inner.online_softmax_step(acc, l_i, m_i, s, v, MASKED, True, False, False, False)
        out, lse = inner.attention_epilogue(acc, l_i, m_i)
        tl.store(Out + rows[:, None] * D + offs_d[None, :], out)
        tl.store(Lse + rows, lse)


@pytest.mark.skipif(not TRITON_OK, reason=TRITON_SKIP_REASON)
@pytest.mark.parametrize("masked", [True, False])
def test_online_softmax_step_and_epilogue_match_float64(masked):
    """Two key tiles folded into the running state: row 0 has no valid key in the first tile
    (the ``-inf`` guard), row 1 none at all (out 0, lse -inf, no NaN), the others a mix."""
    m = n = d = 16
    gen = seeded(41)
    s = torch.randn(2, m, n, generator=gen) * 3.0
    v = torch.randn(2, n, d, generator=gen)
    valid = torch.rand(2, m, n, generator=gen) > 0.3 if masked else torch.ones(2, m, n, dtype=torch.bool)
    if masked:
        valid[0, 0] = False
        valid[:, 1] = False
    scores = torch.where(valid, s, float("-inf"))
    out = torch.empty(m, d)
    lse = torch.empty(m)
    dev = [t.to(DEVICE).contiguous() for t in (scores, v, out, lse)]
    _two_tiles_kernel[(1,)](*dev, M=m, N=n, D=d, MASKED=masked)
    out, lse = dev[2].cpu(), dev[3].cpu()
    ref_out, ref_lse = _reference(torch.cat(list(s), 1), torch.cat(list(v), 0), torch.cat(list(valid), 1))
    assert not out.isnan().any() and not lse.isnan().any()
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)
    if masked:
        assert (out[1] == 0).all() and lse[1] == float("-inf")
