"""ModelOpt's sparse-attention profile (``sparse_attention_config``) both ways, against the real
``nvidia-modelopt`` package on the CPU, and the ``skip_softmax`` method that runs it.

* ModelOpt's own calibration (its PyTorch ``flash_skip_softmax`` path) and its own diffusers export
  (``export_hf_checkpoint``) of a tiny random-weight Wan transformer write a config.json; fastdit
  reads it, and each patched layer's output equals the float64 skip-rule walk at ModelOpt's
  threshold ``lambda = a * exp(b * target) / N_k``.
* fastdit writes a plan as a profile; ModelOpt's own loader (``load_from_checkpoint_metadata``) and
  its own runtime threshold (``TritonSkipSoftmaxMethod.get_inference_threshold``) read it back.
* Bad input: algorithms fastdit does not have, profiles for another model, plans ModelOpt's format
  cannot carry.

ModelOpt's PyTorch calibration patches ``F.softmax``; diffusers attention calls SDPA, so the
calibration forward runs under ``SoftmaxAttention`` (fastdit.integrations.profiles: SDPA as matmul,
softmax, matmul), which is what ModelOpt's eager path expects of an HF model.
"""
from __future__ import annotations

import copy
import json
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import fastdit
from fastdit.calibration.calibration_file import CALIBRATION_FORMAT, CALIBRATION_VERSION, CalibrationError
from fastdit.integrations.profiles import (FORMULA, ProfileError, SoftmaxAttention, apply_profile, profile_options,
                                           read_profile, sparse_attention_config, write_profile)
from fastdit.kernels import skip_reference
from fastdit.methods import OptionError, get_method

from layer_capture import LayerCapture
from tiny_transformers import tiny_wan, wan_inputs

mtsa = pytest.importorskip("modelopt.torch.sparsity.attention_sparsity",
                           reason="nvidia-modelopt is not installed (pip install -e '.[modelopt]'; CI installs it)")
from modelopt.torch.sparsity.attention_sparsity.plugins.sparse_attn_config import (  # noqa: E402
    load_from_checkpoint_metadata, match_sparse_config)

TARGET = 0.1  # within the sparsity the tiny model reaches below lambda = 1 (about 20 %)
def _peaked_wan(seed=3, gain=3.0):
    """The tiny Wan with its self-attention q / k norm gains raised, so that attention is peaked
    (random weights give near-uniform attention, which no threshold below the row maximum thins)."""
    model = tiny_wan(seed=seed)
    with torch.no_grad():
        for block in model.blocks:
            block.attn1.norm_q.weight.mul_(gain)
            block.attn1.norm_k.weight.mul_(gain)
    return model


def _inputs():
    return wan_inputs(frames=3, height=14, width=26, batch=1)  # grid (3, 7, 13): 273 tokens, odd


def _modelopt_export(tmp_path, disabled_steps=0):
    """ModelOpt calibrates skip-softmax on the tiny Wan (self-attention only) and exports it."""
    from modelopt.torch.export import export_hf_checkpoint

    model, inputs = _peaked_wan(), _inputs()

    def forward_loop(m):
        with torch.no_grad(), SoftmaxAttention():
            for t in (900.0, 400.0):
                m(**{**inputs, "timestep": torch.full((1,), t)})

    layer = {"method": "flash_skip_softmax", "br": 16, "bc": 16, "backend": "pytorch", "is_causal": False,
             "collect_stats": True, "enable": True}
    if disabled_steps:
        layer["initial_disabled_steps"] = disabled_steps
    config = {"sparse_cfg": {"calibration": {"target_sparse_ratio": {"prefill": TARGET, "decode": 0.0},
                                             "fit_logspace": True},
                             "*attn1*": layer, "default": {"enable": False}}}
    mtsa.sparsify(model, config, forward_loop=forward_loop)
    export_hf_checkpoint(model, export_dir=tmp_path)
    return tmp_path


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    return _modelopt_export(tmp_path_factory.mktemp("modelopt"))


