"""fastdit's vllm-omni sparse-attention plugins, called as vllm-omni's SPARSE_ATTN dispatcher calls them.

The callables are found through ``importlib.metadata.entry_points(group="vllm_omni.sparse_attn")``
(registered by the editable install's metadata), and ``dispatch`` below does what the dispatcher's
``_SparseAttentionImpl`` does (vllm-omni's ``vllm_omni/diffusion/attention/backends/sparse_attn.py``):
resolve by name (case-insensitive), read ``fn.capabilities`` (a missing capability and a given
``attn_mask`` / ``full_attn_spans`` -> ValueError), merge static < per-forward < dynamic params
dropping None, and call ``fn(q, k, v, params, is_causal=..., softmax_scale=...)`` with BSND tensors.

Each result is compared bit for bit with ``fastdit.attention`` on the same call in model order
(BHSD), and with a float64 reference: dense attention on a dense step, and for block-sparse
methods the attention restricted to the plan's token mask (built independently from the plan).
"""
import math
from importlib.metadata import entry_points

import pytest
import torch

import fastdit
from fastdit.integrations import vllm_omni

GROUP = "vllm_omni.sparse_attn"
#: A Wan-like video: 12 latent frames of 16 x 16, patch (1, 2, 2) -> a 12 x 8 x 8 token grid.
LATENT, PATCH = (12, 16, 16), (1, 2, 2)
GRID = (12, 8, 8)
TEXT = 7  # a full-attention span (odd length) after the video tokens
HEADS, DIM = 2, 16
#: Options that make every method clearly sparse on the small grid; dense_steps=1: step 0 dense.
OPTIONS = {
    "sta": dict(tile=(2, 2, 4), window=(1, 3, 3)),
    "radial": dict(block_size=64, decay=0.5, sink=False),
    "sparge": dict(tile=(2, 2, 4), topk=0.25, simthresh=-1.0),
    "sla": dict(tile=(2, 2, 4), topk_ratio=0.25),
    "svg": dict(block_size=64, density=0.25),
    "svg2": dict(q_clusters=6, k_clusters=12, top_p=0.3, init_iters=3),
    "todo": dict(factor=2),
    "tome": dict(ratio=0.5),
    "vsa": dict(block_size_3d=(2, 2, 4), top_k_ratio=0.25),
}
#: sla in an engine: its sparse branch; vsa: its fine stage (no layer identity, so no trained gate: zero)
BLOCK_SPARSE = ("sta", "radial", "sparge", "svg", "svg2", "sla", "vsa")


def dispatch(name, q, k, v, static=None, per_forward=None, extra=None, attn_mask=None, full_attn_spans=None,
             causal=False, scale=None):
    """vllm-omni's SPARSE_ATTN dispatch of one attention call (BSND tensors)."""
    matches = [ep for ep in entry_points(group=GROUP) if ep.name.lower() == name.lower()]
    assert matches, f"no entry point {name!r} in {GROUP}"
    fn = matches[0].load()
    caps = getattr(fn, "capabilities", None)
    caps = caps if isinstance(caps, dict) else {}
    merged = {**(static or {}), **(per_forward or {}), **(extra or {})}
    params = {key: value for key, value in merged.items() if value is not None}
    if attn_mask is not None:
        if not caps.get("supports_attention_mask", False):
            raise ValueError(f"{name} received an attn_mask but does not advertise 'supports_attention_mask'")
        params["attn_mask"] = attn_mask
    if full_attn_spans is not None:
        if not caps.get("supports_full_attn_spans", False):
            raise ValueError(f"{name} received full_attn_spans but does not advertise 'supports_full_attn_spans'")
        params["full_attn_spans"] = full_attn_spans
    return fn(q, k, v, params, is_causal=causal, softmax_scale=scale if scale is not None else q.shape[-1] ** -0.5)


def per_forward(batch, step, total=2, latent=LATENT, patch=PATCH):
    """The per-forward tier as vllm-omni's PerForwardState.to_dict(exclude_none=True) gives it."""
    return {"denoise_step_idx": torch.full((batch,), step), "total_denoise_steps": torch.full((batch,), total),
            "latent_shape": torch.tensor([latent] * batch), "patch_size": torch.tensor([patch] * batch)}


def bsnd(batch, seq, seed):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, seq, HEADS, DIM, generator=generator) for _ in range(3)]


def model_order(*tensors):
    return [t.permute(0, 2, 1, 3) for t in tensors]


