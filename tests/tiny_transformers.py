"""Tiny random-weight Wan and HunyuanVideo transformers and their call inputs (shared by tests).

Defaults give odd latent grids; ``batch``, ``frames``, ``height``, ``width`` (latent pixels, patch
2) and the timestep are free, so tests can change resolution or step between calls.
"""
import torch
from diffusers import HunyuanVideoTransformer3DModel, WanTransformer3DModel


def tiny_wan(seed=0, i2v=False):
    """Wan with 2 layers, 2 heads of 16; ``i2v`` adds the image branch of attn2 (Wan 2.1 I2V)."""
    torch.manual_seed(seed)
    extra = dict(image_dim=24, added_kv_proj_dim=32) if i2v else {}
    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
        text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2, rope_max_seq_len=64, **extra,
    ).eval()


def wan_inputs(frames=5, height=14, width=18, batch=2, timestep=900.0, i2v=False, seed=1):
    g = torch.Generator().manual_seed(seed)
    inputs = dict(
        hidden_states=torch.randn(batch, 4, frames, height, width, generator=g),
        timestep=torch.full((batch,), float(timestep)),
        # Wan I2V's processor takes the last 512 context tokens as text.
        encoder_hidden_states=torch.randn(batch, 512 if i2v else 7, 32, generator=g),
    )
    if i2v:
        inputs["encoder_hidden_states_image"] = torch.randn(batch, 5, 24, generator=g)
    return inputs


def tiny_hunyuan(seed=0):
    """HunyuanVideo with one double-stream and one single-stream block, 2 heads of 16."""
    torch.manual_seed(seed)
    return HunyuanVideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=1,
        num_single_layers=1, num_refiner_layers=1, mlp_ratio=2.0, patch_size=2, patch_size_t=1,
        text_embed_dim=32, pooled_projection_dim=16, rope_axes_dim=(4, 6, 6),
    ).eval()


def hunyuan_inputs(frames=3, height=10, width=14, batch=2, text=9, seed=1):
    """Text padding differs per sample: 6 valid tokens in the first, 4 in the second."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(batch, text, dtype=torch.bool)
    mask[0, 6:] = False
    if batch > 1:
        mask[1, 4:] = False
    return dict(
        hidden_states=torch.randn(batch, 4, frames, height, width, generator=g),
        timestep=torch.full((batch,), 900.0),
        encoder_hidden_states=torch.randn(batch, text, 32, generator=g),
        encoder_attention_mask=mask,
        pooled_projections=torch.randn(batch, 16, generator=g),
        guidance=torch.full((batch,), 3500.0),
    )