# -- the method ----------------------------------------------------------------------------------
def _decaying(seed, heads=2, grid=(3, 5, 7), dim=16, width=9.0):
    """q, k, v whose scores fall off with token distance (video-like locality), so far key
    sub-tiles really fall below the running maximum; float32."""
    n = math.prod(grid)
    gen = torch.Generator().manual_seed(seed)
    pos = torch.arange(n, dtype=torch.float64)
    c = math.sqrt(dim) / (width * width)
    q = torch.randn(1, heads, n, dim, generator=gen, dtype=torch.float64) * 0.3
    k = torch.randn(1, heads, n, dim, generator=gen, dtype=torch.float64) * 0.3
    q[..., 0], q[..., 1], q[..., 2] = math.sqrt(c) * pos, -0.5 * math.sqrt(c) * pos**2 / n, math.sqrt(c) * n
    k[..., 0], k[..., 1], k[..., 2] = math.sqrt(c) * pos, math.sqrt(c) * n, -0.5 * math.sqrt(c) * pos**2 / n
    v = torch.randn(1, heads, n, dim, generator=gen, dtype=torch.float64)
    return q.float(), k.float(), v.float()


def _full_plan(n, block):
    blocks = -(-n // block)
    return (torch.arange(blocks, dtype=torch.int32).expand(1, 1, blocks, blocks).contiguous(),
            torch.full((1, 1, blocks), blocks, dtype=torch.int32))


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("form", ["skip_threshold", "scale_factor"])
def test_skip_softmax_is_the_skip_rule_over_every_block(backend, form):
    grid, block = (3, 5, 7), 16
    layout = fastdit.TokenLayout(grid)
    n = layout.seq_len
    q, k, v = _decaying(seed=7 if form == "scale_factor" else 8)
    threshold = 2.5
    option = {"skip_threshold": threshold} if form == "skip_threshold" else {"scale_factor": n * math.exp(-threshold)}
    out, info = fastdit.attention(q, k, v, "skip_softmax", layout=layout, block=block, backend=backend,
                                  return_info=True, **option)
    ref = skip_reference(q, k, v, *_full_plan(n, block), block, block, threshold)
    assert ref["margin"] > 1e-3  # no decision within float32 rounding
    skipped, walked = int(ref["skipped"].sum()), int(ref["walked"].sum())
    assert 0.2 * walked < skipped < walked  # really sparse, not empty
    assert torch.isfinite(out).all()
    assert torch.equal(info["skipped_subtiles"].long().cpu(), ref["skipped"])
    error = ((out.double() - ref["out"]).norm() / ref["out"].norm()).item()
    assert error < 1e-5
    dense = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
    assert ((out.double() - dense).norm() / dense.norm()).item() > 10 * error  # the skipping shows


def test_skip_softmax_threshold_follows_the_key_count():
    from fastdit.methods.skip_softmax import SkipSoftmaxConfig, threshold_for

    config = SkipSoftmaxConfig(scale_factor=40.0)
    config.validate()
    assert threshold_for(config, 4000) == pytest.approx(math.log(100.0))
    assert threshold_for(config, 30) == 0.0  # lambda >= 1: the most the engine's rule expresses
    assert get_method("skip_softmax").make_config().skip_threshold == pytest.approx(math.log(10.0))  # ModelOpt's 0.1


@pytest.mark.parametrize("options, words", [
    ({"skip_threshold": 2.0, "scale_factor": 10.0}, "not both"),
    ({"skip_threshold": -1.0}, "skip_threshold"),
    ({"scale_factor": 0.0}, "scale_factor"),
    ({"scale_factor": float("nan")}, "scale_factor"),
    ({"skip_threshold": 2.0, "correction": "pooled"}, "correction must be 'none'"),
    ({"skip_threshold": 2.0, "quant": "int8"}, "quant"),
    ({"skip_threshold": 2.0, "block": 8}, "block"),
])
def test_skip_softmax_bad_options(options, words):
    with pytest.raises((OptionError, ValueError), match=words):
        get_method("skip_softmax").make_config(**options)


# -- ModelOpt -> fastdit -------------------------------------------------------------------------
def test_modelopt_export_is_read(exported):
    data = json.loads((exported / "config.json").read_text())["sparse_attention_config"]
    group = data["config_groups"]["group_0"]
    assert data["producer"]["name"] == "modelopt" and group["algorithm"] == "skip_softmax"
    assert group["targets"] == ["WanAttention"] and group["ignore"] == ["blocks.0.attn2", "blocks.1.attn2"]
    params = group["threshold_scale_factor"]["prefill"]
    profile = read_profile(exported)  # the folder: its config.json
    assert profile.group.method == "skip_softmax"
    assert profile.group.options == {"scale_factor": pytest.approx(params["a"] * math.exp(params["b"] * TARGET)),
                                     "dense_steps": 0}
    assert read_profile(exported / "config.json").group.options == profile.group.options
    assert read_profile(data).group.options == profile.group.options
    lower = read_profile(exported, target_sparsity=0.05).group.options["scale_factor"]
    assert lower == pytest.approx(params["a"] * math.exp(params["b"] * 0.05))


def test_modelopt_profile_runs_as_its_skip_rule(exported, monkeypatch):
    """Each patched self-attention call equals the float64 skip walk at ModelOpt's threshold for its
    key count; cross-attention (in ``ignore``) is not patched by fastdit anyway."""
    profile = read_profile(exported)
    scale_factor = profile.group.options["scale_factor"]
    model, inputs = _peaked_wan(), _inputs()
    capture = LayerCapture(monkeypatch)
    with torch.no_grad():
        patch = apply_profile(model, profile, block=16, backend="torch")
        model(**inputs)
    assert len(capture.calls) == 2
    skipped = walked = 0
    for q, k, v, scale, out in capture.calls:
        threshold = math.log(k.shape[-2] / scale_factor)
        assert threshold > 0  # lambda < 1: no clamping
        ref = skip_reference(q, k, v, *_full_plan(q.shape[-2], 16), 16, 16, threshold, scale=scale)
        error = ((out.double() - ref["out"]).norm() / ref["out"].norm()).item()
        assert torch.isfinite(out).all() and error < 1e-5
        skipped, walked = skipped + int(ref["skipped"].sum()), walked + int(ref["walked"].sum())
    assert 0 < skipped < walked
    assert (patch.stats.skipped_subtiles, patch.stats.walked_subtiles) == (skipped, walked)  # counted by the patch
    assert patch.stats.as_dict()["skip"]["share"] == pytest.approx(skipped / walked)
    patch.remove()


def test_modelopt_disabled_steps_and_ignored_layers(tmp_path):
    path = _modelopt_export(tmp_path, disabled_steps=3)
    data = json.loads((path / "config.json").read_text())
    assert data["sparse_attention_config"]["config_groups"]["group_0"]["initial_disabled_steps"] == 3
    group = data["sparse_attention_config"]["config_groups"]["group_0"]
    group["ignore"].append("blocks.1.attn1")  # a self-attention layer kept dense
    method, options = profile_options(read_profile(data), tiny_wan())
    assert method == "skip_softmax" and options["dense_steps"] == 3 and options["layer_settings"] == {"0_1": None}


# -- fastdit -> ModelOpt -------------------------------------------------------------------------
def _plan(options, settings=None, heads=2, layers=2, grids=((3, 7, 13),)):
    return {"format": CALIBRATION_FORMAT, "version": CALIBRATION_VERSION, "method": "skip_softmax",
            "model": {"family": "wan", "transformer": "WanTransformer3DModel", "layers": layers, "heads": heads,
                      "grids": [list(g) for g in grids]},
            "options": options, "step_buckets": [0], "settings": settings or {"0_0": {}}}


@pytest.mark.parametrize("form", ["skip_threshold", "scale_factor"])
def test_fastdit_profile_is_read_by_modelopt(tmp_path, form):
    keys = 3 * 7 * 13
    options = {"skip_threshold": 3.0} if form == "skip_threshold" else {"scale_factor": 12.5}
    options["dense_steps"] = 2
    model = tiny_wan()
    (tmp_path / "config.json").write_text(json.dumps({"_class_name": "WanTransformer3DModel", "num_layers": 2}))
    written = write_profile(_plan(options, {"0_0": {}, "0_1": None}), tmp_path, model)
    data = json.loads((tmp_path / "config.json").read_text())
    assert data["num_layers"] == 2 and data["sparse_attention_config"] == written  # merged, not replaced

    resolved = load_from_checkpoint_metadata(SimpleNamespace(**data))
    assert resolved is not None
    sparse_cfg, preset = resolved
    assert preset == "CHECKPOINT_CALIBRATED_SOFTMAX_SKIP"
    assert match_sparse_config("blocks.0.attn1", sparse_cfg)["enable"] is True
    for dense in ("blocks.1.attn1", "blocks.0.attn2", "blocks.1.attn2"):
        assert match_sparse_config(dense, sparse_cfg) == {"enable": False}

    # ModelOpt's own runtime threshold from what it loaded
    from modelopt.torch.sparsity.attention_sparsity.methods.triton_skip_softmax import TritonSkipSoftmaxMethod

    layer = match_sparse_config("blocks.0.attn1", sparse_cfg)
    method = TritonSkipSoftmaxMethod({})
    method.calibration_params = {"prefill": layer["threshold_scale_factor"]["prefill"]}
    method.target_sparse_ratio = layer["target_sparse_ratio"]
    expected = math.exp(-3.0) if form == "skip_threshold" else 12.5 / keys
    assert method.get_inference_threshold(keys, keys) == pytest.approx(expected, rel=1e-9)
    assert written["config_groups"]["group_0"]["initial_disabled_steps"] == 2
    assert written["config_groups"]["group_0"]["threshold_scale_factor"]["formula"] == FORMULA

    # and fastdit reads its own profile back to the same settings
    method_name, back = profile_options(read_profile(tmp_path), model)
    assert method_name == "skip_softmax" and back["dense_steps"] == 2 and back["layer_settings"] == {"0_1": None}
    assert back["scale_factor"] == pytest.approx(keys * math.exp(-3.0) if form == "skip_threshold" else 12.5)


def test_per_layer_thresholds_write_the_strictest():
    """``fastdit calibrate`` picks a threshold per layer; ModelOpt's format has one: the strictest
    (smallest lambda, i.e. largest skip_threshold) keeps every layer within its budget."""
    keys = 3 * 7 * 13
    written = sparse_attention_config(_plan({"skip_threshold": 3.0}, {"0_0": {"skip_threshold": 5.0}, "0_1": {}}),
                                      tiny_wan())
    scale = written["config_groups"]["group_0"]["threshold_scale_factor"]["prefill"]["a"]
    assert scale == pytest.approx(keys * math.exp(-5.0), rel=1e-5)
    assert written["fastdit"]["scale_factors"] == {"0": pytest.approx(keys * math.exp(-5.0)),
                                                   "1": pytest.approx(keys * math.exp(-3.0))}
    dense_first = sparse_attention_config(_plan({"scale_factor": 50.0}, {"0_0": None, "0_1": {"scale_factor": 9.0}}),
                                          tiny_wan())  # a dense layer takes no part
    assert dense_first["config_groups"]["group_0"]["threshold_scale_factor"]["prefill"]["a"] == pytest.approx(9.0)


def test_calibrated_plan_is_written(tmp_path):
    """``fastdit.calibrate(..., "skip_softmax")`` on a tiny pipeline, then its plan as a profile that
    ModelOpt's loader resolves."""
    from fastdit.pipelines.tiny import TINY_TEST_DEFAULTS, tiny

    pipe = tiny("wan")
    call = {k: v for k, v in TINY_TEST_DEFAULTS["wan"].items() if k != "prompt"}
    plan = fastdit.calibrate(pipe, "skip_softmax", ["a red fox"], budget=0.5, out=str(tmp_path / "plan.json"),
                             call_kwargs=call, progress=False)
    assert plan["method"] == "skip_softmax"
    written = write_profile(tmp_path / "plan.json", tmp_path, pipe)
    resolved = load_from_checkpoint_metadata(SimpleNamespace(**json.loads((tmp_path / "config.json").read_text())))
    assert resolved is not None and resolved[1] == "CHECKPOINT_CALIBRATED_SOFTMAX_SKIP"
    assert written["fastdit"]["model"]["layers"] == 4


# -- bad input -----------------------------------------------------------------------------------
def _profile(**group):
    return {"config_groups": {"group_0": {"algorithm": "skip_softmax", "targets": ["WanAttention"], **group}},
            "producer": {"name": "modelopt", "version": "0.47.0"}}


@pytest.mark.parametrize("algorithm", ["sparse_softmax", "nsa"])
def test_unknown_algorithm_names_it_and_fastdit_s(algorithm):
    with pytest.raises(ProfileError, match=rf"algorithm '{algorithm}'.*skip_softmax.*methods are \[.*'sta'"):
        read_profile(_profile(algorithm=algorithm))


def test_vsa_profile_runs_fastdit_s_vsa_or_says_it_is_missing():
    """ModelOpt's VSA keys (``block_size_3d``, ``top_k_ratio``) become fastdit's ``vsa`` options;
    without a ``vsa`` method the read names the algorithm and says fastdit does not have it yet."""
    from fastdit.methods import register_method, unregister_method

    profile = _profile(algorithm="vsa", block_size_3d=[1, 2, 2], top_k_ratio=0.5,
                       ignore=["blocks.0.attn2", "blocks.1.attn2"])
    model, inputs = tiny_wan(), _inputs()
    method, options = profile_options(read_profile(profile), model)
    assert method == "vsa" and options == {"block_size_3d": (1, 2, 2), "top_k_ratio": 0.5}
    with torch.no_grad():
        patch = apply_profile(model, read_profile(profile), backend="torch")
        out = model(**inputs).sample
    assert torch.isfinite(out).all() and patch.stats.sparse_calls == 2 and patch.stats.sparse_density < 0.9
    patch.remove()
    with pytest.raises(ProfileError, match=r"config_groups.group_0: top_k_ratio must be a number in \(0, 1\]"):
        read_profile(_profile(algorithm="vsa", top_k_ratio=1.5))
    vsa = get_method("vsa")
    unregister_method("vsa")
    try:
        with pytest.raises(ProfileError, match=r"algorithm 'vsa' runs as fastdit's method 'vsa', which this fastdit "
                                               r"does not have yet; its methods are \["):
            read_profile(profile)
    finally:
        register_method(vsa)


def test_uncalibrated_skip_softmax_is_modelopt_s_static_default():
    options = read_profile(_profile(threshold_scale_factor={"formula": FORMULA})).group.options
    assert options == {"skip_threshold": pytest.approx(-math.log(0.1)), "dense_steps": 0}


def test_profile_for_another_model_names_both(tmp_path):
    model = tiny_wan()
    written = sparse_attention_config(_plan({"skip_threshold": 3.0}), model)
    other = copy.deepcopy(written)
    other["fastdit"]["model"]["heads"] = 12
    with pytest.raises(CalibrationError, match="number of attention heads is 2 but the profile was made for 12"):
        profile_options(read_profile(other), model)
    other = copy.deepcopy(written)
    other["fastdit"]["model"]["layers"] = 40
    with pytest.raises(ProfileError, match="layers is 2 but the profile was made for 40"):
        apply_profile(model, read_profile(other))
    with pytest.raises(ProfileError, match=r"'blocks.39.attn1'.*blocks.0.attn1 .. blocks.1.attn1"):
        profile_options(read_profile(_profile(ignore=["blocks.39.attn1"])), model)
    with pytest.raises(ProfileError, match=r"\['LlamaAttention'\].*\['WanAttention'\]"):
        profile_options(read_profile(_profile(targets=["LlamaAttention"])), model)
    with pytest.raises(CalibrationError, match="heads"):  # the plan's own check when writing
        sparse_attention_config(_plan({"skip_threshold": 3.0}, heads=12), model)


def test_bad_profiles_and_plans(tmp_path):
    model = tiny_wan()
    with pytest.raises(ProfileError, match="no sparse_attention_config"):
        read_profile({"_class_name": "WanTransformer3DModel"})
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ProfileError, match="not valid JSON"):
        read_profile(tmp_path)
    (tmp_path / "config.json").write_bytes(b'{"a": "\xff"}')  # not UTF-8: named, not a bare UnicodeDecodeError
    with pytest.raises(ProfileError, match=r"profile .*config\.json: not UTF-8 text"):
        read_profile(tmp_path)
    with pytest.raises(ProfileError, match="initial_disabled_steps"):
        read_profile(_profile(initial_disabled_steps=-1))
    with pytest.raises(ProfileError, match="a must be a finite"):
        read_profile(_profile(threshold_scale_factor={"prefill": {"a": float("nan"), "b": 1.0}}))
    with pytest.raises(ProfileError, match="one method per model"):
        read_profile({"config_groups": {"a": _profile()["config_groups"]["group_0"],
                                        "b": _profile()["config_groups"]["group_0"]}})
    sparge = {**_plan({}), "method": "sparge", "settings": {"0_0": {"cdf": 0.9}}}
    with pytest.raises(ProfileError, match="method 'sparge'.*skip_softmax"):
        sparse_attention_config(sparge, model)
    with pytest.raises(ProfileError, match="no step buckets"):
        sparse_attention_config({**_plan({"skip_threshold": 3.0}, {"0_0": {}, "2_1": None}), "step_buckets": [0, 2]},
                                model)
    with pytest.raises(ProfileError, match=r"sets \['block'\]"):
        sparse_attention_config(_plan({"skip_threshold": 3.0}, {"0_0": {"block": 32}}), model)
    with pytest.raises(ProfileError, match="pass keys="):
        sparse_attention_config(_plan({"skip_threshold": 3.0}, grids=()), model)
    with pytest.raises(ProfileError, match="sets option"):
        apply_profile(model, read_profile(_profile()), dense_steps=1)


