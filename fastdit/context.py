"""Per-call state: which pipeline call, denoising step, transformer call and attention call we are in.

Nothing here lives on the patch or on a shared model object: every piece of per-call state lives
in ``contextvars``, so two threads (each with its own context) or two pipelines never see each
other's steps, grids or method state, and a deep-copied scheduler drives only itself.

* ``CallState`` - one pipeline call (started by ``scheduler.set_timesteps``; for a bare transformer,
  by the timestep going up again, or repeating past the calls one step can make): the denoising step,
  the number of steps this call actually runs, and a store of method state per (layer, branch), fresh
  for every pipeline call.
* ``TransformerCall`` - one forward of a patched transformer: its latent grid, the CFG branch (the
  index of this transformer call within the step) and the ``CallState`` it belongs to.
* ``AttentionContext`` - what a method sees of one intercepted attention call.

Step counting: a step is a round of transformer calls between scheduler steps. Every
``scheduler.step`` marks the round as finished, and the next transformer call starts a new one;
with a scheduler of ``order`` 2 (Heun) two rounds make a step. So classifier-free guidance (one
batched call, or two calls per step), Wan 2.2's two experts and SkyReels-V2's diffusion forcing
(one scheduler copy stepped per latent frame) all count one step per denoising iteration.

Steps actually run: img2img / video2video pipelines at ``strength < 1`` start inside the schedule.
The first ``scheduler.step`` of a call tells where (its timestep's index in the schedule), so
``num_steps`` is exact from step 1 on; step 0 is dense for any positive ``dense_steps`` anyway.
"""
from __future__ import annotations

import contextvars
from dataclasses import dataclass, field

import torch

#: The pipeline call running in this context (set by the scheduler wrappers).
_ACTIVE_CALL = contextvars.ContextVar("fastdit_active_call", default=None)
#: id(transformer) -> TransformerCall of the transformer forward running in this context.
_TRANSFORMER_CALLS = contextvars.ContextVar("fastdit_transformer_calls", default=None)
#: patch id -> CallState driven by timesteps, for transformers called without a tracked scheduler.
_BARE_CALLS = contextvars.ContextVar("fastdit_bare_calls", default=None)


