"""Method "prune" (query-block pruning with a per-layer output cache, after AT-EDM / ToCa).

References are independent: float64 attention written here, and the block choice recomputed here
from the definition (relative change of block-mean queries since they were cached, top-k).
"""
import math

import numpy as np
import pytest
import torch

import fastdit
from fastdit import TokenLayout
from fastdit.pipelines import registered_adapters
from fastdit.pipelines.tiny import TINY_TEST_DEFAULTS, tiny

from helpers import seeded_qkv
from tiny_models import TINY, run

UNPATCHABLE = {a.family for a in registered_adapters() if a.unsupported}
FAMILIES = [name for name in TINY if name not in UNPATCHABLE and name != "cogvideox15"]
#: Families on which the state reset is also checked (a second pipeline call); the rest run once.
RESET_CHECKED = {"wan", "hunyuan_video", "cogvideox", "flux"}


def dense64(q, k, v, key_mask=None):
    """Float64 softmax attention; ``key_mask`` ``(B, S)`` False keys excluded."""
    scores = q.double() @ k.double().transpose(-1, -2) / math.sqrt(q.shape[-1])
    if key_mask is not None:
        scores = scores.masked_fill(~key_mask[:, None, None, :], float("-inf"))
    return scores.softmax(-1) @ v.double()


def block_means64(q, layout, size):
    video = q[:, :, layout.video_start:layout.video_start + layout.video_len].double()
    return torch.stack([video[:, :, i:i + size].mean(2) for i in range(0, layout.video_len, size)], dim=2)


def chosen_blocks(means, reference, keep):
    """The ``keep`` blocks per (batch, head) whose mean query changed most, relative to the cache."""
    change = (means - reference).norm(dim=-1) / reference.norm(dim=-1)
    ordered = change.sort(dim=-1, descending=True).values
    gap = (ordered[..., keep - 1] - ordered[..., keep]) / ordered[..., keep]
    assert (gap > 1e-4).all(), "near-tie in the block ranking: the test would depend on rounding"
    return change.topk(keep, dim=-1).indices


def block_rows(layout, size, block):
    start = layout.video_start + block * size
    return torch.arange(start, min(start + size, layout.video_start + layout.video_len))


@pytest.mark.parametrize("position", ["prefix", "suffix"])
def test_recomputes_exactly_the_chosen_blocks_and_reuses_the_cache_bit_for_bit(position):
    layout = TokenLayout((3, 5, 7), 5, position)  # 105 video tokens: 14 blocks of 8, the last of 1
    size, ratio, seq = 8, 0.5, layout.seq_len
    q, k, v = seeded_qkv(2, 3, seq, 16, seed=1)
    key_mask = torch.ones(2, seq, dtype=torch.bool)
    key_mask[1, layout.text_start + 3:layout.text_start + 5] = False  # padded text keys of sample 1
    options = dict(ratio=ratio, block_size=size, refresh_every=4, warmup=0.0)
    state = {}
    out = fastdit.attention(q, k, v, "prune", layout=layout, key_mask=key_mask, step=0, num_steps=8, state=state,
                            backend="torch", **options)
    assert torch.allclose(out.double(), dense64(q, k, v, key_mask), atol=1e-5)  # step 0 is a full step
    reference = block_means64(q, layout, size)
    n_blocks = reference.shape[2]
    keep = n_blocks - math.floor(ratio * n_blocks)
    g = torch.Generator().manual_seed(2)
    for step in (1, 2):
        # Each block's queries move by a block-wide random amount, so the ranking has clear gaps.
        amount = torch.rand(2, 3, n_blocks, 1, 1, generator=g) * 0.6
        shift = (amount * torch.randn(2, 3, n_blocks, 1, 16, generator=g)).expand(-1, -1, -1, size, -1)
        shift = shift.reshape(2, 3, n_blocks * size, 16)[:, :, :layout.video_len]
        q_new = q.clone()
        q_new[:, :, layout.video_start:layout.video_start + layout.video_len] += shift
        q_new[:, :, layout.text_start:layout.text_start + layout.text_len] += 0.3  # text queries move too
        previous = out
        out, info = fastdit.attention(q_new, k, v, "prune", layout=layout, key_mask=key_mask, step=step,
                                      num_steps=8, state=state, backend="torch", return_info=True, **options)
        means = block_means64(q_new, layout, size)
        chosen = chosen_blocks(means, reference, keep)
        expected = dense64(q_new, k, v, key_mask)
        text = layout.text_positions()
        assert torch.allclose(out[:, :, text].double(), expected[:, :, text], atol=1e-5)  # text: always recomputed
        for b in range(2):
            for h in range(3):
                for block in range(n_blocks):
                    rows = block_rows(layout, size, block)
                    if block in chosen[b, h]:
                        assert torch.allclose(out[b, h, rows].double(), expected[b, h, rows], atol=1e-5)
                    else:  # the cached output, bit for bit
                        assert torch.equal(out[b, h, rows], previous[b, h, rows])
                    if block in chosen[b, h]:  # recomputed blocks refresh their reference (ToCa)
                        reference[b, h, block] = means[b, h, block]
        assert info["density"] == pytest.approx((layout.text_len + keep * size) / seq)
        assert torch.isfinite(out).all()


