"""``fastdit eval`` / ``python -m fastdit.eval`` on the tiny Wan model at the tiny test size.

One module-scoped run (dense + sta, 2 prompts x 1 seed) serves the report, resume and
two-process tests; bad input must fail before any generation.
"""
import json
import re
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fastdit.cli.eval import main as eval_main
from fastdit.eval.runner import generation
from fastdit.eval.runner import report
from fastdit.eval.runner.config import SCHEMA, TIMING_FIELDS, EvalConfig, EvalError
from fastdit.eval.runner.prompts import Prompt, load_prompts, shipped_prompt_file
from fastdit.eval.runner.settings import build_settings
from fastdit.pipelines.tiny import TINY_TEST_DEFAULTS

SIZE = TINY_TEST_DEFAULTS["wan"]


def _args(out, prompts, seeds="0", metrics="psnr,ssim,vbench", extra=()):
    return ["--model", "tiny-wan", "--frames", str(SIZE["num_frames"]), "--height", str(SIZE["height"]),
            "--width", str(SIZE["width"]), "--steps", str(SIZE["num_inference_steps"]), "--device", "cpu",
            "--methods", "dense,sta", "--set", "sta.tile=1,2,2", "--set", "sta.dense_steps=0",
            "--prompts", str(prompts), "--seeds", seeds, "--metrics", metrics, "--out", str(out),
            "--no-progress", *extra]


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "two.txt"
    path.write_text("# two prompts\nA red fox runs through fresh snow.\n\nA boat sails on a calm lake.\n")
    return path


class Counter:
    def __init__(self, monkeypatch):
        self.calls = []
        real = generation.timed_generate

        def counted(pipe, sample, *args, **kwargs):
            self.calls.append(sample.key)
            return real(pipe, sample, *args, **kwargs)

        monkeypatch.setattr(generation, "timed_generate", counted)


@pytest.fixture(scope="module")
def first_run(tmp_path_factory, prompts):
    out = tmp_path_factory.mktemp("eval") / "run"
    mp = pytest.MonkeyPatch()
    counter = Counter(mp)
    try:
        assert eval_main(_args(out, prompts)) == 0
    finally:
        mp.undo()
    return out, counter.calls


def _load(out):
    with open(os.path.join(out, "results.json")) as f:
        return json.load(f)


def test_run_writes_results_table_and_plots(first_run):
    out, calls = first_run
    assert len(calls) == 4  # 2 settings x 2 prompts x 1 seed
    results = _load(out)
    assert results["schema"] == SCHEMA
    assert [s["setting"] for s in results["settings"]] == ["dense", "sta"]
    assert len(results["samples"]) == 4
    dense, sta = results["settings"]
    assert dense["speedup"] == pytest.approx(1.0) and dense["psnr"] is None
    assert sta["speedup"] > 0 and sta["latency_s"] > 0 and 0 < sta["density"] < 1
    assert sta["psnr"] > 10 and 0 < sta["ssim"] <= 1
    for setting in results["settings"]:  # every run gets a VBench number: native temporal flickering
        assert 0 < setting["temporal_flickering"] <= 1
    assert any("vbench-python" in note for note in results["notes"])
    assert results["call"]["num_frames"] == SIZE["num_frames"] and results["call"]["num_inference_steps"] == 2
    for row in results["samples"]:
        assert os.path.isfile(os.path.join(out, row["video"])) and os.path.isfile(os.path.join(out, row["frames"]))
        assert row["shape"] == [SIZE["num_frames"], SIZE["height"], SIZE["width"], 3]
    for record_path in (p for p in (Path(out) / "samples").glob("*/*.json") if not p.name.endswith(".metrics.json")):  # each sample's timing says how loaded the CPU was
        load = json.loads(record_path.read_text())["load"]
        assert load["cpu_count"] >= 1 and load["wall_s"] > 0
    table = open(os.path.join(out, "results.md")).read()
    assert "| `sta` |" in table and "psnr (dB)" in table
    for name in ["speedup_vs_psnr", "speedup_vs_ssim", "speedup_vs_temporal_flickering", "per_prompt_psnr",
                 "per_prompt_speedup"]:
        path = os.path.join(out, "plots", name + ".png")
        assert os.path.getsize(path) > 1000, path


