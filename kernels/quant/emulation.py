"""PyTorch emulation of quantised block-sparse attention: the reference semantics of ``quant``.

For ``(B, H)`` with query rows ``i`` in query block ``a(i)`` and keys ``j`` in key block ``b(j)``
(fixed-size plans: ``a(i) = i // block_m``, ``b(j) = j // block_n``; variable-size plans: the
blocks of the offsets), in float32 unless said otherwise:

    mu        = mean_j k_j                                    (per batch, head, channel; smoothing)
    k~_j      = k_j - mu                                      (leaves every softmax row unchanged)
    sq_a      = max_{i in a} |q_i|_inf / 127,   sk_b = max_{j in b} |k~_j|_inf / 127   (1 if 0)
    q8_i      = clamp(rne(q_i / sq_a(i)), -127, 127),  k8_j likewise with sk_b(j)   (int8 values)
    s_ij      = float(q8_i . k8_j) * (sq_a(i) * sk_b(j)) * scale     (int32 dot: exact)
    p_ij      = exp(s_ij - max_j s_ij)         over the attended keys of row i
    out_i     = (sum_j half(p_ij) v_j) / sum_j p_ij                  ("int8": P, V in q's half dtype)
    lse_i     = max_j s_ij + log sum_j p_ij + scale * (q_i . mu)

Non-finite inputs (the unquantised engine's rows, not the whole head): ``mu`` is the mean over the
finite entries of each channel where the plain mean is not finite; a key with a non-finite entry is
quantised as 0 and its block's scale ``sk_b`` is NaN, so exactly the rows that attend that block
come out NaN (the unquantised engine's rows; it may return them finite but wrong); a non-finite
value ``v_jc`` is NaN in channel ``c`` of exactly the rows that attend its block (as the engine's
``P.V`` over the block gives). The FP8 scale ``sv_c`` is the maximum over finite values.

``rne`` rounds to the nearest integer, ties to even. The last term of ``lse`` undoes the smoothing:
``lse`` is the exact log-sum-exp of the quantised scores of the *unsmoothed* keys
(``s_ij + scale q_i . mu``), so partial results merge exactly (corrections, ring attention).

``"int8-fp8"`` (after SageAttention 2): V is scaled per (batch, head, channel) to the e4m3 range,
``sv_c = max_j |v_jc| / 448``, ``v8 = e4m3(v / sv)``, P is stored as ``e4m3(448 * p)``, and
``out_i = sv * (sum_j e4m3(448 p_ij) v8_j) / (448 sum_j p_ij)``.

The rows of a chunk are computed against all keys with a block mask, so memory is
``O(rows x Nk)`` per chunk and time ``O(N x Nk)``: an emulation for tests and accuracy
measurement, not a fast CPU path.
"""
from __future__ import annotations

import torch

QMAX = 127.0
FP8_MAX = 448.0  # largest finite float8 e4m3 (the "fn" variant, what tl.float8e4nv is)


def key_mean(k):
    """float32 ``(B, H, 1, D)``: the mean of ``k`` over the sequence, or, in a channel where that is
    not finite (an inf or NaN key), the mean of its finite entries (no host synchronisation)."""
    if not k.shape[2]:
        return torch.zeros_like(k[:, :, :1], dtype=torch.float32)
    mu = k.mean(dim=2, keepdim=True, dtype=torch.float32)
    finite = torch.isfinite(k)
    finite_mu = (torch.where(finite, k, torch.zeros_like(k)).sum(dim=2, keepdim=True, dtype=torch.float32)
                 / finite.sum(dim=2, keepdim=True).clamp_(min=1))
    return torch.where(torch.isfinite(mu), mu, finite_mu)


def nonfinite_keys(k):
    """``(k_clean, bad)``: ``k`` with every key that has a non-finite entry set to 0, and bool
    ``(B, H, Nk)`` marking those keys."""
    bad = ~torch.isfinite(k).all(-1)
    return k.masked_fill(bad.unsqueeze(-1), 0), bad


