"""Tiny, offline, randomly initialised diffusers video DiT pipelines.

Everything is built from configs in code (no hub access, no weights): the
transformer, the VAE, the text encoder(s), the image encoder and the
tokenizers (small WordPiece tokenizers over a built-in English vocabulary
with a per-character fallback, so any ASCII prompt tokenizes and different
prompts give different embeddings).

API
---
``tiny(name, seed=0, **overrides) -> DiffusionPipeline``
    Build a whole pipeline (fp32, CPU, eval mode).  ``name`` is one of
    :data:`TINY_MODELS`.
``tiny_transformer(name, seed=0, **overrides)``
    Build only the transformer; its weights are identical to
    ``tiny(name, seed=seed, **overrides).transformer``.
``TINY_DEFAULTS[name]``
    Call arguments for ``pipe(prompt=prompt, **TINY_DEFAULTS[name], output_type="np")``
    sized so that attention dominates the run time on a small CPU: a
    8 x 24 x 32 = 6144-token latent grid (29 frames of 384 x 512), 4 transformer
    layers (HunyuanVideo: 2 double- + 2 single-stream), 2 heads of dim 64,
    5 CFG steps (Wan) / 8 guidance-distilled steps (HunyuanVideo), tiny VAE and
    text encoders.  On 2 CPU cores a dense run takes about 13-20 s with 55-70 %
    of it in ``F.scaled_dot_product_attention``.
    Pass the prompt BY KEYWORD: ``WanImageToVideoPipeline.__call__`` takes
    ``image`` as its first positional argument.
``TINY_TEST_DEFAULTS[name]``
    Same, with a very small, odd latent token grid (3x5x7 = 105 tokens) and
    2 inference steps, for unit tests.

Overrides
---------
Plain keyword overrides go to the transformer config
(e.g. ``tiny("wan", num_layers=4, attention_head_dim=32)``).  Per-component
config overrides are passed as dicts under the component name: ``vae=``,
``text_encoder=``, ``text_encoder_2=``, ``image_encoder=``, ``scheduler=``.
Derived values are kept consistent automatically unless given explicitly:
Wan I2V ``added_kv_proj_dim`` (= inner dim), HunyuanVideo ``rope_axes_dim``
(must sum to ``attention_head_dim``), ``text_dim`` / ``text_embed_dim`` /
``pooled_projection_dim`` / ``image_dim`` / ``in_channels`` from the encoder
and VAE configs.

Size granularity
----------------
All three pipelines use a VAE with spatial factor 8 and temporal factor 4 and
a transformer patch of (t, h, w) = (1, 2, 2):

* ``height`` and ``width`` must be multiples of 16 (8 * 2); the Wan I2V and
  HunyuanVideo pipelines raise otherwise, Wan T2V rounds down with a warning.
  Any multiple of 16 works, including odd token counts (e.g. 80 -> 5 tokens).
* ``num_frames`` must be ``4k + 1`` (Wan rounds otherwise, HunyuanVideo
  silently gives ``(num_frames - 1) // 4 + 1`` latent frames).
* Latent token grid: ``((num_frames - 1) // 4 + 1, height // 16, width // 16)``.

Pipeline notes
--------------
* ``wan_i2v``: the Wan attention processor hard-codes a text context of 512
  tokens (``encoder_hidden_states.shape[1] - 512`` is taken as the image
  context), so ``max_sequence_length`` must stay at the pipeline default 512.
  An ``image`` (PIL or tensor) is required; ``TINY_DEFAULTS["wan_i2v"]``
  carries a small deterministic one (:func:`tiny_image`).
* ``hunyuan_video``: the default prompt template (``crop_start=95``) works
  unchanged: the tiny Llama tokenizer is built so that the template prefix is
  exactly 95 tokens, like the real Llama 3 tokenizer.  Text tokens are
  appended AFTER the video tokens in the joint attention of both double- and
  single-stream blocks; a boolean key mask ``[B, 1, 1, N_video + N_text]``
  masks padded text tokens.  The guidance scale is embedded (one transformer
  pass per step); true CFG only runs with ``true_cfg_scale > 1`` and a
  negative prompt.
* Wan (T2V and I2V) runs classifier-free guidance as two transformer passes
  per step when ``guidance_scale > 1``; text tokens are only in cross-attention
  (``attn2``), self-attention (``attn1``) is over video tokens only, no mask.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import torch

from .tiny_tokenizers import tiny_tokenizer

__all__ = [
    "TINY_MODELS",
    "TINY_DEFAULTS",
    "TINY_TEST_DEFAULTS",
    "native_call",
    "tiny",
    "tiny_transformer",
    "tiny_tokenizer",
    "tiny_image",
]

TINY_MODELS: tuple[str, ...] = ("wan", "wan_i2v", "hunyuan_video")

# --------------------------------------------------------------------------- #
# Component configs
# --------------------------------------------------------------------------- #

_Z = 4  # latent channels of both tiny VAEs
_TEXT_DIM = 32  # hidden size of all tiny text encoders
_IMAGE_DIM = 32  # hidden size of the tiny CLIP vision encoder

_WAN_TRANSFORMER = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=2,
    attention_head_dim=64,
    in_channels=_Z,
    out_channels=_Z,
    text_dim=_TEXT_DIM,
    freq_dim=64,
    ffn_dim=256,
    num_layers=4,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    eps=1e-6,
    image_dim=None,
    added_kv_proj_dim=None,
    rope_max_seq_len=1024,
)

_WAN_I2V_TRANSFORMER = dict(
    _WAN_TRANSFORMER,
    in_channels=2 * _Z + 4,  # noise latents + VAE-encoded condition + 4 mask channels
    image_dim=_IMAGE_DIM,
    added_kv_proj_dim=None,  # derived: inner dim (num_heads * head_dim), as in Wan 2.1 I2V
)

_HUNYUAN_TRANSFORMER = dict(
    in_channels=_Z,
    out_channels=_Z,
    num_attention_heads=2,
    attention_head_dim=64,
    num_layers=2,
    num_single_layers=2,
    num_refiner_layers=1,
    mlp_ratio=2.0,
    patch_size=2,
    patch_size_t=1,
    qk_norm="rms_norm",
    guidance_embeds=True,
    text_embed_dim=_TEXT_DIM,
    pooled_projection_dim=_TEXT_DIM,
    rope_theta=256.0,
    rope_axes_dim=None,  # derived from attention_head_dim: (16, 24, 24) for 64
)

_WAN_VAE = dict(
    base_dim=2,
    z_dim=_Z,
    dim_mult=[1, 1, 1, 1],
    num_res_blocks=0,  # decoder still has one res block per stage
    attn_scales=[],
    temperal_downsample=[False, True, True],
    latents_mean=[0.0] * _Z,
    latents_std=[1.0] * _Z,
)

_HUNYUAN_VAE = dict(
    in_channels=3,
    out_channels=3,
    latent_channels=_Z,
    down_block_types=("HunyuanVideoDownBlock3D",) * 4,
    up_block_types=("HunyuanVideoUpBlock3D",) * 4,
    block_out_channels=(2, 2, 2, 2),
    layers_per_block=0,  # decoder still has one resnet per up block
    norm_num_groups=1,
    scaling_factor=0.476986,
    spatial_compression_ratio=8,
    temporal_compression_ratio=4,
    # the mid-block attention of this VAE is full attention over ALL latent
    # tokens of the video with a frame-causal mask; far too costly here.
    mid_block_add_attention=False,
)

_UMT5 = dict(d_model=_TEXT_DIM, d_kv=16, d_ff=64, num_layers=2, num_heads=2,
             relative_attention_num_buckets=8, relative_attention_max_distance=32,
             dropout_rate=0.0, feed_forward_proj="gated-gelu", is_encoder_decoder=False)
_LLAMA = dict(hidden_size=_TEXT_DIM, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=1024,
              rms_norm_eps=1e-5)
_CLIP_TEXT = dict(hidden_size=_TEXT_DIM, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, max_position_embeddings=77, projection_dim=_TEXT_DIM)
_CLIP_VISION = dict(hidden_size=_IMAGE_DIM, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=2, image_size=32, patch_size=8, projection_dim=_IMAGE_DIM)

_WAN_SCHEDULER = dict(prediction_type="flow_prediction", use_flow_sigmas=True,
                      num_train_timesteps=1000, flow_shift=3.0)
_HUNYUAN_SCHEDULER = dict(shift=7.0)

_TRANSFORMER_CONFIGS = {
    "wan": _WAN_TRANSFORMER,
    "wan_i2v": _WAN_I2V_TRANSFORMER,
    "hunyuan_video": _HUNYUAN_TRANSFORMER,
}

_COMPONENTS = {
    "wan": ("vae", "text_encoder", "scheduler"),
    "wan_i2v": ("vae", "text_encoder", "image_encoder", "scheduler"),
    "hunyuan_video": ("vae", "text_encoder", "text_encoder_2", "scheduler"),
}

# --------------------------------------------------------------------------- #
# Call arguments
# --------------------------------------------------------------------------- #


def tiny_image(height: int = 64, width: int = 64):
    """A deterministic smooth RGB PIL image (the conditioning frame for wan_i2v)."""
    import numpy as np
    from PIL import Image

    y = np.linspace(0.0, 1.0, height, dtype=np.float32)[:, None]
    x = np.linspace(0.0, 1.0, width, dtype=np.float32)[None, :]
    rgb = np.stack([
        0.5 + 0.5 * np.sin(6.0 * x + 2.0 * y),
        0.5 + 0.5 * np.cos(4.0 * y - 3.0 * x),
        0.25 + 0.5 * x * y + 0.0 * x,
    ], axis=-1)
    return Image.fromarray((np.clip(rgb, 0, 1) * 255).astype(np.uint8))


# Latent token grid (T, H, W) = ((num_frames - 1) // 4 + 1, height // 16, width // 16).
# Default: 8 x 24 x 32 = 6144 video tokens (29 frames of 384 x 512).
TINY_DEFAULTS: dict[str, dict[str, Any]] = {
    "wan": dict(num_frames=29, height=384, width=512, num_inference_steps=5,
                guidance_scale=5.0, max_sequence_length=64),
    "wan_i2v": dict(image=tiny_image(64, 64), num_frames=29, height=384, width=512,
                    num_inference_steps=5, guidance_scale=5.0, max_sequence_length=512),
    "hunyuan_video": dict(num_frames=29, height=384, width=512, num_inference_steps=8,
                          guidance_scale=6.0, max_sequence_length=64),
}

# Test size: 3 x 5 x 7 = 105 video tokens (odd in every axis), 2 steps.
TINY_TEST_DEFAULTS: dict[str, dict[str, Any]] = {
    "wan": dict(num_frames=9, height=80, width=112, num_inference_steps=2,
                guidance_scale=5.0, max_sequence_length=16),
    "wan_i2v": dict(image=tiny_image(32, 32), num_frames=9, height=80, width=112,
                    num_inference_steps=2, guidance_scale=5.0, max_sequence_length=512),
    "hunyuan_video": dict(num_frames=9, height=80, width=112, num_inference_steps=2,
                          guidance_scale=6.0, max_sequence_length=16),
}

# --------------------------------------------------------------------------- #
# Builders
# --------------------------------------------------------------------------- #

_SEED_OFFSET = {"transformer": 0, "vae": 1, "text_encoder": 2, "text_encoder_2": 3, "image_encoder": 4}


@contextlib.contextmanager
def _seeded(seed: int):
    """Seed the CPU RNG for the block and restore the caller's RNG state afterwards."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def _check_name(name: str) -> None:
    if name not in TINY_MODELS:
        raise ValueError(f"unknown tiny model {name!r}; expected one of {TINY_MODELS}")


