"""The offline compile check (``fastdit.kernels.offline``) and the per-architecture limits it feeds.

``test_ci_targets_compile_within_budgets`` compiles the kernels to cubin for sm_80, sm_89 and sm_90
on the CPU (a subprocess without ``TRITON_INTERPRET``): the configs used without autotuning, fresh,
plus every table entry that is missing or stale for the installed Triton; it fails naming kernel,
target and config when a compile fails or a budget breaks, and when a fresh compile disagrees with
the checked-in table. The other tests need no compiler.
"""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton

from fastdit.kernels import block_sparse_varlen_triton as bsv
from fastdit.kernels import offline
from fastdit.kernels import triton_tuning as tuning

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def table(tmp_path, monkeypatch):
    """Point the pruner at a table of our own; returns a writer of entries."""
    path = tmp_path / "table.json"
    monkeypatch.setattr(tuning, "TABLE_PATH", path)
    tuning._table_verdicts.cache_clear()

    def write(entries, version=None):
        rows = []
        for kernel, cap, dtype, d, cfg, clean in entries:
            rows.append({"kernel": kernel, "capability": cap, "dtype": dtype, "head_dim": d, "config": list(cfg),
                         "clean": clean, "registers": 100, "error": None, "triton": version or triton.__version__})
        path.write_text(json.dumps({"entries": rows}))
        tuning._table_verdicts.cache_clear()

    yield write
    tuning._table_verdicts.cache_clear()


def test_every_triton_kernel_is_checked():
    """Each ``@triton.jit`` function of kernels/ is a listed kernel or called by one (a new kernel
    that is not in ``offline.KERNELS`` fails here)."""
    covered = {fn.__name__ for k in offline.KERNELS for fn in offline.dependencies(k)}
    found = set()
    for path in (REPO / "kernels").rglob("*.py"):
        if path.name == "compile.py":  # its target probe is not a fastdit kernel
            continue
        found |= set(re.findall(r"@triton\.jit[^\n]*\n(?:@[^\n]*\n)*def (\w+)", path.read_text()))
    assert found, "no @triton.jit function found: the scan is broken"
    assert found <= covered, f"Triton kernels not in fastdit.kernels.offline.KERNELS: {sorted(found - covered)}"


def test_launch_specialisation_matches_triton_rules():
    """Integers equal to 1 become constants, multiples of 16 get tt.divisibility, others none."""
    case = offline.Case("fixed", "sm_80", "bf16", 128, (128, 64, 8, 3))
    fn, named, options = offline.launch(case)
    assert options == {"num_warps": 8, "num_stages": 3}
    from triton.backends.compiler import GPUTarget
    signature, constexprs, attrs = offline.specialise(fn, named, GPUTarget("cuda", 80, 32))
    index = {name: (i,) for i, name in enumerate(fn.arg_names)}
    assert signature["stride_qd"] == "constexpr" and constexprs[index["stride_qd"]] == 1  # contiguous
    assert signature["stride_qn"] == "i32" and attrs[index["stride_qn"]] == [["tt.divisibility", 16]]  # 128
    assert signature["N"] == "i32" and index["N"] not in attrs  # 32760 is not a multiple of 16
    assert signature["Q"] == "*bf16" and index["Q"] in attrs
    assert constexprs[index["BLOCK_M"]] == 128 and constexprs[index["MASKED"]] is True  # key-validity vector


def test_pruner_drops_configs_the_table_marks_per_arch(table):
    table([("fixed", 80, "bf16", 128, (128, 64, 8, 3), False), ("fixed", 90, "bf16", 128, (128, 64, 8, 3), True)])
    grid = tuning.AUTOTUNE_CONFIGS
    on_80 = {tuning.config_tuple(c) for c in tuning.prune_for_target(grid, 128, 128, 128, 2, 163 * 1024, 80, "bf16")}
    on_90 = {tuning.config_tuple(c) for c in tuning.prune_for_target(grid, 128, 128, 128, 2, 227 * 1024, 90, "bf16")}
    assert (128, 64, 8, 3) in on_90 and (128, 64, 8, 3) not in on_80
    assert on_80 - on_90 == set()  # nothing else changed but shared memory
    # sm_87 (Orin) is read as sm_86 when tabled, else as nothing; sm_75 is not covered
    table([("fixed", 86, "bf16", 128, (128, 64, 8, 3), False)])
    assert tuning.table_capability(87) == 86 and tuning.table_capability(75) is None
    assert tuning.table_verdict("fixed", 87, "bf16", 128, (128, 64, 8, 3)) is False


