"""The load record around timed runs (``fastdit.cpu_load``): the rule, and that compare, the eval and
the benchmarks carry it."""
import json
import os

import pytest

from fastdit import cpu_load
from fastdit.cpu_load import SHARED_FRACTION, LoadWatch, judge, load_warning


def loads(one):
    return {"1m": one, "5m": one, "15m": one}


@pytest.mark.parametrize("before, after, own, cpus, shared", [
    (0.1, 2.0, 2.0, 2, False),   # idle machine: the run's own two threads are the whole load
    (2.0, 2.1, 2.0, 2, False),   # the process's previous run still in the 1-minute average
    (4.0, 4.1, 2.0, 2, True),    # another job with two busy threads: others = 2.1 > 1
    (2.9, 3.0, 2.0, 2, False),   # one busy thread of other work: others = 1.0, exactly the threshold
    (3.2, 3.0, 1.9, 2, True),    # others = 1.3
    (9.5, 8.0, 1.0, 16, True),   # 16 CPUs: threshold 8, others 8.5
    (7.0, 8.5, 1.0, 16, False),  # others = 7.5 < 8
])
def test_rule(before, after, own, cpus, shared):
    record = judge(loads(before), loads(after), cpus, own)
    others = max(before, after) - own
    assert record["others"] == pytest.approx(max(0.0, others), abs=0.01)
    assert record["shared"] is shared is (others > SHARED_FRACTION * cpus)
    warning = load_warning(record, "sta")
    assert (warning is not None) is shared
    if shared:
        assert "sta" in warning and f"{before:.1f}" in warning and f"{cpus} CPUs" in warning


def test_without_load_average_nothing_is_judged(monkeypatch):
    monkeypatch.delattr(os, "getloadavg", raising=False)
    record = LoadWatch().start().stop()
    assert record["before"] is None and record["shared"] is None and load_warning(record) is None


def test_watch_reads_the_machine(monkeypatch):
    """Before and after are two readings of os.getloadavg; own_cores is this process's CPU time over
    the wall time (a busy loop keeps about one core busy)."""
    readings = iter([(3.5, 2.0, 1.0), (4.5, 2.5, 1.1)])
    monkeypatch.setattr(os, "getloadavg", lambda: next(readings))
    with LoadWatch() as watch:
        x, end = 0, __import__("time").process_time() + 0.2
        while __import__("time").process_time() < end:
            x += 1
    record = watch.record
    assert record["before"] == {"1m": 3.5, "5m": 2.0, "15m": 1.0} and record["after"]["1m"] == 4.5
    assert record["cpu_count"] == cpu_load.cpu_count() >= 1
    assert 0 < record["own_cores"] <= os.cpu_count() + 0.5  # busy for 0.2 s of CPU time (less than a core when shared)
    assert record["others"] == pytest.approx(4.5 - record["own_cores"], abs=0.01)
    json.dumps(record)  # goes into the reports as it is
