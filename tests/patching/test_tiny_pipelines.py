"""Tiny built-in pipelines (fastdit.pipelines.tiny): build, run, shapes, prompts, determinism."""

import numpy as np
import pytest
import torch

from fastdit.pipelines.tiny import (
    TINY_DEFAULTS,
    TINY_MODELS,
    TINY_TEST_DEFAULTS,
    tiny,
    tiny_tokenizer,
    tiny_transformer,
)

_PIPELINE_CLASSES = {
    "wan": "WanPipeline",
    "wan_i2v": "WanImageToVideoPipeline",
    "hunyuan_video": "HunyuanVideoPipeline",
}


@pytest.fixture(scope="module")
def pipes():
    built = {}

    def get(name):
        if name not in built:
            pipe = tiny(name)
            pipe.set_progress_bar_config(disable=True)
            built[name] = pipe
        return built[name]

    return get


def _run(pipe, name, prompt, **extra):
    kwargs = {**TINY_TEST_DEFAULTS[name], **extra}
    # prompt by keyword: WanImageToVideoPipeline takes `image` as its first positional argument
    return pipe(prompt=prompt, **kwargs, output_type="np",
                generator=torch.Generator().manual_seed(0)).frames


def _expected_shape(kwargs):
    return (1, kwargs["num_frames"], kwargs["height"], kwargs["width"], 3)


def test_models_and_defaults_listed():
    assert set(TINY_MODELS) == set(_PIPELINE_CLASSES)
    assert set(TINY_DEFAULTS) == set(TINY_MODELS) == set(TINY_TEST_DEFAULTS)
    for name in TINY_MODELS:
        for table in (TINY_DEFAULTS, TINY_TEST_DEFAULTS):
            kw = table[name]
            assert kw["height"] % 16 == 0 and kw["width"] % 16 == 0
            assert (kw["num_frames"] - 1) % 4 == 0
        # default grid: several thousand video tokens
        kw = TINY_DEFAULTS[name]
        tokens = ((kw["num_frames"] - 1) // 4 + 1) * (kw["height"] // 16) * (kw["width"] // 16)
        assert 4000 <= tokens <= 8000
    assert TINY_DEFAULTS["wan_i2v"]["max_sequence_length"] == 512  # hardcoded in the Wan processor


@pytest.mark.parametrize("name", TINY_MODELS)
def test_pipeline_runs_and_prompts_matter(pipes, name):
    pipe = pipes(name)
    assert type(pipe).__name__ == _PIPELINE_CLASSES[name]
    a = _run(pipe, name, "a red fox runs through the snow")
    shape = _expected_shape(TINY_TEST_DEFAULTS[name])
    assert a.shape == shape
    assert a.dtype == np.float32
    assert np.isfinite(a).all()
    assert 0.0 <= a.min() and a.max() <= 1.0
    b = _run(pipe, name, "a blue boat on a calm lake at sunset")
    assert b.shape == shape
    assert np.abs(a - b).max() > 1e-6, "different prompts gave identical videos"
    # same prompt, same generator seed -> identical output
    a2 = _run(pipe, name, "a red fox runs through the snow")
    np.testing.assert_array_equal(a, a2)


@pytest.mark.parametrize("name", ["wan", "hunyuan_video"])
def test_other_odd_grid(pipes, name):
    # 2 x 3 x 5 latent token grid, 1 step
    kw = dict(num_frames=5, height=48, width=80, num_inference_steps=1)
    out = _run(pipes(name), name, "a cat", **kw)
    assert out.shape == (1, 5, 48, 80, 3)
    assert np.isfinite(out).all()


def test_wan_i2v_image_branch():
    tr = tiny_transformer("wan_i2v")
    inner = tr.config.num_attention_heads * tr.config.attention_head_dim
    assert tr.config.added_kv_proj_dim == inner
    assert tr.config.image_dim is not None
    assert tr.blocks[0].attn2.add_k_proj is not None
    assert tr.config.in_channels == 2 * tr.config.out_channels + 4


def test_hunyuan_has_double_and_single_blocks_and_template_crop():
    from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE

    tr = tiny_transformer("hunyuan_video")
    assert len(tr.transformer_blocks) >= 1 and len(tr.single_transformer_blocks) >= 1
    assert sum(tr.config.rope_axes_dim) == tr.config.attention_head_dim
    # the pipeline crops the first `crop_start` tokens of the templated prompt: the tiny Llama
    # tokenizer must produce exactly that many tokens for the template prefix
    tok = tiny_tokenizer("llama")
    prefix = DEFAULT_PROMPT_TEMPLATE["template"].split("{}")[0]
    assert len(tok(prefix).input_ids) == DEFAULT_PROMPT_TEMPLATE["crop_start"]
    ids = tok(DEFAULT_PROMPT_TEMPLATE["template"].format("a red fox")).input_ids
    crop = DEFAULT_PROMPT_TEMPLATE["crop_start"]
    assert tok.convert_ids_to_tokens(ids[crop:crop + 3]) == ["a", "red", "fox"]


def test_tokenizers_distinguish_unknown_words():
    for kind in ("llama", "t5", "clip"):
        tok = tiny_tokenizer(kind)
        assert tok.pad_token_id is not None and tok.eos_token_id is not None
        assert tok.bos_token_id is not None and tok.unk_token_id is not None
        x, y = tok("zyxwv qrstu").input_ids, tok("abcde fghij").input_ids
        assert x != y
        assert tok.unk_token_id not in x


@pytest.mark.parametrize("name", TINY_MODELS)
def test_construction_is_deterministic(name):
    state = torch.get_rng_state()
    p1, p2 = tiny(name), tiny(name)
    assert torch.equal(torch.get_rng_state(), state), "tiny() changed the global RNG state"
    for comp in ("transformer", "vae", "text_encoder", "text_encoder_2", "image_encoder"):
        m1, m2 = getattr(p1, comp, None), getattr(p2, comp, None)
        if m1 is None:
            continue
        s1, s2 = m1.state_dict(), m2.state_dict()
        assert s1.keys() == s2.keys()
        for k in s1:
            assert torch.equal(s1[k], s2[k]), f"{name}.{comp}.{k} differs between builds"
    # the standalone transformer has the same weights as the pipeline's
    t = tiny_transformer(name).state_dict()
    for k, v in p1.transformer.state_dict().items():
        assert torch.equal(t[k], v), k
    # another seed gives other weights
    other = tiny_transformer(name, seed=1).state_dict()
    assert any(not torch.equal(other[k], t[k]) for k in t)


def test_overrides():
    tr = tiny_transformer("hunyuan_video", attention_head_dim=32, num_layers=1, num_single_layers=1)
    assert sum(tr.config.rope_axes_dim) == 32
    tr = tiny_transformer("wan_i2v", num_attention_heads=3)
    assert tr.config.added_kv_proj_dim == 3 * tr.config.attention_head_dim
    with pytest.raises(ValueError, match="unknown override"):
        tiny_transformer("wan", not_a_key=1)


def test_unknown_name():
    for fn in (tiny, tiny_transformer):
        with pytest.raises(ValueError) as err:
            fn("sdxl")
        msg = str(err.value)
        assert "sdxl" in msg
        for name in TINY_MODELS:
            assert name in msg
