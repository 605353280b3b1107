"""Token methods: attention on fewer tokens than the sequence holds (merged, downsampled or pruned),
with the outputs mapped back to every token. ``token_attention`` holds what they share."""
from .todo import ToDoConfig
from .tome import ToMeConfig

__all__ = ["ToDoConfig", "ToMeConfig"]
