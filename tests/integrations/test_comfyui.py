"""The ComfyUI node against ComfyUI's own code (issue 43, items 1 and 2), on the CPU.

ComfyUI's source comes from ``FASTDIT_COMFYUI_SRC`` or the shared tarball (``tests/comfyui_models.py``);
without either, the tests that need it skip with that message. ComfyUI's own models (``WanModel``
T2V and I2V, ``HunyuanVideo``, ``LTXVModel``, ``Flux``) are built tiny with random weights and called
as ComfyUI's sampler calls them; one test runs ComfyUI's own sampler (``comfy.sample.sample``).
"""
import json
import math
import warnings

import pytest
import torch

import comfyui_models as cm
import fastdit
from fastdit.calibration.calibration_file import CalibrationError
from fastdit.integrations.comfyui import NODE_CLASS_MAPPINGS, step_of
from fastdit.layout import TokenLayout
from fastdit.methods.base import get_method
from layer_capture import sta_token_mask

KINDS = list(cm.CONFIGS)
NODE = NODE_CLASS_MAPPINGS["FastditSparseAttention"]
STA = dict(tile=(1, 2, 4), window=(3, 3, 1))  # tiles of 8 tokens; windows that keep about a fifth


@pytest.fixture(scope="module")
def comfy():
    loaded = cm.load_comfy()
    if loaded is None:
        pytest.skip(cm.skip_reason())
    return loaded


def patch(model, method, options="", **kwargs):
    kwargs.setdefault("dense_steps", 0)
    kwargs.setdefault("dense_blocks", 0)
    return NODE().patch(model, method=method, options=options, **kwargs)[0]


def runtime_of(patched):
    """The node's ``FastditAttention`` (also behind a test's recording override)."""
    override = patched.model_options["transformer_options"]["optimized_attention_override"]
    return getattr(override, "runtime", override)


def layout_of(kind):
    text = {"hunyuan_video": "suffix", "flux": "prefix"}.get(kind, "none")
    return TokenLayout(cm.GRIDS[kind], cm.TEXT if text != "none" else 0, text)


def record(patched):
    """Every layer call the node's override sees, ``(q, k, v, out)`` as ``(B, H, S, D)``; recorded by an
    override set around the node's (ComfyUI's own hook; the node's code is not touched)."""
    options = patched.model_options["transformer_options"]
    runtime = options["optimized_attention_override"]
    calls = []

    def recorder(func, *args, **kwargs):
        out = runtime(func, *args, **kwargs)
        q, k, v = args[:3]
        heads = args[3] if len(args) > 3 else kwargs["heads"]
        if not kwargs.get("skip_reshape", False):
            q, k, v = (t.view(t.shape[0], t.shape[1], heads, -1).transpose(1, 2) for t in (q, k, v))
        if not kwargs.get("skip_output_reshape", False):
            out = out.view(out.shape[0], out.shape[1], heads, -1).transpose(1, 2)
        calls.append((q, k, v, out, kwargs.get("mask"), kwargs.get("transformer_options")))
        return out if kwargs.get("skip_output_reshape", False) else out.transpose(1, 2).flatten(2)

    recorder.runtime = runtime
    options["optimized_attention_override"] = recorder
    return calls


def masked_reference(q, k, v, mask):
    """float64 softmax attention under a boolean ``(S, S)`` mask, written out."""
    q, k, v = (t.double() for t in (q, k, v))
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def check_layers(calls, layout, masks_of):
    """Each layer call of the grid's length equals the float64 reference under its mask."""
    layers = [c for c in calls if c[0].shape[2] == layout.seq_len and c[1].shape[2] == layout.seq_len]
    assert layers, "no layer call reached the node"
    for index, (q, k, v, out, _, _) in enumerate(layers):
        for head in range(q.shape[1]):
            mask = masks_of(index, head)
            assert mask.shape == (layout.seq_len, layout.seq_len)
            assert 0.05 < mask.double().mean() < 0.8  # really sparse, and not empty
            ref = masked_reference(q[:, head], k[:, head], v[:, head], mask)
            got = out[:, head].double()
            assert torch.isfinite(got).all()
            error = ((got - ref).norm() / ref.norm()).item()
            assert error < 1e-5, f"layer {index} head {head}: relative error {error:.3g}"
    return len(layers)