def test_cli_profile_export_and_show(tmp_path, capsys):
    from fastdit.cli import main

    plan = _plan({"skip_threshold": 3.0, "dense_steps": 1}, {"0_0": {}, "0_1": None}, grids=((3, 10, 14),))
    plan["model"]["layers"] = 4
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    out = tmp_path / "exported" / "transformer"  # made when missing
    assert main(["profile", "export", str(tmp_path / "plan.json"), "--model", "tiny-wan", "--out", str(out)]) == 0
    data = json.loads((out / "config.json").read_text())
    assert data["sparse_attention_config"]["config_groups"]["group_0"]["initial_disabled_steps"] == 1
    capsys.readouterr()
    assert main(["profile", "show", str(out), "--model", "tiny-wan"]) == 0
    shown = capsys.readouterr().out
    assert "algorithm skip_softmax -> fastdit method skip_softmax" in shown
    assert "'layer_settings': {'0_1': None}" in shown and "'dense_steps': 1" in shown
    with pytest.raises(SystemExit) as exit_info:
        main(["profile", "show", str(tmp_path / "missing")])
    assert exit_info.value.code == 1
    assert "cannot read it" in capsys.readouterr().err
    sparge = {**plan, "method": "sparge", "options": {}, "settings": {"0_0": {"cdf": 0.9}}}
    (tmp_path / "sparge.json").write_text(json.dumps(sparge))
    with pytest.raises(SystemExit):
        main(["profile", "export", str(tmp_path / "sparge.json"), "--model", "tiny-wan", "--out", str(out)])
    assert "method 'sparge'" in capsys.readouterr().err


def test_profile_steps_and_layers_in_a_pipeline_run():
    """initial_disabled_steps and ignored self-attention layers, counted in a real pipeline call:
    the tiny Wan (4 layers), 2 steps, CFG as two calls."""
    from fastdit.pipelines.tiny import TINY_TEST_DEFAULTS, tiny

    pipe = tiny("wan")
    profile = _profile(ignore=[f"blocks.{i}.attn2" for i in range(4)] + ["blocks.3.attn1"], initial_disabled_steps=1,
                       threshold_scale_factor={"formula": FORMULA, "prefill": {"a": 1.0, "b": 2.0}})
    patch = apply_profile(pipe, read_profile(profile), backend="torch")
    call = {**TINY_TEST_DEFAULTS["wan"], "num_inference_steps": 2, "prompt": "a red fox"}
    pipe(generator=torch.Generator().manual_seed(0), output_type="latent", **call)
    assert (patch.stats.dense_calls, patch.stats.sparse_calls) == (8 + 2, 6)  # step 0 all dense; layer 3 dense
    assert patch.stats.walked_subtiles > 0
    patch.remove()
