#!/usr/bin/env python
"""Run a command as a child process and report its peak resident memory (RSS).

    python scripts/peak_memory.py --limit-gb 4 -- fastdit compare --out /tmp/x
    python scripts/peak_memory.py --json peak.json --limit-gb 4 --kill-over-limit -- fastdit eval ...

Two numbers are measured, because each misses something the other sees:

* ``max_process_rss``: the kernel's high-water mark from ``wait4`` (``ru_maxrss``): the largest
  resident set that the child, or any descendant it waited for, ever had. Exact (no sampling can
  miss a short spike), but it is a per-process maximum, not a sum over processes running at once.
* ``tree_rss_sampled``: every ``--interval`` seconds the ``VmRSS`` of the child and all its live
  descendants is read from ``/proc`` and summed; the maximum of these sums is kept. It sees
  concurrent processes but can miss a spike shorter than the interval (Linux only).

``peak_rss`` is the larger of the two and is what ``--limit-gb`` is checked against. One line goes
to stderr (the command's own stdout/stderr pass through unchanged); ``--json PATH`` also writes
all numbers. GB here means 10^9 bytes.

Exit status: the command's own when it failed (128 + signal number when a signal killed it), else
3 when the peak exceeded ``--limit-gb``, else 0. With ``--kill-over-limit`` the command's process
tree is killed as soon as a sample exceeds the limit, so a regression cannot exhaust the machine.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time

GB = 10**9
EXIT_OVER_LIMIT = 3


def _children_map():
    """{ppid: [pid, ...]} for every process visible in /proc (empty off Linux)."""
    children = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return children
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue  # exited in between
        # "pid (comm) state ppid ...": comm may contain spaces and ')', so split after the last ')'.
        fields = stat[stat.rfind(b")") + 2:].split()
        if len(fields) > 1:
            children.setdefault(int(fields[1]), []).append(int(entry))
    return children


def _rss_bytes(pid):
    """Current VmRSS of ``pid`` in bytes (0 if it is gone or a zombie)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmRSS:"):
                    return int(line.split()[1]) * 1024  # reported in kB (KiB)
    except (OSError, ValueError, IndexError):
        pass
    return 0


def process_tree(root):
    """``root`` and all its live descendants."""
    children = _children_map()
    tree, stack = [], [root]
    while stack:
        pid = stack.pop()
        tree.append(pid)
        stack.extend(children.get(pid, []))
    return tree


def tree_rss(root):
    """Summed resident memory of ``root`` and its descendants, in bytes."""
    return sum(_rss_bytes(pid) for pid in process_tree(root))


def _kill_tree(root):
    for pid in reversed(process_tree(root)):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def measure(command, limit_bytes=None, interval=0.05, kill_over_limit=False, env=None):
    """Run ``command`` (a list) and return a dict of its peak memory, exit status and wall time."""
    start = time.monotonic()
    proc = subprocess.Popen(command, env=env)
    sampled, killed = 0, False
    status, usage = None, None
    while status is None:
        pid, st, ru = os.wait4(proc.pid, os.WNOHANG)
        if pid == proc.pid:
            status, usage = st, ru
            break
        sampled = max(sampled, tree_rss(proc.pid))
        if kill_over_limit and limit_bytes is not None and sampled > limit_bytes and not killed:
            _kill_tree(proc.pid)
            killed = True
        time.sleep(interval)
    proc.returncode = os.waitstatus_to_exitcode(status)  # keeps Popen from waiting again
    wall = time.monotonic() - start
    # ru_maxrss: KiB on Linux, bytes on macOS.
    max_process = usage.ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    peak = max(max_process, sampled)
    return {
        "command": list(command),
        "returncode": proc.returncode,
        "wall_s": round(wall, 3),
        "peak_rss_bytes": peak,
        "max_process_rss_bytes": max_process,
        "tree_rss_sampled_bytes": sampled,
        "sample_interval_s": interval,
        "limit_bytes": limit_bytes,
        "over_limit": limit_bytes is not None and peak > limit_bytes,
        "killed_over_limit": killed,
    }


def exit_status(result):
    rc = result["returncode"]
    if rc < 0:
        return 128 - rc
    if rc != 0:
        return rc
    return EXIT_OVER_LIMIT if result["over_limit"] else 0


def summary(result):
    gb = lambda n: f"{n / GB:.2f} GB"  # noqa: E731
    rc = result["returncode"]
    state = f"exit {rc}" if rc >= 0 else f"killed by signal {-rc}"
    limit = ""
    if result["limit_bytes"] is not None:
        limit = f"; limit {gb(result['limit_bytes'])}: " + ("EXCEEDED" if result["over_limit"] else "ok")
        if result["killed_over_limit"]:
            limit += " (killed)"
    return (f"peak_memory: {gb(result['peak_rss_bytes'])} peak resident (max process "
            f"{gb(result['max_process_rss_bytes'])}, sampled tree {gb(result['tree_rss_sampled_bytes'])}), "
            f"{result['wall_s']:.1f} s, {state}{limit}: {shlex.join(result['command'])}")


def main(argv=None):
    parser = argparse.ArgumentParser(
        description="Run COMMAND and report its peak resident memory.",
        usage="%(prog)s [--limit-gb GB] [--json PATH] [--interval S] [--kill-over-limit] -- COMMAND [ARG ...]")
    parser.add_argument("--limit-gb", type=float, default=None,
                        help="fail (exit 3) when the peak exceeds this (10^9 bytes)")
    parser.add_argument("--json", default=None, help="also write the measurement to this JSON file")
    parser.add_argument("--interval", type=float, default=0.05, help="seconds between /proc samples (default 0.05)")
    parser.add_argument("--kill-over-limit", action="store_true",
                        help="kill the command's process tree as soon as a sample exceeds --limit-gb")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given (put it after --)")
    if args.kill_over_limit and args.limit_gb is None:
        parser.error("--kill-over-limit needs --limit-gb")
    limit = None if args.limit_gb is None else int(args.limit_gb * GB)
    try:
        result = measure(command, limit, args.interval, args.kill_over_limit)
    except FileNotFoundError as error:
        print(f"peak_memory: cannot run {command[0]!r}: {error}", file=sys.stderr)
        return 127
    print(summary(result), file=sys.stderr, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
    return exit_status(result)


if __name__ == "__main__":
    sys.exit(main())
