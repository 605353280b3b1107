"""Model coverage, bad input: unpatchable families, UNet models and pipelines, and unknown modules
are refused with a clear error and nothing is left patched (helpers: model_matrix.py).
"""
from __future__ import annotations

import types

import pytest
import torch

import fastdit
from fastdit.pipelines import UnsupportedModelError, registered_adapters

from model_matrix import CASE_FAMILY, METHODS, UNPATCHABLE, assert_clean, model
from tiny_models import TINY

# -- bad input -------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", [c for c in TINY if CASE_FAMILY[c] in UNPATCHABLE])
@pytest.mark.parametrize("method", METHODS)
def test_unpatchable_family_clear_error_nothing_patched(case, method):
    m = model(case)
    with pytest.raises(UnsupportedModelError, match="linear"):
        fastdit.patch(m, method)
    assert_clean(m)


def _tiny_unet():
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    return UNet2DConditionModel(sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
                                block_out_channels=(8, 16), down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=8,
                                attention_head_dim=2, norm_num_groups=4).eval()


def test_unet_model_clear_error_nothing_patched():
    unet = _tiny_unet()
    with pytest.raises(ValueError, match="UNet") as info:
        fastdit.patch(unet, "sta")
    for family in ("wan", "flux", "sd3"):
        assert family in str(info.value)
    assert "register_adapter" in str(info.value)
    assert_clean(unet)


def test_unet_pipeline_clear_error_nothing_patched():
    unet = _tiny_unet()
    pipe = types.SimpleNamespace(unet=unet, scheduler=types.SimpleNamespace())
    with pytest.raises(ValueError, match="UNet"):
        fastdit.patch(pipe, "sta")
    assert_clean(unet)
    assert "set_timesteps" not in vars(pipe.scheduler)


def test_unknown_module_clear_error_lists_families():
    module = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(UnsupportedModelError) as info:
        fastdit.patch(module, "sta")
    message = str(info.value)
    for adapter in registered_adapters():
        if not adapter.unsupported:
            assert adapter.family in message
    assert "register_adapter" in message
    assert_clean(module)
