"""What a method tells the quality guard (``guard.py``), and how a call runs under it.

A mixin of ``Method``: ``guard_promise`` (the kept mass the method's options promise),
``guard_levels`` / ``guard_widen_options`` (its wider settings, tried on a failed head before
dense), and ``run_checked`` (``attend`` under the guard when ``config.guard`` is a number).
"""
from __future__ import annotations

import dataclasses


class GuardHooks:
    """The guard's part of the method protocol (see the module docstring)."""

    def guard_promise(self):
        """The kept attention mass this method's options promise (``cdf``, ``top_p``), or None."""
        return None

    def guard_levels(self):
        """How many wider settings the guard may try on a failed head before dense (0: dense at once)."""
        return 0

    def guard_widened(self, level):
        """This method at its ``level``-th wider setting (1-based; ``guard_widen_options``), or None."""
        options = self.guard_widen_options(level)
        if options is None:
            return None
        cache = self.__dict__.setdefault("_guard_wider", {})
        if level not in cache:
            config = dataclasses.replace(self.config, layer_settings=None, guard=False, dense_steps=0, dense_layers=0,
                                         **options)
            cache[level] = type(self)(type(self).make_config(config))
        return cache[level]

    def guard_widen_options(self, level):
        """Options of the ``level``-th wider setting (e.g. ``{"cdf": 0.99}``), or None."""
        return None

    def guarded(self, ctx):
        """Whether this call runs under the guard (a number in ``config.guard``)."""
        guard = getattr(self.config, "guard", None)
        return guard is not None and guard is not False

    def run_checked(self, ctx, q, k, v):
        """``attend`` under the guard when it is on (see ``guard.guarded_call``)."""
        if not self.guarded(ctx):
            return self.attend(ctx, q, k, v)
        from .guard import guarded_call

        return guarded_call(self, ctx, q, k, v, self.attend)
