"""``vsa`` (Video Sparse Attention) against a float64 reference of the published formulas.

The reference below is written from the paper / FastVideo's description (not from fastdit's code):
token-level, in float64, cubes found from each token's (t, h, w) coordinates, text in blocks of one
cube's size after the cubes. Coarse stage: block means over valid tokens, softmax over key blocks,
output broadcast to the block's tokens; selection: the top ``max(1, int(ratio * cubes))`` video key
cubes per video query cube (plus text blocks; text query blocks keep everything); fine stage:
exact softmax over the kept blocks' valid keys; output ``fine + gate * coarse``.
"""
import math

import pytest
import torch

import fastdit
from fastdit import TokenLayout
from fastdit.calibration.calibration_file import CalibrationError
from fastdit.context import AttentionContext, CallState
from fastdit.methods.base import OptionError
from fastdit.methods.parallel import ring_refusal
from fastdit.methods.vsa import VideoSparse, VSAGate

from kernel_backends import BACKENDS, DEVICE
from tiny_transformers import tiny_wan, wan_inputs


def _blocks(layout, cube):
    """Block index of every token (model order), number of video cubes and of blocks."""
    t_, h_, w_ = layout.grid
    bt, bh, bw = (min(c, g) for c, g in zip(cube, layout.grid))
    nt, nh, nw = math.ceil(t_ / bt), math.ceil(h_ / bh), math.ceil(w_ / bw)
    n_cubes = nt * nh * nw
    block = torch.empty(layout.seq_len, dtype=torch.long)
    for i in range(layout.video_len):
        t, rest = divmod(i, h_ * w_)
        h, w = divmod(rest, w_)
        block[layout.video_start + i] = ((t // bt) * nh + h // bh) * nw + w // bw
    size = bt * bh * bw
    for j in range(layout.text_len):
        block[layout.text_start + j] = n_cubes + j // size
    return block, n_cubes, n_cubes + math.ceil(layout.text_len / size)


def reference(q, k, v, layout, cube, keep, gate=None, key_mask=None, query_mask=None, chosen=None):
    """float64 VSA. ``gate``: None (0), ``"sum"`` (1) or ``(W (H, D, D), b (H, D))``. ``chosen``:
    ``(B, H, cubes, keep)`` selected key cubes to use (default: the top-k of the float64 scores).
    Returns ``(out, probs, topk indices)``."""
    q, k, v = (t.double() for t in (q, k, v))
    batch, heads, seq, dim = q.shape
    block, n_cubes, n_blocks = _blocks(layout, cube)
    kv = torch.ones(batch, seq, dtype=torch.bool) if key_mask is None else key_mask.bool()
    qv = torch.ones(batch, seq, dtype=torch.bool) if query_mask is None else query_mask.bool()
    member = torch.nn.functional.one_hot(block, n_blocks).double()  # (S, n)

    def means(x, valid):
        w = member[None] * valid[:, :, None].double()  # (B, S, n)
        return torch.einsum("bsn,bhsd->bhnd", w, x) / w.sum(1).clamp_min(1)[:, None, :, None], w.sum(1)

    qc, _ = means(q, qv)
    kc, kcount = means(k, kv)
    vc, _ = means(v, kv)
    scores = qc @ kc.transpose(-1, -2) / math.sqrt(dim)
    scores = scores.masked_fill((kcount == 0)[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, -1)
    coarse = (probs @ vc)[:, :, block]  # broadcast to the tokens
    top = probs[..., :n_cubes, :n_cubes].topk(keep, -1).indices
    sel = top if chosen is None else chosen
    kept = torch.zeros(batch, heads, n_blocks, n_blocks, dtype=torch.bool)
    kept[..., n_cubes:, :] = True
    kept[..., :, n_cubes:] = True
    kept[..., :n_cubes, :].scatter_(-1, sel.long(), True)
    allowed = kept[:, :, block][:, :, :, block] & kv[:, None, None, :]
    s = (q @ k.transpose(-1, -2) / math.sqrt(dim)).masked_fill(~allowed, float("-inf"))
    fine = torch.nan_to_num(torch.softmax(s, -1), nan=0.0) @ v
    if gate is None:
        out = fine
    elif gate == "sum":
        out = fine + coarse
    else:
        weight, bias = gate
        out = fine + (torch.einsum("bhsd,hde->bhse", q, weight.double()) + bias.double()[None, :, None]) * coarse
    return out * qv[:, None, :, None], probs, top


def _ctx(layout, heads, key_mask=None, query_mask=None, params=None, backend="auto"):
    return AttentionContext(layer=0, layer_name="layer0", step=0, num_steps=None, branch=0, layout=layout,
                            call=CallState(), key_mask=key_mask, query_mask=query_mask, num_heads=heads,
                            total_heads=heads, params=params, backend=backend)


def _inputs(layout, seed, batch=2, heads=3, dim=16, masks=False):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, heads, layout.seq_len, dim, generator=gen) for _ in range(3))
    key_mask = query_mask = None
    if masks:
        key_mask = torch.rand(batch, layout.seq_len, generator=gen) > 0.2
        query_mask = torch.rand(batch, layout.seq_len, generator=gen) > 0.1
    return q, k, v, key_mask, query_mask


def _gate(heads, dim, seed):
    gate = VSAGate(heads, dim)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        gate.weight.copy_(0.3 * torch.randn(gate.weight.shape, generator=gen))
        gate.bias.copy_(0.3 * torch.randn(gate.bias.shape, generator=gen))
    return gate


def _chosen(plan, n_cubes, keep):
    """The method's selected key cubes ``(B, H, cubes, keep)`` from its recorded plan."""
    return plan.kv_indices[..., :n_cubes, :keep].long()


def _check_selection(probs, chosen, keep):
    """The method's top-k equals the float64 top-k wherever the k-th and (k+1)-th scores are apart."""
    ordered = probs.sort(-1, descending=True).values
    gap = ordered[..., keep - 1] - (ordered[..., keep] if keep < probs.shape[-1] else -1.0)
    clear = gap > 1e-6
    top = probs.topk(keep, -1).indices.sort(-1).values
    assert torch.equal(top[clear], chosen.sort(-1).values[clear])
    assert clear.float().mean() > 0.9


CASES = [  # grid, text, position, cube, ratio, gate, masks, seed
    ((5, 6, 7), 0, "none", (4, 4, 4), 0.3, "learned", False, 11),
    ((3, 5, 9), 9, "prefix", (2, 3, 4), 0.25, "learned", True, 12),
    ((4, 7, 5), 5, "suffix", (3, 2, 2), 0.4, "sum", True, 13),
    ((1, 7, 9), 3, "prefix", (4, 4, 4), 0.5, None, False, 14),  # an image: 1 x 4 x 4 squares (the 2-D form)
]


@pytest.mark.parametrize("grid,text,position,cube,ratio,gate,masks,seed", CASES)
def test_forward_matches_float64_reference(grid, text, position, cube, ratio, gate, masks, seed):
    layout = TokenLayout(grid, text, position)
    q, k, v, key_mask, query_mask = _inputs(layout, seed, masks=masks)
    method = VideoSparse(VideoSparse.resolve(options={"block_size_3d": cube, "top_k_ratio": ratio,
                                                      "gate": gate or "learned"}, where="call"))
    params = _gate(3, 16, seed + 100) if gate == "learned" else None
    ctx = _ctx(layout, 3, key_mask, query_mask, params)
    with torch.no_grad():
        out = method(ctx, q, k, v)
    _, n_cubes, _ = _blocks(layout, cube)
    keep = max(1, int(ratio * n_cubes))
    plan = ctx.info["plan"]
    assert plan.density < 0.8  # really sparse
    chosen = _chosen(plan, n_cubes, keep)
    ref_gate = (params.weight, params.bias) if params is not None else ("sum" if gate == "sum" else None)
    expected, probs, _ = reference(q, k, v, layout, cube, keep, ref_gate, key_mask, query_mask, chosen)
    _check_selection(probs[..., :n_cubes, :n_cubes], chosen, keep)
    assert torch.isfinite(out).all()
    assert (out.double() - expected).abs().max() < 2e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_backward_matches_float64_autograd(backend):
    """Forward and backward on the engine's PyTorch fallback and its Triton kernels (interpreted on a CPU)."""
    layout = TokenLayout((3, 5, 6), 7, "prefix")
    q, k, v, key_mask, query_mask = _inputs(layout, 21, masks=True)
    cube, ratio = (2, 2, 3), 0.3
    method = VideoSparse(VideoSparse.resolve(options={"block_size_3d": cube, "top_k_ratio": ratio}, where="call"))
    gate = _gate(3, 16, 22).to(DEVICE)
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(23))
    leaves = [t.clone().to(DEVICE).requires_grad_(True) for t in (q, k, v)]
    ctx = _ctx(layout, 3, key_mask.to(DEVICE), query_mask.to(DEVICE), gate, backend)
    out = method(ctx, *leaves)
    (out * grad_out.to(DEVICE)).sum().backward()
    _, n_cubes, _ = _blocks(layout, cube)
    keep = max(1, int(ratio * n_cubes))
    chosen = _chosen(ctx.info["plan"], n_cubes, keep).cpu()
    ref_leaves = [t.double().requires_grad_(True) for t in (q, k, v)]
    weight = gate.weight.detach().double().requires_grad_(True)
    bias = gate.bias.detach().double().requires_grad_(True)
    expected, _, _ = reference(*ref_leaves, layout, cube, keep, (weight, bias), key_mask, query_mask, chosen)
    assert (out.detach().cpu().double() - expected).abs().max() < 2e-5
    (expected * grad_out.double()).sum().backward()
    for mine, theirs, name in [(leaves[0].grad, ref_leaves[0].grad, "q"), (leaves[1].grad, ref_leaves[1].grad, "k"),
                               (leaves[2].grad, ref_leaves[2].grad, "v"), (gate.weight.grad, weight.grad, "W"),
                               (gate.bias.grad, bias.grad, "b")]:
        assert mine is not None and torch.isfinite(mine).all(), name
        scale = theirs.abs().max().item()
        assert scale > 0 and (mine.cpu().double() - theirs).abs().max() < 5e-5 * max(1.0, scale), name