def test_ratio_zero_and_refresh_every_one_equal_dense():
    layout = TokenLayout((2, 7, 5), 4, "suffix")
    for options in (dict(ratio=0.0), dict(ratio=0.9, refresh_every=1)):
        state = {}
        for step in range(4):
            q, k, v = seeded_qkv(1, 2, layout.seq_len, 8, seed=10 + step)
            out, info = fastdit.attention(q, k, v, "prune", layout=layout, step=step, num_steps=4, state=state,
                                          block_size=4, return_info=True, backend="torch", **options)
            assert torch.allclose(out.double(), dense64(q, k, v), atol=1e-5), (options, step)
            assert info["density"] == 1.0


def test_schedule_prunes_less_in_early_steps_and_refreshes():
    layout = TokenLayout((1, 8, 14))  # 112 tokens: 14 blocks of 8
    options = dict(ratio=0.75, warmup=0.5, refresh_every=6, block_size=8, dense_steps=1)
    state, kept = {}, []
    for step in range(1, 9):
        q, k, v = seeded_qkv(1, 1, layout.seq_len, 8, seed=20 + step)
        _, info = fastdit.attention(q, k, v, "prune", layout=layout, step=step, num_steps=8, state=state,
                                    return_info=True, backend="torch", **options)
        kept.append(round(info["density"] * layout.seq_len / 8))
    # step 1 (first after the dense step) and 7 are full; r_s = 0.75 * min(1, (s - 1) / 4) elsewhere
    expected = [14] + [14 - math.floor(0.75 * min(1, (s - 1) / 4) * 14) for s in range(2, 7)] + [14, 14 - 10]
    assert kept == expected
    assert kept[1] > kept[2] > kept[3] > kept[4] == kept[5]


@pytest.mark.parametrize("options, match", [
    (dict(ratio=1.0), "ratio"), (dict(ratio=-0.1), "ratio"), (dict(ratio=float("nan")), "ratio"),
    (dict(refresh_every=0), "refresh_every"), (dict(block_size=0), "block_size"), (dict(warmup=1.5), "warmup"),
])
def test_bad_options_raise_at_patch_time(options, match):
    model = TINY["wan"].build(0)
    with pytest.raises(ValueError, match=match):
        fastdit.patch(model, "prune", **options)
    assert not model._forward_pre_hooks  # nothing installed


def bare_steps(model, kwargs, calls):
    """``calls`` transformer calls at falling timesteps (one denoising step each, bare transformer)."""
    outs = []
    for i in range(calls):
        step_kwargs = dict(kwargs, timestep=kwargs["timestep"] * (1.0 - 0.1 * i))
        outs.append(run(model, step_kwargs))
    return outs


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_runs_pruned_steps_finite_and_state_resets(family):
    case = TINY[family]
    model = case.build(0)
    kwargs = case.inputs(model, case.grid)
    with fastdit.patch(model, "prune", ratio=0.5, block_size=8, refresh_every=3, warmup=0.0, backend="torch") as p:
        first = bare_steps(model, kwargs, 2)
        assert p.stats.fallback_calls == 0 and p.stats.sparse_calls == 2 * len(p.layers)
        assert p.stats.effective_density < 1.0  # step 1 really pruned
        # the timestep goes up again: a new call, with fresh state
        second = bare_steps(model, kwargs, 2) if family in RESET_CHECKED else first
    for a, b in zip(first, second):
        assert torch.isfinite(a).all() and torch.equal(a, b)


def test_pipeline_second_call_equals_first():
    pipe = tiny("wan")
    kwargs = dict(TINY_TEST_DEFAULTS["wan"], num_inference_steps=2)

    def generate():
        with torch.no_grad():
            out = pipe(prompt="a red fox", generator=torch.Generator().manual_seed(0), output_type="np", **kwargs)
        return np.asarray(out.frames)

    with fastdit.patch(pipe, "prune", ratio=0.5, block_size=8, refresh_every=3, warmup=0.0) as p:
        first = generate()
        assert p.stats.effective_density < 1.0  # step 1 pruned (in both CFG calls)
        second = generate()
    assert np.isfinite(first).all() and np.array_equal(first, second)


def test_gpu_plan_shape_and_triton_interpreter_equal_the_cpu_path():
    from fastdit.methods.prune import ENGINE_BLOCK
    from fastdit.plan import dense_plan, run_plan

    q, k, v = seeded_qkv(1, 2, 2 * ENGINE_BLOCK + 37, 8, seed=50)  # not a multiple of the GPU block
    multi = dense_plan(q.shape[2], k.shape[2], torch.device("cpu"), single_block=False).validate()
    assert multi.kv_indices.shape[-2:] == (3, 3) and multi.block_m == ENGINE_BLOCK
    assert torch.allclose(run_plan(q, k, v, multi, backend="torch").double(), dense64(q, k, v), atol=1e-5)
    layout = TokenLayout((1, 5, 7), 3, "suffix")
    outs = {}
    for backend in ("torch", "triton"):  # tests run Triton in the interpreter on the CPU
        state, outs[backend] = {}, []
        for step in range(2):
            q, k, v = seeded_qkv(1, 2, layout.seq_len, 16, seed=60 + step)
            outs[backend].append(fastdit.attention(q, k, v, "prune", layout=layout, step=step, num_steps=2, state=state,
                                                   ratio=0.5, block_size=8, warmup=0.0, backend=backend))
    for a, b in zip(outs["torch"], outs["triton"]):
        assert torch.allclose(a, b, atol=1e-5)
