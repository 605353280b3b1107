"""Method "window" (DiTFastAttn: window attention + cached residual, step sharing, CFG sharing).

References are independent float64 attention under masks written here (the sliding-tile rule of
``layer_capture.sta_token_mask``, the band rule below).
"""
import math

import numpy as np
import pytest
import torch

import fastdit
import fastdit.methods.window as window_module
from fastdit import TokenLayout
from fastdit.context import AttentionContext, CallState
from fastdit.methods import get_method
from fastdit.pipelines import registered_adapters
from fastdit.pipelines.tiny import TINY_TEST_DEFAULTS, tiny

from helpers import seeded_qkv
from layer_capture import sta_token_mask
from tiny_models import TINY, run

UNPATCHABLE = {a.family for a in registered_adapters() if a.unsupported}
FAMILIES = [name for name in TINY if name not in UNPATCHABLE and name != "cogvideox15"]
#: Families on which the state reset is also checked (a second pipeline call); the rest run once.
RESET_CHECKED = {"wan", "hunyuan_video", "cogvideox", "flux"}
SMALL = dict(tile=(1, 2, 2), window=(1, 1, 3))  # really sparse at 3x5x7


def masked64(q, k, v, mask=None):
    scores = q.double() @ k.double().transpose(-1, -2) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1) @ v.double()


def band_token_mask(layout, band, block=64):
    """Video query token i attends video key j iff their 64-token blocks are within ceil(band/64)."""
    reach = -(-band // block)
    blocks = torch.arange(layout.video_len) // block
    mask = torch.ones(layout.seq_len, layout.seq_len, dtype=torch.bool)
    video = layout.video_positions()
    mask[video[:, None], video[None, :]] = (blocks[:, None] - blocks[None, :]).abs() <= reach
    return mask


@pytest.mark.parametrize("options, mask_of", [
    (SMALL, lambda layout: sta_token_mask(layout, SMALL["tile"], SMALL["window"])),
    (dict(band=60), lambda layout: band_token_mask(layout, 60)),
])
def test_window_steps_add_the_residual_of_the_last_full_step(options, mask_of):
    layout = TokenLayout((3, 10, 14), 5, "prefix")  # 420 video tokens: 7 band blocks, each reaching 1 block
    mask = mask_of(layout)
    assert mask.float().mean() < 0.8
    state, full_q = {}, None
    for step in range(4):
        q, k, v = seeded_qkv(1, 2, layout.seq_len, 16, seed=step)
        q_step = q if step == 0 else full_q + 0.2 * q  # queries drift across steps
        out, info = fastdit.attention(q_step, k, v, "window", layout=layout, step=step, num_steps=4, state=state,
                                      refresh_every=3, backend="torch", return_info=True, **options)
        if step % 3 == 0:  # full step: full attention, residual (full - window) stored
            full_q, full_k, full_v = q_step, k, v
            assert torch.allclose(out.double(), masked64(q_step, k, v), atol=1e-5)
            residual = masked64(q_step, k, v) - masked64(q_step, k, v, mask)
            assert info["density"] == pytest.approx(1.0 + mask.double().mean().item())
        else:
            expected = masked64(q_step, k, v, mask) + residual
            assert torch.allclose(out.double(), expected, atol=1e-5)
            assert info["density"] == pytest.approx(mask.double().mean().item())
            # text query rows attend every key and have no residual: plain attention
            text = layout.text_positions()
            assert torch.allclose(out[:, :, text].double(), masked64(q_step, k, v)[:, :, text], atol=1e-5)


@pytest.mark.parametrize("options", [dict(tile=(3, 5, 7), window=(1, 1, 1)), dict(band=200),
                                     dict(SMALL, refresh_every=1)])
def test_window_covering_everything_and_refresh_every_one_equal_dense(options):
    layout = TokenLayout((3, 5, 7), 6, "suffix")
    state = {}
    for step in range(4):
        q, k, v = seeded_qkv(1, 2, layout.seq_len, 8, seed=30 + step)
        out = fastdit.attention(q, k, v, "window", layout=layout, step=step, num_steps=4, state=state,
                                backend="torch", **options)
        assert torch.allclose(out.double(), masked64(q, k, v), atol=1e-5), (options, step)


def test_share_steps_reuses_the_previous_output_when_the_layer_barely_changes():
    layout = TokenLayout((3, 5, 7))
    outs = {}
    for threshold in (1e3, 0.0):
        state, outs[threshold] = {}, []
        for step in range(4):
            q, k, v = seeded_qkv(1, 2, layout.seq_len, 8, seed=40 + step)
            out, info = fastdit.attention(q, k, v, "window", layout=layout, step=step, num_steps=4, state=state,
                                          dense_steps=1, refresh_every=4, share_steps=True, share_threshold=threshold,
                                          backend="torch", return_info=True, **SMALL)
            outs[threshold].append((out, info["density"]))
        assert state["change"] > 0.05  # measured at step 1 against the dense step 0
    shared = outs[1e3]
    assert all(torch.equal(out, shared[1][0]) and density == 0.0 for out, density in shared[2:])
    unshared = outs[0.0]
    assert all(not torch.equal(out, unshared[1][0]) and density > 0 for out, density in unshared[2:])


# -- CFG sharing -------------------------------------------------------------------------------------

def make_window(**options):
    cls = get_method("window")
    return cls(cls.resolve(cls.make_config(**options)))


def call_method(method, call, layout, step, branch, q, k, v, cfg=True):
    call.rounds = step
    ctx = AttentionContext(layer=0, layer_name="layer0", step=step, num_steps=4, branch=branch, layout=layout,
                           call=call, num_heads=q.shape[1], total_heads=q.shape[1], cfg=cfg,
                           state=call.layer_state(0, branch), backend="torch",
                           dense_fn=lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v))
    out = method(ctx, q, k, v)
    return out, ctx.info["performed"]


