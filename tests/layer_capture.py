"""Test helper: capture what each patched layer's sparse call received and returned.

Sparse calls go through ``run_plan`` (called from ``fastdit.methods.base``); this wraps it (via pytest's monkeypatch) and
records ``(q, k, v, key_mask, scale, out)`` per call, so tests can compare each layer's output
with the float64 dense reference under the mask the patch recorded.
"""
import torch

import fastdit.methods.base as patch_module  # where methods call run_plan
from fastdit.kernels import dense_reference


class LayerCapture:
    def __init__(self, monkeypatch):
        self.calls = []
        original = patch_module.run_plan

        def recording_run_plan(q, k, v, plan, key_mask=None, scale=None, **kwargs):
            result = original(q, k, v, plan, key_mask=key_mask, scale=scale, **kwargs)
            out = result[0] if isinstance(result, tuple) else result
            self.calls.append((q.detach().clone(), k.detach().clone(), v.detach().clone(), scale, out.detach().clone()))
            return result

        monkeypatch.setattr(patch_module, "run_plan", recording_run_plan)

    def clear(self):
        self.calls.clear()


def assert_matches_masked_dense(q, k, v, out, masks, scale=None, tol=1e-4):
    """``out`` equals float64 attention under ``masks[h]`` (``(S, S)`` per head), batch 0 mask."""
    for head, mask in enumerate(masks):
        ref, _ = dense_reference(q[:, head:head + 1], k[:, head:head + 1], v[:, head:head + 1], mask.to(q.device), scale)
        got = out[:, head:head + 1].double()
        assert torch.isfinite(got).all()
        err = ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()
        assert err < tol, f"head {head}: relative error {err:.3g}"


def sta_token_mask(layout, tile, window, key_valid=None):
    """Sliding-tile rule written directly at token level, in model order (the spec of issue 3)."""
    t_, h_, w_ = layout.grid
    n = [-(-g // t) for g, t in zip(layout.grid, tile)]
    coords = torch.stack(torch.meshgrid(torch.arange(t_), torch.arange(h_), torch.arange(w_), indexing="ij"), -1).reshape(-1, 3)
    tiles = coords // torch.tensor(tile)
    half = torch.tensor([w // 2 for w in window])
    n_t = torch.tensor(n)
    win = torch.tensor(window)
    centre = torch.minimum(torch.maximum(tiles, half), n_t - 1 - half)
    centre = torch.where(n_t <= win, tiles, centre)  # whole axis covered below
    close = (centre[:, None, :] - tiles[None, :, :]).abs() <= half
    close = close | (n_t <= win)
    video = close.all(-1)
    seq = layout.seq_len
    mask = torch.zeros(seq, seq, dtype=torch.bool)
    vpos = layout.video_positions()
    tpos = layout.text_positions()
    mask[vpos[:, None], vpos[None, :]] = video
    mask[vpos[:, None], tpos[None, :]] = True
    mask[tpos] = True
    if key_valid is not None:
        mask &= key_valid[None, :]
    return mask
