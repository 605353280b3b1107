"""The block plan: what every method produces and the engine consumes.

A plan says, per (batch, head, query block), which key blocks are computed (``kv_indices`` /
``kv_counts``, the contract of ``fastdit.kernels.block_sparse_attention``), together with an
optional token permutation into the kernel's order (e.g. tile order for sliding-tile attention)
and a static key-validity vector for padding slots. ``run_plan`` applies it to a model-order
attention call: permute, run the kernel, un-permute and drop padding.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

import torch

from fastdit.kernels import (block_sparse_attention, block_sparse_attention_varlen, plan_to_token_mask,
                             validate_varlen_plan)


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
        dynamic: True for plans chosen per call from q and k.
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
    #: chosen per call from q / k (its density is read on the device, never cached)
    dynamic: bool = False

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

    @property
    def num_kv_blocks(self):
        return -(-self.kernel_len // self.block_n)

    def block_density_tensor(self):
        """Computed / total (query block, key block) pairs per (batch, head): float32 ``(1|B, 1|H)``
        on the plan's device (no host synchronisation; dynamic plans report through this)."""
        total = self.kv_counts.shape[-1] * self.num_kv_blocks
        return self.kv_counts.float().sum(-1) / total

    @functools.cached_property
    def density(self):
        """Fraction of (query block, key block) pairs computed, averaged over heads (computed once:
        a plan never changes, and reading its counts from a GPU would sync every call)."""
        return float(self.block_density_tensor().double().mean())

    def pair_counts(self):
        """Query-key score computations this plan performs per (batch, head), counting real tokens
        only (padding slots excluded): float64 ``(1|B, 1|H)`` on the plan's device.

        A computed block pair ``(m, j)`` contributes ``real_rows(m) * real_cols(j)``; dense
        attention over the call would be ``seq_len ** 2``.
        """
        length = self.kernel_len
        device = self.kv_counts.device
        valid = (self.perm >= 0) if self.perm is not None else torch.ones(length, dtype=torch.bool, device=device)

        def per_block(size):
            n = -(-length // size)
            padded = torch.zeros(n * size, dtype=torch.float64, device=device)
            padded[:length] = valid.to(torch.float64)
            return padded.view(n, size).sum(1)

        rows, cols = per_block(self.block_m), per_block(self.block_n)
        width = self.kv_indices.shape[-1]
        used = torch.arange(width, device=device) < self.kv_counts[..., None]
        key_cols = cols[self.kv_indices.long().clamp(0, cols.numel() - 1)] * used
        return (key_cols.sum(-1) * rows).sum(-1)

    def validate(self):
        """Raise ValueError when the plan breaks the engine's contract (indices, counts, sizes)."""
        from fastdit.kernels import validate_plan

        query_blocks = -(-self.kernel_len // self.block_m)
        problems = validate_plan(self.kv_indices, self.kv_counts, self.num_kv_blocks, query_blocks)
        if problems:
            raise ValueError(f"invalid block plan {self.name!r}: " + "; ".join(problems))
        return self

    def select_heads(self, offset, count):
        """This plan for heads ``offset .. offset + count`` of the layer (context parallelism
        splits heads across ranks); a plan shared by all heads is returned as it is."""
        if self.kv_indices.shape[1] == 1:
            return self
        if offset + count > self.kv_indices.shape[1]:
            raise ValueError(f"heads {offset}..{offset + count - 1} are outside the plan's "
                             f"{self.kv_indices.shape[1]} heads")
        return dataclasses.replace(
            self, kv_indices=self.kv_indices[:, offset:offset + count],
            kv_counts=self.kv_counts[:, offset:offset + count],
            name=f"{self.name}_h{offset}-{offset + count - 1}",
        )

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


def run_plan(q, k, v, plan, key_mask=None, scale=None, backend="auto", query_mask=None, return_lse=False,
             skip_threshold=None, skip_tile=(64, 64), return_skipped=False, quant=None):
    """Attention of model-order ``q, k, v`` ``(B, H, S, D)`` under ``plan``; returns ``(B, H, S, D)``
    (and, with ``return_lse``, the log-sum-exp ``(B, H, S)`` float32 in model order; with
    ``return_skipped``, last, the int32 ``(B, H)`` count of key sub-tiles the skip rule skipped).

    Tokens are permuted into kernel order (padding slots read token 0 and are masked as keys;
    their query rows are dropped on the way back), the engine runs, and the output is returned in
    model order. ``key_mask`` ``(B, S)``: False keys are never attended; ``query_mask`` ``(B, S)``:
    False query rows are 0 (fully masked rows, as the model's own attention gives them).
    ``skip_threshold`` / ``skip_tile``: the engine's in-kernel skip rule (see
    ``fastdit.kernels.block_sparse_attention``), applied in kernel order; None: off.
    ``quant``: the engine's quantisation mode (None, ``"int8"``, ``"int8-fp8"``).
    """
    if getattr(plan, "run", None) is not None:  # a plan with its own kernel order per head (svg's HeadOrderPlan)
        return plan.run(q, k, v, key_mask=key_mask, scale=scale, backend=backend, query_mask=query_mask,
                        return_lse=return_lse, skip_threshold=skip_threshold, skip_tile=skip_tile,
                        return_skipped=return_skipped, quant=quant)
    if plan.perm is not None:
        index = plan.gather_index
        q, k, v = (t.index_select(2, index) for t in (q, k, v))
    out, lse, *skipped = block_sparse_attention(
        q, k, v, plan.kv_indices, plan.kv_counts, plan.block_m, plan.block_n,
        scale=scale, kv_valid=plan.kernel_kv_valid(key_mask), return_lse=True, backend=backend,
        validate=False,  # methods' plans are validated when built (Method.prepared); FASTDIT_DEBUG=1 checks every call
        skip_threshold=skip_threshold, skip_tile=skip_tile, return_skipped=return_skipped, quant=quant,
    )
    if plan.inverse is not None:
        out = out.index_select(2, plan.inverse)
        lse = lse.index_select(2, plan.inverse)
    if query_mask is not None:
        out = out * query_mask.to(device=out.device, dtype=out.dtype)[:, None, :, None]
        lse = lse.masked_fill(~query_mask.to(device=lse.device, dtype=torch.bool)[:, None, :], float("-inf"))
    result = (out, lse) if return_lse else (out,)
    result = result + tuple(skipped)
    return result if len(result) > 1 else out


#: Query / key block of the dense-over-keys plans on GPUs: a fixed size, so that the Triton
#: autotuner (keyed by the block sizes) tunes once, whatever the number of kept rows.
ENGINE_BLOCK = 128


def dense_plan(n_q, n_k, device, single_block=None):
    """Every query attending every key. On the CPU one block pair of all rows and all keys (the CPU
    engine then runs a single fused attention call instead of a loop over query blocks); elsewhere
    ``ENGINE_BLOCK`` blocks, each query block listing every key block. ``single_block``: force one
    layout or the other (None: by the device, as above)."""
    if single_block is None:
        single_block = torch.device(device).type == "cpu"
    return _dense_plan(n_q, n_k, device, bool(single_block))


@functools.lru_cache(maxsize=64)
def _dense_plan(n_q, n_k, device, single_block):
    if single_block:
        block_m, block_n = max(n_q, 1), max(n_k, 1)
    else:
        block_m = block_n = ENGINE_BLOCK
    n_qb, n_kb = -(-n_q // block_m), -(-n_k // block_n)
    indices = torch.arange(n_kb, dtype=torch.int32, device=device).expand(1, 1, n_qb, n_kb).contiguous()
    counts = torch.full((1, 1, n_qb), n_kb, dtype=torch.int32, device=device)
    return BlockPlan(kv_indices=indices, kv_counts=counts, block_m=block_m, block_n=block_n, seq_len=n_q,
                     name="dense_over_keys", info={"dense": True})


# -- variable-size (cluster) blocks: svg2's plans ------------------------------------------------

@dataclass
class ClusterPlan(BlockPlan):
    """A ``BlockPlan`` of variable-size blocks, two permutations per (batch, head).

    ``q_order`` / ``k_order`` ``(B, H, S)``: model token at each kernel query / key position;
    ``q_inverse`` their inverse; ``q_offsets`` ``(B, H, Mq + 1)`` and ``k_offsets`` ``(B, H, Mk + 1)``
    int32 block boundaries; ``q_blocks`` / ``k_blocks`` ``(B, H, S)`` each model token's block.
    ``kv_indices`` ``(B, H, Mq, Mk)`` / ``kv_counts`` ``(B, H, Mq)`` index key blocks (not tokens);
    ``block_m = block_n = 1`` carry no meaning here.
    """

    q_order: torch.Tensor | None = None
    q_inverse: torch.Tensor | None = None
    k_order: torch.Tensor | None = None
    q_offsets: torch.Tensor | None = None
    k_offsets: torch.Tensor | None = None
    q_blocks: torch.Tensor | None = None
    k_blocks: torch.Tensor | None = None

    @property
    def num_kv_blocks(self):
        return self.k_offsets.shape[-1] - 1

    def select_heads(self, offset, count):
        raise NotImplementedError("a per-call svg2 plan covers exactly the heads of its call")

    def pair_counts(self):
        """Computed query-key pairs per (batch, head): float64 ``(B, H)`` (text included)."""
        q_sizes = self.q_offsets.diff(dim=-1).double()
        k_sizes = self.k_offsets.diff(dim=-1).double()
        width = self.kv_indices.shape[-1]
        used = torch.arange(width, device=self.kv_counts.device) < self.kv_counts[..., None]
        keys = torch.gather(k_sizes[..., None, :].expand(*self.kv_indices.shape[:-1], k_sizes.shape[-1]), -1,
                            self.kv_indices.long()) * used
        return (keys.sum(-1) * q_sizes).sum(-1)

    def block_density_tensor(self):
        """Token-pair density per (batch, head): computed pairs / ``S^2``, float32 ``(B, H)``."""
        return (self.pair_counts() / float(self.seq_len) ** 2).float()

    def kept_pairs(self):
        """Bool ``(B, H, Mq, Mk)``: True where the block pair is computed."""
        mq, mk = self.kv_counts.shape[-1], self.num_kv_blocks
        used = torch.arange(self.kv_indices.shape[-1], device=self.kv_counts.device) < self.kv_counts[..., None]
        index = torch.where(used, self.kv_indices.long(), mk)
        kept = torch.zeros(*self.kv_counts.shape[:2], mq, mk + 1, dtype=torch.bool, device=index.device)
        return kept.scatter_(-1, index, True)[..., :mk]

    def token_blocks(self, batch, heads, seq):
        """For ``correction="pooled"``: each token's query and key cluster (text: the text block),
        the dropped cluster pairs and the number of key blocks (see ``corrections.token_blocks``)."""
        return self.q_blocks, self.k_blocks, ~self.kept_pairs(), self.num_kv_blocks

    def token_mask(self, head=0, key_mask=None, batch=0):
        """The ``(S, S)`` mask of one (batch, head), in model token order (small sizes only)."""
        kept = self.kept_pairs()[batch, head]
        mask = kept[self.q_blocks[batch, head]][:, self.k_blocks[batch, head]]
        if key_mask is not None:
            mask = mask & key_mask[batch].to(torch.bool)[None, :]
        return mask

    def validate(self):
        problems = validate_varlen_plan(self.q_offsets, self.k_offsets, self.kv_indices, self.kv_counts,
                                        self.seq_len, self.seq_len)
        if problems:
            raise ValueError(f"invalid svg2 plan {self.name!r}: " + "; ".join(problems))
        return self

    def run(self, q, k, v, key_mask=None, scale=None, backend="auto", query_mask=None, return_lse=False,
            skip_threshold=None, skip_tile=(64, 64), return_skipped=False, quant=None):
        """``fastdit.run_plan`` of this plan (same arguments and results; no skip rule)."""
        if skip_threshold is not None:
            raise ValueError("svg2 plans run on the variable-size engine, which has no skip rule: "
                             "skip_threshold must be None")
        out, lse = run_cluster_plan(q, k, v, self, key_mask=key_mask, query_mask=query_mask, scale=scale,
                                    backend=backend, quant=quant)
        result = (out, lse) if return_lse else (out,)
        if return_skipped:
            result = result + (torch.zeros(q.shape[:2], dtype=torch.int32, device=q.device),)
        return result if len(result) > 1 else out


def run_cluster_plan(q, k, v, plan, key_mask=None, query_mask=None, scale=None, backend="auto", quant=None):
    """Attention of model-order ``(B, H, S, D)`` tensors under a ``ClusterPlan``: one engine call
    for all heads; returns ``(out, lse)`` in model order."""
    batch, heads, seq, dim = q.shape
    groups = batch * heads
    base = (torch.arange(groups, device=q.device) * seq).view(batch, heads, 1)
    # one index_select per tensor over the (B*H*S, D) rows (a per-head gather)
    q_rows = (plan.q_order + base).reshape(-1)
    k_rows = (plan.k_order + base).reshape(-1)
    q_k = q.reshape(groups * seq, dim).index_select(0, q_rows).view(groups, 1, seq, dim)
    k_k, v_k = (t.reshape(groups * seq, dim).index_select(0, k_rows).view(groups, 1, seq, dim) for t in (k, v))
    valid = None
    if key_mask is not None:
        keys = key_mask.to(device=q.device, dtype=torch.bool)[:, None, :].expand(batch, heads, seq)
        valid = torch.gather(keys, 2, plan.k_order).reshape(groups, seq)
    mq, width = plan.kv_indices.shape[-2:]
    out, lse = block_sparse_attention_varlen(
        q_k, k_k, v_k, plan.q_offsets.reshape(groups, 1, -1), plan.k_offsets.reshape(groups, 1, -1),
        plan.kv_indices.reshape(groups, 1, mq, width), plan.kv_counts.reshape(groups, 1, mq), scale=scale,
        kv_valid=valid, return_lse=True, backend=backend, validate=False, quant=quant)  # plan valid by construction
    back = (plan.q_inverse + base).reshape(-1)
    out = out.reshape(groups * seq, dim).index_select(0, back).view(batch, heads, seq, dim)
    lse = lse.reshape(-1).index_select(0, back).view(batch, heads, seq)
    if query_mask is not None:
        out = out * query_mask.to(device=out.device, dtype=out.dtype)[:, None, :, None]
        lse = lse.masked_fill(~query_mask.to(device=lse.device, dtype=torch.bool)[:, None, :], float("-inf"))
    return out, lse
