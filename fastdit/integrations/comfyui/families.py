"""ComfyUI's diffusion models the node supports: which fastdit family each is, where its text
tokens sit in joint attention, and the token grid of one forward call.

Read off ComfyUI's own model classes (by module and class name, so nothing here imports ComfyUI):

* ``comfy.ldm.wan.model.WanModel`` (Wan 2.1 / 2.2, T2V and I2V: ``model_type`` ``"t2v"`` / ``"i2v"``):
  self-attention over the video tokens only (text and CLIP image tokens reach the blocks through
  cross-attention); the input ``x`` is ``(B, C, T, H, W)``, padded up to whole patches, tokens in
  ``(t, h, w)`` order; ``time_dim_concat`` adds frames.
* ``comfy.ldm.hunyuan_video.model.HunyuanVideo``: joint attention, video tokens then text tokens
  (``context``, plus ``txt_byt5`` when given): a text suffix; the text padding arrives as a key mask.
* ``comfy.ldm.lightricks.model.LTXVModel``: self-attention over the video tokens (its symmetric
  patchifier, ``(f, h, w)`` order), text through cross-attention.
* ``comfy.ldm.flux.model.Flux``: joint attention, text tokens (``context``) then image tokens: a
  text prefix; an image is one frame ``(1, H / p, W / p)``.

The grid is the model input's spatial shape over the model's patch size, rounded up (ComfyUI pads
the latent to whole patches). Inputs that add tokens of another kind (Wan's ``reference_latent``,
Flux Kontext's ``ref_latents``, HunyuanVideo's ``ref_latent``) give a reason instead: those calls
run ComfyUI's own attention.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from fastdit.layout import TokenLayout

__all__ = ["ComfyFamily", "Geometry", "find_family", "supported_classes"]


@dataclass(frozen=True)
class Geometry:
    """One forward call: the token layout of its self / joint attention calls, or why none."""

    layout: TokenLayout | None
    reason: str | None = None
    cross_lengths: tuple = ()  # key lengths of the family's cross-attention calls (never sparsified)


@dataclass(frozen=True)
class ComfyFamily:
    """A ComfyUI model class and how fastdit reads it."""

    module: str
    cls: str
    family: str  # the fastdit family (its method defaults, plan files)
    text: str  # "none" (text by cross-attention), "prefix" or "suffix" (joint attention)
    label: str

    def matches(self, model):
        return type(model).__module__ == self.module and type(model).__name__ == self.cls

    # -- facts of the model --------------------------------------------------------------------------
    def patch_size(self, model):
        """``(p_t, p_h, p_w)`` of the model's patch embedding."""
        if self.family == "ltx_video":
            size = tuple(model.patchifier.patch_size)
        else:
            size = model.patch_size
        size = (size, size) if isinstance(size, int) else tuple(size)
        return (1, *size) if len(size) == 2 else size

    def layers(self, model):
        """The self / joint attention layers of one forward, in call order."""
        if self.family in ("flux", "hunyuan_video"):
            return len(model.double_blocks) + len(model.single_blocks)
        if self.family == "ltx_video":
            return len(model.transformer_blocks)
        return len(model.blocks)

    def heads(self, model):
        if self.family == "ltx_video":
            return model.transformer_blocks[0].attn1.heads
        return model.num_heads

    # -- one forward ---------------------------------------------------------------------------------
    def geometry(self, model, arguments):
        """The ``Geometry`` of a forward call, from the diffusion model's bound arguments."""
        x = arguments.get("x")
        if x is None or not hasattr(x, "shape"):
            return Geometry(None, "no model input x in the forward call")
        extra = {"wan": "reference_latent", "flux": "ref_latents", "hunyuan_video": "ref_latent"}.get(self.family)
        kwargs = arguments.get("kwargs") or {}
        if extra and (arguments.get(extra) is not None or kwargs.get(extra) is not None):
            return Geometry(None, f"{self.label} with {extra} (reference tokens beside the video: not a token grid)")
        patch = self.patch_size(model)
        spatial = tuple(int(n) for n in x.shape[2:])
        if len(spatial) == 2:
            spatial = (1, *spatial)
        if len(spatial) != 3:
            return Geometry(None, f"{self.label} input x of shape {tuple(x.shape)} is not (B, C, [T,] H, W)")
        frames = spatial[0]
        concat = arguments.get("time_dim_concat") if self.family == "wan" else None
        if concat is not None:
            frames += math.ceil(concat.shape[2] / patch[0]) * patch[0]
        grid = (math.ceil(frames / patch[0]), math.ceil(spatial[1] / patch[1]), math.ceil(spatial[2] / patch[2]))
        context = arguments.get("context")
        text = int(context.shape[1]) if context is not None and hasattr(context, "shape") and self.text != "none" \
            else 0
        byt5 = arguments.get("txt_byt5") if self.family == "hunyuan_video" else None
        if byt5 is not None and getattr(model, "byt5_in", None) is not None:  # joined to the text only then
            text += int(byt5.shape[1])
        cross = ()
        if self.text == "none":
            cross = tuple(int(t.shape[1]) for t in (context, arguments.get("clip_fea"))
                          if t is not None and hasattr(t, "shape") and t.dim() == 3)
        return Geometry(TokenLayout(grid, text, self.text if text else "none"), None, cross)


#: The ComfyUI model classes the node runs fastdit's methods on.
FAMILIES = (
    ComfyFamily("comfy.ldm.wan.model", "WanModel", "wan", "none", "Wan (T2V / I2V)"),
    ComfyFamily("comfy.ldm.hunyuan_video.model", "HunyuanVideo", "hunyuan_video", "suffix", "HunyuanVideo"),
    ComfyFamily("comfy.ldm.lightricks.model", "LTXVModel", "ltx_video", "none", "LTX-Video"),
    ComfyFamily("comfy.ldm.flux.model", "Flux", "flux", "prefix", "Flux"),
)


def find_family(diffusion_model):
    """The ``ComfyFamily`` of a ComfyUI diffusion model (exact class: subclasses such as VACE or
    camera Wan add attention calls of their own), or None."""
    for family in FAMILIES:
        if family.matches(diffusion_model):
            return family
    return None


def supported_classes():
    """``"module.Class"`` of every supported ComfyUI model (for messages and docs)."""
    return [f"{f.module}.{f.cls}" for f in FAMILIES]