def poison_scales(scales, bad, blocks):
    """``scales`` ``(B, H, M)`` with NaN for every block holding a ``bad`` row (``blocks``: the block
    of each row ``(B|1, H|1, L)``): every score against that block is then NaN."""
    if not bad.shape[-1]:
        return scales
    batch, heads, n_blocks = scales.shape
    hit = torch.zeros(batch, heads, n_blocks, dtype=torch.float32, device=scales.device)
    hit = hit.scatter_reduce(2, blocks.expand(batch, heads, bad.shape[-1]), bad.float().expand(batch, heads, -1),
                             "amax", include_self=True)
    return torch.where(hit > 0, torch.full_like(scales, float("nan")), scales)


def fp8_value_scale(v):
    """float32 ``(B, H, 1, D)``: V's per-channel e4m3 scale, ``max |v_c| / 448`` over finite values (1 if 0)."""
    v_scale = v.float().abs().nan_to_num(0.0, 0.0, 0.0).amax(dim=2, keepdim=True) / FP8_MAX
    return torch.where(v_scale > 0, v_scale, torch.ones_like(v_scale))


def smooth_keys(k):
    """``(k - mu, mu)`` with ``mu`` the float32 mean of ``k`` over the sequence ``(B, H, 1, D)``
    (``key_mean``: finite entries where the mean is not finite)."""
    mu = key_mean(k)
    return k.float() - mu, mu


def quantize_blocks(x, blocks, n_blocks):
    """INT8 quantisation with one scale per block: ``x`` float32 ``(B, H, L, D)``, ``blocks`` int64
    ``(B|1, H|1, L)`` the block of each row. Returns ``(x8, scale_of_row, scale)``: ``x8`` float32
    holding the int8 values, the scale of each row ``(B, H, L)`` and per block ``(B, H, n_blocks)``."""
    batch, heads, length, _ = x.shape
    blocks = blocks.expand(batch, heads, length)
    amax = torch.zeros(batch, heads, n_blocks, dtype=torch.float32, device=x.device)
    if length:
        amax = amax.scatter_reduce(2, blocks, x.abs().amax(-1), "amax", include_self=True)
    scale = amax / QMAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero block quantises to 0
    row_scale = scale.gather(2, blocks)
    x8 = torch.round(x / row_scale.unsqueeze(-1)).clamp_(-QMAX, QMAX)  # torch.round: ties to even
    return x8, row_scale, scale


def allowed_blocks(kv_indices, kv_counts, batch, heads, n_kblocks):
    """Bool ``(B, H, Mq, Mk)``: query block ``m`` attends key block ``j`` (the plan's listed blocks)."""
    idx = kv_indices.long().expand(batch, heads, *kv_indices.shape[2:])
    counts = kv_counts.long().expand(batch, heads, kv_indices.shape[2])
    used = torch.arange(idx.shape[-1], device=idx.device) < counts.unsqueeze(-1)
    idx = torch.where(used, idx, torch.full_like(idx, n_kblocks))  # unused slots go to a dropped column
    allowed = torch.zeros(batch, heads, idx.shape[2], n_kblocks + 1, dtype=torch.bool, device=idx.device)
    return allowed.scatter_(3, idx, True)[..., :n_kblocks]


