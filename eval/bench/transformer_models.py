"""The transformer benchmark's models: published configs, random-weight builds and their inputs.

``MODELS`` holds per model the diffusers class, the published config (``WAN_1_3B``,
``HUNYUAN_13B``), the full-size video and latent shape, the text length, the repeated-block lists
and the tiny scale's overrides; ``model_spec`` resolves a scale, ``build_model`` builds with random
weights (nothing is downloaded), ``make_inputs`` the call's inputs, ``first_blocks_only`` cuts the
repeated blocks to their first for a cheap warm-up. See ``fastdit.eval.bench.transformer``.
"""
from __future__ import annotations

import contextlib

import torch


WAN_1_3B = dict(  # Wan-AI/Wan2.1-T2V-1.3B-Diffusers, transformer/config.json
    patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
    text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True,
    qk_norm="rms_norm_across_heads", eps=1e-6, image_dim=None, added_kv_proj_dim=None, rope_max_seq_len=1024,
)
HUNYUAN_13B = dict(  # hunyuanvideo-community/HunyuanVideo, transformer/config.json (= diffusers' defaults)
    in_channels=16, out_channels=16, num_attention_heads=24, attention_head_dim=128, num_layers=20,
    num_single_layers=40, num_refiner_layers=2, mlp_ratio=4.0, patch_size=2, patch_size_t=1, qk_norm="rms_norm",
    guidance_embeds=True, text_embed_dim=4096, pooled_projection_dim=768, rope_theta=256.0, rope_axes_dim=(16, 56, 56),
)

MODELS = {
    "wan": {
        "name": "Wan2.1-T2V-1.3B", "class": "WanTransformer3DModel", "family": "wan", "config": WAN_1_3B,
        "video": "480p (832x480) x 81 frames", "latent": (21, 60, 104), "text": 512, "text_valid": None,
        "block_lists": ("blocks",),
        "tiny": {"config": dict(num_layers=2, num_attention_heads=2, attention_head_dim=64, ffn_dim=256, text_dim=64,
                                freq_dim=32), "latent": (4, 32, 48), "text": 16, "video": "tiny"},
        "reduced": dict(num_layers=2),
    },
    "hunyuan": {
        "name": "HunyuanVideo-13B", "class": "HunyuanVideoTransformer3DModel", "family": "hunyuan_video",
        "config": HUNYUAN_13B, "video": "720p (1280x720) x 129 frames", "latent": (33, 90, 160), "text": 256,
        "text_valid": 64, "block_lists": ("transformer_blocks", "single_transformer_blocks"),
        "tiny": {"config": dict(num_layers=1, num_single_layers=1, num_refiner_layers=1, num_attention_heads=2,
                                attention_head_dim=64, mlp_ratio=2.0, text_embed_dim=64, pooled_projection_dim=32,
                                rope_axes_dim=(16, 24, 24)),
                 "latent": (4, 32, 48), "text": 32, "text_valid": 12, "video": "tiny"},
        "reduced": dict(num_layers=1, num_single_layers=1),
    },
}


def model_spec(name, scale, hy_frames=None):
    """``(config, latent (T, H, W), text tokens, valid text tokens or None, description)``."""
    spec = MODELS[name]
    config = dict(spec["config"])
    if scale == "tiny":
        tiny = spec["tiny"]
        config.update(tiny["config"])
        return config, tiny["latent"], tiny["text"], tiny.get("text_valid"), tiny["video"]
    latent, video = spec["latent"], spec["video"]
    if name == "hunyuan" and hy_frames:
        latent = ((hy_frames - 1) // 4 + 1, *latent[1:])
        video = f"720p (1280x720) x {hy_frames} frames"
    return config, latent, spec["text"], spec["text_valid"], video


def token_grid(config, latent):
    """The token grid ``(T, H, W)`` of a latent shape after the model's patching."""
    p = config["patch_size"]
    p_t, p_h, p_w = p if isinstance(p, (tuple, list)) else (config.get("patch_size_t", 1), p, p)
    return (latent[0] // p_t, latent[1] // p_h, latent[2] // p_w)


def model_class(name):
    import diffusers

    return getattr(diffusers, MODELS[name]["class"])


def count_parameters(name, config):
    """Parameters of the model, counted on a meta-device build (no memory)."""
    with torch.device("meta"):
        model = model_class(name)(**config)
    return sum(p.numel() for p in model.parameters())


def build_model(name, config, device, dtype, seed=0):
    """The model with random weights, built on ``device`` (no host copy on CUDA) and cast to ``dtype``
    as ``from_pretrained(torch_dtype=dtype)`` casts: the class's ``_keep_in_fp32_modules`` (Wan:
    rope, time embedder, modulation tables, norms) stay float32."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = model_class(name)(**config)
    keep = tuple(getattr(model, "_keep_in_fp32_modules", None) or ())
    with torch.no_grad():
        for tensors in (model.named_parameters(), model.named_buffers()):
            for key, tensor in tensors:
                if tensor.is_floating_point() and tensor.dtype != dtype and not any(k in key.split(".") for k in keep):
                    tensor.data = tensor.data.to(dtype)
    return model.eval().requires_grad_(False)


def make_inputs(name, config, latent, text, text_valid, device, dtype, seed=1):
    """The keyword arguments of one ``transformer(**inputs)`` call: random latents and text at
    timestep 999; HunyuanVideo also a text key mask (the first ``text_valid`` tokens valid), pooled
    projections and guidance."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype)

    inputs = {"hidden_states": randn(1, config["in_channels"], *latent),
              "timestep": torch.tensor([999.0], device=device)}
    if name == "wan":
        inputs["encoder_hidden_states"] = randn(1, text, config["text_dim"])
    else:
        mask = torch.zeros(1, text, dtype=torch.bool, device=device)
        mask[:, : text_valid or text] = True
        inputs.update(encoder_hidden_states=randn(1, text, config["text_embed_dim"]), encoder_attention_mask=mask,
                      pooled_projections=randn(1, config["pooled_projection_dim"]),
                      guidance=torch.tensor([6000.0], device=device))
    return inputs


@contextlib.contextmanager
def first_blocks_only(model, block_lists):
    """The model with each repeated-block list cut to its first block (restored on exit)."""
    saved = {}
    try:
        for attr in block_lists:
            blocks = getattr(model, attr, None)
            if isinstance(blocks, torch.nn.ModuleList) and len(blocks) > 1:
                saved[attr] = blocks
                setattr(model, attr, torch.nn.ModuleList([blocks[0]]))
        yield model
    finally:
        for attr, blocks in saved.items():
            setattr(model, attr, blocks)

