"""What the benchmarks share: timing, peak memory, the machine's description and the report.

* ``time_calls`` / ``timed`` / ``time_fn`` / ``time_once``: milliseconds of calls, CUDA events on
  a GPU (synchronised before and after), ``time.perf_counter`` on the CPU;
* ``RSSPeak`` / ``peak_memory_mb``: peak memory of a block or of one call above the level before it
  (CUDA: allocated memory; CPU: the resident set, sampled by a thread);
* ``machine`` (device, CPU and GPU names, library versions), ``default_out_path``;
* ``BenchReport``: what a benchmark prints and writes (the log, the rows, the JSON rewritten after
  every row so that an interrupted run keeps what it measured, and optionally the printed table);
  every row carries the machine's load around its measurement (``"load"``, ``fastdit.cpu_load``),
  and a warning goes to stderr when other work shared the cores.
"""
from __future__ import annotations

import datetime as _dt
import os
import platform
import statistics
import sys
import threading
import time

import torch

from fastdit.cpu_load import LoadWatch, load_warning
from fastdit.jsonutil import dump_json

# --------------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------------


def time_calls(fn, reps, cuda):
    """``([milliseconds of each of reps calls], output of the last)`` (CUDA events, else perf_counter)."""
    times, out = [], None
    for _ in range(reps):
        out = None  # the previous output is freed before the next call, as in a denoising loop
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            out = fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            out = fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return times, out


def timed(fn, reps, warmup, cuda):
    """``(median ms, [ms per timed run])`` of ``fn()`` after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    times, _ = time_calls(fn, reps, cuda)
    return statistics.median(times), times


def time_fn(fn, reps, warmup, cuda):
    """Median milliseconds of ``fn()`` after ``warmup`` untimed calls."""
    return timed(fn, reps, warmup, cuda)[0]


def time_once(fn, cuda):
    """Milliseconds of one call of ``fn``."""
    return time_calls(fn, 1, cuda)[0][0]


def sync(cuda):
    if cuda:
        torch.cuda.synchronize()


# --------------------------------------------------------------------------------------------------
# Memory
# --------------------------------------------------------------------------------------------------


def rss_bytes():
    """The process's resident set in bytes (Linux), else None."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class RSSPeak:
    """The process's resident-set peak while the block runs, above its level on entry (MiB, in
    ``peak_mib``), sampled every ``interval`` s by a thread (Linux; None elsewhere or when disabled).
    Memory freed earlier that the allocator keeps is not seen again: figures are lower bounds."""

    def __init__(self, enabled=True, interval=0.005):
        self.enabled, self.interval, self.peak_mib = enabled, interval, None

    def __enter__(self):
        self._base = rss_bytes() if self.enabled else None
        if self._base is None:
            return self
        self._peak = self._base
        self._done = threading.Event()

        def sample():
            while not self._done.is_set():
                self._peak = max(self._peak, rss_bytes() or 0)
                self._done.wait(self.interval)

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        if self._base is not None:
            self._done.set()
            self._thread.join()
            self.peak_mib = (max(self._peak, rss_bytes() or 0) - self._base) / 2**20
        return False


def peak_memory_mb(fn, cuda, interval=0.002):
    """Peak memory of one call of ``fn`` above the level before it, in MiB.

    CUDA: ``torch.cuda.max_memory_allocated`` after a reset, minus what was allocated before (the
    inputs are excluded). CPU: ``RSSPeak`` around the call (None off Linux). Run on a call of its
    own, never a timed one, so the sampling does not disturb the timings."""
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20
    with RSSPeak(interval=interval) as rss:
        fn()
    return rss.peak_mib


# --------------------------------------------------------------------------------------------------
# The machine
# --------------------------------------------------------------------------------------------------


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def versions():
    """``(torch, triton or None, diffusers or None)`` versions."""
    found = []
    for name in ("triton", "diffusers"):
        try:
            found.append(__import__(name).__version__)
        except Exception:
            found.append(None)
    return (torch.__version__, *found)


def pick_device(name=None, threads=None):
    """``torch.device(name)``, default cuda when available; ``threads`` sets torch's CPU threads."""
    if threads:
        torch.set_num_threads(threads)
    return torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))


def machine(device):
    """Facts every report's meta carries about where it ran."""
    cuda = device.type == "cuda"
    torch_v, triton_v, diffusers_v = versions()
    return {"timestamp": _dt.datetime.now().strftime("%Y%m%d-%H%M%S"), "device": str(device),
            "gpu": torch.cuda.get_device_name(device) if cuda else None, "cpu": cpu_name(), "torch": torch_v,
            "triton": triton_v, "diffusers": diffusers_v, "cpu_threads": torch.get_num_threads(),
            "timer": "cuda_events" if cuda else "perf_counter"}


def default_out_path(prefix, meta):
    """``bench_results/<prefix>_<cpu or cuda-<gpu>>_<timestamp>.json``."""
    gpu = meta["gpu"]
    tag = "cpu" if gpu is None else "cuda-" + "".join(c if c.isalnum() else "_" for c in gpu).strip("_")
    return os.path.join("bench_results", f"{prefix}_{tag}_{meta['timestamp']}.json")


def fmt(x, spec):
    """``format(x, spec)``, or ``-`` for None (a table cell)."""
    return "-" if x is None else format(x, spec)


def rel_error(a, b):
    """``||a - b|| / ||b||`` in float64 (a Python float)."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def first_line(error, limit=120):
    """``Type: first line of the message`` of an exception, cut to ``limit`` characters."""
    return f"{type(error).__name__}: {str(error).splitlines()[0][:limit] if str(error) else ''}"


# --------------------------------------------------------------------------------------------------
# The report
def warn_if_shared(load, what):
    """Print ``fastdit.cpu_load.load_warning`` to stderr when ``load`` says other work shared the cores."""
    warning = load_warning(load, what)
    if warning:
        print(warning, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------------


class BenchReport:
    """What a benchmark prints and writes.

    ``log`` prints a line and keeps it; ``add`` keeps a row, stamped with the meta's ``stamp`` keys
    (so a row read alone says where it ran) and with ``"load"``: the machine's load from the
    previous row (or the report's creation) to this one, the span in which the row was measured
    (``fastdit.cpu_load.LoadWatch``; a warning on stderr when other work shared the cores);
    ``write`` (re)writes the JSON ``{"meta", **sections, "rows"}`` atomically
    (``fastdit.jsonutil.dump_json``) and, with ``table_path``, the lines."""

    def __init__(self, out_path, meta, table_path=None, stamp=("timestamp", "gpu", "cpu", "torch", "triton")):
        self.out_path, self.meta, self.table_path, self.stamp = out_path, meta, table_path, stamp
        self.lines, self.rows, self.sections = [], [], {}
        self.load = LoadWatch().start()

    def log(self, s=""):
        print(s, flush=True)
        self.lines.append(s)

    def add(self, row):
        row.update({k: self.meta[k] for k in self.stamp})
        row["load"] = self.load.stop()
        warn_if_shared(row["load"], f"row {len(self.rows) + 1}")
        self.load.start()
        self.rows.append(row)
        return row

    def write(self):
        os.makedirs(os.path.dirname(os.path.abspath(self.out_path)), exist_ok=True)
        dump_json(self.out_path, {"meta": self.meta, **self.sections, "rows": self.rows}, indent=1)
        if self.table_path:
            with open(self.table_path, "w") as f:
                f.write("\n".join(self.lines) + "\n")