def test_default_config_is_the_first_clean_candidate(table):
    first, second, third = tuning.DEFAULT_PREFERENCE[:3]
    table([("fixed", 80, "bf16", 128, first, False), ("fixed", 80, "bf16", 128, second, False),
           ("fixed", 80, "bf16", 128, third, True), ("fixed", 90, "bf16", 128, first, True)])
    assert tuning.default_config(80, 128, "bf16") == third
    assert tuning.default_config(90, 128, "bf16") == first
    assert tuning.default_config(75, 128, "bf16") == first  # not covered: the plain default
    table([("fixed", 80, "bf16", 128, first, True)], version="0.0.0")  # another Triton only: used
    assert tuning.default_config(80, 128, "bf16") == first


def test_installed_triton_entries_win_and_others_fill_in(table, tmp_path):
    first, second = tuning.DEFAULT_PREFERENCE[:2]
    rows = []
    for version, cfg, clean in ((triton.__version__, first, True), ("0.0.1", first, False),  # mine wins
                                ("0.0.1", second, True), ("0.0.2", second, False)):  # others: all must be clean
        rows.append({"kernel": "fixed", "capability": 86, "dtype": "fp16", "head_dim": 64, "config": list(cfg),
                     "clean": clean, "registers": 100, "error": None, "triton": version})
    tuning.TABLE_PATH.write_text(json.dumps({"entries": rows}))
    tuning._table_verdicts.cache_clear()
    assert tuning.table_verdict("fixed", 86, "fp16", 64, first) is True
    assert tuning.table_verdict("fixed", 86, "fp16", 64, second) is False


def test_varlen_launch_falls_back_to_a_clean_tile(table):
    table([("varlen", 80, "bf16", 128, (128, 32, 8, 2), False), ("varlen", 80, "bf16", 128, (128, 16, 8, 2), True),
           ("varlen", 80, "bf16", 128, (128, 64, 8, 2), False)])
    args = (32760, 100, 32760, 500, 128)  # 328-row / 66-key mean blocks: 128 x 32 by the size rule
    assert bsv.launch_config(*args) == (128, 32, 8, 2)
    assert bsv.launch_config(*args, capability=80, dtype="bf16") == (128, 16, 8, 2)
    assert bsv.launch_config(*args, capability=90, dtype="bf16") == (128, 32, 8, 2)  # not tabled


def test_skip_launch_takes_the_deepest_clean_pipeline(table):
    from fastdit.kernels import block_sparse_triton as bst

    table([("skip", 89, "bf16", 64, (64, 64, 4, 3), False), ("skip", 89, "bf16", 64, (64, 64, 4, 2), True)])
    assert bst._skip_launch_config(64, 64, 64, 2, None, smem=99 * 1024) == (4, 3)  # no table: shared memory only
    assert bst._skip_launch_config(64, 64, 64, 2, None, smem=99 * 1024, capability=89, dtype="bf16") == (4, 2)
    assert bst._skip_launch_config(64, 64, 64, 2, None, smem=99 * 1024, capability=90, dtype="bf16") == (4, 3)
    # 256-wide tiles at d=128 fit 99 KiB only with 1 stage: the table cannot ask for more
    assert bst._skip_launch_config(128, 256, 128, 2, None, smem=99 * 1024, capability=89, dtype="bf16") == (8, 1)


def _entry(kernel, target, cfg, clean=True, error=None, dtype="bf16", d=128):
    case = offline.Case(kernel, target, dtype, d, cfg)
    return {"key": case.key, "kernel": kernel, "target": target, "dtype": dtype, "head_dim": d, "config": list(cfg),
            "error": error, "clean": clean, "spill_stores": 0 if clean else 28, "spill_loads": 0 if clean else 28,
            "shared": 1024, "shared_limit": 99 * 1024, "role": "default"}


