"""Denoising-step tracking, so methods can run dense for the first steps of every pipeline call.

With a pipeline, the scheduler is watched at instance level: ``set_timesteps`` starts a call
(step 0, and the call's step count) and every ``step`` advances one denoising step, however many
transformer calls a step makes (classifier-free guidance as a batch of two or as two calls both
happen before ``scheduler.step``). Two transformers driven by one scheduler (Wan 2.2) share it.

With a bare transformer there is no scheduler: a new step starts whenever the ``timestep``
argument changes, and a new call when it goes up again (denoising runs from high noise to low).
Fractional ``dense_steps`` then need the step count: ``Patch.set_num_steps(n)``.
"""
from __future__ import annotations

import math


class StepTracker:
    """Step index within the current pipeline call and the call's number of steps."""

    def __init__(self):
        self.reset()

    def reset(self, num_steps=None):
        self.step = 0
        self.num_steps = num_steps
        self._scheduler_calls = 0
        self._last_timestep = None

    # -- scheduler-driven -------------------------------------------------------------------
    def begin_call(self, num_steps, order=1):
        self.reset(num_steps)
        self._order = max(int(order), 1)

    def on_scheduler_step(self):
        self._scheduler_calls += 1
        self.step = self._scheduler_calls // getattr(self, "_order", 1)

    # -- transformer-driven (no scheduler) ----------------------------------------------------
    def on_transformer_call(self, timestep):
        if timestep is None:
            return
        if self._last_timestep is None:
            self.step = 0
        elif timestep > self._last_timestep:
            self.step = 0  # noise went up again: a new pipeline call
        elif timestep != self._last_timestep:
            self.step += 1
        self._last_timestep = timestep

    def dense_threshold(self, dense_steps):
        """Steps with index below this run dense."""
        if isinstance(dense_steps, float):
            if dense_steps == 0.0:
                return 0.0
            if self.num_steps is None:
                raise RuntimeError(
                    "dense_steps is a fraction but the number of denoising steps is unknown (a bare transformer "
                    "was patched): pass an int count, or call patch.set_num_steps(n) before the run"
                )
            return dense_steps * self.num_steps
        return dense_steps

    def is_dense(self, dense_steps):
        return self.step < self.dense_threshold(dense_steps)

    def dense_step_count(self, dense_steps):
        """How many steps of the current call run dense."""
        threshold = self.dense_threshold(dense_steps)
        count = math.ceil(threshold)
        return count if self.num_steps is None else min(count, self.num_steps)
