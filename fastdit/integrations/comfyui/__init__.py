"""fastdit as a ComfyUI custom node: "fastdit Sparse Attention" (and one typed node per method).

Install (docs/comfyui.md): ``pip install fastdit`` into ComfyUI's Python, then a one-line shim
``custom_nodes/fastdit_nodes.py`` holding ``from fastdit.integrations.comfyui import *`` (or symlink
this folder into ``custom_nodes/``). ComfyUI reads ``NODE_CLASS_MAPPINGS`` and
``NODE_DISPLAY_NAME_MAPPINGS`` from it.

The node takes a MODEL and returns a patched ``ModelPatcher.clone()`` that runs a fastdit method
through ComfyUI's own ``transformer_options["optimized_attention_override"]`` hook and a
``DIFFUSION_MODEL`` wrapper (nothing of ComfyUI is monkeypatched): ``runtime.py`` says what runs,
``families.py`` which models (Wan T2V / I2V, HunyuanVideo, LTX-Video, Flux) and how their token
grid is read, ``node.py`` the widgets. Importing this package does not import ComfyUI.
"""
from .families import FAMILIES, find_family, supported_classes
from .node import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS, FastditSparseAttention, node_widgets
from .runtime import FastditAttention, step_of

__all__ = ["FAMILIES", "NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "FastditAttention",
           "FastditSparseAttention", "find_family", "node_widgets", "step_of", "supported_classes"]
