"""Offline compile check: every Triton kernel of fastdit compiled to machine code for each NVIDIA
target, without a GPU, with its registers, spills, stack and shared memory.

    python -m fastdit.kernels.offline                       # the checked-in table's state, no compile
    python -m fastdit.kernels.offline --update              # compile what is missing or stale, save
    python -m fastdit.kernels.offline --targets native --fresh default   # gpu_check.sh's first part
    python -m fastdit.kernels.offline --markdown            # the table for BENCHMARKS.md

What is compiled. Kernels (every ``@triton.jit`` kernel of ``kernels/``; ``KERNELS`` lists them and
``tests/kernels/test_offline_compile.py`` fails when a new one is not listed):

* ``fixed``: ``_block_sparse_fwd_kernel`` (fixed-size blocks), every config the pruner
  (``triton_tuning.prune_for_target``) can select on the target for 128 x 128 plan blocks (the
  plan size that admits every tile; ``--configs full``: the whole autotune grid), and the
  default-config candidates ``DEFAULT_PREFERENCE``;
* ``skip``: the same kernel with ``SKIP=True``, on the skip rule's default 64 x 64 tiles with the
  warps / stages ``_skip_launch_config`` picks for the target's shared memory;
* ``varlen``: ``_varlen_fwd_kernel`` (variable-size blocks), each tile that ``launch_config`` can
  return for head dims <= 128 (BLOCK_M 128 with 8 warps or 64 with 4, BLOCK_N 64 / 32 / 16, 2
  stages). Its scheduler (``row_tile_schedule``) is torch ops, not a Triton kernel: nothing to
  compile.
* ``bwd_dq``, ``bwd_dkdv``, ``varlen_bwd_dq``, ``varlen_bwd_dkdv``: the backward kernels
  (``block_sparse_bwd_triton.py``), each candidate of ``triton_tuning.BWD_PREFERENCE`` (the
  launcher runs the first one the table records as clean on the target: ``bwd_config``).
* ``quant``, ``quant_fp8``, ``quant_varlen``, ``quantize``: the quantised engine (``quant/``):
  the fixed- and variable-size attention kernels with INT8 Q.K^T (``quant_fp8``: FP8 P.V, sm_89
  and later only) and the quantiser, each at its launcher's one config, bf16 / fp16 only. Not in
  the ``used`` set: the CI check compiles them when the table lacks them or they are stale.

Targets ``TARGETS``: sm_80 (A100, 163 KiB of shared memory a block), sm_86 (RTX 30xx / A40,
99 KiB), sm_89 (RTX 40xx / L40, 99 KiB), sm_90 (H100 / H200, 227 KiB), sm_100 (B200, 227 KiB),
sm_120 (RTX 50xx, 99 KiB); a target the installed Triton cannot compile for is listed as skipped
with the compiler's reason. Head dims 64 and 128; bf16, fp16 and fp32 (the kernels take fp32 too).

The specialisation is the real launch's: the arguments are built by the launchers' own
``kernel_args`` / ``varlen_kernel_args`` from meta tensors of a Wan2.1 480p call (1 x 12 heads x
32760 tokens, contiguous, 128-token plan blocks, a key-validity vector: the masked path, the
superset of the unmasked one), and each argument is specialised by Triton's own rule (integers
divisible by 16 get ``tt.divisibility = 16``, integers equal to 1 become constants, pointers are
16-byte aligned) via ``native_specialize_impl`` where the installed Triton has it.

What is recorded, from ``ptxas -v`` as Triton itself runs it (the log of Triton's own ``ptxas``
call, ``knobs.nvidia.dump_ptxas_log``, on a fresh compile): registers a thread, spill stores /
loads (bytes), stack frame (bytes); shared memory (bytes) from the compiled kernel's metadata.
A kernel is *clean* on a target when it spills 0 bytes and its shared memory is within the
target's limit. Budgets (``check``): every compile succeeds; the default config of each kernel
(``fixed``: ``default_config`` of the target; ``skip``, ``varlen``: their launch configs) is
clean; at least one config the pruner keeps per (target, head dim, dtype) is clean. Configs that
are not clean are pruned on that target at run time (``triton_tuning.table_verdict``).

The table ``offline_table.json`` (beside this file) caches results: one entry per (kernel,
target, dtype, head dim, config, Triton version), with the kernel's source hash (the source of
the kernel and of the jitted functions it calls). An entry whose hash differs from the current
source is *stale* and is recompiled by ``--update`` (and by the CI test).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import triton

from .. import block_sparse_bwd_triton as bwd
from .. import block_sparse_tma as tma
from .. import block_sparse_varlen_triton as bsv
from . import sass_census
from .. import triton_tuning as tuning
from .compile import (  # noqa: F401  (re-exported: the check's vocabulary)
    BWD_KERNELS,
    CI_TARGETS,
    DTYPES,
    HEAD_DIMS,
    KERNELS,
    KIB,
    TARGETS,
    _PLAN_BLOCK,
    _TOKENS,
    _TORCH_DTYPE,
    Case,
    Target,
    _env,
    _target_error,
    cases,
    compile_case,
    compile_cases,
    dependencies,
    launch,
    skip_configs,
    skip_used,
    source_hash,
    specialise,
    varlen_configs,
)

TABLE_PATH = tuning.TABLE_PATH


# --------------------------------------------------------------------------------------------------
# The table
# --------------------------------------------------------------------------------------------------

def load_table(path=TABLE_PATH):
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        return {"entries": [], "skipped_targets": []}


def save_table(table, path=TABLE_PATH):
    table["entries"] = sorted(table["entries"], key=lambda e: (e["triton"], e["key"]))
    table["skipped_targets"] = sorted(table.get("skipped_targets", []), key=lambda e: (e["triton"], e["target"]))
    # one entry a line: small, and a diff shows which entries changed
    lines = ['{"entries": [']
    lines += [json.dumps(e, separators=(",", ":")) + "," for e in table["entries"]]
    if table["entries"]:
        lines[-1] = lines[-1][:-1]
    lines += ['], "skipped_targets": ' + json.dumps(table["skipped_targets"], separators=(",", ":")) + "}"]
    Path(path).write_text("\n".join(lines) + "\n")


def merge_entries(table, compiled):
    """Entries compiled elsewhere (another machine's ``--json`` output, e.g. a lent GPU's own Triton
    and target: ``scripts/gpu_check.sh``'s ``offline_<stamp>.json``) into ``table``: each replaces the
    table's entry of the same Triton version and key. An entry whose kernel source has changed since
    (another ``source_hash``) describes code that no longer exists and is left out. Returns
    ``(merged, stale)`` counts."""
    hashes = {k: source_hash(k) for k in KERNELS}
    fresh = [e for e in compiled if e.get("source_hash") == hashes.get(e["kernel"])]
    replaced = {(e["triton"], e["key"]) for e in fresh}
    table["entries"] = [e for e in table["entries"] if (e["triton"], e["key"]) not in replaced] + fresh
    return len(fresh), len(compiled) - len(fresh)


def current_entries(table, version=None):
    """``{key: entry}`` of the table's entries for Triton ``version`` (default: the installed one)."""
    version = version or triton.__version__
    return {e["key"]: e for e in table["entries"] if e["triton"] == version}


def stale_or_missing(todo, table):
    """The cases of ``todo`` whose entry is missing for this Triton or has another source hash."""
    have = current_entries(table)
    hashes = {k: source_hash(k) for k in KERNELS}
    return [c for c in todo if c.key not in have or have[c.key]["source_hash"] != hashes[c.kernel]]


def supported_targets(names):
    """``(supported names, [{target, triton, reason}] skipped)``."""
    ok, skipped = [], []
    for name in names:
        reason = _target_error(TARGETS[name].capability)
        if reason is None:
            ok.append(name)
        else:
            skipped.append({"target": name, "triton": triton.__version__, "reason": reason})
    return ok, skipped


def check(entries, all_cases):
    """Budget failures (strings naming kernel, target and config) of compiled ``entries``:

    * a compile that failed;
    * ``skip``: none of its launch candidates (pipeline depths) is clean (it runs without
      autotuning, on the deepest clean one);
    * ``fixed``, per (target, dtype, head dim): no clean config among ``DEFAULT_PREFERENCE`` (then
      ``default_config`` has nothing clean to pick), or, when all of them were compiled, none among
      the pruner's short list for the target (at run time the clean default joins that list, so the
      autotuner always has a clean config);
    * ``varlen``, likewise: no clean config among ``launch_config``'s choices (a choice that is not
      clean is replaced by the nearest clean one at run time); ``fixed_tma`` (sm_90 on): none of
      ``TMA_PREFERENCE`` is clean;
    * an entry whose instruction census (``sass``) lost what ``sass_census.expectation_failures``
      asks: tensor-core instructions, the generation's own MMA (wgmma on sm_90, tcgen05 on sm_100)
      for the fixed-size forward, TMA loads and no local memory for its TMA variant.
    """
    by_key = {e["key"]: e for e in entries}
    failures = []
    for e in entries:  # the machine code lost tensor cores / the TMA path (sass_census)
        failures += sass_census.expectation_failures(e)
    for e in entries:
        if e["error"]:
            failures.append(f"{e['kernel']} on {e['target']} ({e['dtype']}, d={e['head_dim']}, "
                            f"config {Case(**_case_fields(e)).label}) failed to compile: {e['error']}")
    groups = {}
    for c in all_cases:
        groups.setdefault((c.kernel, c.target, c.dtype, c.head_dim), []).append(c)
    for (kernel, target, dtype, d), group in groups.items():
        got = [(c, by_key.get(c.key)) for c in group]
        got = [(c, e) for c, e in got if e is not None and not e["error"]]
        if not got:
            continue
        where = f"{kernel} on {target} ({dtype}, d={d})"
        defaults = [(c, e) for c, e in got if c.role == "default"]
        if defaults and not any(e["clean"] for _, e in defaults):
            worst = "; ".join(f"{c.label}: {_budget_text(e)}" for c, e in defaults)
            failures.append(f"{where}: no default candidate is clean ({worst})")
        if kernel == "fixed":  # the pruner's short list for this target (before the table prunes it)
            elt = _TORCH_DTYPE[dtype].itemsize
            with _env("FASTDIT_TRITON_AUTOTUNE", "1"):
                short = {tuning.config_tuple(c) for c in tuning.prune_for_target(
                    tuning.AUTOTUNE_CONFIGS, _PLAN_BLOCK, _PLAN_BLOCK, d, elt, TARGETS[target].shared_limit)}
            kept = [(c, e) for c, e in got if c.config in short]
            # judged only when every config of the list was compiled (--configs pruned); at run time
            # the architecture's clean default joins the list anyway (prune_for_target)
            if {c.config for c, _ in kept} == short and not any(e["clean"] for _, e in kept):
                failures.append(f"{where}: no config of the pruner's list is clean "
                                f"({', '.join(c.label for c, _ in kept)}: all spill or exceed shared memory)")
    return failures


def _case_fields(e):
    return {"kernel": e["kernel"], "target": e["target"], "dtype": e["dtype"], "head_dim": e["head_dim"],
            "config": tuple(e["config"]), "role": e.get("role", "pruned")}


def _budget_text(e):
    return (f"{e['spill_stores']} B spill stores, {e['spill_loads']} B spill loads, "
            f"shared {e['shared']} B of {e['shared_limit']} B")


def used_cases(names, all_cases):
    """The cases of ``all_cases`` that run without autotuning on targets ``names``: the fixed
    kernel's ``default_config`` (from the installed table), the skip kernel's config, and the
    varlen kernel's ``launch_config`` for a Wan 480p call with svg2's default clusters (100 query /
    500 key clusters)."""
    wanted = set()
    for name in names:
        cap = TARGETS[name].capability
        for c in all_cases:
            if c.target != name:
                continue
            if c.kernel == "fixed" and c.config == tuning.default_config(cap, c.head_dim, c.dtype):
                wanted.add(c)
            elif c.kernel == "skip" and c.config == skip_used(name, c.head_dim, c.dtype):
                wanted.add(c)
            elif c.kernel == "fixed_tma" and c.config == (tma.tma_config(cap, c.head_dim, c.dtype)
                                                          or tuning.TMA_PREFERENCE[0]):
                wanted.add(c)
            elif c.kernel in BWD_KERNELS and c.config == bwd.bwd_config(c.kernel, c.head_dim, cap, c.dtype):
                wanted.add(c)
            elif c.kernel == "varlen" and c.config == bsv.launch_config(_TOKENS, 100, _TOKENS, 500, c.head_dim, cap,
                                                                        c.dtype):
                wanted.add(c)
    return [c for c in all_cases if c in wanted]


def default_choice(entries, target, dtype, d):
    """The fixed kernel's default config on ``target`` from ``entries`` (as ``default_config``)."""
    clean = {tuple(e["config"]) for e in entries if e["kernel"] == "fixed" and e["target"] == target
             and e["dtype"] == dtype and e["head_dim"] == d and e["clean"]}
    return next((cfg for cfg in tuning.DEFAULT_PREFERENCE if cfg in clean), None)


def markdown(table, version=None):
    """The target x kernel x config table (Markdown) of Triton ``version``'s entries: one row per
    (target, kernel, config), one column per (dtype, head dim), each cell
    ``registers / spill bytes (stores + loads) / shared KiB``; **bold**: the config that runs there
    without autotuning (fixed: ``default_config``; varlen: the Wan 480p svg2-like choice); the last
    column is the row's instruction census (``sass_census.short``; bf16 d128 where compiled, ``-``
    for entries compiled before the census existed)."""
    version = version or triton.__version__
    entries = list(current_entries(table, version).values())
    columns = sorted({(e["dtype"], e["head_dim"]) for e in entries}, key=lambda c: (DTYPES.index(c[0]), c[1]))
    cells, rows, census = {}, [], {}
    for e in entries:
        row = (TARGETS[e["target"]].capability if e["target"] in TARGETS else 0, e["target"], e["kernel"],
               tuple(e["config"]))
        if row not in rows:
            rows.append(row)
        if e["error"]:
            text = "fails"
        else:
            text = f"{e['registers']}/{e['spill_stores'] + e['spill_loads']}/{e['shared'] / KIB:.0f}"
            if not e["clean"]:
                text = f"*{text}*"
        group = {tuple(x["config"]): x["clean"] for x in entries if x["kernel"] == e["kernel"]
                 and x["target"] == e["target"] and x["dtype"] == e["dtype"] and x["head_dim"] == e["head_dim"]}
        used = (e["kernel"] == "fixed" and tuple(e["config"]) == default_choice(entries, e["target"], e["dtype"],
                                                                                 e["head_dim"]))
        if e["kernel"] == "varlen":  # launch_config's choice, with this version's verdicts
            with _env("FASTDIT_TRITON_CONFIG", None):
                choice = bsv.launch_config(_TOKENS, 100, _TOKENS, 500, e["head_dim"])
            used = tuple(e["config"]) == next((c for c in bsv._fallback_order(choice) if group.get(c)), choice)
        if e["kernel"] == "fixed_tma":  # tma_config: the first clean candidate
            used = tuple(e["config"]) == next((c for c in tuning.TMA_PREFERENCE if group.get(c)), None)
        if e["kernel"] == "skip":  # the deepest clean pipeline, with this version's verdicts
            used = tuple(e["config"]) == max((c for c, ok in group.items() if ok), key=lambda c: c[3], default=None)
        cells[(row, (e["dtype"], e["head_dim"]))] = f"**{text}**" if used else text
        if e.get("sass") and (row not in census or (e["dtype"], e["head_dim"]) == ("bf16", 128)):
            census[row] = sass_census.short(e["sass"])  # bf16 d128's when compiled, else any column's
    order = {"fixed": 0, "fixed_tma": 1, "skip": 2, "varlen": 3}
    rows.sort(key=lambda r: (r[0], order.get(r[2], 9), [-x for x in r[3]]))
    head = " | ".join(f"{dt} d{d}" for dt, d in columns)
    lines = [f"| target (shared KiB) | kernel | config | {head} | SASS census |", "|" + " --- |" * (4 + len(columns))]
    for row in rows:
        _, target, kernel, cfg = row
        limit = TARGETS[target].shared_limit // KIB if target in TARGETS else "?"
        label = Case(kernel, target, "bf16", 0, cfg).label
        lines.append(f"| {target} ({limit}) | {kernel} | {label} | "
                     + " | ".join(cells.get((row, c), "") for c in columns) + f" | {census.get(row, '-')} |")
    for s in table.get("skipped_targets", []):
        if s["triton"] == version:
            lines.append(f"| {s['target']} | all | skipped | {s['reason']} |" + " |" * len(columns))
    return "\n".join(lines)


def _native_targets():
    """The local device's target (``--targets native``), with its own shared memory as the limit."""
    if not torch.cuda.is_available():
        raise SystemExit("--targets native: no CUDA device here")
    major, minor = torch.cuda.get_device_capability(0)
    cap = 10 * major + minor
    smem = tuning._shared_mem_bytes(0)
    name = f"sm_{cap}"
    if name not in TARGETS:
        TARGETS[name] = Target(name, cap, smem, torch.cuda.get_device_name(0))
    else:
        TARGETS[name] = Target(name, cap, smem, TARGETS[name].gpus)
    return [name]


def _items(text):
    return [item.strip() for item in text.split(",") if item.strip()]


def _check_args(parser, args):
    """Every value checked before anything is compiled: a one-line error naming the flag."""
    for flag, given, known in (("--kernels", args.kernels, list(KERNELS)), ("--dtypes", args.dtypes, list(DTYPES))):
        names = _items(given)
        unknown = [name for name in names if name not in known]
        if not names or unknown:
            parser.error(f"{flag}: {'unknown ' + repr(unknown) if unknown else 'none given'}; "
                         f"a comma list of {', '.join(known)}")
    try:
        dims = [int(x) for x in _items(args.head_dims)]
    except ValueError:
        dims = []
    if not dims or any(d < 1 for d in dims):
        parser.error(f"--head-dims: a comma list of positive ints (default {','.join(map(str, HEAD_DIMS))}), "
                     f"got {args.head_dims!r}")
    if not _items(args.targets):
        parser.error(f"--targets: none given; a comma list of {', '.join(TARGETS)}, or all, ci, native")
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1, got {args.jobs}")
    table = Path(args.table)
    if table.is_dir() or (not table.exists() and not (args.update or args.fresh != "none")):
        parser.error(f"--table {args.table!r}: {'a folder' if table.is_dir() else 'no such file'}; it takes the "
                     "table's JSON file (--update writes a new one)")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", default="all", help=f"comma list of {', '.join(TARGETS)}, 'all', 'ci' "
                        f"({', '.join(CI_TARGETS)}) or 'native' (this machine's GPU)")
    parser.add_argument("--kernels", default=",".join(KERNELS))
    parser.add_argument("--head-dims", default=",".join(map(str, HEAD_DIMS)))
    parser.add_argument("--dtypes", default=",".join(DTYPES))
    parser.add_argument("--configs", default="pruned", choices=("default", "pruned", "full"))
    parser.add_argument("--update", action="store_true", help="compile missing / stale entries and save the table")
    parser.add_argument("--fresh", default="none", choices=("none", "used", "default", "all"),
                        help="also recompile these cases even when the table has them: 'used' the configs "
                             "run without autotuning (fixed: default_config; skip; varlen: launch_config "
                             "of a Wan 480p svg2-like call), 'default' every default candidate, 'all'")
    parser.add_argument("--table", default=str(TABLE_PATH))
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--json", default=None, help="write the compiled entries and failures here")
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown and exit")
    parser.add_argument("--merge", default=None, metavar="JSON",
                        help="merge another machine's --json output (a GPU run's own compiles) into the table, "
                             "save it and exit")
    args = parser.parse_args(argv)
    _check_args(parser, args)
    if args.merge:
        table = load_table(args.table)
        try:
            compiled = json.loads(Path(args.merge).read_text())["compiled"]
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise SystemExit(f"--merge {args.merge!r}: not an offline check's --json output ({error})")
        merged, stale = merge_entries(table, compiled)
        save_table(table, args.table)
        print(f"[offline] merged {merged} entries from {args.merge} into {args.table}"
              + (f"; {stale} left out (their kernel's source changed since)" if stale else ""))
        return 0

    from triton.runtime.jit import JITFunction
    if not all(isinstance(fn, JITFunction) for fn in KERNELS.values()):
        raise SystemExit("fastdit.kernels.offline: the kernels were built for the Triton interpreter; "
                         "run it without TRITON_INTERPRET=1")
    table = load_table(args.table)
    if args.markdown:
        print(markdown(table))
        return 0
    if args.targets == "native":
        names = _native_targets()
    elif args.targets == "all":
        names = list(TARGETS)
    elif args.targets == "ci":
        names = list(CI_TARGETS)
    else:
        names = [t.strip() for t in args.targets.split(",") if t.strip()]
    unknown = [n for n in names if n not in TARGETS]
    if unknown:
        raise SystemExit(f"unknown target(s) {unknown}; known: {', '.join(TARGETS)}, all, ci, native")
    t0 = time.perf_counter()
    names, skipped = supported_targets(names)
    for s in skipped:
        print(f"[offline] {s['target']}: skipped ({s['reason']})")
    all_cases = cases(names, _items(args.kernels), [int(x) for x in _items(args.head_dims)], _items(args.dtypes),
                      args.configs)
    todo = stale_or_missing(all_cases, table) if args.update or args.fresh != "none" else []
    if args.fresh == "all":
        todo = all_cases
    elif args.fresh == "used":
        todo += [c for c in used_cases(names, all_cases) if c not in todo]
    elif args.fresh == "default":
        todo += [c for c in all_cases if c.role == "default" and c not in todo]
    print(f"[offline] Triton {triton.__version__}; {len(all_cases)} cases on {', '.join(names) or 'no target'}; "
          f"compiling {len(todo)} with {args.jobs} job(s)", flush=True)

    def progress(e):
        state = "ERROR " + e["error"][:120] if e["error"] else (
            f"regs {e['registers']:3d} spills {e['spill_stores']}+{e['spill_loads']} B stack {e['stack']} B "
            f"shared {e['shared'] / KIB:.0f}/{e['shared_limit'] // KIB} KiB {'ok' if e['clean'] else 'NOT CLEAN'}")
        print(f"[offline] {e['key']:44s} {state} ({e['compile_s']:.1f}s)", flush=True)

    compiled = compile_cases(todo, args.jobs, progress)
    entries = dict(current_entries(table))
    entries.update({e["key"]: e for e in compiled})
    relevant = [entries[c.key] for c in all_cases if c.key in entries]
    # roles of the current case list (an entry's stored role may come from another --configs run)
    role = {c.key: c.role for c in all_cases}
    for e in relevant:
        e["role"] = role[e["key"]]
    failures = check(relevant, all_cases)
    missing = [c.key for c in all_cases if c.key not in entries]
    if args.update:
        others = [e for e in table["entries"] if e["triton"] != triton.__version__]
        table["entries"] = others + list(entries.values())
        table["skipped_targets"] = [s for s in table.get("skipped_targets", []) if s["triton"] != triton.__version__
                                    or s["target"] not in {x["target"] for x in skipped}] + skipped
        save_table(table, args.table)
        print(f"[offline] table saved: {args.table}")
    if args.json:
        Path(args.json).write_text(json.dumps({"triton": triton.__version__, "targets": names, "skipped": skipped,
                                               "compiled": compiled, "failures": failures, "missing": missing},
                                              indent=1))
    print(f"[offline] {len(compiled)} compiled in {time.perf_counter() - t0:.0f}s; "
          f"{len(missing)} case(s) not in the table; {len(failures)} failure(s)")
    for name in names:
        for dtype in args.dtypes.split(","):
            for d in [int(x) for x in args.head_dims.split(",")]:
                cfg = default_choice(relevant, name, dtype, d)
                e = entries.get(Case("fixed", name, dtype, d, cfg).key) if cfg else None
                if e is not None:
                    print(f"[offline] default on {name} {dtype} d={d}: {Case('fixed', name, dtype, d, cfg).label} "
                          f"regs {e['registers']} spills {e['spill_stores']}+{e['spill_loads']} B")
    for f in failures:
        print(f"[offline] FAIL {f}")
    return 1 if failures else 0


