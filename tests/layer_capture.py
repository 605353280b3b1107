"""Test helper: capture what each patched layer's sparse call received and returned.

Sparse calls go through ``run_plan`` (called from ``fastdit.methods.base``); this wraps it (via pytest's monkeypatch) and
records ``(q, k, v, key_mask, scale, out)`` per call, so tests can compare each layer's output
with the float64 dense reference under the mask the patch recorded.
"""
import torch

import fastdit.methods.base as patch_module  # where methods call run_plan
from fastdit.kernels import dense_reference
from fastdit.methods.tokens.token_attention import TokenSplit


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


# -- observing a model's own attention calls (no fastdit involved) ---------------------------------

class _TokenwiseSDPA(torch.overrides.TorchFunctionMode):
    """Replaces every ``scaled_dot_product_attention`` call by a token-wise stand-in and records the
    calls made inside a tracked module: self-attention returns ``value`` (each query row gets its own
    value row), cross-attention returns zeros. With no attention mixing tokens, every row of every
    layer's ``q`` depends only on its own token's input (and on global conditioning such as the
    timestep), so which rows an input reaches can be read layer by layer."""

    def __init__(self, calls):
        super().__init__()
        self.calls = calls
        self.current = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") != "scaled_dot_product_attention":
            return func(*args, **kwargs)
        names = ("query", "key", "value")
        q, k, v = (kwargs[n] if n in kwargs else args[i] for i, n in enumerate(names))
        if self.current is not None:
            self.calls.append((self.current, q.detach().clone(), k.detach().clone()))
        if q.shape[-2] == k.shape[-2]:
            return v.clone()
        return q.new_zeros((*q.shape[:-1], v.shape[-1]))


def observe_attention_calls(model, modules, kwargs):
    """Run ``model(**kwargs)`` with its attention made token-wise (``_TokenwiseSDPA``; the model's
    own code, no fastdit) and return ``[(name, q, k)]`` of the attention calls made inside each of
    ``modules`` (``[(name, module)]``), in call order; ``q``/``k`` are ``(B, H, S, D)``."""
    calls = []
    mode = _TokenwiseSDPA(calls)
    handles = []
    for name, module in modules:
        handles.append(module.register_forward_pre_hook(lambda m, a, name=name: setattr(mode, "current", name)))
        handles.append(module.register_forward_hook(lambda m, a, o: setattr(mode, "current", None)))
    try:
        with torch.no_grad(), mode:
            model(**kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return calls


def changed_rows(a, b, tol=1e-4):
    """Bool ``(S,)``: the sequence rows (dim -2) where two ``(B, H, S, D)`` tensors differ."""
    diff = (a.double() - b.double()).abs().transpose(-2, 0).reshape(a.shape[-2], -1).amax(1)
    return diff > tol * max(a.abs().max().item(), 1e-12)


class LayerTrace(LayerCapture):
    """``LayerCapture`` that also notes which patched module each sparse call came from:
    ``layers[i]`` is the name (from ``modules``, ``[(name, module)]``) of ``calls[i]``'s module,
    read by forward pre-hooks on the modules (removed by ``remove()``)."""

    def __init__(self, monkeypatch, modules):
        super().__init__(monkeypatch)
        self.layers = []
        self.current = None
        inner = patch_module.run_plan

        def traced_run_plan(*args, **kwargs):
            self.layers.append(self.current)
            return inner(*args, **kwargs)

        monkeypatch.setattr(patch_module, "run_plan", traced_run_plan)
        # Token methods (todo, tome) run no plan: their call ends in ``TokenSplit.assemble``.
        assemble = TokenSplit.assemble

        def traced_assemble(split, video_out, scale):
            out = assemble(split, video_out, scale)
            self.layers.append(self.current)
            self.calls.append((split.q.detach().clone(), split.k.detach().clone(), split.v.detach().clone(), scale,
                               out.detach().clone()))
            return out

        monkeypatch.setattr(TokenSplit, "assemble", traced_assemble)
        self.handles = [module.register_forward_pre_hook(lambda m, a, name=name: setattr(self, "current", name))
                        for name, module in modules]

    def clear(self):
        super().clear()
        self.layers.clear()

    def remove(self):
        for handle in self.handles:
            handle.remove()
        self.handles = []