# -- without ComfyUI ---------------------------------------------------------------------------------


# -- ComfyUI's models ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_dense_is_exact_and_the_original_is_untouched(comfy, kind):
    model = cm.build(kind)
    args = cm.inputs(kind)
    reference = cm.forward(model, kind, args)
    dense = patch(model, "dense")
    assert dense is not model
    assert torch.equal(cm.forward(dense, kind, args), reference)
    sparse = patch(model, "sta", options="tile=1,2,4 window=3,3,1")
    out = cm.forward(sparse, kind, args)
    assert torch.isfinite(out).all() and not torch.equal(out, reference)
    stats = runtime_of(sparse).stats
    assert stats.sparse_calls == cm.CONFIGS[kind][1].get("num_layers", 0) + sum(
        cm.CONFIGS[kind][1].get(n, 0) for n in ("depth", "depth_single_blocks"))
    assert stats.sparse_density < 0.8 and not stats.fallbacks
    # removing the node = using the model it was given: untouched, bit-exact
    assert "optimized_attention_override" not in model.model_options.get("transformer_options", {})
    assert not model.wrappers
    assert torch.equal(cm.forward(model, kind, args), reference)


@pytest.mark.parametrize("kind", KINDS)
def test_sta_equals_masked_float64_reference(comfy, kind):
    model = cm.build(kind)
    patched = patch(model, "sta", options="tile=1,2,4 window=3,3,1")
    calls = record(patched)
    cm.forward(patched, kind)
    layout = layout_of(kind)
    mask = sta_token_mask(layout, STA["tile"], STA["window"])
    assert check_layers(calls, layout, lambda layer, head: mask) == runtime_of(patched).stats.sparse_calls


@pytest.mark.parametrize("kind", ["wan", "wan_i2v", "hunyuan_video", "ltx_video"])
def test_radial_equals_masked_float64_reference(comfy, kind):
    model = cm.build(kind)
    patched = patch(model, "radial", options="block_size=64")
    calls = record(patched)
    cm.forward(patched, kind)
    layout = layout_of(kind)
    config = runtime_of(patched).config
    plan = get_method("radial")(config).prepare(layout, 2, torch.device("cpu"))
    masks = [plan.token_mask(head) for head in range(2)]
    assert check_layers(calls, layout, lambda layer, head: masks[head]) == 2


def test_hunyuan_text_padding_is_a_key_mask(comfy):
    """HunyuanVideo's text padding reaches the override as ComfyUI's float mask: the node runs it as
    a key mask (padded text keys never attended), equal to the masked reference."""
    model = cm.build("hunyuan_video")
    args = cm.inputs("hunyuan_video")
    valid = torch.ones(1, cm.TEXT, dtype=torch.long)  # as ComfyUI's text encoders give it
    valid[:, -3:] = 0
    args["attention_mask"] = valid
    patched = patch(model, "sta", options="tile=1,2,4 window=3,3,1")
    calls = record(patched)
    cm.forward(patched, "hunyuan_video", args)
    layout = layout_of("hunyuan_video")
    key_valid = torch.ones(layout.seq_len, dtype=torch.bool)
    key_valid[-3:] = False
    mask = sta_token_mask(layout, STA["tile"], STA["window"], key_valid)
    assert check_layers(calls, layout, lambda layer, head: mask) == 2
    assert not runtime_of(patched).stats.fallbacks


