"""Did other work share the CPU while something was timed? The load average around a timed run.

A CPU timing taken while another job held the cores says little about fastdit (seen: ``fastdit
compare`` printed sta at 0.80x on a shared 2-core machine, 1.85x on an idle one). ``LoadWatch``
records, around each timed run, the load average (``os.getloadavg``: runnable and running tasks,
averaged over 1, 5 and 15 minutes) and the CPU count before and after, and the cores the run itself
kept busy (this process's CPU seconds, ``os.times``, over the wall seconds); every timing fastdit
writes (``fastdit compare``'s report, ``fastdit eval``'s sample records, the benchmarks' rows) carries
that record under ``"load"``, and a warning is printed when other work shared the cores.

The rule (``shared``): the load that is not the run's own,

    others = max(load_1m before, load_1m after) - own_cores,

exceeds ``SHARED_FRACTION`` (0.5) x the CPU count. ``own_cores`` is what the run added (its average
number of busy cores); subtracting it from both readings is deliberate, because the 1-minute
average before a run still holds the process's previous run (dense before sta in ``fastdit
compare``). ``others`` is therefore a lower bound of the competing load, and a warning means the
timing really was shared: on 2 cores, another job keeping one core busy for the run's length is
about at the threshold, two busy threads are well over it. The 1-minute average lags (it moves
about 1 - exp(-t / 60 s) of the way to the current load in t seconds), so a short run right after
another job started or stopped can be misjudged; the 5- and 15-minute figures are recorded beside it.
Where ``os.getloadavg`` does not exist (Windows) the record says so and nothing is judged.
"""
from __future__ import annotations

import os
import time

SHARED_FRACTION = 0.5

__all__ = ["SHARED_FRACTION", "LoadWatch", "cpu_count", "judge", "load_average", "load_warning"]


def cpu_count():
    """CPUs this process may run on (its affinity mask where the OS has one), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def load_average():
    """``{"1m", "5m", "15m"}`` from ``os.getloadavg``, or None where the OS has none."""
    try:
        one, five, fifteen = os.getloadavg()
    except (AttributeError, OSError):
        return None
    return {"1m": round(one, 2), "5m": round(five, 2), "15m": round(fifteen, 2)}


def _process_cpu_s():
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


class LoadWatch:
    """The load around one timed run: ``start()`` before it, ``stop()`` after it (or ``with``).

    ``stop()`` returns (and ``record`` holds) ``{"cpu_count", "before", "after", "own_cores",
    "others", "shared", "wall_s"}``: the load averages before and after (``load_average``), the
    cores this process kept busy on average during the run, the load left for other work (the
    module's rule) and whether it exceeded ``SHARED_FRACTION`` x ``cpu_count``."""

    def __init__(self):
        self.record = None
        self._before = self._cpu = self._wall = None

    def start(self):
        self._before, self._cpu, self._wall = load_average(), _process_cpu_s(), time.perf_counter()
        return self

    def stop(self):
        if self._wall is None:
            raise RuntimeError("LoadWatch.stop() before start()")
        wall = time.perf_counter() - self._wall
        own = (_process_cpu_s() - self._cpu) / wall if wall > 0 else 0.0
        self.record = judge(self._before, load_average(), cpu_count(), own, wall)
        return self.record

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
        return False


def judge(before, after, cpus, own_cores, wall_s=None):
    """The record of ``LoadWatch`` from its readings (the rule of the module docstring)."""
    record = {"cpu_count": int(cpus), "before": before, "after": after, "own_cores": round(float(own_cores), 2),
              "wall_s": None if wall_s is None else round(float(wall_s), 3), "others": None, "shared": None,
              "rule": f"shared when max(load_1m before, after) - own_cores > {SHARED_FRACTION} x cpu_count"}
    if before is None or after is None:
        return record
    others = max(0.0, max(before["1m"], after["1m"]) - float(own_cores))
    record["others"] = round(others, 2)
    record["shared"] = others > SHARED_FRACTION * cpus
    return record


def load_warning(record, what="this timing"):
    """A one-line warning when ``record`` (a ``LoadWatch`` record) says other work shared the cores, else None."""
    if not record or not record.get("shared"):
        return None
    return (f"warning: other work shared the CPU during {what} (1-min load {record['before']['1m']:.1f} before, "
            f"{record['after']['1m']:.1f} after, on {record['cpu_count']} CPUs; this run kept "
            f"{record['own_cores']:.1f} busy): the time is not what an idle machine gives")
