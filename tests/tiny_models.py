"""Tiny random-weight diffusers transformers, one per fastdit family, with their call kwargs.

No downloads: every model is built from a config in code (fp32, CPU, eval mode). Each entry of
``TINY`` gives

* ``build(seed)`` -> the transformer;
* ``inputs(model, grid, seed)`` -> the forward kwargs for a latent token grid ``(T, H, W)``
  (images use ``T = 1``), text embeddings included (no text encoders are needed);
* ``video``: whether the family is a video family.

Sizes are tiny (2 heads, head dims 16..72, 1-2 layers of each kind) so the whole family x method
matrix runs in well under a minute on two CPU cores. The default test grids are odd on purpose:
no tile or block size divides them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import diffusers

TEXT_LEN = 6


def _g(seed):
    return torch.Generator().manual_seed(seed)


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=_g(seed))


def _build(cls_name, seed, **config):
    torch.manual_seed(seed)
    model = getattr(diffusers, cls_name)(**config)
    # Many DiTs zero-initialise gates and output layers; with those left at zero the output would
    # not depend on attention at all. Give every all-zero weight small random values.
    with torch.no_grad():
        for param in model.parameters():
            if param.numel() and not bool(param.any()):
                param.normal_(0.0, 0.05)
    return model.eval().float()


@dataclass
class Tiny:
    family: str
    build: object
    inputs: object
    video: bool = True
    grid: tuple = (3, 5, 7)


TINY = {}


def _register(family, video=True, grid=None):
    def wrap(fns):
        build, inputs = fns()
        TINY[family] = Tiny(family, build, inputs, video, grid or ((3, 5, 7) if video else (1, 5, 7)))
        return fns
    return wrap


# -- video ---------------------------------------------------------------------------------------

def _wan_like(cls_name, extra=None, extra_inputs=None):
    def build(seed=0):
        return _build(cls_name, seed, patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16,
                      in_channels=4, out_channels=4, text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2,
                      rope_max_seq_len=64, **(extra or {}))

    def inputs(model, grid, seed=0):
        t, h, w = grid
        kwargs = dict(hidden_states=_randn(1, 4, t, 2 * h, 2 * w, seed=seed), timestep=torch.tensor([500]),
                      encoder_hidden_states=_randn(1, TEXT_LEN, 32, seed=seed + 1), return_dict=False)
        if extra_inputs:
            kwargs.update(extra_inputs(grid, seed))
        return kwargs
    return build, inputs


@_register("wan")
def _wan():
    return _wan_like("WanTransformer3DModel")


@_register("wan_vace")
def _wan_vace():
    return _wan_like(
        "WanVACETransformer3DModel", dict(vace_layers=[0, 1], vace_in_channels=8),
        lambda grid, seed: dict(control_hidden_states=_randn(1, 8, grid[0], 2 * grid[1], 2 * grid[2], seed=seed + 2),
                                control_hidden_states_scale=torch.ones(2)),
    )


@_register("skyreels_v2")
def _skyreels():
    return _wan_like("SkyReelsV2Transformer3DModel")


@_register("hunyuan_video")
def _hunyuan():
    def build(seed=0):
        return _build("HunyuanVideoTransformer3DModel", seed, in_channels=4, out_channels=4, num_attention_heads=2,
                      attention_head_dim=16, num_layers=1, num_single_layers=1, num_refiner_layers=1, patch_size=2,
                      patch_size_t=1, text_embed_dim=32, pooled_projection_dim=16, rope_axes_dim=(4, 6, 6))

    def inputs(model, grid, seed=0):
        t, h, w = grid
        mask = torch.ones(1, TEXT_LEN, dtype=torch.bool)
        mask[:, -2:] = False  # padded text: the model passes a key mask
        return dict(hidden_states=_randn(1, 4, t, 2 * h, 2 * w, seed=seed), timestep=torch.tensor([500]),
                    encoder_hidden_states=_randn(1, TEXT_LEN, 32, seed=seed + 1), encoder_attention_mask=mask,
                    pooled_projections=_randn(1, 16, seed=seed + 2), guidance=torch.tensor([3500.0]),
                    return_dict=False)
    return build, inputs


@_register("hunyuan_video15")
def _hunyuan15():
    def build(seed=0):
        return _build("HunyuanVideo15Transformer3DModel", seed, in_channels=4, out_channels=4, num_attention_heads=2,
                      attention_head_dim=16, num_layers=2, num_refiner_layers=1, patch_size=1, patch_size_t=1,
                      text_embed_dim=32, text_embed_2_dim=24, image_embed_dim=16, rope_axes_dim=(4, 6, 6),
                      target_size=64, task_type="t2v")

    def inputs(model, grid, seed=0):
        mask = torch.ones(1, TEXT_LEN)
        mask[:, -2:] = 0
        return dict(hidden_states=_randn(1, 4, *grid, seed=seed), timestep=torch.tensor([500.0]),
                    encoder_hidden_states=_randn(1, TEXT_LEN, 32, seed=seed + 1), encoder_attention_mask=mask,
                    encoder_hidden_states_2=_randn(1, 3, 24, seed=seed + 2),
                    encoder_attention_mask_2=torch.ones(1, 3),
                    image_embeds=torch.zeros(1, 4, 16), return_dict=False)
    return build, inputs


def _cogvideox(patch_t):
    def build(seed=0):
        return _build("CogVideoXTransformer3DModel", seed, num_attention_heads=2, attention_head_dim=16,
                      in_channels=4, out_channels=4, time_embed_dim=16, text_embed_dim=32, num_layers=2,
                      sample_width=16, sample_height=16, sample_frames=9, patch_size=2, patch_size_t=patch_t,
                      max_text_seq_length=TEXT_LEN, use_rotary_positional_embeddings=patch_t is not None)

    def inputs(model, grid, seed=0):
        t, h, w = grid
        frames = t * (patch_t or 1)
        return dict(hidden_states=_randn(1, frames, 4, 2 * h, 2 * w, seed=seed),  # (B, F, C, H, W)
                    encoder_hidden_states=_randn(1, TEXT_LEN, 32, seed=seed + 1), timestep=torch.tensor([500]),
                    return_dict=False)
    return build, inputs


@_register("cogvideox")
def _cogvideox10():
    return _cogvideox(None)


@_register("cogvideox15", grid=(2, 5, 7))
def _cogvideox15():
    return _cogvideox(2)


@_register("ltx_video")
def _ltx():
    def build(seed=0):
        return _build("LTXVideoTransformer3DModel", seed, in_channels=4, out_channels=4, patch_size=1, patch_size_t=1,
                      num_attention_heads=2, attention_head_dim=16, cross_attention_dim=32, num_layers=2,
                      caption_channels=32)

    def inputs(model, grid, seed=0):
        t, h, w = grid
        return dict(hidden_states=_randn(1, t * h * w, 4, seed=seed),  # packed (B, S, C)
                    encoder_hidden_states=_randn(1, TEXT_LEN, 32, seed=seed + 1), timestep=torch.tensor([500]),
                    encoder_attention_mask=torch.ones(1, TEXT_LEN), num_frames=t, height=h, width=w,
                    return_dict=False)
    return build, inputs


@_register("mochi")
def _mochi():
    def build(seed=0):
        return _build("MochiTransformer3DModel", seed, patch_size=2, num_attention_heads=2, attention_head_dim=16,
                      num_layers=2, pooled_projection_dim=16, in_channels=4, text_embed_dim=32, time_embed_dim=16,
                      max_sequence_length=TEXT_LEN)

    def inputs(model, grid, seed=0):
        t, h, w = grid
        mask = torch.ones(1, TEXT_LEN, dtype=torch.bool)
        mask[:, -2:] = False  # Mochi drops padded text tokens per sample before attention
        return dict(hidden_states=_randn(1, 4, t, 2 * h, 2 * w, seed=seed),
                    encoder_hidden_states=_randn(1, TEXT_LEN, 32, seed=seed + 1), timestep=torch.tensor([500]),
                    encoder_attention_mask=mask, return_dict=False)
    return build, inputs


@_register("cosmos")
def _cosmos():
    def build(seed=0):
        return _build("CosmosTransformer3DModel", seed, in_channels=4, out_channels=4, num_attention_heads=2,
                      attention_head_dim=16, num_layers=2, mlp_ratio=2.0, text_embed_dim=32, adaln_lora_dim=8,
                      max_size=(8, 32, 32), patch_size=(1, 2, 2), rope_scale=(1.0, 1.0, 1.0),
                      concat_padding_mask=False, extra_pos_embed_type=None)  # True needs torchvision

    def inputs(model, grid, seed=0):
        t, h, w = grid
        return dict(hidden_states=_randn(1, 4, t, 2 * h, 2 * w, seed=seed), timestep=torch.tensor([0.5]),
                    encoder_hidden_states=_randn(1, TEXT_LEN, 32, seed=seed + 1), return_dict=False)
    return build, inputs


@_register("allegro")
def _allegro():
    def build(seed=0):
        return _build("AllegroTransformer3DModel", seed, patch_size=2, patch_size_t=1, num_attention_heads=2,
                      attention_head_dim=16, in_channels=4, out_channels=4, num_layers=2, cross_attention_dim=32,
                      sample_height=16, sample_width=16, sample_frames=4, caption_channels=32)

    def inputs(model, grid, seed=0):
        t, h, w = grid
        return dict(hidden_states=_randn(1, 4, t, 2 * h, 2 * w, seed=seed),
                    encoder_hidden_states=_randn(1, TEXT_LEN, 32, seed=seed + 1), timestep=torch.tensor([500]),
                    return_dict=False)
    return build, inputs


@_register("kandinsky5")
def _kandinsky5():
    def build(seed=0):
        return _build("Kandinsky5Transformer3DModel", seed, in_visual_dim=4, in_text_dim=32, in_text_dim2=16,
                      time_dim=16, out_visual_dim=4, patch_size=(1, 2, 2), model_dim=32, ff_dim=64,
                      num_text_blocks=1, num_visual_blocks=2, axes_dims=(4, 6, 6))

    def inputs(model, grid, seed=0):
        t, h, w = grid
        return dict(hidden_states=_randn(1, t, 2 * h, 2 * w, 4, seed=seed),  # (B, T, H, W, C)
                    encoder_hidden_states=_randn(1, TEXT_LEN, 32, seed=seed + 1), timestep=torch.tensor([500.0]),
                    pooled_projections=_randn(1, 16, seed=seed + 2), visual_rope_pos=[torch.arange(t), torch.arange(h), torch.arange(w)],
                    text_rope_pos=torch.arange(TEXT_LEN), return_dict=False)
    return build, inputs


@_register("sana_video")
def _sana_video():
    def build(seed=0):
        return _build("SanaVideoTransformer3DModel", seed, in_channels=4, out_channels=4, num_attention_heads=2,
                      attention_head_dim=16, num_layers=1, num_cross_attention_heads=2, cross_attention_head_dim=16,
                      cross_attention_dim=32, caption_channels=32, sample_size=16)

    def inputs(model, grid, seed=0):
        t, h, w = grid
        return dict(hidden_states=_randn(1, 4, t, 2 * h, 2 * w, seed=seed),
                    encoder_hidden_states=_randn(1, TEXT_LEN, 32, seed=seed + 1), timestep=torch.tensor([500]),
                    return_dict=False)
    return build, inputs


# -- image ---------------------------------------------------------------------------------------

def _flux_ids(h, w, axes):
    ids = torch.zeros(h, w, axes)
    ids[..., 1] = torch.arange(h)[:, None]
    ids[..., 2] = torch.arange(w)[None, :]
    return ids.reshape(h * w, axes)


@_register("flux", video=False)
def _flux():
    def build(seed=0):
        return _build("FluxTransformer2DModel", seed, patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                      attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=16,
                      axes_dims_rope=(4, 6, 6))

    def inputs(model, grid, seed=0):
        _, h, w = grid
        return dict(hidden_states=_randn(1, h * w, 16, seed=seed), encoder_hidden_states=_randn(1, TEXT_LEN, 32, seed=seed + 1),
                    pooled_projections=_randn(1, 16, seed=seed + 2), timestep=torch.tensor([0.5]),
                    img_ids=_flux_ids(h, w, 3), txt_ids=torch.zeros(TEXT_LEN, 3), return_dict=False)
    return build, inputs


@_register("flux2", video=False)
def _flux2():
    def build(seed=0):
        return _build("Flux2Transformer2DModel", seed, patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                      attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                      timestep_guidance_channels=16, axes_dims_rope=(4, 4, 4, 4), guidance_embeds=False)

    def inputs(model, grid, seed=0):
        _, h, w = grid
        txt_ids = torch.zeros(TEXT_LEN, 4)
        txt_ids[:, 3] = torch.arange(TEXT_LEN)
        return dict(hidden_states=_randn(1, h * w, 16, seed=seed), encoder_hidden_states=_randn(1, TEXT_LEN, 32, seed=seed + 1),
                    timestep=torch.tensor([0.5]), img_ids=_flux_ids(h, w, 4)[None], txt_ids=txt_ids[None],
                    return_dict=False)
    return build, inputs


@_register("sd3", video=False)
def _sd3():
    def build(seed=0):
        return _build("SD3Transformer2DModel", seed, sample_size=16, patch_size=2, in_channels=4, num_layers=2,
                      attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32, caption_projection_dim=32,
                      pooled_projection_dim=16, out_channels=4, pos_embed_max_size=32, dual_attention_layers=(0,),
                      qk_norm="rms_norm")

    def inputs(model, grid, seed=0):
        _, h, w = grid
        return dict(hidden_states=_randn(1, 4, 2 * h, 2 * w, seed=seed), encoder_hidden_states=_randn(1, TEXT_LEN, 32, seed=seed + 1),
                    pooled_projections=_randn(1, 16, seed=seed + 2), timestep=torch.tensor([500]), return_dict=False)
    return build, inputs


@_register("pixart_sigma", video=False)
def _pixart():
    def build(seed=0):
        return _build("PixArtTransformer2DModel", seed, num_attention_heads=2, attention_head_dim=72, in_channels=4,
                      out_channels=8, num_layers=2, cross_attention_dim=144, sample_size=16, patch_size=2,
                      caption_channels=32, norm_num_groups=1)

    def inputs(model, grid, seed=0):
        _, h, w = grid
        return dict(hidden_states=_randn(1, 4, 2 * h, 2 * w, seed=seed), encoder_hidden_states=_randn(1, TEXT_LEN, 32, seed=seed + 1),
                    timestep=torch.tensor([500]), added_cond_kwargs={"resolution": None, "aspect_ratio": None},
                    return_dict=False)
    return build, inputs


@_register("qwen_image", video=False)
def _qwen():
    def build(seed=0):
        return _build("QwenImageTransformer2DModel", seed, patch_size=2, in_channels=16, out_channels=4, num_layers=2,
                      attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 6, 6))

    def inputs(model, grid, seed=0):
        _, h, w = grid
        mask = torch.ones(1, TEXT_LEN, dtype=torch.long)
        mask[:, -2:] = 0
        return dict(hidden_states=_randn(1, h * w, 16, seed=seed), encoder_hidden_states=_randn(1, TEXT_LEN, 32, seed=seed + 1),
                    encoder_hidden_states_mask=mask, timestep=torch.tensor([0.5]), img_shapes=[[(1, h, w)]],
                    return_dict=False)
    return build, inputs


@_register("sana", video=False)
def _sana():
    def build(seed=0):
        return _build("SanaTransformer2DModel", seed, in_channels=4, out_channels=4, num_attention_heads=2,
                      attention_head_dim=16, num_layers=1, num_cross_attention_heads=2, cross_attention_head_dim=16,
                      cross_attention_dim=32, caption_channels=32, sample_size=16, patch_size=1)

    def inputs(model, grid, seed=0):
        _, h, w = grid
        return dict(hidden_states=_randn(1, 4, h, w, seed=seed), encoder_hidden_states=_randn(1, TEXT_LEN, 32, seed=seed + 1),
                    timestep=torch.tensor([500]), return_dict=False)
    return build, inputs


def run(model, kwargs):
    """The transformer's output tensor for ``kwargs`` (no grad)."""
    with torch.no_grad():
        out = model(**kwargs)
    if isinstance(out, torch.Tensor):
        return out
    return out[0] if isinstance(out, (tuple, list)) else out.sample
