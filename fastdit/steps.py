"""Denoising-step tracking through the scheduler, at instance level and safe to deep-copy.

A tracked scheduler gets two instance attributes, ``set_timesteps`` and ``step``, that call its
own methods and then report to the pipeline call running in this context
(``fastdit.context``): ``set_timesteps`` starts a call (step 0, the schedule), every ``step``
ends a round of transformer calls. The wrappers hold their scheduler and its bound method as
attributes, so ``copy.deepcopy(scheduler)`` gives a copy whose wrappers drive the copy (SkyReels-V2
diffusion forcing deep-copies the scheduler per latent frame), and they keep the signatures
pipelines inspect (HunyuanVideo checks that ``set_timesteps`` accepts ``sigmas``).

Several patches may track one scheduler (two pipelines sharing it): the wrappers are installed by
the first and removed with the last (a reference count on the scheduler), whatever the order.
"""
from __future__ import annotations

import functools

from fastdit.context import active_call, begin_pipeline_call

_COUNT = "_fastdit_step_tracking"
_TRACKED = ("set_timesteps", "step")


class _TrackedMethod:
    """``scheduler.<name>`` replacement: the scheduler's own method, then a report."""

    def __init__(self, owner, name, original, instance_level=False):
        self.owner = owner
        self.name = name
        self.instance_level = instance_level  # the original was itself an instance attribute
        functools.update_wrapper(self, original)  # sets __wrapped__ (the bound original), keeps signatures

    def __call__(self, *args, **kwargs):
        result = self.__wrapped__(*args, **kwargs)
        owner = self.owner
        if self.name == "set_timesteps":
            order = getattr(owner, "order", 1) or 1
            timesteps = getattr(owner, "timesteps", None)
            count = None if timesteps is None else len(timesteps) // order
            begin_pipeline_call(count, order, timesteps)
        else:
            state = active_call()
            if state is not None:
                timestep = args[1] if len(args) > 1 else kwargs.get("timestep")
                state.on_scheduler_step(timestep)
        return result


def track_scheduler(scheduler):
    """Install step tracking on ``scheduler`` (reference counted); returns the undo function."""
    count = scheduler.__dict__.get(_COUNT, 0)
    if count == 0:
        for name in _TRACKED:
            own = name in scheduler.__dict__
            setattr(scheduler, name, _TrackedMethod(scheduler, name, getattr(scheduler, name), own))
    scheduler.__dict__[_COUNT] = count + 1

    def untrack():
        remaining = scheduler.__dict__.get(_COUNT, 1) - 1
        if remaining > 0:
            scheduler.__dict__[_COUNT] = remaining
            return
        scheduler.__dict__.pop(_COUNT, None)
        for name in _TRACKED:
            wrapper = scheduler.__dict__.get(name)
            if isinstance(wrapper, _TrackedMethod) and wrapper.owner is scheduler:
                if wrapper.instance_level:
                    scheduler.__dict__[name] = wrapper.__wrapped__
                else:
                    del scheduler.__dict__[name]

    return untrack