def test_check_names_kernel_target_and_config():
    cases = [offline.Case("fixed", "sm_89", "bf16", 128, cfg, "default") for cfg in tuning.DEFAULT_PREFERENCE]
    cases += [offline.Case("skip", "sm_89", "bf16", 128, (64, 64, 4, 3), "default")]
    entries = [_entry("fixed", "sm_89", cfg, clean=False) for cfg in tuning.DEFAULT_PREFERENCE]
    entries += [_entry("skip", "sm_89", (64, 64, 4, 3), error="PTXASError: boom")]
    failures = offline.check(entries, cases)
    assert any("skip on sm_89" in f and "64x64 w4 s3" in f and "boom" in f for f in failures)
    assert any("fixed on sm_89 (bf16, d=128): no default candidate is clean" in f and "128x64 w8 s3" in f
               for f in failures)
    entries[2]["clean"] = True
    entries[2]["spill_stores"] = entries[2]["spill_loads"] = 0
    assert not any(f.startswith("fixed") for f in offline.check(entries, cases))
    # every config of the pruner's short list compiled, none clean: named
    short = [tuning.config_tuple(c) for c in tuning.prune_for_target(tuning.AUTOTUNE_CONFIGS, 128, 128, 128, 2,
                                                                     99 * 1024)]
    cases += [offline.Case("fixed", "sm_89", "bf16", 128, cfg, "pruned") for cfg in short]
    entries += [_entry("fixed", "sm_89", cfg, clean=False) for cfg in short if cfg not in tuning.DEFAULT_PREFERENCE]
    for e in entries:
        if tuple(e["config"]) in short:
            e["clean"] = False
    assert any("no config of the pruner's list is clean" in f for f in offline.check(entries, cases))


def test_checked_in_table_has_clean_defaults_everywhere():
    """The table in the repository: for every tabled target, head dim and dtype, the fixed kernel
    has a clean default and the skip kernel is clean (what the run time relies on)."""
    table = offline.load_table()
    entries = table["entries"]
    assert entries, "kernels/offline_table.json is empty: run python -m fastdit.kernels.offline --update"
    versions = {e["triton"] for e in entries}
    for version in versions:
        mine = [e for e in entries if e["triton"] == version]
        fixed = [e for e in mine if e["kernel"] == "fixed"]  # where the fixed kernel is tabled
        for target in {e["target"] for e in fixed}:
            for dtype in {e["dtype"] for e in fixed if e["target"] == target}:
                for d in {e["head_dim"] for e in fixed if e["target"] == target and e["dtype"] == dtype}:
                    assert offline.default_choice(mine, target, dtype, d) is not None, (version, target, dtype, d)
        groups = {}
        for e in mine:
            if e["kernel"] == "skip":
                groups.setdefault((e["target"], e["dtype"], e["head_dim"]), []).append(e["clean"])
        bad = [g for g, clean in groups.items() if not any(clean)]
        assert not bad, f"Triton {version}: no clean skip launch config for {bad}"


def test_ci_targets_compile_within_budgets(tmp_path):
    """Compile for sm_80, sm_89, sm_90 (bf16 / fp16, d 64 / 128): the default configs fresh, stale
    or missing table entries too; no failure, and fresh results equal the table's."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONWARNINGS"] = "ignore"
    out = tmp_path / "offline.json"
    proc = subprocess.run(
        [sys.executable, "-m", "fastdit.kernels.offline", "--targets", "ci", "--dtypes", "bf16,fp16",
         "--configs", "default", "--fresh", "used", "--jobs", "2", "--json", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=1800,
    )
    print(proc.stdout[-4000:], proc.stderr[-2000:])
    assert out.exists(), proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert not result["failures"], "\n".join(result["failures"])
    assert not result["skipped"], result["skipped"]  # the CI targets must be compilable
    assert result["compiled"], "nothing was compiled"
    assert proc.returncode == 0
    have = offline.current_entries(offline.load_table())
    for e in result["compiled"]:
        old = have.get(e["key"])
        if old is not None and old["source_hash"] == e["source_hash"]:
            got = (e["registers"], e["spill_stores"], e["spill_loads"], e["shared"])
            want = (old["registers"], old["spill_stores"], old["spill_loads"], old["shared"])
            assert got == want, f"{e['key']}: fresh compile {got} != table {want} (regenerate the table)"
            if old.get("sass") and e.get("sass"):
                assert e["sass"] == old["sass"], f"{e['key']}: fresh census {e['sass']} != table {old['sass']}"


def test_unsupported_target_is_skipped_with_its_reason(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONWARNINGS"] = "ignore"
    code = ("from fastdit.kernels import offline as o\n"
            "o.TARGETS['sm_10'] = o.Target('sm_10', 10, 16 * 1024, 'none')\n"
            "ok, skipped = o.supported_targets(['sm_10'])\n"
            "print(ok, skipped)\n"
            "assert ok == [] and skipped[0]['target'] == 'sm_10' and skipped[0]['reason']\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]


# -------------------------------------------------------------------------------------------------
# The instruction census (sass_census) and the TMA variant in CI
# -------------------------------------------------------------------------------------------------

_SASS = """
        /*0a40*/                   @!P0 UTMALDG.2D [UR8], [UR14] ;
        /*0a50*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24 ;
        /*0a60*/                   LDGSTS.E.BYPASS.128 [R3], desc[UR6][R4.64] ;
        /*0a70*/              @P1  STL.64 [R1], R2 ;
        /*0a80*/                   UTCHMMA gdesc[UR12], gdesc[UR14], tmem[UR8], tmem[UR10], idesc[UR11], UPT ;
        /*0a90*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;
        /*0aa0*/                   USETMAXREG.DEALLOC.CTAPOOL 0x18 ;
        /*0ab0*/                   FMUL R2, R3, R4 ;
