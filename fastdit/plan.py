"""The block plan: what every method produces and the engine consumes.

A plan says, per (batch, head, query block), which key blocks are computed (``kv_indices`` /
``kv_counts``, the contract of ``fastdit.kernels.block_sparse_attention``), together with an
optional token permutation into the kernel's order (e.g. tile order for sliding-tile attention)
and a static key-validity vector for padding slots. ``run_plan`` applies it to a model-order
attention call: permute, run the kernel, un-permute and drop padding.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from fastdit.kernels import block_sparse_attention, plan_to_token_mask


@dataclass
class BlockPlan:
    """A block-sparse attention plan in kernel order.

    Attributes:
        kv_indices: int32 ``(1|B, 1|H, n_blocks, max_blocks)``.
        kv_counts: int32 ``(1|B, 1|H, n_blocks)``.
        block_m, block_n: query / key block sizes (the kernel sequence is cut into these).
        seq_len: model sequence length S (tokens of the attention call).
        perm: long ``(L,)`` or None: model token index at each kernel position, -1 for a padding
            slot. None means kernel order == model order (L == S).
        kv_valid: bool ``(1, L)`` or None: False for padding slots (never attended as keys).
        padding_fraction: padding slots / real tokens.
        name: a readable name including the parameters, e.g. ``sta_t6x8x8_w3x3x3``.
        info: free-form numbers for reports (tile, window, ...).
    """

    kv_indices: torch.Tensor
    kv_counts: torch.Tensor
    block_m: int
    block_n: int
    seq_len: int
    perm: torch.Tensor | None = None
    kv_valid: torch.Tensor | None = None
    padding_fraction: float = 0.0
    name: str = ""
    info: dict = field(default_factory=dict)

    def __post_init__(self):
        self.inverse = None
        if self.perm is not None:
            # Kernel position of each model token (every model token appears exactly once).
            real = (self.perm >= 0).nonzero().squeeze(1)
            inverse = torch.empty(self.seq_len, dtype=torch.long, device=self.perm.device)
            inverse[self.perm[real]] = real
            self.inverse = inverse
            self.gather_index = self.perm.clamp(min=0)

    @property
    def kernel_len(self):
        return self.seq_len if self.perm is None else int(self.perm.numel())

    @functools.cached_property
    def density(self):
        """Fraction of (query block, key block) pairs computed, averaged over heads (computed once:
        a plan never changes, and reading its counts from a GPU would sync every call)."""
        n_kblocks = -(-self.kernel_len // self.block_n)
        total = self.kv_counts.shape[-1] * n_kblocks
        return float(self.kv_counts.double().mean() * self.kv_counts.shape[-1] / total)

    def kernel_kv_valid(self, key_mask=None):
        """Key validity in kernel order: static padding & the model's key mask ``(B, S)``."""
        if key_mask is None:
            return self.kv_valid
        key_mask = key_mask.to(torch.bool)
        if self.perm is not None:
            key_mask = key_mask[:, self.gather_index]
        return key_mask if self.kv_valid is None else key_mask & self.kv_valid

    def token_mask(self, head=0, key_mask=None):
        """The ``(S, S)`` boolean mask this plan computes for one head, in model token order.

        For tests and pictures at small sizes (it is S^2 booleans). ``key_mask`` ``(B, S)``: the
        first batch element's key validity is applied.
        """
        idx = self.kv_indices[:1, min(head, self.kv_indices.shape[1] - 1)][:, None]
        cnt = self.kv_counts[:1, min(head, self.kv_counts.shape[1] - 1)][:, None]
        valid = self.kernel_kv_valid(None if key_mask is None else key_mask[:1])
        mask = plan_to_token_mask(idx, cnt, self.kernel_len, self.kernel_len, self.block_m, self.block_n, valid)[0, 0]
        if self.inverse is not None:
            mask = mask[self.inverse][:, self.inverse]
        return mask


def run_plan(q, k, v, plan, key_mask=None, scale=None, backend="auto", query_mask=None):
    """Attention of model-order ``q, k, v`` ``(B, H, S, D)`` under ``plan``; returns ``(B, H, S, D)``.

    Tokens are permuted into kernel order (padding slots read token 0 and are masked as keys;
    their query rows are dropped on the way back), the engine runs, and the output is returned in
    model order. ``key_mask`` ``(B, S)``: False keys are never attended; ``query_mask`` ``(B, S)``:
    False query rows are 0 (fully masked rows, as the model's own attention gives them).
    """
    if plan.perm is not None:
        index = plan.gather_index
        q, k, v = (t.index_select(2, index) for t in (q, k, v))
    out = block_sparse_attention(
        q, k, v, plan.kv_indices, plan.kv_counts, plan.block_m, plan.block_n,
        scale=scale, kv_valid=plan.kernel_kv_valid(key_mask), return_lse=False, backend=backend,
    )
    if plan.inverse is not None:
        out = out.index_select(2, plan.inverse)
    if query_mask is not None:
        out = out * query_mask.to(device=out.device, dtype=out.dtype)[:, None, :, None]
    return out