def quant_attention_emulated(q, k, v, q_blocks, k_blocks, allowed, scale, kv_valid, mode="int8"):
    """``(out, lse)`` of quantised block-sparse attention (the module docstring's formulas).

    ``q_blocks`` / ``k_blocks``: int64 ``(B|1, H|1, N)`` / ``(B|1, H|1, Nk)`` block of each row /
    key; ``allowed``: bool ``(B, H, Mq, Mk)``; ``kv_valid``: bool ``(B|1, Nk)`` or None;
    ``mode``: ``"int8"`` or ``"int8-fp8"``. ``out`` in q's dtype, ``lse`` float32 ``(B, H, N)``."""
    batch, heads, n_q, dim = q.shape
    n_k = k.shape[2]
    out = torch.zeros(batch, heads, n_q, dim, dtype=q.dtype, device=q.device)
    lse = torch.full((batch, heads, n_q), float("-inf"), dtype=torch.float32, device=q.device)
    if n_k == 0 or batch * heads * n_q == 0:
        return out, lse
    n_qblocks, n_kblocks = allowed.shape[2], allowed.shape[3]
    bad_k = nonfinite_keys(k)[1]
    k_s, mu = smooth_keys(k)
    k_s = k_s.masked_fill(bad_k.unsqueeze(-1), 0)
    q32 = q.float()
    q8, q_row_scale, _ = quantize_blocks(q32, q_blocks, n_qblocks)
    k8, _, k_scale = quantize_blocks(k_s, k_blocks, n_kblocks)
    k_row_scale = poison_scales(k_scale, bad_k, k_blocks).gather(2, k_blocks.expand(batch, heads, n_k))
    shift = scale * torch.matmul(q32, mu.transpose(-1, -2)).squeeze(-1)  # (B, H, N): the smoothing term
    bad_v = ~torch.isfinite(v)
    if mode == "int8-fp8":
        v_scale = fp8_value_scale(v)
        v_used = (v.float() / v_scale).to(torch.float8_e4m3fn).float()
    else:
        v_used = v.float()
    # a non-finite value: NaN in its channel of the rows attending its block (the engine's P.V per block)
    v_poison = None
    if bool(bad_v.any()):
        v_used = v_used.masked_fill(bad_v, 0)
        v_poison = torch.zeros(batch, heads, n_kblocks, dim, dtype=torch.float32, device=q.device)
        v_poison = v_poison.scatter_reduce(2, k_blocks.expand(batch, heads, n_k)[..., None].expand(-1, -1, -1, dim),
                                           bad_v.float().expand(batch, heads, -1, -1), "amax", include_self=True)
    k_cols = k_blocks.expand(batch, heads, n_k)
    key_ok = None if kv_valid is None else kv_valid.to(torch.bool).view(-1, 1, 1, n_k)
    q_rows = q_blocks.expand(batch, heads, n_q)
    chunk = max(1, min(n_q, (1 << 22) // max(1, batch * heads * n_k)))
    for r0 in range(0, n_q, chunk):
        r1 = min(n_q, r0 + chunk)
        dot = torch.matmul(q8[:, :, r0:r1], k8.transpose(-1, -2))  # integers below 2^24: exact in float32
        s = dot * (q_row_scale[:, :, r0:r1, None] * k_row_scale[:, :, None, :]) * scale
        rows = allowed.gather(2, q_rows[:, :, r0:r1, None].expand(-1, -1, -1, n_kblocks))
        ok = rows.gather(3, k_cols[:, :, None, :].expand(-1, -1, r1 - r0, -1))
        if key_ok is not None:
            ok = ok & key_ok
        s = s.masked_fill(~ok, float("-inf"))
        row_max = s.amax(-1, keepdim=True)
        row_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
        p = torch.exp(s - row_max)
        denom = p.sum(-1, keepdim=True)
        if mode == "int8-fp8":
            acc = torch.matmul((p * FP8_MAX).to(torch.float8_e4m3fn).float(), v_used) * (v_scale / FP8_MAX)
        else:
            acc = torch.matmul(p.to(q.dtype).float(), v_used)
        if v_poison is not None:
            acc = acc.masked_fill(torch.matmul(rows.float(), v_poison) > 0, float("nan"))
        out[:, :, r0:r1] = (acc / torch.where(denom > 0, denom, torch.ones_like(denom))).to(q.dtype)
        block_lse = (row_max + denom.log()).squeeze(-1) + shift[:, :, r0:r1]
        # a row with no attended key: -inf; a NaN row (a non-finite key) keeps its NaN lse
        lse[:, :, r0:r1] = torch.where(denom.squeeze(-1) == 0, torch.full_like(block_lse, float("-inf")), block_lse)
    return out, lse


def fixed_blocks(n, block, device):
    """int64 ``(1, 1, n)``: the fixed-size block of each row."""
    return (torch.arange(n, device=device) // block).view(1, 1, n)


def varlen_blocks(offsets, n):
    """int64 ``(B|1, H|1, n)``: the block of each row under ``offsets`` ``(B|1, H|1, M + 1)``
    (an empty block owns no row: the last block starting at or before the row)."""
    offsets = offsets.long().contiguous()
    rows = torch.arange(n, device=offsets.device).expand(*offsets.shape[:2], n).contiguous()
    return (torch.searchsorted(offsets, rows, right=True) - 1).clamp_(min=0, max=max(offsets.shape[-1] - 2, 0))