"""


def test_census_counts_the_instruction_groups():
    from fastdit.kernels.offline import sass_census
    got = sass_census.census_of_text(_SASS)
    assert got == {"tma": 1, "ldgsts": 1, "wgmma": 1, "tcgen05": 1, "mma_sync": 1, "local": 1, "setmaxreg": 1}
    assert sass_census.short(got).startswith("tma 1, ldgsts 1")
    assert sass_census.short(None) == "-"


def test_census_expectations_name_what_was_lost():
    from fastdit.kernels.offline import sass_census
    base = {"kernel": "fixed_tma", "target": "sm_90", "capability": 90, "dtype": "bf16", "head_dim": 128,
            "config": [128, 64, 8, 3], "error": None}
    good = dict(sass_census.census_of_text(_SASS), local=0)
    assert sass_census.expectation_failures(dict(base, sass=good)) == []
    assert sass_census.expectation_failures(dict(base, sass=None)) == []  # no census: nothing to judge
    lost_tma = sass_census.expectation_failures(dict(base, sass=dict(good, tma=0)))
    assert len(lost_tma) == 1 and "fixed_tma on sm_90 (bf16, d=128, config 128x64 w8 s3): no tma" in lost_tma[0]
    stack = sass_census.expectation_failures(dict(base, clean=True, sass=dict(good, local=4)))
    assert any("local-memory" in f for f in stack)
    assert sass_census.expectation_failures(dict(base, clean=False, sass=dict(good, local=4))) == []  # budgets
    no_tc = dict(good, wgmma=0, tcgen05=0, mma_sync=0)
    assert any("no tensor-core" in f for f in sass_census.expectation_failures(dict(base, kernel="varlen",
                                                                                    sass=no_tc)))
    blackwell = dict(base, target="sm_100", capability=100, sass=dict(good, tcgen05=0))
    assert any("no tcgen05" in f for f in sass_census.expectation_failures(blackwell))
    # and the check reports them with the budgets
    entry = dict(base, key=offline.Case("fixed_tma", "sm_90", "bf16", 128, (128, 64, 8, 3)).key, clean=True,
                 spill_stores=0, spill_loads=0, shared=1024, shared_limit=227 * 1024, sass=dict(good, tma=0))
    assert any("no tma" in f for f in offline.check([entry], []))


def test_tma_variant_keeps_tma_loads_and_tensor_cores(tmp_path):
    """sm_90 and sm_100, bf16, d 64 / 128: the TMA variant's and the classic fixed kernel's launch
    configs compiled fresh (8 compiles); the census must show TMA loads (UTMALDG) and wgmma
    (sm_90) / tcgen05 (sm_100) for the variant, the generation's MMA for the classic kernel, no
    spills, and equal the checked-in table's census."""
    from fastdit.kernels.offline import sass_census
    if not sass_census.tools():
        pytest.skip(f"Triton {triton.__version__} ships no cuobjdump / nvdisasm: no census")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONWARNINGS"] = "ignore"
    out = tmp_path / "offline.json"
    proc = subprocess.run(
        [sys.executable, "-m", "fastdit.kernels.offline", "--targets", "sm_90,sm_100", "--kernels", "fixed,fixed_tma",
         "--dtypes", "bf16", "--configs", "default", "--fresh", "used", "--jobs", "2", "--json", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900,
    )
    print(proc.stdout[-4000:], proc.stderr[-2000:])
    assert out.exists(), proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert not result["failures"], "\n".join(result["failures"])
    assert not result["skipped"], result["skipped"]
    compiled = {(e["kernel"], e["target"], e["head_dim"]): e for e in result["compiled"]}
    for target, mma in (("sm_90", "wgmma"), ("sm_100", "tcgen05")):
        for d in (64, 128):
            e = compiled[("fixed_tma", target, d)]
            assert e["sass"]["tma"] > 0 and e["sass"][mma] > 0 and e["sass"]["ldgsts"] == 0, e["sass"]
            assert e["clean"] and e["sass"]["local"] == 0
            assert compiled[("fixed", target, d)]["sass"][mma] > 0
    have = offline.current_entries(offline.load_table())
    for e in result["compiled"]:
        old = have.get(e["key"])
        if old is not None and old["source_hash"] == e["source_hash"] and old.get("sass"):
            assert e["sass"] == old["sass"], f"{e['key']}: fresh census {e['sass']} != table {old['sass']}"


def test_markdown_table_has_the_census_column():
    lines = offline.markdown(offline.load_table()).splitlines()
    assert lines[0].endswith("| SASS census |")
    rows = [ln for ln in lines if ln.startswith("| sm_90 ") and "| fixed_tma |" in ln]
    assert rows and all("tma " in ln and "wgmma " in ln for ln in rows), rows


# -------------------------------------------------------------------------------------------------
# Merging a GPU run's own compiles (--merge)
# -------------------------------------------------------------------------------------------------

def test_merge_replaces_same_version_and_key_keeps_the_rest_and_drops_stale(tmp_path):
    """A lent GPU's ``offline_<stamp>.json`` into the table: an entry of the same Triton version and key
    is replaced, every other entry kept, and an entry of kernel source that changed since left out."""
    current = offline.source_hash("fixed")
    key = "fixed|sm_90|bf16|d128|128x64 w8 s3"
    old = {"kernel": "fixed", "key": key, "triton": "3.6.0", "source_hash": current, "registers": 1, "clean": False}
    other_version = dict(old, triton="3.9.0", registers=2)
    other_key = dict(old, key="fixed|sm_90|bf16|d64|128x64 w8 s3", registers=3)
    table = {"entries": [old, other_version, other_key], "skipped_targets": []}
    from_gpu = [dict(old, registers=206, clean=True), dict(old, key="varlen|sm_90|bf16|d64|128x32 w8 s2",
                                                             kernel="varlen", source_hash="0" * 16)]
    assert offline.merge_entries(table, from_gpu) == (1, 1)
    by = {(e["triton"], e["key"]): e["registers"] for e in table["entries"]}
    assert by == {("3.6.0", key): 206, ("3.9.0", key): 2, ("3.6.0", other_key["key"]): 3}
    # the command line: merges, saves in the table's one-entry-a-line form, reads back
    path, run = tmp_path / "table.json", tmp_path / "offline_run.json"
    offline.save_table({"entries": [old], "skipped_targets": []}, path)
    run.write_text(json.dumps({"triton": "3.6.0", "compiled": from_gpu}))
    assert offline.main(["--table", str(path), "--merge", str(run)]) == 0
    saved = offline.load_table(path)["entries"]
    assert [(e["key"], e["registers"]) for e in saved] == [(key, 206)]
    with pytest.raises(SystemExit, match="not an offline check's --json output"):
        offline.main(["--table", str(path), "--merge", str(path)])  # a table is not a run's output


def test_checked_in_table_holds_the_h200_runs_compiles():
    """The first GPU run's own compiles (Triton 3.6.0 on an H200, ``docs/gpu_runs/2026-12-04-h200``) are
    in the checked-in table, so Triton 3.6 on sm_90 decides by them (e.g. a spill the 3.9 entries miss)."""
    run = next((REPO / "docs" / "gpu_runs" / "2026-12-04-h200" / "run1_default").glob("offline_*.json"))
    compiled = json.loads(run.read_text())["compiled"]
    table = {(e["triton"], e["key"]): e for e in offline.load_table()["entries"]}
    for e in compiled:
        mine = table[(e["triton"], e["key"])]
        assert (mine["registers"], mine["spill_stores"], mine["clean"]) == (e["registers"], e["spill_stores"],
                                                                            e["clean"])
    spilled = table[("3.6.0", "varlen_bwd_dkdv|sm_90|bf16|d128|32x32 w4 s1")]
    assert not spilled["clean"] and table[("3.9.0", spilled["key"])]["clean"]