def test_calibration_file_sets_windows_per_layer(comfy, tmp_path):
    plan = {"format": "fastdit-plan", "version": 2, "method": "sta",
            "model": {"family": "wan", "transformer": None, "layers": 2, "heads": 2, "grids": None},
            "options": {"tile": [1, 2, 4]}, "step_buckets": [0],
            "strategy": {"0_0_0": [3, 3, 1], "0_0_1": [3, 3, 1], "0_1_0": [1, 3, 3], "0_1_1": [1, 3, 3]}}
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    model = cm.build("wan")
    patched = patch(model, "sta", calibration_file=str(path))
    calls = record(patched)
    cm.forward(patched, "wan")
    layout = layout_of("wan")
    masks = [sta_token_mask(layout, (1, 2, 4), w) for w in ((3, 3, 1), (1, 3, 3))]
    assert check_layers(calls, layout, lambda layer, head: masks[layer]) == 2
    # a plan for another model: CalibrationError naming both layer counts
    plan["model"]["layers"] = 30
    path.write_text(json.dumps(plan))
    with pytest.raises(CalibrationError, match="layers.*2.*30"):
        patch(model, "sta", calibration_file=str(path))
    # options the plan fixes cannot be set beside it
    plan["model"]["layers"] = 2
    path.write_text(json.dumps(plan))
    with pytest.raises(CalibrationError, match="window"):
        patch(model, "sta", calibration_file=str(path), options="window=1,1,1")
    with pytest.raises(CalibrationError, match="both"):  # the input and its earlier name at once
        patch(model, "sta", calibration_file=str(path), plan_file=str(path))
    # settings measured on another grid: refused at the first forward on this grid, naming both
    other = {"format": "fastdit-plan", "version": 2, "method": "sparge",
             "model": {"family": "wan", "transformer": None, "layers": 2, "heads": 2, "grids": [[3, 4, 4]]},
             "options": {}, "step_buckets": [0], "settings": {"0_0": {"cdf": 0.9}, "0_1": None}}
    path.write_text(json.dumps(other))
    patched = patch(model, "sparge", plan_file=str(path))  # the input's earlier name still works
    with pytest.raises(CalibrationError, match=r"grid \(5, 6, 9\).*\[\(3, 4, 4\)\]"):
        cm.forward(patched, "wan")


@pytest.mark.parametrize("method", ["sta", "radial"])
def test_same_kept_blocks_as_the_diffusers_model(comfy, method):
    """ComfyUI's Wan and diffusers' Wan with the same weights, patched with the same method, compute
    the same attention pattern: equal sparse density and outputs equal to float32 rounding (a
    different pattern moves them by far more than dense-vs-sparse rounding)."""
    from diffusers import WanTransformer3DModel
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    model = cm.build("wan")
    state = {k: v.clone() for k, v in model.model.diffusion_model.state_dict().items()}
    twin = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4,
                                 out_channels=4, text_dim=12, freq_dim=32, ffn_dim=64, num_layers=2,
                                 cross_attn_norm=True, eps=1e-6).eval()
    missing, unexpected = twin.load_state_dict(convert_wan_transformer_to_diffusers(state), strict=False)
    assert not missing and not unexpected
    args = cm.inputs("wan")
    options = {"sta": dict(tile=(1, 2, 4), window=(3, 3, 1)), "radial": dict(block_size=64)}[method]
    text = " ".join(f"{k}={','.join(map(str, v)) if isinstance(v, tuple) else v}" for k, v in options.items())
    patched = patch(model, method, options=text)
    ours = cm.forward(patched, "wan", args)
    dense = cm.forward(model, "wan", args)
    handle = fastdit.patch(twin, method, dense_steps=0, dense_layers=0, backend="torch", **options)
    with torch.no_grad():
        theirs = twin(hidden_states=args["x"], timestep=args["timestep"], encoder_hidden_states=args["context"],
                      return_dict=False)[0]
    node_stats = runtime_of(patched).stats
    assert handle.stats.sparse_calls == node_stats.sparse_calls == 2
    assert handle.stats.sparse_density == pytest.approx(node_stats.sparse_density, abs=1e-9)
    assert node_stats.sparse_density < 0.9
    gap = (ours - theirs).abs().max().item()
    assert gap < 1e-4 < (ours - dense).abs().max().item()
    handle.remove()