class CallState:
    """One pipeline call: step index, steps this call runs, and method state per (layer, branch)."""

    def __init__(self, num_steps=None, order=1, schedule=None, source="scheduler"):
        self.num_steps = num_steps
        self.order = max(int(order or 1), 1)
        self.schedule = schedule  # the scheduler's timesteps (CPU float64), to find where the call starts
        self.source = source
        self.rounds = 0  # transformer-call rounds completed (a round ends at a scheduler step)
        self.step_pending = False
        self.calls_in_round = 0
        self.start_known = schedule is None
        self.last_timestep = None
        self.store = {}

    @property
    def step(self):
        return self.rounds // self.order

    # -- events ---------------------------------------------------------------------------
    def on_scheduler_step(self, timestep=None):
        if not self.start_known:
            self.start_known = True
            start = _schedule_index(self.schedule, timestep)
            if start is not None and self.num_steps is not None:
                self.num_steps = max(1, (len(self.schedule) - start) // self.order)
        self.step_pending = True

    def on_transformer_call(self):
        """A transformer forward begins; returns its branch (index within the current round)."""
        if self.step_pending:
            self.step_pending = False
            self.rounds += 1
            self.calls_in_round = 0
        branch = self.calls_in_round
        self.calls_in_round += 1
        return branch

    def on_bare_timestep(self, timestep, branches=2):
        """Step tracking without a scheduler: a new step when the timestep changes, a new pipeline
        call (fresh state) when it goes up again (denoising runs from high noise to low), and also
        when it repeats past ``branches`` transformer calls in one step (what a pipeline can make
        of one step: two for classifier-free guidance). So a loop at one timestep (a one-step
        model, feature extraction) is a run of one-step calls, and the state per (layer, branch)
        stays bounded over any number of calls. An unknown timestep counts like a repeated one."""
        if self.last_timestep is not None or timestep is None:
            if timestep is not None and timestep > self.last_timestep:
                self._new_call()
            elif timestep is not None and timestep != self.last_timestep:
                self.step_pending = True
            elif not self.step_pending and self.calls_in_round >= max(int(branches), 1):
                self._new_call()
        self.last_timestep = timestep
        return self.on_transformer_call()

    def _new_call(self):
        self.rounds, self.calls_in_round, self.step_pending = 0, 0, False
        self.store = {}

    # -- queries --------------------------------------------------------------------------
    def layer_state(self, layer, branch):
        """The method state of (layer, branch) for this pipeline call (a dict, created empty)."""
        return self.store.setdefault((layer, branch), {})

    def dense_threshold(self, dense_steps):
        """Steps with index below this run dense (``dense_steps``: an int count or a fraction)."""
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

    def is_dense_step(self, dense_steps):
        return self.step < self.dense_threshold(dense_steps)



def _schedule_index(schedule, timestep):
    """Index of ``timestep`` in ``schedule`` (the nearest entry), or None when it is not there."""
    if schedule is None or timestep is None or len(schedule) == 0:
        return None
    try:
        value = float(timestep.flatten()[0]) if isinstance(timestep, torch.Tensor) else float(timestep)
    except (TypeError, ValueError, IndexError):
        return None
    distance = (schedule - value).abs()
    index = int(distance.argmin())
    tolerance = 1e-3 * max(1.0, float(schedule.abs().max()))
    return index if float(distance[index]) <= tolerance else None


def begin_pipeline_call(num_steps, order=1, timesteps=None):
    """Start a pipeline call in this context (called by the wrapped ``set_timesteps``)."""
    schedule = None
    if isinstance(timesteps, torch.Tensor) and timesteps.numel():
        schedule = timesteps.detach().flatten().to("cpu", torch.float64)
    state = CallState(num_steps, order, schedule)
    _ACTIVE_CALL.set(state)
    return state


def active_call():
    return _ACTIVE_CALL.get()


def bare_call_state(patch_id, num_steps=None):
    """The timestep-driven ``CallState`` of a bare-transformer patch in this context."""
    calls = _BARE_CALLS.get()
    if calls is None:
        calls = {}
        _BARE_CALLS.set(calls)
    state = calls.get(patch_id)
    if state is None:
        state = calls[patch_id] = CallState(num_steps, source="transformer")
    return state


def release_bare_call_state(patch_id):
    """Drop a removed patch's timestep-driven state in this context (its method caches)."""
    calls = _BARE_CALLS.get()
    if calls is not None:
        calls.pop(patch_id, None)


def reset_bare_call_state(patch_id, num_steps):
    bare_call_state(patch_id).__init__(num_steps, source="transformer")


@dataclass
class TransformerCall:
    """One forward of a patched transformer, as the attention calls inside it see it."""

    grid: tuple | None
    branch: int
    call: CallState
    cfg: bool | None = None
    #: the call's timestep argument as given (a number or tensor; None when unknown): what a
    #: method that needs per-step randomness keys it to (``timestep_value``), never a call count
    timestep: object = None


def set_transformer_call(transformer, info):
    calls = _TRANSFORMER_CALLS.get()
    calls = {} if calls is None else dict(calls)
    calls[id(transformer)] = info
    _TRANSFORMER_CALLS.set(calls)


def transformer_call(transformer):
    calls = _TRANSFORMER_CALLS.get()
    return None if calls is None else calls.get(id(transformer))


@dataclass
class AttentionContext:
    """What a method sees of one attention call.

    Attributes:
        layer: index of the patched layer (model order, over all patched transformers).
        layer_name: its module name.
        local_layer: its index within its own transformer (Wan 2.2 has two), for ``dense_layers``.
        call: the ``CallState`` of the pipeline call (step bookkeeping).
        step: denoising step within this pipeline call (0-based).
        num_steps: steps this pipeline call actually runs (None when unknown).
        branch: index of this transformer call within the step: 0 and 1 for the two CFG branches of
            a pipeline that calls the transformer twice per step (0 when CFG is batched).
        cfg: whether the pipeline runs classifier-free guidance (None when unknown).
        layout: the ``TokenLayout`` of the call.
        key_mask, query_mask: bool ``(B, S)`` validity, or None when every token is valid.
        head_offset, num_heads: the heads of this call within the layer's ``total_heads`` (under
            context parallelism a rank sees a slice of them).
        scale: the softmax scale (None: ``1/sqrt(D)``).
        state: per (layer, branch) method state, a dict reset at the start of every pipeline call.
        backend: the kernel backend (``"auto"``, ``"triton"``, ``"torch"``).
    """

    layer: int
    layer_name: str
    step: int
    num_steps: int | None
    branch: int
    layout: object
    call: CallState
    local_layer: int = 0
    key_mask: torch.Tensor | None = None
    query_mask: torch.Tensor | None = None
    head_offset: int = 0
    num_heads: int = 1
    total_heads: int | None = None
    scale: float | None = None
    cfg: bool | None = None
    state: dict = field(default_factory=dict)
    backend: str = "auto"
    #: the model's own attention for this call (set by the patch; the functional API computes it).
    dense_fn: object = None
    #: the transformer call's timestep argument (number or tensor), None when unknown
    timestep: object = None
    #: the layer's trainable parameters the patch added (``Method.layer_module``), or None
    params: object = None
    #: what the method did: filled by ``record`` (plan, density) and read by the stats.
    info: dict = field(default_factory=dict)

    def timestep_value(self):
        """The call's timestep as a float (its first element), or None when unknown. Reading a
        device tensor synchronises: only methods that need it (optiprune's draw) ask."""
        t = self.timestep
        if t is None:
            return None
        if isinstance(t, torch.Tensor):
            return float(t.detach().flatten()[0]) if t.numel() else None
        return float(t)

    def dense(self):
        """The model's own attention for this call."""
        return self.dense_fn()

    def record(self, plan=None, performed=None, total=None):
        """Tell the caller what was computed: a block plan, or (token methods) the query-key score
        computations ``performed`` over the whole call against dense attention's ``total``."""
        if plan is not None:
            self.info["plan"] = plan
        if performed is not None:
            self.info["performed"] = performed
            self.info["total"] = total


def new_context(*, layout, num_heads, layer=0, layer_name=None, step=0, num_steps=None, branch=0, call=None,
                local_layer=None, total_heads=None, **fields):
    """The one builder of an ``AttentionContext``: the patched path (``Patch.call_context``, also
    under ring attention), ``fastdit.attention`` / ``run_call`` and the benchmarks all call it.

    Outside a pipeline (``call`` None) a fresh ``CallState`` of ``num_steps`` steps stands at
    ``step``; ``layer_name`` defaults to ``"layer<layer>"``, ``local_layer`` to ``layer`` and
    ``total_heads`` to ``num_heads``. Every other field (``key_mask``, ``query_mask``,
    ``head_offset``, ``scale``, ``cfg``, ``state``, ``backend``, ``dense_fn``, ``timestep``,
    ``params``) passes through under its ``AttentionContext`` name."""
    if call is None:
        call = CallState(num_steps)
        call.rounds = int(step)
    return AttentionContext(
        layer=layer, layer_name=f"layer{layer}" if layer_name is None else layer_name, step=int(step),
        num_steps=num_steps, branch=branch, layout=layout, call=call,
        local_layer=layer if local_layer is None else local_layer, num_heads=num_heads,
        total_heads=num_heads if total_heads is None else total_heads, **fields)