def _rope_axes(head_dim: int) -> tuple[int, int, int]:
    """Split head_dim into (t, h, w) even rope dims summing to head_dim (64 -> 16, 24, 24)."""
    if head_dim % 2 or head_dim < 6:
        raise ValueError(f"HunyuanVideo attention_head_dim must be even and >= 6, got {head_dim}")
    t = max(2, (head_dim // 4) // 2 * 2)
    hw = (head_dim - t) // 2 // 2 * 2
    t = head_dim - 2 * hw
    return (t, hw, hw)


def _split_overrides(name: str, overrides: dict[str, Any]):
    comp_over: dict[str, dict[str, Any]] = {}
    tr_over: dict[str, Any] = {}
    valid_comp = _COMPONENTS[name]
    tr_keys = set(_TRANSFORMER_CONFIGS[name])
    for k, v in overrides.items():
        if k in valid_comp:
            if not isinstance(v, dict):
                raise TypeError(f"override {k}= must be a dict of config values, got {type(v).__name__}")
            comp_over[k] = dict(v)
        elif k in tr_keys:
            tr_over[k] = v
        else:
            raise ValueError(
                f"unknown override {k!r} for tiny({name!r}); transformer config keys: {sorted(tr_keys)}; "
                f"component config dicts: {list(valid_comp)}"
            )
    return tr_over, comp_over


def _transformer_config(name: str, tr_over: dict[str, Any], comp_over: dict[str, dict[str, Any]]) -> dict:
    cfg = copy.deepcopy(_TRANSFORMER_CONFIGS[name])
    # keep dims consistent with (possibly overridden) encoders / VAE
    if name in ("wan", "wan_i2v"):
        te = {**_UMT5, **comp_over.get("text_encoder", {})}
        cfg["text_dim"] = te["d_model"]
        z = {**_WAN_VAE, **comp_over.get("vae", {})}["z_dim"]
        cfg["in_channels"] = z if name == "wan" else 2 * z + 4
        cfg["out_channels"] = z
        if name == "wan_i2v":
            cfg["image_dim"] = {**_CLIP_VISION, **comp_over.get("image_encoder", {})}["hidden_size"]
    else:
        cfg["text_embed_dim"] = {**_LLAMA, **comp_over.get("text_encoder", {})}["hidden_size"]
        cfg["pooled_projection_dim"] = {**_CLIP_TEXT, **comp_over.get("text_encoder_2", {})}["hidden_size"]
        z = {**_HUNYUAN_VAE, **comp_over.get("vae", {})}["latent_channels"]
        cfg["in_channels"] = cfg["out_channels"] = z
    cfg.update(tr_over)
    if name == "wan_i2v" and cfg.get("added_kv_proj_dim") is None:
        cfg["added_kv_proj_dim"] = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    if name == "hunyuan_video" and cfg.get("rope_axes_dim") is None:
        cfg["rope_axes_dim"] = _rope_axes(cfg["attention_head_dim"])
    return cfg


def _build_transformer(name: str, cfg: dict, seed: int):
    from diffusers import HunyuanVideoTransformer3DModel, WanTransformer3DModel

    cls = HunyuanVideoTransformer3DModel if name == "hunyuan_video" else WanTransformer3DModel
    with _seeded(seed + _SEED_OFFSET["transformer"]):
        model = cls(**cfg)
    return model.eval()  # fp32 already (default dtype); .to() would warn about fp32 modules


def tiny_transformer(name: str, seed: int = 0, **overrides):
    """Only the transformer of ``tiny(name, seed, **overrides)`` (same weights)."""
    _check_name(name)
    tr_over, comp_over = _split_overrides(name, overrides)
    return _build_transformer(name, _transformer_config(name, tr_over, comp_over), seed)


def _seeded_model(factory, seed: int, key: str):
    with _seeded(seed + _SEED_OFFSET[key]):
        model = factory()
    return model.eval()  # fp32 already (default dtype); .to() would warn about fp32 modules


def tiny(name: str, seed: int = 0, **overrides):
    """Build the tiny pipeline ``name`` (one of :data:`TINY_MODELS`), fp32 on CPU.

    Construction is deterministic for a given ``seed`` and leaves the global
    torch RNG state untouched.  See the module docstring for overrides, sizes
    and pipeline notes; run it as ``pipe(prompt, **TINY_DEFAULTS[name])``.

    The pipeline carries its native call, ``TINY_DEFAULTS[name]`` without the image, as
    ``pipe._fastdit_call_defaults`` (as ``load_trained`` does for the trained models):
    ``fastdit.optimize_noise``, ``fastdit.calibrate`` and ``fastdit.compare`` fill the sizes and
    steps a caller leaves out from it (see :func:`native_call`). A bare ``pipe(prompt)`` still runs
    at diffusers' defaults (50 steps, 81 frames of 480 x 832: minutes per step on a CPU): the
    defaults are those of the pipeline class's ``__call__``, which no instance attribute changes.
    """
    pipe = _build(name, seed, **overrides)
    pipe._fastdit_call_defaults = {k: v for k, v in TINY_DEFAULTS[name].items() if k != "image"}
    return pipe


def native_call(pipe, call_kwargs=None):
    """``call_kwargs`` over the native call ``pipe`` carries (``_fastdit_call_defaults``: the tiny and
    trained built-in models), so a size or step count the caller leaves out is the model's own,
    not the pipeline class's default (50 steps at full size: minutes per step on a CPU). A pipeline
    without one (a hub model) gets ``call_kwargs`` unchanged."""
    return {**dict(getattr(pipe, "_fastdit_call_defaults", None) or {}), **dict(call_kwargs or {})}


def _build(name: str, seed: int = 0, **overrides):
    _check_name(name)
    tr_over, comp_over = _split_overrides(name, overrides)
    transformer = _build_transformer(name, _transformer_config(name, tr_over, comp_over), seed)

    def cfg(base: dict, key: str) -> dict:
        return {**copy.deepcopy(base), **comp_over.get(key, {})}

    if name in ("wan", "wan_i2v"):
        from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanImageToVideoPipeline, WanPipeline
        from transformers import UMT5Config, UMT5EncoderModel

        tokenizer = tiny_tokenizer("t5")
        vae_cfg = cfg(_WAN_VAE, "vae")
        z = vae_cfg["z_dim"]
        vae_cfg.setdefault("latents_mean", [0.0] * z)
        vae_cfg.setdefault("latents_std", [1.0] * z)
        if len(vae_cfg["latents_mean"]) != z:
            vae_cfg["latents_mean"], vae_cfg["latents_std"] = [0.0] * z, [1.0] * z
        vae = _seeded_model(lambda: AutoencoderKLWan(**vae_cfg), seed, "vae")
        te_cfg = UMT5Config(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                            eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=tokenizer.pad_token_id,
                            **cfg(_UMT5, "text_encoder"))
        text_encoder = _seeded_model(lambda: UMT5EncoderModel(te_cfg), seed, "text_encoder")
        scheduler = UniPCMultistepScheduler(**cfg(_WAN_SCHEDULER, "scheduler"))
        if name == "wan":
            return WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae,
                               transformer=transformer, scheduler=scheduler)

        from transformers import CLIPVisionConfig, CLIPVisionModel

        try:  # transformers >= 5 without torchvision: the PIL backend, without the fallback warning
            from transformers import CLIPImageProcessorPil as _ImageProcessor
        except ImportError:  # pragma: no cover - older transformers
            from transformers import CLIPImageProcessor as _ImageProcessor
        ve_cfg = CLIPVisionConfig(**cfg(_CLIP_VISION, "image_encoder"))
        image_encoder = _seeded_model(lambda: CLIPVisionModel(ve_cfg), seed, "image_encoder")
        side = ve_cfg.image_size
        image_processor = _ImageProcessor(size={"shortest_edge": side}, crop_size={"height": side, "width": side})
        return WanImageToVideoPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae,
                                       transformer=transformer, scheduler=scheduler,
                                       image_processor=image_processor, image_encoder=image_encoder)

    # hunyuan_video
    from diffusers import AutoencoderKLHunyuanVideo, FlowMatchEulerDiscreteScheduler, HunyuanVideoPipeline
    from transformers import CLIPTextConfig, CLIPTextModel, LlamaConfig, LlamaModel

    tokenizer = tiny_tokenizer("llama")
    tokenizer_2 = tiny_tokenizer("clip")
    vae_cfg = cfg(_HUNYUAN_VAE, "vae")
    vae = _seeded_model(lambda: AutoencoderKLHunyuanVideo(**vae_cfg), seed, "vae")
    # Decode all latent frames in one go: the default frame-wise decoding re-decodes overlapping
    # temporal tiles (about 1.6x the work) to save memory, which this tiny VAE does not need.
    vae.use_framewise_decoding = False
    llama_cfg = LlamaConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                            **cfg(_LLAMA, "text_encoder"))
    text_encoder = _seeded_model(lambda: LlamaModel(llama_cfg), seed, "text_encoder")
    clip_cfg = CLIPTextConfig(vocab_size=len(tokenizer_2), bos_token_id=tokenizer_2.bos_token_id,
                              eos_token_id=tokenizer_2.eos_token_id, pad_token_id=tokenizer_2.pad_token_id,
                              **cfg(_CLIP_TEXT, "text_encoder_2"))
    text_encoder_2 = _seeded_model(lambda: CLIPTextModel(clip_cfg), seed, "text_encoder_2")
    scheduler = FlowMatchEulerDiscreteScheduler(**cfg(_HUNYUAN_SCHEDULER, "scheduler"))
    return HunyuanVideoPipeline(text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer,
                                vae=vae, scheduler=scheduler, text_encoder_2=text_encoder_2,
                                tokenizer_2=tokenizer_2)
