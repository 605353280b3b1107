"""What a patch computed, over all calls of all patched layers.

``effective_density`` is the honest figure: computed / total (query block, key block) pairs over
every attention call of the patched layers, each call weighted by its size
(``batch * heads * query tokens * key tokens``), dense steps, dense layers and fallback calls
counted as 1.0. The quality guard's work (sampled exact rows, re-runs of failed heads) is counted as computed work
too (``guard_density`` says how much of it there was). ``sparse_density`` is the same over the calls that ran
sparse only (the figure reports used to quote, which made a half-dense run look sparse). Fallback calls (calls the patch
did not understand and ran with the model's own attention) are listed with their reasons.

Dynamic methods report densities as device tensors; they are summed on the device and read once,
when a figure is asked for, so counting never synchronises the GPU during a run.
"""
from __future__ import annotations

import threading

import torch


class PatchStats:
    """Counters over a patch's lifetime (``Patch.reset_stats`` starts them again).

    Attributes:
        dense_calls: calls that ran dense by design (the dense method, dense steps and layers,
            layouts the method computes densely).
        sparse_calls: calls that ran the method.
        fallback_calls: calls the patch could not handle and ran with the model's own attention.
        fallbacks: reason -> number of fallback calls.
        plan_names: names of the plans used. padding_fraction: the largest padding of any plan.
        reuse_head_calls, reused_heads: head-calls of a dynamic method with ``reuse_threshold`` set,
            and those of them that kept an earlier step's selection (``methods/selection/reuse.py``).
        skipped_subtiles, walked_subtiles: the in-kernel skip rule (``skip_threshold``, and the
            ``skip_softmax`` method): key sub-tiles it skipped / looked at over every (batch, head)
            of the calls that ran it (read from the device when asked); ``skip_share`` their ratio.
    """

    def __init__(self, method=None):
        self._lock = threading.Lock()
        self._method = method
        self._plans_at_start = getattr(method, "plans_built", 0)
        self.dense_calls = 0
        self.sparse_calls = 0
        self.fallback_calls = 0
        self.fallbacks = {}
        self.plan_names = set()
        self.padding_fraction = 0.0
        self._work = 0.0  # sum of call sizes (dense work), all calls
        self._computed = 0.0  # sum of size * density, all calls (float, or a device tensor)
        self._sparse_work = 0.0
        self._sparse_computed = 0.0
        self.ring_steps = 0  # ring attention: (query shard, key shard) steps computed ...
        self.ring_skipped_steps = 0  # ... and skipped (the plan keeps no block of that key shard)
        self.ring_block_pairs = 0  # block pairs this rank's ring steps computed (all heads, all calls)
        # the quality guard (fastdit/methods/guard.py): head-calls checked, widened, run dense
        self.guard_head_calls = 0
        self.guard_widened = 0
        self.guard_dense = 0
        self.guard_nonfinite_calls = 0
        self.guard_seconds = 0.0  # host time of the checks and re-runs (on a GPU: without device syncs)
        self._guard_computed = 0.0  # the guard's own work (checks, re-runs), in call-size units
        # selection reuse across steps (fastdit/methods/selection/reuse.py): head-calls with reuse on, and reused
        self.reuse_head_calls = 0
        self.reused_heads = 0
        # the in-kernel skip rule: device tensors summed per call (no host synchronisation)
        self._skipped_subtiles = 0
        self._walked_subtiles = 0

    # -- counting ---------------------------------------------------------------------------
    def count_dense(self, size):
        with self._lock:
            self.dense_calls += 1
            self._work += size
            self._computed = self._computed + size

    def count_fallback(self, reason, size=0):
        with self._lock:
            self.fallback_calls += 1
            self.fallbacks[reason] = self.fallbacks.get(reason, 0) + 1
            self._work += size
            self._computed = self._computed + size

    def count_ring(self, steps, skipped, pairs=0):
        """One ring-attention call: ``steps`` key shards computed, ``skipped`` skipped, ``pairs``
        block pairs computed by this rank."""
        with self._lock:
            self.ring_steps += steps
            self.ring_skipped_steps += skipped
            self.ring_block_pairs += pairs

    def count_sparse(self, size, density, plan=None):
        """``density``: a float or a 0-d device tensor (dynamic plans)."""
        with self._lock:
            self.sparse_calls += 1
            self._work += size
            self._sparse_work += size
            self._computed = self._computed + size * density
            self._sparse_computed = self._sparse_computed + size * density
            if plan is not None:
                self.plan_names.add(plan.name)
                self.padding_fraction = max(self.padding_fraction, plan.padding_fraction)

    def count_call(self, info, size):
        """Count one finished method call from its ``AttentionContext.info`` (what ``record`` and the
        method wrote): dense by design, token-method counts, or a block plan (a dynamic plan's
        density stays a device tensor: no host synchronisation)."""
        guard = info.get("guard")
        if guard is not None:
            self.count_guard(guard, size)
        reuse = info.get("reuse")
        if reuse is not None:
            with self._lock:
                self.reuse_head_calls += reuse["heads"]
                self.reused_heads += reuse["reused"]
        skipped, walked = info.get("skipped_subtiles"), info.get("walked_subtiles")
        if skipped is not None and walked is not None and not info.get("dense"):
            with self._lock:
                self._skipped_subtiles = self._skipped_subtiles + skipped.sum()
                self._walked_subtiles = self._walked_subtiles + walked.expand(skipped.shape).sum()
        if info.get("dense"):
            self.count_dense(size)
        elif "performed" in info:
            self.count_sparse(size, info["performed"] / max(info["total"], 1), info.get("plan"))
        elif "plan" in info:
            plan = info["plan"]
            density = plan.block_density_tensor().mean() if plan.dynamic else plan.density
            self.count_sparse(size, density, plan)
        else:
            self.count_sparse(size, 1.0)  # a method that reported nothing computed everything

    def count_guard(self, report, size):
        """One guarded call: its head-calls and actions, and its work (added to the computed total:
        the check's sampled rows and any re-run are work the call really did)."""
        with self._lock:
            self.guard_head_calls += len(report["action"])
            self.guard_widened += report["action"].count("widened")
            self.guard_dense += report["action"].count("dense")
            self.guard_nonfinite_calls += int(bool(report["nonfinite"]))
            self.guard_seconds += report["seconds"]
            extra = size * report["extra_density"]
            self._guard_computed += extra
            self._computed = self._computed + extra
            self._sparse_computed = self._sparse_computed + extra

    @property
    def guard_density(self):
        """The guard's own work over all calls' dense work (0 when it never ran)."""
        return self._ratio(self._guard_computed, self._work)

    # -- figures ------------------------------------------------------------------------------
    @staticmethod
    def _ratio(computed, work):
        if not work:
            return 1.0
        value = computed.item() if isinstance(computed, torch.Tensor) else computed
        return float(value) / work

    @property
    def effective_density(self):
        """Computed / total block pairs over all calls (dense and fallback calls count as 1.0)."""
        return self._ratio(self._computed, self._work)

    @property
    def sparse_density(self):
        """Mean block density of the sparse calls alone (1.0 when none ran)."""
        return self._ratio(self._sparse_computed, self._sparse_work)

    @property
    def mean_density(self):
        """Old name of ``sparse_density``."""
        return self.sparse_density

    @property
    def skipped_subtiles(self):
        return int(self._skipped_subtiles)

    @property
    def walked_subtiles(self):
        return int(self._walked_subtiles)

    @property
    def skip_share(self):
        """Skipped / looked-at key sub-tiles of the skip rule; None when no call ran it."""
        walked = self.walked_subtiles
        return self.skipped_subtiles / walked if walked else None

    @property
    def total_calls(self):
        return self.dense_calls + self.sparse_calls + self.fallback_calls

    @property
    def plans_built(self):
        return getattr(self._method, "plans_built", 0) - self._plans_at_start

    def as_dict(self):
        """The figures for reports (JSON-ready)."""
        return {
            "effective_density": self.effective_density,
            "sparse_density": self.sparse_density if self.sparse_calls else None,
            "dense_calls": self.dense_calls,
            "sparse_calls": self.sparse_calls,
            "fallback_calls": self.fallback_calls,
            "fallbacks": dict(self.fallbacks),
            "plans": sorted(self.plan_names),
            "padding_fraction": self.padding_fraction,
            "ring_steps": self.ring_steps,
            "ring_skipped_steps": self.ring_skipped_steps,
            "ring_block_pairs": self.ring_block_pairs,
            "guard": {"head_calls": self.guard_head_calls, "widened": self.guard_widened, "dense": self.guard_dense,
                      "nonfinite_calls": self.guard_nonfinite_calls, "density": self.guard_density,
                      "seconds": self.guard_seconds},
            "reuse": {"head_calls": self.reuse_head_calls, "reused": self.reused_heads,
                      "rate": self.reused_heads / self.reuse_head_calls if self.reuse_head_calls else None},
            "skip": {"skipped_subtiles": self.skipped_subtiles, "walked_subtiles": self.walked_subtiles,
                     "share": self.skip_share},
        }

    def __repr__(self):
        return (f"PatchStats(effective_density={self.effective_density:.3f}, sparse_calls={self.sparse_calls}, "
                f"dense_calls={self.dense_calls}, fallback_calls={self.fallback_calls})")