def reference64(q, k, v, allowed, scale):
    """Float64 softmax attention of BHSD ``q, k, v`` over the ``allowed`` (S, S) bool pairs."""
    scores = (q.double() @ k.double().transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v.double()


def test_entry_points_registered_with_capabilities():
    names = {ep.name for ep in entry_points(group=GROUP)}
    assert {f"fastdit_{m}" for m in OPTIONS} <= names
    for ep in entry_points(group=GROUP):
        if ep.name.startswith("fastdit_"):
            fn = ep.load()
            assert callable(fn) and fn.capabilities == {"supports_attention_mask": True,
                                                        "supports_full_attn_spans": True}


@pytest.mark.parametrize("text", [0, TEXT], ids=["video", "video+text"])
@pytest.mark.parametrize("method", sorted(OPTIONS))
def test_plugin_equals_fastdit_attention(method, text):
    batch, video = 2, math.prod(GRID)
    seq = video + text
    q, k, v = bsnd(batch, seq, seed=hash((method, text)) % 1000)
    static = dict(OPTIONS[method], dense_steps=1)
    spans = [[(video, seq)]] * batch if text else None
    layout = fastdit.TokenLayout(GRID, text, "suffix" if text else "none")
    scale = DIM ** -0.5
    plugin = getattr(vllm_omni, f"fastdit_{method}")
    plugin.reset_stats()
    for step in (0, 1):
        out = dispatch(f"fastdit_{method}", q, k, v, static, per_forward(batch, step), full_attn_spans=spans)
        assert out.shape == q.shape and torch.isfinite(out).all()
        expected, info = fastdit.attention(*model_order(q, k, v), method, layout=layout, step=step, num_steps=2,
                                           scale=scale, return_info=True, dense_layers=0,
                                           **({"warm_start": False} if method == "svg2" else {}), **static)
        assert torch.equal(out, expected.permute(0, 2, 1, 3))
        qm, km, vm = model_order(q, k, v)
        if step == 0:  # dense step: exactly dense attention
            assert info["dense"]
            allowed = torch.ones(seq, seq, dtype=torch.bool)
        else:
            assert not info["dense"] and info["density"] < 0.6, info["density"]
            if method not in BLOCK_SPARSE:
                continue
        for head in range(HEADS):
            if step:
                allowed = info["plan"].token_mask(head)
            ref = reference64(qm[0, head], km[0, head], vm[0, head], allowed, scale)
            torch.testing.assert_close(out[0, :, head].double(), ref, atol=2e-5, rtol=1e-4)
            if step:  # the text rows attend every key: never sparsified
                assert allowed[video:].all() if text else True
    assert plugin.stats.dense_calls == 1 and plugin.stats.sparse_calls == 1 and plugin.stats.fallback_calls == 0


def test_key_padding_mask_runs_the_method_with_masked_keys():
    batch, seq = 2, math.prod(GRID)
    q, k, v = bsnd(batch, seq, seed=3)
    mask = torch.ones(batch, seq, dtype=torch.bool)
    mask[1, -37:] = False
    static = dict(OPTIONS["sta"], dense_steps=0)
    out = dispatch("fastdit_sta", q, k, v, static, per_forward(batch, 1), attn_mask=mask)
    expected = fastdit.attention(*model_order(q, k, v), "sta", layout=fastdit.TokenLayout(GRID), key_mask=mask,
                                 step=1, num_steps=2, dense_layers=0, **static)
    assert torch.equal(out, expected.permute(0, 2, 1, 3))
    qm, km, vm = model_order(q, k, v)
    plan = fastdit.attention(*model_order(q, k, v), "sta", layout=fastdit.TokenLayout(GRID), dense_layers=0,
                             return_info=True, **static)[1]["plan"]
    allowed = plan.token_mask(0) & mask[1][None, :]
    torch.testing.assert_close(out[1, :, 0].double(), reference64(qm[1, 0], km[1, 0], vm[1, 0], allowed, DIM ** -0.5),
                               atol=2e-5, rtol=1e-4)


def test_samples_at_different_steps_run_per_sample():
    batch, seq = 2, math.prod(GRID)
    q, k, v = bsnd(batch, seq, seed=5)
    static = dict(OPTIONS["sta"], dense_steps=1)
    state = per_forward(batch, 0)
    state["denoise_step_idx"] = torch.tensor([0, 1])
    out = dispatch("fastdit_sta", q, k, v, static, state)
    for b in range(batch):
        expected = fastdit.attention(*model_order(q[b:b + 1], k[b:b + 1], v[b:b + 1]), "sta",
                                     layout=fastdit.TokenLayout(GRID), step=b, num_steps=2, dense_layers=0, **static)
        assert torch.equal(out[b:b + 1], expected.permute(0, 2, 1, 3))
    assert not torch.equal(out[1], dispatch("fastdit_sta", q, k, v, static, per_forward(batch, 0))[1])


@pytest.mark.filterwarnings("ignore:fastdit")
def test_derived_geometry_serves_frame_methods_only():
    batch, seq = 1, math.prod(GRID)
    q, k, v = bsnd(batch, seq, seed=7)
    derived = {"denoise_step_idx": torch.tensor([1]), "total_denoise_steps": torch.tensor([2]),
               "total_latent_frames": GRID[0], "patches_per_frame": torch.tensor([GRID[1] * GRID[2]])}
    static = dict(OPTIONS["svg"], dense_steps=1)
    out = dispatch("fastdit_svg", q, k, v, static, derived)
    expected = fastdit.attention(*model_order(q, k, v), "svg", layout=fastdit.TokenLayout((GRID[0], 1, 64)),
                                 step=1, num_steps=2, dense_layers=0, **static)
    assert torch.equal(out, expected.permute(0, 2, 1, 3))
    vllm_omni.fastdit_sta.reset_stats()
    out = dispatch("fastdit_sta", q, k, v, dict(OPTIONS["sta"], dense_steps=1), derived)
    assert torch.equal(out, dense_reference(q, k, v))
    assert list(vllm_omni.fastdit_sta.stats.fallbacks) == [
        "only frame counts given (total_latent_frames, patches_per_frame): sta needs the (H, W) split of a frame "
        "from latent_shape and patch_size"]


def dense_reference(q, k, v, **kwargs):
    return torch.nn.functional.scaled_dot_product_attention(*model_order(q, k, v), **kwargs).permute(0, 2, 1, 3)


@pytest.mark.filterwarnings("ignore:fastdit")
@pytest.mark.parametrize("case", ["no geometry", "mismatch", "causal", "mask", "middle span", "all text"])
def test_bad_input_runs_dense_with_a_counted_reason(case):
    batch, seq = 2, math.prod(GRID)
    q, k, v = bsnd(batch, seq, seed=11)
    static = dict(OPTIONS["sta"], dense_steps=0)
    state, kwargs, expected_kwargs, reason = per_forward(batch, 1), {}, {}, ""
    if case == "no geometry":
        state = {"denoise_step_idx": torch.tensor([1, 1])}
        reason = "no geometry"
    elif case == "mismatch":
        state = per_forward(batch, 1, latent=(12, 16, 18))
        reason = "geometry mismatch"
    elif case == "causal":
        kwargs, expected_kwargs, reason = {"causal": True}, {"is_causal": True}, "is_causal"
    elif case == "mask":  # a block-causal mask: not a key mask
        mask = torch.ones(seq, seq, dtype=torch.bool).tril(64)[None, None].expand(batch, 1, -1, -1)
        kwargs, expected_kwargs, reason = {"attn_mask": mask}, {"attn_mask": mask}, "not a key"
    elif case == "middle span":
        kwargs, reason = {"full_attn_spans": [[(100, 110)]] * batch}, "neither at the start nor"
    plugin = vllm_omni.fastdit_sta
    plugin.reset_stats()
    if case == "all text":
        out = dispatch("fastdit_sta", q, k, v, static, state, full_attn_spans=[[(0, seq)]] * batch)
        assert plugin.stats.dense_calls == 1 and plugin.stats.fallback_calls == 0
    else:
        out = dispatch("fastdit_sta", q, k, v, static, state, **kwargs)
        assert plugin.stats.fallback_calls == 1 and plugin.stats.sparse_calls == 0
        assert any(reason in r for r in plugin.stats.fallbacks), plugin.stats.fallbacks
    assert torch.equal(out, dense_reference(q, k, v, **expected_kwargs))


@pytest.mark.filterwarnings("ignore:fastdit")
def test_causal_with_a_key_mask_combines_both():
    batch, seq = 1, math.prod(GRID)
    q, k, v = bsnd(batch, seq, seed=13)
    mask = torch.ones(batch, seq, dtype=torch.bool)
    mask[0, 5:9] = False
    vllm_omni.fastdit_sta.reset_stats()
    out = dispatch("fastdit_sta", q, k, v, dict(OPTIONS["sta"], dense_steps=0), per_forward(batch, 1),
                   attn_mask=mask, causal=True)
    assert any("is_causal" in reason for reason in vllm_omni.fastdit_sta.stats.fallbacks)
    allowed = torch.ones(seq, seq, dtype=torch.bool).tril() & mask[0][None, :]
    qm, km, vm = model_order(q, k, v)
    torch.testing.assert_close(out[0, :, 0].double(), reference64(qm[0, 0], km[0, 0], vm[0, 0], allowed, DIM ** -0.5),
                               atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("static, per, kwargs, message", [
    ({"window": (2, 3, 3)}, {}, {}, "window"),
    ({"correction": "cached"}, {}, {}, "layer identity"),
    ({"dense_layers": 2}, {}, {}, "layer identity"),
    ({"dense_steps": 2}, {"denoise_step_idx": None}, {}, "denoise_step_idx"),
    ({"dense_steps": 0.5}, {"total_denoise_steps": None}, {}, "total_denoise_steps"),
    ({}, {}, {"attn_mask": torch.ones(2, 5, dtype=torch.bool)}, "does not broadcast"),
    ({}, {}, {"full_attn_spans": [[(5,)]] * 2}, "full_attn_spans"),
])
def test_bad_input_raises_a_clear_value_error(static, per, kwargs, message):
    batch, seq = 2, math.prod(GRID)
    q, k, v = bsnd(batch, seq, seed=17)
    state = {**per_forward(batch, 1), **per}
    with pytest.raises(ValueError, match=message):
        dispatch("fastdit_sta", q, k, v, dict(OPTIONS["sta"], **static), state, **kwargs)


def test_refused_state_options_of_svg2_and_tome():
    q, k, v = bsnd(1, math.prod(GRID), seed=19)
    with pytest.raises(ValueError, match="k-means centroids"):
        dispatch("fastdit_svg2", q, k, v, {"warm_start": True}, per_forward(1, 1))
    with pytest.raises(ValueError, match="matching"):
        dispatch("fastdit_tome", q, k, v, {"match_every": 2}, per_forward(1, 1))


def test_dispatcher_refuses_without_capabilities():
    """The dispatcher refuses a mask for a plugin that does not advertise it (checked by `dispatch`)."""
    q, k, v = bsnd(1, 8, seed=0)
    fn = vllm_omni.fastdit_sta
    saved = fn.capabilities
    fn.capabilities = {}
    try:
        with pytest.raises(ValueError, match="supports_attention_mask"):
            dispatch("fastdit_sta", q, k, v, attn_mask=torch.ones(1, 8, dtype=torch.bool))
    finally:
        fn.capabilities = saved


def test_unknown_params_keys_are_ignored_with_one_warning():
    """Issue 45 item 9: an engine that adds a per-call key to the params broke every call with
    "unknown option"; the key is now ignored (the output is the one without it) with one warning
    naming it and the valid options."""
    import warnings

    q, k, v = bsnd(1, math.prod(GRID), seed=23)
    state = per_forward(1, 1)
    options = dict(OPTIONS["sta"], dense_steps=0)
    expected = dispatch("fastdit_sta", q, k, v, options, state)
    with pytest.warns(UserWarning, match=r"ignoring params keys \['engine_extra', 'windw'\].*valid: \[") as seen:
        out = dispatch("fastdit_sta", q, k, v, {**options, "engine_extra": 1, "windw": (1, 3, 3)}, state)
    torch.testing.assert_close(out, expected)
    assert sum("ignoring params keys" in str(w.message) for w in seen) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once: not again
        dispatch("fastdit_sta", q, k, v, {**options, "engine_extra": 2, "windw": (1, 3, 3)}, state)


def test_engine_input_mistakes_get_clear_answers():
    """Issue 45 item 9: batch 0 gave a torch.cat error (now the empty output); a negative
    latent_shape a confusing grid message (now a ValueError naming latent_shape); a BHSD tensor
    with a text suffix span "text_len=-254 does not fit" (now a ValueError naming the layout)."""
    seq = math.prod(GRID)
    q, k, v = bsnd(1, seq, seed=29)
    options = dict(OPTIONS["sta"], dense_steps=0)
    empty = dispatch("fastdit_sta", q[:0], k[:0], v[:0], options, per_forward(0, 1))
    assert empty.shape == (0, seq, HEADS, DIM)
    with pytest.raises(ValueError, match=r"latent_shape \[-12, 16, 16\] .* must be positive"):
        dispatch("fastdit_sta", q, k, v, options, per_forward(1, 1, latent=(-12, 16, 16)))
    qb, kb, vb = model_order(*bsnd(1, seq + 4, seed=31))  # BHSD by mistake, with a 4-token text suffix
    with pytest.raises(ValueError, match=r"starts past the \d+ tokens.*\[batch, seq_len, num_heads, head_dim\]"):
        dispatch("fastdit_sta", qb, kb, vb, options, per_forward(1, 1), full_attn_spans=[[(seq, seq + 4)]])