def test_resume_regenerates_only_missing(first_run, prompts, tmp_path, monkeypatch):
    out, _ = first_run
    run = tmp_path / "resume"
    shutil.copytree(out, run)
    before = _load(run)
    os.remove(run / "samples" / "sta" / "1_0.json")  # an interrupted sample: video may exist, record does not
    counter = Counter(monkeypatch)
    assert eval_main(_args(run, prompts)) == 0
    assert counter.calls == [("sta", 1, 0)]
    after = _load(run)
    assert _strip(after["samples"])[:3] == _strip(before["samples"])[:3]
    counter.calls.clear()
    assert eval_main(_args(run, prompts)) == 0  # everything done: nothing generated, pipeline not loaded
    assert counter.calls == []


def _strip(value):
    """Drop the fields that depend on timing and the machine (and the note that says the CPU was
    shared while samples were timed: whether it appears depends on the machine's load)."""
    if isinstance(value, dict):
        return {k: [n for n in v if "shared the CPU" not in n] if k == "notes" else _strip(v)
                for k, v in value.items() if k not in TIMING_FIELDS}
    if isinstance(value, list):
        return [_strip(v) for v in value]
    return value


def _assert_close(a, b, path=""):
    if isinstance(a, dict):
        assert set(a) == set(b), path
        for k in a:
            _assert_close(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_close(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and isinstance(b, float):
        assert math.isclose(a, b, rel_tol=1e-3, abs_tol=1e-6), (path, a, b)
    else:
        assert a == b, (path, a, b)


@pytest.mark.slow
def test_two_processes_match_one(first_run, prompts, tmp_path):
    out, _ = first_run
    two = tmp_path / "two"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "0",
           "-m", "fastdit.eval", *_args(two, prompts)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    one_results, two_results = _load(out), _load(two)
    assert two_results["num_processes"] == 2 and one_results["num_processes"] == 1
    # the two processes share stdout, so their lines may interleave: look for the tags anywhere
    ranks = set(re.findall(r"\[rank \d+\]", proc.stdout))
    assert ranks == {"[rank 0]", "[rank 1]"}, proc.stdout[-2000:]
    _assert_close(_strip(one_results), _strip(two_results))


@pytest.mark.parametrize("change, message", [
    (["--metrics", "psnr,bogus"], "unknown metric"),
    (["--methods", "dense,nope"], "unknown method"),
    (["--metrics", "psnr,lpips", "--lpips-weights", "/nonexistent/lpips"], "alex.pth"),
    (["--metrics", "fid", "--fid-weights", "/nonexistent/fid"], "pt_inception"),
    (["--metrics", "clip", "--clip-model", "/nonexistent/clip"], "config.json"),
])
def test_bad_input_fails_before_generating(change, message, prompts, tmp_path, monkeypatch):
    counter = Counter(monkeypatch)
    monkeypatch.setattr(generation, "load_pipe", lambda *a: pytest.fail("pipeline loaded despite bad input"))
    argv = _args(tmp_path / "bad", prompts)
    for flag, value in zip(change[::2], change[1::2]):
        if flag in argv:
            argv[argv.index(flag) + 1] = value
        else:
            argv += [flag, value]
    with pytest.raises(SystemExit) as info:
        eval_main(argv)
    assert message in str(info.value)
    assert counter.calls == []


@pytest.mark.parametrize("content, name, message", [
    ("", "empty.txt", "holds no prompts"),
    ("# only a comment\n\n", "comments.txt", "holds no prompts"),
    ('[{"prompt_en": "a cat"', "broken.json", "not valid JSON"),
    ('{"prompt": "a cat"}', "object.json", "expected a JSON list"),
    ('[{"text": "a cat"}]', "nofield.json", "no string 'prompt_en' or 'prompt'"),
    ("[]", "emptylist.json", "holds no prompts"),
])
def test_bad_prompt_files(content, name, message, tmp_path):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(SystemExit) as info:
        eval_main(_args(tmp_path / "out", path))
    assert message in str(info.value) and str(path) in str(info.value)


def test_missing_prompt_file_and_model(tmp_path, prompts):
    with pytest.raises(SystemExit, match="does not exist"):
        eval_main(_args(tmp_path / "out", tmp_path / "nope.txt"))
    argv = _args(tmp_path / "out", prompts)
    argv[argv.index("--model") + 1] = str(tmp_path / "no_model_here")
    with pytest.raises(SystemExit, match="no such folder"):
        eval_main(argv)


def test_shipped_prompt_files():
    vbench = load_prompts("vbench")
    assert len(vbench) >= 10 and all(p.dimension for p in vbench)
    assert any("temporal_flickering" in p.dimension for p in vbench)
    coco = load_prompts("coco")
    assert len(coco) >= 3 and all(not p.dimension and p.text.endswith(".") for p in coco)
    strings = load_prompts(shipped_prompt_file("vbench"))
    assert [p.text for p in strings] == [p.text for p in vbench]


def test_grid_makes_one_setting_per_value():
    cfg = EvalConfig(out="unused", methods=["dense", "sta"], options={"sta": {"tile": (1, 2, 2)}},
                     grid={"sta": {"dense_steps": [0, 0.25]}}, prompts=[Prompt("a")], seeds=[0])
    settings = build_settings(cfg)
    assert [s.name for s in settings] == ["dense", "sta[dense_steps=0]", "sta[dense_steps=0.25]"]
    assert settings[2].options == {"tile": (1, 2, 2), "dense_steps": 0.25}
    assert len({s.slug for s in settings}) == 3
    with pytest.raises(EvalError, match="window"):
        build_settings(EvalConfig(out="x", methods=["sta"], options={"sta": {"window": (2, 2, 2)}}))


def test_different_sizes_are_a_clear_error(first_run, prompts, tmp_path):
    import numpy as np

    out, _ = first_run
    run = tmp_path / "sizes"
    shutil.copytree(out, run)
    npy = run / "samples" / "dense" / "0_0.npy"
    np.save(npy, np.load(npy)[:, :-2])
    for cache in (run / "samples").rglob("*.metrics.json"):
        cache.unlink()
    with pytest.raises(SystemExit, match="different sizes"):
        eval_main(_args(run, prompts))


def test_pareto_front():
    points = [(1.0, 30.0), (2.0, 25.0), (1.5, 20.0), (3.0, 10.0)]
    assert report.pareto_front(points, higher_is_better=True) == [0, 1, 3]
    assert report.pareto_front([(1.0, 10.0), (2.0, 20.0), (1.5, 5.0)], higher_is_better=False) == [2, 1]


FAKE_VBENCH = '''#!{python}
"""A stand-in for VBench's interpreter: answers run_vbench's probe and writes a results file."""
import json, os, sys
here = os.path.dirname(os.path.abspath(__file__))
if sys.argv[1] == "-c":
    os.makedirs(os.path.join(here, "vbench", "launch"), exist_ok=True)
    open(os.path.join(here, "vbench", "launch", "evaluate.py"), "w").close()
    print(os.path.join(here, "vbench"))
    sys.exit(0)
args = sys.argv[1:]
dims = args[args.index("--dimension") + 1:]
dims = dims[:next((i for i, a in enumerate(dims) if a.startswith("--")), len(dims))]
out = args[args.index("--output_path") + 1]
videos = sorted(os.listdir(args[args.index("--videos_path") + 1]))
with open(os.path.join(out, "fake_eval_results.json"), "w") as f:
    json.dump({{d: [0.9, [{{"video_path": v, "video_results": 0.9}} for v in videos]] for d in dims}}, f)
'''


def test_metrics_added_later_without_regenerating(first_run, prompts, tmp_path, monkeypatch):
    """lpips (random weights in the official formats) and full VBench (a fake interpreter) on a
    finished run: only metrics are computed, cached values are kept, nothing is generated."""
    import torch

    from fastdit.eval.metrics.fidelity import LPIPS

    out, _ = first_run
    run = tmp_path / "more"
    shutil.copytree(out, run)
    weights = tmp_path / "lpips"
    weights.mkdir()
    torch.manual_seed(0)
    net = LPIPS("alex")
    torch.save({f"features.{k}": v for k, v in net.features.state_dict().items()}, weights / "alexnet-owt-7be5be79.pth")
    torch.save({f"lin{i}.model.1.weight": torch.rand(1, c, 1, 1) for i, c in enumerate((64, 192, 384, 256, 256))},
               weights / "alex.pth")
    fake = tmp_path / "fake_python"
    fake.write_text(FAKE_VBENCH.format(python=sys.executable))
    fake.chmod(0o755)
    counter = Counter(monkeypatch)
    argv = _args(run, prompts, metrics="psnr,ssim,lpips,vbench",
                 extra=["--lpips-weights", str(weights), "--vbench-python", str(fake),
                        "--vbench-dimensions", "subject_consistency,temporal_flickering"])
    assert eval_main(argv) == 0
    assert counter.calls == []
    before, after = _load(out), _load(run)
    for old, new in zip(before["samples"], after["samples"]):
        assert new["psnr"] == old["psnr"] and new["ssim"] == old["ssim"]
        assert (new["lpips"] is None) == (new["setting"] == "dense")
    assert after["settings"][1]["lpips"] >= 0
    for setting in after["settings"]:
        assert setting["vbench"]["dimensions"] == {"subject_consistency": 0.9, "temporal_flickering": 0.9}
        assert setting["vbench_quality"] is not None
    assert not any("vbench-python" in note for note in after["notes"])
    assert os.path.isfile(run / "plots" / "speedup_vs_lpips.png")


def test_tiny_call_size_is_compare_size():
    """The library keeps its own copy of the tiny call size (it must not import the command line)."""
    from fastdit.compare import COMPARE_TINY_SIZE

    assert generation.TINY_CALL_SIZE == COMPARE_TINY_SIZE


def test_library_does_not_import_the_command_line():
    code = ("import sys, fastdit.eval.runner.run, fastdit.eval.runner.report, fastdit.eval.runner.aggregate; "
            "print(sorted(m for m in sys.modules if m in ('fastdit.cli', 'fastdit.cli.eval')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_density_counts_dense_steps(prompts, tmp_path):
    """With dense steps the effective density (all calls) lies strictly between the sparse-only
    density and 1; without them the two agree. Both, and the fallbacks, are in results.md."""
    out = tmp_path / "density"
    one_prompt = tmp_path / "one.txt"
    one_prompt.write_text(prompts.read_text().splitlines()[1] + "\n")
    assert eval_main(_args(out, one_prompt, metrics="psnr", extra=["--grid", "sta.dense_steps=0,1", "--no-plots",
                                                                   "--no-warmup"])) == 0
    results = _load(out)
    dense, no_dense_steps, one_dense_step = results["settings"]
    assert dense["density"] is None and dense["sparse_density"] is None and dense["fallback_calls"] is None
    assert no_dense_steps["dense_calls"] == 0 and no_dense_steps["sparse_calls"] > 0
    assert no_dense_steps["density"] == pytest.approx(no_dense_steps["sparse_density"])
    assert one_dense_step["dense_calls"] > 0 and one_dense_step["sparse_calls"] > 0
    assert one_dense_step["sparse_density"] < one_dense_step["density"] < 1
    assert one_dense_step["sparse_density"] == pytest.approx(no_dense_steps["sparse_density"])
    for setting in (no_dense_steps, one_dense_step):
        assert setting["fallback_calls"] == 0 and setting["fallbacks"] == {}
    row = next(r for r in results["samples"] if r["setting"] == one_dense_step["setting"])
    assert row["density"] == pytest.approx(one_dense_step["density"])
    assert "all calls" in results["density_definition"]
    table = open(os.path.join(out, "results.md")).read()
    header = table.splitlines()[2]
    assert "density (all calls)" in header and "sparse-only" in header and "fallbacks" in header
    assert f"| {one_dense_step['density']:.3f} | {one_dense_step['sparse_density']:.3f} | 0 |" in table
    assert "dense steps, dense layers and fallback calls counted as fully computed" in table


@pytest.mark.filterwarnings("ignore:fastdit.*float64 attention:UserWarning")
def test_fallbacks_reach_results(prompts, tmp_path):
    """A float64 pipeline: fastdit runs every attention call with the model's own attention and
    counts it as a fallback with its reason; results.json and results.md report them."""
    from fastdit.eval.runner.run import run_eval

    cfg = EvalConfig(out=str(tmp_path / "f64"), model="tiny-wan", methods=["dense", "sta"],
                     options={"sta": {"tile": (1, 2, 2), "dense_steps": 0}}, prompts=[Prompt("A boat on a lake.")],
                     seeds=[0], metrics=["psnr"], dtype="float64", device="cpu", warmup=False, progress=False,
                     plots=False, call={"frames": SIZE["num_frames"], "height": SIZE["height"],
                                        "width": SIZE["width"], "steps": SIZE["num_inference_steps"]})
    run_eval(cfg)
    results = _load(cfg.out)
    sta = results["settings"][1]
    assert sta["fallback_calls"] > 0 and sta["sparse_calls"] == 0
    assert sta["fallbacks"] == {next(iter(sta["fallbacks"])): sta["fallback_calls"]}
    assert "float64" in next(iter(sta["fallbacks"]))
    assert sta["density"] == pytest.approx(1.0) and sta["sparse_density"] is None
    assert results["samples"][1]["fallbacks"] == sta["fallbacks"]
    table = open(os.path.join(cfg.out, "results.md")).read()
    assert f"- fallbacks of `sta`: {sta['fallback_calls']} call(s): {next(iter(sta['fallbacks']))}" in table


def test_records_from_before_effective_density_are_regenerated(first_run, prompts, tmp_path, monkeypatch):
    """An old record (density counted the sparse calls only, no sparse_density) is not reused."""
    out, _ = first_run
    run = tmp_path / "old"
    shutil.copytree(out, run)
    path = run / "samples" / "sta" / "0_0.json"
    record = json.loads(path.read_text())
    record["extra"].pop("sparse_density")
    path.write_text(json.dumps(record))
    counter = Counter(monkeypatch)
    assert eval_main(_args(run, prompts, extra=["--no-plots"])) == 0
    assert counter.calls == [("sta", 0, 0)]


def test_run_draws_a_contact_sheet_per_prompt(first_run):
    """One PNG per prompt (first seed): a row per setting, dense first; each row's first tile shows
    that setting's own first frame (its mean colour, read off the stored frames, not the sheet code)."""
    import numpy as np
    from PIL import Image

    out, _ = first_run
    folder = os.path.join(out, "contact_sheets")
    assert sorted(os.listdir(folder)) == ["p0_s0.png", "p1_s0.png"]
    sheet = np.asarray(Image.open(os.path.join(folder, "p0_s0.png")).convert("RGB")).astype(float)
    rows = {}
    for setting in ("dense", "sta"):
        frames = np.load(os.path.join(out, "samples", setting, "0_0.npy"))
        rows[setting] = frames[0].astype(float).mean((0, 1))
    from fastdit.media.contact_sheet import FRAME_PIXELS, LABEL_WIDTH

    factor = max(1, FRAME_PIXELS // max(frames.shape[1:3]))  # whole-number nearest-neighbour scaling
    tile_h, tile_w = frames.shape[1] * factor, frames.shape[2] * factor
    height = sheet.shape[0] // 2
    assert sheet.shape[0] == 2 * height == 2 * (tile_h + 4)  # two rows: dense, sta
    for row, setting in enumerate(("dense", "sta")):
        first = sheet[row * height + 2: row * height + 2 + tile_h, LABEL_WIDTH: LABEL_WIDTH + tile_w]
        assert np.abs(first.mean((0, 1)) - rows[setting]).max() < 3.0, setting


def test_a_calibration_re_made_in_place_is_not_reused_on_resume(tmp_path):
    """The stored-sample fingerprint covers a calibration file's content, not only its path (a file
    re-calibrated under the same name must regenerate its samples); the old option name too."""
    from types import SimpleNamespace

    from fastdit.eval.runner.prompts import Prompt
    from fastdit.eval.runner.settings import Sample, Setting, fingerprint

    cfg = SimpleNamespace(model="tiny-shapes", call={}, dtype=None, backend="auto", cache_options={})
    path = tmp_path / "sparge.json"

    def print_of(key="calibration"):
        setting = Setting("sparge", "sparge", {key: str(path)})
        return fingerprint(cfg, Sample(setting, 0, Prompt("a red circle moving up"), 0))

    path.write_text('{"settings": {"0_0": {"cdf": 0.9}}}')
    first, first_alias = print_of(), print_of("plan")
    assert print_of() == first  # stable
    path.write_text('{"settings": {"0_0": {"cdf": 0.95}}}')
    assert print_of() != first and print_of("plan") != first_alias