class EngineSpy:
    """Counts the window-plan engine calls and the query rows they attend."""

    def __init__(self, monkeypatch):
        self.calls, self.rows = 0, 0
        inner = window_module.run_window_plan

        def spy(q, *args, **kwargs):
            self.calls += 1
            self.rows += q.shape[0] * q.shape[2]
            return inner(q, *args, **kwargs)

        monkeypatch.setattr(window_module, "run_window_plan", spy)


def test_share_cfg_two_calls_per_step_halves_attention(monkeypatch):
    layout = TokenLayout((3, 5, 7))
    spy = EngineSpy(monkeypatch)
    performed, outputs = {}, {}
    for share in (False, True):
        method, call = make_window(refresh_every=4, share_cfg=share, **SMALL), CallState(4)
        performed[share], outputs[share] = [], []
        for step in range(2):
            for branch in (0, 1):  # Wan: conditional pass, then unconditional
                q, k, v = seeded_qkv(1, 2, layout.seq_len, 8, seed=10 * step + branch)
                spy.calls = 0
                out, work = call_method(method, call, layout, step, branch, q, k, v)
                performed[share].append((work, spy.calls))
                outputs[share].append(out)
    # step 0 is a full step: both branches compute either way; step 1: branch 1 reuses branch 0
    assert performed[True][:3] == performed[False][:3]
    assert performed[True][3] == (0, 0) and performed[False][3][0] > 0
    assert sum(w for w, _ in performed[True][2:]) == sum(w for w, _ in performed[False][2:]) / 2
    assert outputs[True][3] is outputs[True][2]
    assert torch.equal(outputs[True][2], outputs[False][2])