def test_training_free_form_is_the_fine_stage_and_full_ratio_is_dense():
    layout = TokenLayout((5, 6, 7), 4, "suffix")
    q, k, v, key_mask, _ = _inputs(layout, 31, masks=True)
    out, info = fastdit.attention(q, k, v, "vsa", layout=layout, key_mask=key_mask, top_k_ratio=0.3,
                                  return_info=True)
    _, n_cubes, _ = _blocks(layout, (4, 4, 4))
    keep = max(1, int(0.3 * n_cubes))
    expected, _, _ = reference(q, k, v, layout, (4, 4, 4), keep, None, key_mask,
                               chosen=_chosen(info["plan"], n_cubes, keep))
    assert (out.double() - expected).abs().max() < 2e-5
    same = fastdit.attention(q, k, v, "vsa", layout=layout, key_mask=key_mask, sparsity=0.7)
    assert torch.equal(same, out)  # FastVideo's sparsity = 1 - top_k_ratio
    dense = fastdit.attention(q, k, v, "vsa", layout=layout, key_mask=key_mask, top_k_ratio=1.0)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=key_mask[:, None, None, :])
    assert (dense - sdpa).abs().max() < 1e-5


@pytest.mark.parametrize("options,message", [
    ({"top_k_ratio": 0.0}, "top_k_ratio must be a number in \\(0, 1\\]"),
    ({"top_k_ratio": 1.5}, "top_k_ratio must be"),
    ({"top_k_ratio": float("nan")}, "top_k_ratio must be"),
    ({"sparsity": 1.0}, "sparsity must be a number in \\[0, 1\\)"),
    ({"sparsity": 0.8, "top_k_ratio": 0.3}, "sparsity=0.8 and top_k_ratio=0.3 disagree"),
    ({"block_size_3d": (0, 4, 4)}, "block_size_3d must be three positive ints"),
    ({"block_size_3d": (4, 4)}, "block_size_3d must be three positive ints"),
    ({"gate": "mean"}, "gate must be one of \\('learned', 'sum'\\)"),
    ({"correction": "pooled"}, "vsa takes no correction"),
])
def test_bad_options_name_the_option(options, message):
    with pytest.raises(ValueError, match=message):
        VideoSparse.make_config(None, **options)


