"""The built-in model families: one ``Adapter`` per diffusers DiT family, with the grid rules that
need more than the latent tensor's shape. Registered in lookup order (= the README table's order)
when ``fastdit.pipelines`` is imported.
"""
from __future__ import annotations

import math

import torch

from .adapters import Adapter, register_adapter


# ---------------------------------------------------------------------------------------------
# Grid rules that need more than the latent tensor's shape
# ---------------------------------------------------------------------------------------------

def _distinct(values):
    return int(torch.unique(values).numel())


def _grid_from_ids(ids, axes):
    """``(T, H, W)`` of packed image tokens from their position ids ``(S, A)`` or ``(B, S, A)``.

    ``axes`` are the id columns of (T, H, W). Tokens must form a full grid in frame-major order
    (the order the Flux pipelines pack them); otherwise None (the call then runs dense).
    """
    if ids is None:
        return None
    if ids.dim() == 3:
        ids = ids[0]
    cols = [ids[:, a] for a in axes]
    grid = tuple(_distinct(c) for c in cols)
    if math.prod(grid) != ids.shape[0]:
        return None  # e.g. reference images of another size appended (Kontext / edit): not one grid
    # frame-major order: the ids must run through the grid t, then h, then w
    ranks = [torch.unique(c, return_inverse=True)[1] for c in cols]
    flat = (ranks[0] * grid[1] + ranks[1]) * grid[2] + ranks[2]
    if not bool((flat == torch.arange(flat.numel(), device=flat.device)).all()):
        return None
    return grid


def _flux_grid(adapter, transformer, call):
    return _grid_from_ids(call.get("img_ids"), (0, 1, 2))


def _qwen_image_grid(adapter, transformer, call):
    shapes = call.get("img_shapes")
    if not shapes:
        return None
    first = shapes[0]
    if isinstance(first, tuple) and len(first) == 3 and all(isinstance(x, int) for x in first):
        first = [first]  # a flat list of shapes (one per batch element)
    first = [tuple(int(x) for x in s) for s in first]
    frames = sum(s[0] for s in first)
    if len({s[1:] for s in first}) != 1:
        return None  # edit model with a reference image of another size: not one grid, run dense
    return (frames, first[0][1], first[0][2])


