"""The app's two exceptions (shared by every layer, so they live at the bottom)."""
from __future__ import annotations

__all__ = ["AppError", "RunCancelled"]


class AppError(ValueError):
    """A message for the user (the UI shows it as an error box; the run changed nothing)."""


class RunCancelled(Exception):
    """Raised from the step callback when the user pressed Stop."""