def test_ring_is_refused_with_the_reason():
    reason = ring_refusal(VideoSparse())
    assert "does not run under ring attention" in reason and "coarse stage" in reason and "Ulysses" in reason


def test_patch_trains_gates_and_loads_them_for_this_model_only(tmp_path):
    """The gates are the patch's (not the model's), get gradients under trainable=True, change the
    output once loaded, and a file of another cube size is refused naming both."""
    from fastdit.calibration.method_params import method_parameters, save_method_params

    model, inputs = tiny_wan(), wan_inputs(frames=5, height=10, width=12, batch=1)
    options = {"block_size_3d": (2, 2, 2), "top_k_ratio": 0.25}
    with torch.no_grad():
        reference_out = model(**inputs).sample
    with fastdit.patch(model, "vsa", trainable=True, **options) as p:
        gates = method_parameters(p)
        assert len(gates) == 2 * len(p.layers)
        with torch.no_grad():
            free = model(**inputs).sample
        model(**inputs).sample.square().mean().backward()
        assert all(g.grad is not None and g.grad.abs().sum() > 0 for g in gates)
        assert p.stats.sparse_density < 0.6
        with torch.no_grad():
            for g in gates:
                g.add_(0.05 * torch.randn(g.shape, generator=torch.Generator().manual_seed(g.numel())))
            trained = model(**inputs).sample
        save_method_params(p, tmp_path)
    assert (trained - free).abs().max() > 1e-4
    with torch.no_grad():
        assert torch.equal(model(**inputs).sample, reference_out)
        with fastdit.patch(model, "vsa", method_params=tmp_path, **options):
            assert torch.allclose(model(**inputs).sample, trained, atol=1e-5)
    with pytest.raises(CalibrationError, match=r"block_size_3d': \[2, 2, 2\].*block_size_3d': \[4, 4, 4\]"):
        fastdit.patch(model, "vsa", method_params=tmp_path, block_size_3d=(4, 4, 4))
    with pytest.raises(OptionError, match="vsa takes no correction"):
        fastdit.patch(model, "vsa", correction="pooled")


