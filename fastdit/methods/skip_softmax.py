"""Skip-softmax: full attention whose negligible key tiles are skipped inside the kernel ("skip_softmax").

After BLASST / skip-softmax ("BLASST: Block-Level Adaptive Sparse Softmax Tiles", arXiv:2512.12087),
as NVIDIA ModelOpt (``nvidia-modelopt``, ``modelopt.torch.sparsity.attention_sparsity``) calibrates
and exports it for diffusers models. Every query block lists every key block (model token order, no
block is dropped in advance); inside the block-sparse engine a key sub-tile is skipped (no exp, no
P.V) when, for every row ``i`` of the row tile,

    max_{j in tile} s_ij  <  m_i + ln(lambda)        (s: scaled scores, natural log; m_i: running max)

i.e. its softmax weights are all below ``lambda`` times the running maximum's. This is the engine's
skip rule (``fastdit.kernels.block_sparse_attention``) with ``skip_threshold = -ln(lambda)``. The
threshold is either fixed (``skip_threshold``) or ModelOpt's calibrated one, which follows the key
length ``N_k`` of each call:

    scale_factor = a * exp(b * target_sparsity)      (a, b fitted by ModelOpt's calibration)
    lambda = scale_factor / N_k        skip_threshold = ln(N_k / scale_factor)

(``scale_factor``; a ``lambda >= 1``, i.e. ``N_k <= scale_factor``, is clamped to
``skip_threshold = 0``: skip every sub-tile that does not reach the running maximum, the most the
engine's rule expresses). ``fastdit.integrations.profiles`` reads ModelOpt's
``sparse_attention_config`` into these options and writes them back.

Granularity: fastdit's sub-tiles are 64 x 64 (rows x keys) and keys are walked in model order;
ModelOpt's PyTorch calibration path uses 128 x 128 blocks, its Triton kernel autotuned 16..128 x 32
tiles. Whether a tile is skipped depends on its size, so the same ``lambda`` gives similar, not
equal, sparsity. Nothing is dropped before the kernel, so there is no ``correction`` (only
``"none"``) and no ``quant`` (the quantised kernel has no skip rule).

Cost: a dense call's work minus the skipped sub-tiles' exp and P.V (their Q.K^T is computed).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fastdit.kernels import skip_subtiles_walked
from fastdit.plan import BlockPlan

from . import base as _base
from .base import OptionError, check_number, option, register_method
from .block_sparse import BlockSparseConfig, BlockSparseMethod


#: ModelOpt's static default (``SKIP_SOFTMAX_TRITON_DEFAULT``: ``lambda = 0.1``) in log units.
DEFAULT_THRESHOLD = math.log(10.0)


@dataclass
class SkipSoftmaxConfig(BlockSparseConfig):
    """Options of ``skip_softmax`` (see the module docstring); at most one of ``skip_threshold``
    and ``scale_factor`` is set; neither: ModelOpt's static default ``lambda = 0.1``
    (``skip_threshold = ln 10``).

    Attributes:
        scale_factor: ModelOpt's calibrated ``a * exp(b * target_sparsity)``; the threshold of a
            call with ``N_k`` keys is ``lambda = scale_factor / N_k``.
        block: tokens per plan block (every block is listed; the skip rule runs on 64 x 64
            sub-tiles inside them).
    """

    scale_factor: float | None = option(None, "ModelOpt's calibrated a*exp(b*target_sparsity): skip a key sub-tile "
                                        "whose weights are all below scale_factor/keys of the row maximum; empty: "
                                        "use skip_threshold", range=(0.0, None), widget="number")
    block: int = option(64, "tokens per plan block (all blocks are kept; the skip rule decides inside)",
                        range=(16, None), widget="number", advanced=True)

    def validate(self):
        super().validate()
        if self.scale_factor is not None:
            self.scale_factor = check_number("scale_factor", self.scale_factor, 0, low_open=True,
                                             note="ModelOpt's a * exp(b * target_sparsity); or None")
        if self.scale_factor is not None and self.skip_threshold is not None:
            raise OptionError("skip_softmax takes one of skip_threshold (log units below the row maximum) and "
                              f"scale_factor (ModelOpt's calibrated factor), not both; got skip_threshold="
                              f"{self.skip_threshold!r}, scale_factor={self.scale_factor!r}")
        if self.scale_factor is None and self.skip_threshold is None:
            self.skip_threshold = DEFAULT_THRESHOLD
        if self.correction != "none":
            raise OptionError(f"skip_softmax drops no key block in advance, so correction must be 'none', got "
                              f"{self.correction!r}")
        if isinstance(self.block, bool) or not isinstance(self.block, int) or self.block < 16:
            raise OptionError(f"block must be an int >= 16 (tokens per plan block), got {self.block!r}")


def threshold_for(config, keys):
    """The engine's ``skip_threshold`` (natural-log units) for a call with ``keys`` keys."""
    if config.skip_threshold is not None:
        return config.skip_threshold
    return max(0.0, math.log(keys / config.scale_factor))


@register_method
class SkipSoftmax(BlockSparseMethod):
    """Full attention plus the engine's skip rule at ModelOpt's (or a fixed) threshold."""

    guard_scores_widen = False  # the output is more than the plan's engine call (see guard/widen.py)

    name = "skip_softmax"
    config_cls = SkipSoftmaxConfig
    default_options = {"dense_steps": 0, "dense_layers": 0}
    #: Runs from ModelOpt profiles (``fastdit.integrations.profiles``) or by name; not in fastdit's method lists yet.
    listed = False
    rank = 90

    @classmethod
    def candidates(cls, layout):
        """``fastdit.calibrate``'s default thresholds: lambda from 0.1 down to e^-8."""
        return [{"skip_threshold": t} for t in (DEFAULT_THRESHOLD, 3.0, 4.0, 6.0, 8.0)]

    def prepare(self, layout, heads, device):
        block, seq = self.config.block, layout.seq_len
        blocks = -(-seq // block)
        indices = torch.arange(blocks, dtype=torch.int32, device=device).expand(1, 1, blocks, blocks).contiguous()
        counts = torch.full((1, 1, blocks), blocks, dtype=torch.int32, device=device)
        return BlockPlan(kv_indices=indices, kv_counts=counts, block_m=block, block_n=block, seq_len=seq,
                         name=f"skip_softmax_b{block}")

    def attend(self, ctx, q, k, v):
        plan = self.select(ctx, q, k)
        threshold = threshold_for(self.config, k.shape[-2])
        ctx.record(plan=plan)
        out, lse, skipped = _base.run_plan(q, k, v, plan, key_mask=ctx.key_mask, query_mask=ctx.query_mask,
                                           scale=ctx.scale, backend=ctx.backend, return_lse=True,
                                           skip_threshold=threshold, return_skipped=True)
        ctx.info["lse"] = lse
        ctx.info["skip_threshold"] = threshold
        ctx.info["skipped_subtiles"] = skipped
        ctx.info["walked_subtiles"] = skip_subtiles_walked(plan.kv_counts, plan.kernel_len, plan.block_m,
                                                           plan.block_n)
        return self.finalize(ctx, out, lse)
