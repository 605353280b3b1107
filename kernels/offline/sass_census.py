"""Instruction census of a compiled kernel's machine code (SASS), for the offline compile table.

``census(cubin)`` disassembles a cubin with the Triton wheel's own ``cuobjdump -sass`` (or
``nvdisasm``; both ship in ``triton/backends/nvidia/bin``) and counts the opcodes that say how the
kernel feeds and uses the tensor cores:

* ``tma``: tensor-memory-accelerator loads (``UTMALDG``: ``cp.async.bulk.tensor``; ``UBLKCP``:
  ``cp.async.bulk``), the Hopper / Blackwell way of filling shared memory;
* ``ldgsts``: per-thread asynchronous copies (``LDGSTS``: ``cp.async``, the Ampere way);
* ``wgmma``: Hopper warp-group MMA (``HGMMA`` / ``IGMMA`` / ``QGMMA``);
* ``tcgen05``: Blackwell tensor-memory MMA (``UTC*MMA``, e.g. ``UTCHMMA``);
* ``mma_sync``: warp-level MMA (``HMMA`` / ``IMMA`` / ``QMMA``: ``mma.sync``, sm_80 on);
* ``local``: local-memory loads / stores (``LDL`` / ``STL``: spills and stack arrays);
* ``setmaxreg``: register re-allocation between warp groups (``USETMAXREG``: warp
  specialisation's producer / consumer split).

``expectation_failures(entry)`` is the check on a table entry that carries a census: every kernel
with a ``tl.dot`` keeps tensor-core instructions on every target, the fixed-size forward uses the
target generation's own MMA (wgmma on sm_90, tcgen05 on sm_100), and its TMA variant
(``fixed_tma``) also loads through the TMA unit (and, where ptxas reports no spill, touches no local
memory; a config that spills is not clean, which the budgets judge). The CI test
(``tests/kernels/test_offline_compile.py``) fails on any of these.
"""
from __future__ import annotations

import collections
import os
import re
import subprocess
import tempfile

GROUPS = ("tma", "ldgsts", "wgmma", "tcgen05", "mma_sync", "local", "setmaxreg")
_GROUP_OF = [
    ("tma", re.compile(r"^(UTMALDG|UBLKCP)$")),
    ("ldgsts", re.compile(r"^LDGSTS$")),
    ("wgmma", re.compile(r"^[HIQB]GMMA$")),
    ("tcgen05", re.compile(r"^UTC\w*MMA$")),
    ("mma_sync", re.compile(r"^[HIQD]MMA$")),
    ("local", re.compile(r"^(LDL|STL)$")),
    ("setmaxreg", re.compile(r"^USETMAXREG$")),
]
# one SASS instruction line: "        /*0a40*/                   @!P0 UTMALDG.2D [UR8], [UR14] ;"
_LINE = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)", re.MULTILINE)
#: kernels without a matrix product (no tensor-core instruction expected)
NO_DOT = ("quantize",)


def tools():
    """``{name: path}`` of the disassemblers shipped with the installed Triton (may be empty)."""
    import triton
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    found = {}
    for name in ("cuobjdump", "nvdisasm"):
        path = os.path.join(bindir, name)
        if os.path.isfile(path) and os.access(path, os.X_OK):
            found[name] = path
    return found


def disassemble(cubin):
    """SASS text of ``cubin`` (bytes); None when the wheel has no disassembler."""
    have = tools()
    if not have:
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        if "cuobjdump" in have:
            cmd = [have["cuobjdump"], "-sass", f.name]
        else:
            cmd = [have["nvdisasm"], "-c", f.name]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(f"{os.path.basename(cmd[0])} failed: {proc.stderr.strip()[:200]}")
    return proc.stdout


def opcode_counts(sass):
    """``Counter`` of opcodes (without modifiers) in SASS text."""
    return collections.Counter(_LINE.findall(sass))


def census(cubin):
    """``{group: count}`` for every group of ``GROUPS`` (see the module docstring); None without a
    disassembler."""
    sass = disassemble(cubin)
    return None if sass is None else census_of_text(sass)


def census_of_text(sass):
    """``{group: count}`` of SASS text (``census`` without the disassembler)."""
    counts = opcode_counts(sass)
    if not counts:
        raise RuntimeError("the disassembler printed no instruction")
    out = dict.fromkeys(GROUPS, 0)
    for op, n in counts.items():
        for group, pattern in _GROUP_OF:
            if pattern.match(op):
                out[group] += n
                break
    return out


def expected_groups(kernel, capability):
    """The census groups that must be non-zero for ``kernel`` on ``capability`` (an int)."""
    if kernel in NO_DOT:
        return ()
    if kernel == "fixed_tma":  # sm_120 (consumer Blackwell) has TMA but neither wgmma nor tcgen05
        return {9: ("tma", "wgmma"), 10: ("tma", "tcgen05"), 12: ("tma", "mma_sync")}.get(capability // 10, ("tma",))
    if kernel == "fixed":
        return ("wgmma",) if capability // 10 == 9 else ("tcgen05",) if capability // 10 == 10 else ()
    return ()


def tensor_cores(sass_census):
    """Tensor-core instructions of a census (any generation's)."""
    return sass_census["mma_sync"] + sass_census["wgmma"] + sass_census["tcgen05"]


def expectation_failures(entry):
    """What ``entry`` (a table entry with a ``sass`` census) lost; [] when all is there or it has no
    census (compiled where no disassembler was available)."""
    got = entry.get("sass")
    if not got or entry.get("error"):
        return []
    where = f"{entry['kernel']} on {entry['target']} ({entry['dtype']}, d={entry['head_dim']}, config " \
            f"{'x'.join(map(str, entry['config'][:2]))} w{entry['config'][2]} s{entry['config'][3]})"
    failures = []
    if entry["kernel"] not in NO_DOT and not tensor_cores(got):
        failures.append(f"{where}: no tensor-core instruction in the machine code (HMMA / HGMMA / UTC*MMA)")
    for group in expected_groups(entry["kernel"], int(entry["capability"])):
        if not got.get(group):
            failures.append(f"{where}: no {group} instruction in the machine code (census {short(got)})")
    if entry["kernel"] == "fixed_tma" and entry.get("clean") and got.get("local"):
        # ptxas reported no spill, yet the code uses local memory (a stack array): as bad for the variant
        failures.append(f"{where}: {got['local']} local-memory instructions in the TMA variant")
    return failures


def short(sass_census):
    """Compact text of a census for tables and messages: the non-zero groups, e.g.
    ``tma 7, wgmma 12``; ``-`` without a census."""
    if not sass_census:
        return "-"
    parts = [f"{g} {sass_census[g]}" for g in GROUPS if sass_census.get(g)]
    return ", ".join(parts) or "none"