def test_recipe_trains_the_gates_beside_the_lora_and_resumes_them(tmp_path):
    """``train_lora`` with vsa: the gates join the optimiser, every checkpoint and
    ``fastdit_method_params.safetensors``; 2 + 2 resumed steps equal 4 in one go (gates included),
    and the evaluation helpers measure the trained gates (``method_params=``)."""
    pytest.importorskip("peft")
    from safetensors.torch import load_file

    from fastdit.pipelines.tiny import tiny
    from fastdit.train import LoraTrainConfig, output_error, train_lora
    from fastdit.calibration.method_params import FILE

    call = {"num_frames": 9, "height": 64, "width": 64, "num_inference_steps": 2, "guidance_scale": 1.0,
            "max_sequence_length": 16}  # a 3 x 4 x 4 latent grid: 12 cubes of 1 x 2 x 2, 3 kept
    options = {"block_size_3d": (1, 2, 2), "top_k_ratio": 0.25}

    def pipe():
        made = tiny("wan", seed=0, num_layers=2)
        made.set_progress_bar_config(disable=True)
        return made

    def config(steps):
        return LoraTrainConfig(method="vsa", options=options, prompts=("a cat", "a dog"), seeds=(0,), samples=3,
                               steps=steps, lr=1e-2, rank=4, checkpoint_every=2, call_kwargs=call, backend="torch")

    whole = train_lora(pipe(), config(4), tmp_path / "whole", progress=False)
    assert whole["method_params"] == str(tmp_path / "whole" / FILE)
    assert whole["stats"]["fallback_calls"] == 0 and whole["stats"]["sparse_density"] < 0.5
    gates = load_file(whole["method_params"])
    assert len(gates) == 4 and all(torch.isfinite(g).all() for g in gates.values())
    assert max(float(g.abs().max()) for g in gates.values()) > 0  # trained away from the zero init
    train_lora(pipe(), config(2), tmp_path / "split", progress=False)
    resumed_pipe = pipe()
    resumed = train_lora(resumed_pipe, config(4), tmp_path / "split", resume=True, progress=False)
    assert resumed["resumed_from"] == 2
    assert resumed["losses"] == pytest.approx(whole["losses"], rel=1e-5, abs=1e-9)
    for key, value in load_file(resumed["method_params"]).items():
        torch.testing.assert_close(value, gates[key], rtol=1e-4, atol=1e-7)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, resumed_pipe.transformer.config.in_channels, 3, 8, 8, generator=gen)
    text = resumed_pipe.encode_prompt("a bird", do_classifier_free_guidance=False, max_sequence_length=16)[0]
    with torch.no_grad():
        target = resumed_pipe.transformer(hidden_states=x, timestep=torch.tensor([300.0]), encoder_hidden_states=text,
                                          return_dict=False)[0]
    sample = {"hidden_states": x, "timestep": torch.tensor([300.0]), "encoder_hidden_states": text, "target": target}
    free = output_error(resumed_pipe.transformer, [sample], "vsa", options, "torch")
    trained = output_error(resumed_pipe.transformer, [sample], "vsa", options, "torch",
                           method_params=resumed["method_params"])
    assert free > 0 and trained > 0 and free != trained


def test_generic_checks_exact_remove_stats_compile_guard():
    """The registry's generic checks (tests/methods/test_new_method.py) on vsa, and the quality guard on it."""
    from test_new_method import check_compile, check_exact_at_full_density, check_patch_remove_and_stats

    sparse = {"block_size_3d": (1, 2, 2), "top_k_ratio": 0.3}
    check_exact_at_full_density("vsa", {"top_k_ratio": 1.0, "block_size_3d": (1, 2, 2)}, TokenLayout((2, 4, 6)))
    check_patch_remove_and_stats("vsa", sparse)
    check_compile("vsa", sparse)
    layout = TokenLayout((3, 6, 8))
    q, k, v, _, _ = _inputs(layout, 41)
    out, info = fastdit.attention(q, k, v, "vsa", layout=layout, guard=0.05, return_info=True, **sparse)
    assert info["guard"]["action"] == ["dense"] * 3  # random heads: 30% of the cubes miss the bound
    assert (out - torch.nn.functional.scaled_dot_product_attention(q, k, v)).abs().max() < 1e-5
    out, info = fastdit.attention(q, k, v, "vsa", layout=layout, guard=10.0, return_info=True, **sparse)
    assert info["guard"]["action"] == ["pass"] * 3 and info["density"] < 0.5