def test_share_cfg_batched_computes_the_conditional_half_and_the_text_rows(monkeypatch):
    layout = TokenLayout((3, 5, 7), 6, "prefix")
    spy = EngineSpy(monkeypatch)
    results = {}
    for share in (False, True):
        method, call = make_window(refresh_every=4, share_cfg=share, **SMALL), CallState(4)
        for step in range(2):  # batch 2 = [uncond, cond], one call per step
            q, k, v = seeded_qkv(2, 2, layout.seq_len, 8, seed=step)
            spy.rows = 0
            out, work = call_method(method, call, layout, step, 0, q, k, v)
        results[share] = (out, work, spy.rows, q, k, v)
    out, work, rows, q, k, v = results[True]
    plain_out, plain_work, plain_rows, _, _, _ = results[False]
    assert rows == plain_rows / 2  # the window engine ran on the conditional half only
    text_pairs = 2 * layout.text_len * layout.seq_len  # uncond text rows, 2 heads
    assert work == plain_work / 2 + text_pairs
    video, text = layout.video_positions(), layout.text_positions()
    assert torch.equal(out[1], plain_out[1])  # conditional half: as without sharing
    assert torch.equal(out[0][:, video], out[1][:, video])  # unconditional video rows: reused
    assert torch.allclose(out[0][:, text].double(), masked64(q[:1], k[:1], v[:1])[0][:, text], atol=1e-5)
    # no CFG (or unknown): share_cfg is a no-op
    for cfg in (False, None):
        method, call = make_window(refresh_every=4, share_cfg=True, **SMALL), CallState(4)
        for step in range(2):
            q, k, v = seeded_qkv(2, 2, layout.seq_len, 8, seed=step)
            out, _ = call_method(method, call, layout, step, 0, q, k, v, cfg=cfg)
        assert torch.equal(out, plain_out)


# -- patching --------------------------------------------------------------------------------------

@pytest.mark.parametrize("options, match", [
    (dict(window=(2, 3, 3)), "window"), (dict(tile=(0, 1, 1)), "tile"), (dict(band=0), "band"),
    (dict(refresh_every=0), "refresh_every"), (dict(share_threshold=-1.0), "share_threshold"),
    (dict(share_cfg="yes"), "share_cfg"), (dict(window=[(1, 1, 1)] * 3), "heads"),
])
def test_bad_options_raise_at_patch_time(options, match):
    model = TINY["wan"].build(0)  # 2 heads
    with pytest.raises(ValueError, match=match):
        fastdit.patch(model, "window", **options)
    assert not model._forward_pre_hooks


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_runs_window_steps_finite_and_state_resets(family):
    case = TINY[family]
    model = case.build(0)
    kwargs = case.inputs(model, case.grid)

    def steps():  # two denoising steps of a bare transformer (the timestep falls)
        return [run(model, dict(kwargs, timestep=kwargs["timestep"] * scale)) for scale in (1.0, 0.9)]

    with fastdit.patch(model, "window", refresh_every=2, share_steps=True, backend="torch", **SMALL) as p:
        first = steps()
        assert p.stats.fallback_calls == 0 and p.stats.sparse_calls == 2 * len(p.layers)
        second = steps() if family in RESET_CHECKED else first  # timestep up again: a new call, fresh state
    for a, b in zip(first, second):
        assert torch.isfinite(a).all() and torch.equal(a, b)


def test_pipeline_second_call_equals_first_with_cfg_sharing():
    pipe = tiny("wan")  # two transformer calls per step (CFG)
    kwargs = dict(TINY_TEST_DEFAULTS["wan"], num_inference_steps=2)

    def generate():
        with torch.no_grad():
            out = pipe(prompt="a red fox", generator=torch.Generator().manual_seed(0), output_type="np", **kwargs)
        return np.asarray(out.frames)

    with fastdit.patch(pipe, "window", refresh_every=2, share_cfg=True, **SMALL) as p:
        first = generate()
        assert p.stats.effective_density < 1.5  # step 1: window for branch 0, nothing for branch 1
        second = generate()
    assert np.isfinite(first).all() and np.array_equal(first, second)