@pytest.mark.parametrize("method", ["sta", "radial"])
def test_hunyuan_node_computes_the_diffusers_patchs_masks(comfy, method):
    """Text tokens included: diffusers' HunyuanVideo (text suffix) patched with the same method and
    options records per layer and head the masks under which the node's ComfyUI output equals the
    float64 reference (same resolved config, same kept blocks, text rows and columns included)."""
    from tiny_transformers import hunyuan_inputs, tiny_hunyuan

    options = {"sta": dict(tile=(1, 2, 4), window=(3, 3, 1)), "radial": dict(block_size=64)}[method]
    text = " ".join(f"{k}={','.join(map(str, v)) if isinstance(v, tuple) else v}" for k, v in options.items())
    patched = patch(cm.build("hunyuan_video"), method, options=text)
    twin = tiny_hunyuan()
    handle = fastdit.patch(twin, method, dense_steps=0, dense_layers=0, record_masks=True, backend="torch", **options)
    assert handle.config == runtime_of(patched).config
    frames, height, width = cm.SIZES["hunyuan_video"]
    args = hunyuan_inputs(frames=frames, height=height, width=width, batch=1, text=cm.TEXT)
    args["encoder_attention_mask"][:] = True
    with torch.no_grad():
        twin(**args)
    calls = record(patched)
    cm.forward(patched, "hunyuan_video")
    assert check_layers(calls, layout_of("hunyuan_video"), handle.mask) == 2
    handle.remove()


def test_sampler_honours_dense_steps(comfy):
    """ComfyUI's own sampler (``comfy.sample.sample``, euler, 4 steps, CFG): the first two steps run
    dense (ComfyUI's attention), the last two the method; each step is read off the sigmas."""
    model = cm.build("wan")
    patched = patch(model, "sta", dense_steps=0.5, options="tile=1,2,4 window=3,3,1")
    options = patched.model_options["transformer_options"]
    runtime = options["optimized_attention_override"]
    seen = []

    def steps(func, *args, **kwargs):  # an override around the node's: which step ran sparse
        before = runtime.stats.sparse_calls
        out = runtime(func, *args, **kwargs)
        q, k = args[:2]
        if q.shape[1] == layout_of("wan").seq_len and k.shape == q.shape:
            seen.append((step_of(kwargs["transformer_options"])[0], runtime.stats.sparse_calls > before))
        return out

    options["optimized_attention_override"] = steps
    g = torch.Generator().manual_seed(3)
    latent = torch.zeros(1, 4, 5, 12, 18)
    noise = torch.randn(latent.shape, generator=g)
    positive = [[torch.randn(1, cm.TEXT, 12, generator=g), {}]]
    negative = [[torch.randn(1, cm.TEXT, 12, generator=g), {}]]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = comfy.sample.sample(patched, noise, 4, 2.0, "euler", "simple", positive, negative, latent,
                                  disable_pbar=True, seed=3)
    assert torch.isfinite(out).all()
    assert sorted(set(seen)) == [(0, False), (1, False), (2, True), (3, True)]
    assert runtime.stats.dense_calls == runtime.stats.sparse_calls > 0


@pytest.mark.parametrize("kind", KINDS)
def test_every_method_the_geometry_allows_runs(comfy, kind):
    """Every registered method on ComfyUI's model over two sampler steps: finite outputs, every block
    counted; a method the family cannot take is refused at the node with the reason."""
    model = cm.build(kind)
    args = cm.inputs(kind)
    layers = 3 if kind == "flux" else 2
    for method in fastdit.method_names():
        try:
            patched = patch(model, method)
        except ValueError as error:
            assert kind == "flux" and method == "radial" and "image" in str(error), str(error)
            continue
        for sigma in (1.0, 0.5):
            assert torch.isfinite(cm.forward(patched, kind, args, sigma=sigma, schedule=[1.0, 0.5, 0.0])).all()
        stats = runtime_of(patched).stats
        assert stats.sparse_calls + stats.dense_calls == 2 * layers and not stats.fallbacks, method


def test_dense_blocks_and_an_earlier_override(comfy):
    """``dense_blocks`` runs the first blocks with ComfyUI's attention; an attention override another
    node set before runs every call the node leaves dense; a second fastdit node replaces the first."""
    model = cm.build("wan")
    seen = []

    def earlier(func, *args, **kwargs):
        seen.append(args[0].shape)
        return func(*args, **kwargs)

    before = model.clone()
    before.model_options["transformer_options"]["optimized_attention_override"] = earlier
    patched = patch(before, "sta", dense_blocks=1, options="tile=1,2,4 window=3,3,1")
    again = patch(patched, "dense")
    assert runtime_of(again).previous is earlier
    assert len(again.wrappers["diffusion_model"]["fastdit_sparse_attention"]) == 1
    calls = record(patched)
    cm.forward(patched, "wan")
    stats = runtime_of(patched).stats
    assert (stats.dense_calls, stats.sparse_calls) == (1, 1)
    assert len(seen) == 3  # block 0's self-attention and both cross-attention calls went through it
    layout = layout_of("wan")
    mask = sta_token_mask(layout, STA["tile"], STA["window"])
    first, second = [c for c in calls if c[1].shape[2] == layout.seq_len]
    full = torch.ones(layout.seq_len, layout.seq_len, dtype=torch.bool)
    ref = masked_reference(*first[:3], full)
    assert ((first[3].double() - ref).norm() / ref.norm()).item() < 1e-5  # block 0: dense
    check_layers([second], layout, lambda layer, head: mask)


