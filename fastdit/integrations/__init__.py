"""fastdit inside other engines: ``fastdit.integrations.vllm_omni`` (vllm-omni sparse-attention plugins,
registered as entry points in the group ``vllm_omni.sparse_attn``) and ``fastdit.integrations.comfyui``
(the ComfyUI custom node "fastdit Sparse Attention", docs/comfyui.md)."""
