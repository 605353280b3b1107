"""``python -m fastdit.integrations.comfyui``: print the node's widget tables (docs/comfyui.md)."""
from .node import widgets_markdown

print(widgets_markdown())