def _ltx_grid(adapter, transformer, call):
    p = transformer.config.patch_size
    p_t = transformer.config.patch_size_t
    frames, height, width = call.get("num_frames"), call.get("height"), call.get("width")
    if frames is not None and height is not None and width is not None:
        return (int(frames) // p_t, int(height) // p, int(width) // p)
    coords = call.get("video_coords")  # (B, 3, S): frame, row, column of every token
    if coords is not None:
        return _grid_from_ids(coords[0].transpose(0, 1), (0, 1, 2))
    return None


def _kandinsky5_grid(adapter, transformer, call):
    if call.get("sparse_params") is not None:
        return None  # the model's own NABLA attention, with tokens in its fractal order: leave it alone
    latents = call[adapter.hidden_states_arg]
    _, frames, height, width, _ = latents.shape  # (B, T, H, W, C)
    p_t, p_h, p_w = transformer.config.patch_size
    return (frames // p_t, height // p_h, width // p_w)


def _kandinsky5_check(transformer):
    attention_type = getattr(transformer.config, "attention_type", "regular")
    if attention_type not in (None, "regular"):
        return (f"this checkpoint uses Kandinsky's built-in sparse attention (attention_type={attention_type!r}, "
                "tokens in its own fractal order); fastdit patches checkpoints with attention_type='regular'")
    return None


_LINEAR_ATTENTION = ("its self-attention `attn1` is linear (ReLU-kernel) attention, not softmax attention, so "
                     "there is no attention matrix to sparsify; its `attn2` is cross-attention")


# ---------------------------------------------------------------------------------------------
# Built-in families (lookup order = table order)
# ---------------------------------------------------------------------------------------------

register_adapter(Adapter(
    family="wan",
    transformer_classes=("WanTransformer3DModel",),
    attention_pattern=r"blocks\.\d+\.attn1",
    text_position="none",
    pipelines=("WanPipeline", "WanImageToVideoPipeline", "WanVideoToVideoPipeline"),
    # Radial Attention's Wan settings (reference scripts: decay 0.2, sink, first 12 of 50 steps and
    # the first layer dense; adjacent frames dense, as the current reference mask code does).
    method_defaults={"radial": {"decay": 0.2, "sink": True, "adjacent": "dense", "dense_steps": 0.24,
                                "dense_layers": 1}},
    notes="Wan 2.1 and 2.2. Self-attention `blocks.N.attn1` over video tokens; text and image context go "
          "through `attn2` (cross-attention, never patched). Grid: latents (B, C, F, H, W) / patch_size. "
          "Wan 2.2's `transformer` and `transformer_2` share one step counter.",
))

register_adapter(Adapter(
    family="wan_vace",
    transformer_classes=("WanVACETransformer3DModel",),
    attention_pattern=r"(vace_blocks|blocks)\.\d+\.attn1",
    text_position="none",
    pipelines=("WanVACEPipeline",),
    notes="Self-attention `blocks.N.attn1` and `vace_blocks.N.attn1` (the control branch runs on the same "
          "grid); `attn2` is cross-attention. Grid: latents (B, C, F, H, W) / patch_size.",
))

register_adapter(Adapter(
    family="skyreels_v2",
    transformer_classes=("SkyReelsV2Transformer3DModel",),
    attention_pattern=r"blocks\.\d+\.attn1",
    text_position="none",
    pipelines=("SkyReelsV2Pipeline", "SkyReelsV2ImageToVideoPipeline", "SkyReelsV2DiffusionForcingPipeline",
               "SkyReelsV2DiffusionForcingImageToVideoPipeline", "SkyReelsV2DiffusionForcingVideoToVideoPipeline"),
    notes="Wan-style: self-attention `blocks.N.attn1`, grid latents (B, C, F, H, W) / patch_size. Diffusion "
          "forcing with `num_frame_per_block > 1` passes a block-causal mask (not a key mask): those calls run dense.",
))

register_adapter(Adapter(
    family="hunyuan_video",
    transformer_classes=("HunyuanVideoTransformer3DModel",),
    attention_pattern=r"(transformer_blocks|single_transformer_blocks)\.\d+\.attn",
    text_position="suffix",
    pipelines=("HunyuanVideoPipeline", "HunyuanVideoImageToVideoPipeline"),
    # Radial Attention's HunyuanVideo settings (reference scripts).
    method_defaults={"radial": {"decay": 0.95, "sink": False, "adjacent": "dense", "dense_steps": 0.24,
                                "dense_layers": 0}},
    notes="Joint attention in double- and single-stream blocks, text after video; the text-padding "
          "mask the model passes is honoured (padded text keys are never attended). The text refiner's "
          "self-attention is not patched. Grid: latents (B, C, F, H, W) / (patch_size_t, patch_size, patch_size).",
))

register_adapter(Adapter(
    family="hunyuan_video15",
    transformer_classes=("HunyuanVideo15Transformer3DModel",),
    attention_pattern=r"transformer_blocks\.\d+\.attn",
    text_position="suffix",
    pipelines=("HunyuanVideo15Pipeline", "HunyuanVideo15ImageToVideoPipeline"),
    notes="Joint attention `transformer_blocks.N.attn`, conditioning (text, second text encoder, image "
          "tokens) after video. The model passes a (query x key) mask valid[q] & valid[k]; see the README "
          "for how fastdit treats it. Grid: latents (B, C, F, H, W) / (patch_size_t, patch_size, patch_size).",
))

register_adapter(Adapter(
    family="cogvideox",
    transformer_classes=("CogVideoXTransformer3DModel",),
    attention_pattern=r"transformer_blocks\.\d+\.attn1",
    text_position="prefix",
    latent_layout="BFCHW",
    round_up=False,
    pipelines=("CogVideoXPipeline", "CogVideoXImageToVideoPipeline", "CogVideoXVideoToVideoPipeline",
               "CogVideoXFunControlPipeline"),
    notes="CogVideoX 1.0 and 1.5. Joint attention `transformer_blocks.N.attn1` with text before video. "
          "Latents are (B, F, C, H, W) (frames on axis 1); grid (F // patch_size_t, H // patch_size, "
          "W // patch_size), patch_size_t = 1 for 1.0 (1.5 patches time too).",
))

register_adapter(Adapter(
    family="ltx_video",
    transformer_classes=("LTXVideoTransformer3DModel",),
    attention_pattern=r"transformer_blocks\.\d+\.attn1",
    text_position="none",
    grid_fn=_ltx_grid,
    pipelines=("LTXPipeline", "LTXImageToVideoPipeline", "LTXConditionPipeline", "LTXLatentUpsamplePipeline"),
    notes="Self-attention `transformer_blocks.N.attn1`; `attn2` is cross-attention. Latents are already "
          "packed tokens (B, S, C); the grid is (num_frames // patch_size_t, height // patch_size, "
          "width // patch_size) from the call's `num_frames`, `height`, `width` (latent sizes), else from "
          "`video_coords`; when neither gives a full grid the call runs dense.",
))

register_adapter(Adapter(
    family="mochi",
    transformer_classes=("MochiTransformer3DModel",),
    attention_pattern=r"transformer_blocks\.\d+\.attn1",
    text_position="suffix",
    pipelines=("MochiPipeline",),
    notes="Asymmetric joint attention `transformer_blocks.N.attn1`: the processor calls SDPA once per "
          "sample with the video tokens followed by that sample's valid (unpadded) text tokens only, so each "
          "call's text length is its own; the layout is computed per call from its sequence length. "
          "Grid: latents (B, C, F, H, W) / (1, patch_size, patch_size).",
))

register_adapter(Adapter(
    family="cosmos",
    transformer_classes=("CosmosTransformer3DModel",),
    attention_pattern=r"transformer_blocks\.\d+\.attn1",
    text_position="none",
    round_up=False,
    pipelines=("Cosmos2TextToImagePipeline", "Cosmos2VideoToWorldPipeline", "CosmosTextToWorldPipeline",
               "CosmosVideoToWorldPipeline", "Cosmos2_5_PredictBasePipeline"),
    notes="Cosmos (Predict 1 and 2). Self-attention `transformer_blocks.N.attn1`; `attn2` is cross-attention. "
          "Condition and padding masks are extra channels, not tokens. Grid: latents (B, C, F, H, W) / patch_size.",
))

register_adapter(Adapter(
    family="allegro",
    transformer_classes=("AllegroTransformer3DModel",),
    attention_pattern=r"transformer_blocks\.\d+\.attn1",
    text_position="none",
    round_up=False,
    pipelines=("AllegroPipeline",),
    notes="Self-attention `transformer_blocks.N.attn1` (its optional video-padding mask is a key mask and is "
          "honoured); `attn2` is cross-attention. Grid: latents (B, C, F, H, W) / "
          "(patch_size_t, patch_size, patch_size).",
))

register_adapter(Adapter(
    family="kandinsky5",
    transformer_classes=("Kandinsky5Transformer3DModel",),
    attention_pattern=r"visual_transformer_blocks\.\d+\.self_attention",
    text_position="none",
    grid_fn=_kandinsky5_grid,
    check_fn=_kandinsky5_check,
    pipelines=("Kandinsky5T2VPipeline", "Kandinsky5I2VPipeline", "Kandinsky5T2IPipeline", "Kandinsky5I2IPipeline"),
    notes="Visual self-attention `visual_transformer_blocks.N.self_attention`; the text encoder blocks' "
          "self-attention and the visual cross-attention are not patched. Latents are (B, F, H, W, C) "
          "(channels last); grid (F, H, W) / patch_size. Checkpoints with the built-in NABLA sparse attention "
          "(attention_type='nabla') are rejected.",
))

register_adapter(Adapter(
    family="sana_video",
    transformer_classes=("SanaVideoTransformer3DModel",),
    attention_pattern=r"transformer_blocks\.\d+\.attn1",
    unsupported=_LINEAR_ATTENTION,
    pipelines=("SanaVideoPipeline", "SanaImageToVideoPipeline"),
    notes="Not patchable: " + _LINEAR_ATTENTION + ".",
))

# -- image families (single frame, 2-D grids) ----------------------------------------------------

register_adapter(Adapter(
    family="flux",
    transformer_classes=("FluxTransformer2DModel",),
    attention_pattern=r"(transformer_blocks|single_transformer_blocks)\.\d+\.attn",
    text_position="prefix",
    video=False,
    grid_fn=_flux_grid,
    pipelines=("FluxPipeline", "FluxImg2ImgPipeline", "FluxInpaintPipeline", "FluxFillPipeline",
               "FluxControlPipeline", "FluxKontextPipeline"),
    notes="Joint attention in double- and single-stream blocks with text (`txt_ids`) before the image. "
          "Latents are packed (B, S, C); the grid comes from `img_ids` columns (t, h, w): distinct values per "
          "column, tokens in row-major order. Kontext's same-size reference image (t = 1) makes T = 2; "
          "ids that are not one full grid run dense.",
))

register_adapter(Adapter(
    family="flux2",
    transformer_classes=("Flux2Transformer2DModel",),
    attention_pattern=r"(transformer_blocks|single_transformer_blocks)\.\d+\.attn",
    text_position="prefix",
    video=False,
    grid_fn=_flux_grid,
    pipelines=("Flux2Pipeline", "Flux2KleinPipeline"),
    notes="Flux.2: joint attention in double- and single-stream blocks, text first. Grid from `img_ids` "
          "columns (t, h, w, l). Reference-image KV-cache calls (query and key lengths differ) run dense.",
))

register_adapter(Adapter(
    family="sd3",
    transformer_classes=("SD3Transformer2DModel",),
    attention_pattern=r"transformer_blocks\.\d+\.attn2?",
    text_position="suffix",
    video=False,
    round_up=False,
    pipelines=("StableDiffusion3Pipeline", "StableDiffusion3Img2ImgPipeline", "StableDiffusion3InpaintPipeline"),
    notes="Stable Diffusion 3 / 3.5. Joint attention `transformer_blocks.N.attn` with the context appended "
          "after the image tokens, and SD3.5's extra image self-attention `attn2` (dual attention layers). "
          "Grid: latents (B, C, H, W) / patch_size.",
))

register_adapter(Adapter(
    family="pixart_sigma",
    transformer_classes=("PixArtTransformer2DModel",),
    attention_pattern=r"transformer_blocks\.\d+\.attn1",
    text_position="none",
    video=False,
    round_up=False,
    pipelines=("PixArtSigmaPipeline", "PixArtAlphaPipeline"),
    notes="PixArt-Sigma (and Alpha): self-attention `transformer_blocks.N.attn1` (head dim 72); `attn2` is "
          "cross-attention. Grid: latents (B, C, H, W) / patch_size.",
))

register_adapter(Adapter(
    family="qwen_image",
    transformer_classes=("QwenImageTransformer2DModel",),
    attention_pattern=r"transformer_blocks\.\d+\.attn",
    text_position="prefix",
    video=False,
    grid_fn=_qwen_image_grid,
    pipelines=("QwenImagePipeline", "QwenImageImg2ImgPipeline", "QwenImageInpaintPipeline", "QwenImageEditPipeline"),
    notes="Joint attention `transformer_blocks.N.attn` with text before the image; the text-padding mask is "
          "honoured. Latents are packed (B, S, C); the grid is (frames, h, w) from `img_shapes` (edit models: "
          "the target and same-size reference images stack along T; other sizes run dense).",
))

register_adapter(Adapter(
    family="sana",
    transformer_classes=("SanaTransformer2DModel",),
    attention_pattern=r"transformer_blocks\.\d+\.attn1",
    video=False,
    unsupported=_LINEAR_ATTENTION,
    pipelines=("SanaPipeline", "SanaSprintPipeline", "SanaPAGPipeline"),
    notes="Not patchable: " + _LINEAR_ATTENTION + ".",
))
