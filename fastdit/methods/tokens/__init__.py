"""Token methods: attention on fewer tokens than the sequence holds (merged, downsampled or pruned: todo,
tome, optiprune), with the outputs mapped back to every token. ``token_attention`` holds what they share."""
from .optiprune import OptiPruneConfig
from .todo import ToDoConfig
from .tome import ToMeConfig

__all__ = ["OptiPruneConfig", "ToDoConfig", "ToMeConfig"]