def test_reference_tokens_run_comfyuis_attention(comfy):
    """Flux Kontext's reference latents add tokens beside the image grid: every call of that forward
    runs ComfyUI's own attention (bit-exact), counted as a fallback with the reason, warned once."""
    model = cm.build("flux")
    args = cm.inputs("flux")
    args["ref_latents"] = [torch.randn(1, 4, 14, 22, generator=torch.Generator().manual_seed(5))]
    reference = cm.forward(model, "flux", args)
    patched = patch(model, "sta", options="tile=1,2,4 window=1,3,1")
    with pytest.warns(UserWarning, match="ref_latents") as caught:
        out = cm.forward(patched, "flux", args)
        cm.forward(patched, "flux", args)
    assert len([w for w in caught if "ref_latents" in str(w.message)]) == 1
    assert torch.equal(out, reference)
    stats = runtime_of(patched).stats
    assert stats.sparse_calls == 0 and len(stats.fallbacks) == 1
    assert "ref_latents" in next(iter(stats.fallbacks))


def test_tokens_off_the_layout_run_comfyuis_attention(comfy):
    """A ComfyUI ``post_input`` patch that appends tokens to Flux's image sequence: the layers see more
    tokens than the grid and the text; they run ComfyUI's own attention (bit-exact), one warning."""
    model = cm.build("flux")
    args = cm.inputs("flux")

    def extra_tokens(inputs):
        img, ids = inputs["img"], inputs["img_ids"]
        return {**inputs, "img": torch.cat([img, img[:, :3]], 1), "img_ids": torch.cat([ids, ids[:, :3]], 1)}

    model.set_model_patch(extra_tokens, "post_input")
    reference = cm.forward(model, "flux", args)
    patched = patch(model, "sta", options="tile=1,2,4 window=1,3,1")
    with pytest.warns(UserWarning, match="87 tokens.*grid \\(1, 7, 11\\) and 7 text tokens make 84") as caught:
        out = cm.forward(patched, "flux", args)
    assert len([w for w in caught if "tokens" in str(w.message)]) == 1
    assert torch.equal(out, reference)
    stats = runtime_of(patched).stats
    assert stats.sparse_calls == 0 and stats.fallback_calls == 3


def test_unsupported_family_passes_through_and_warns_once(comfy):
    class Other(torch.nn.Module):
        pass

    patcher = comfy.model_patcher.ModelPatcher(torch.nn.Module(), torch.device("cpu"), torch.device("cpu"))
    patcher.model.diffusion_model = Other()
    with pytest.warns(UserWarning, match="Other is not supported.*WanModel.*passes through unchanged"):
        assert NODE().patch(patcher, method="sta")[0] is patcher
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert NODE().patch(patcher, method="sta")[0] is patcher


def test_bad_input_names_the_option(comfy):
    model = cm.build("wan")
    with pytest.raises(ValueError, match="unknown method 'nope'.*sta"):
        patch(model, "nope")
    with pytest.raises(ValueError, match="no_such_option.*its options"):
        patch(model, "sta", options="no_such_option=1")
    with pytest.raises(ValueError, match="window"):
        patch(model, "sta", options="window=2,2,2")
    with pytest.raises(ValueError, match="dense_steps"):
        patch(model, "sta", dense_steps=-0.5)
    typed = NODE_CLASS_MAPPINGS["FastditSparseAttention_sta"]()
    with pytest.raises(ValueError, match="window"):
        typed.patch(model, dense_steps=0, dense_blocks=0, window="2,2,2")
