"""``scripts/ship_tiny_shapes.sh``: what it would run to ship a retrained tiny-shapes (its ``--dry-run``)."""
import json
import os
import re
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "scripts", "ship_tiny_shapes.sh")
WEIGHTS = os.path.join(REPO, "pipelines", "weights", "tiny-shapes")


def _ship(*args):
    return subprocess.run(["bash", SCRIPT, *args], capture_output=True, text=True, cwd=REPO, timeout=60)


def test_dry_run_remakes_every_named_calibration_the_adherence_and_the_readme_column(tmp_path):
    """Read independently of the script: the calibrations presets.json names and the methods of the README's
    table. Every one must be re-made / measured, adherence in two shards before the merge, the column last."""
    before = {name: os.path.getmtime(os.path.join(WEIGHTS, name)) for name in os.listdir(WEIGHTS)}
    result = _ship(WEIGHTS, str(tmp_path / "run"), "--dry-run")
    assert result.returncode == 0, result.stderr
    steps = [line.split(":", 1) for line in result.stdout.splitlines() if ": " in line and not line.startswith("ship")]
    names = [name for name, _ in steps]
    commands = dict(steps)
    with open(os.path.join(WEIGHTS, "presets.json")) as f:
        calibrations = json.load(f)["calibrations"]
    assert calibrations and {f"calibrate_{m}" for m in calibrations} <= set(names)
    for method in calibrations:
        assert f"--method {method} --budget 0.05 --max-prompts 2" in commands[f"calibrate_{method}"]
    assert names.index("adherence_0") < names.index("adherence_merge") > names.index("adherence_1")
    assert "--seeds 0,1" in commands["adherence_0"] and "--shard 1/2" in commands["adherence_1"]
    with open(os.path.join(REPO, "README.md")) as f:
        readme = f.read()
    table = readme.split("## Methods", 1)[1].split("\n\n", 2)[1]
    methods = set(re.findall(r"^\| \[`(\w+)`\]", table, re.M))
    assert len(methods) >= 10
    column = set(commands["column"].split("--methods ")[1].split()[0].split(","))
    assert methods <= column, methods - column
    assert names[-2:] == ["column", "auto_column"] and "dense,auto" in commands["auto_column"]
    # a dry run copies nothing
    assert before == {name: os.path.getmtime(os.path.join(WEIGHTS, name)) for name in os.listdir(WEIGHTS)}


@pytest.mark.parametrize("missing", ["transformer", "vae", "model_index.json"])
def test_a_folder_without_a_component_is_refused_naming_it(tmp_path, missing):
    for name in ("transformer", "text_encoder", "vae", "tokenizer", "scheduler"):
        (tmp_path / "new" / name).mkdir(parents=True)
    (tmp_path / "new" / "model_index.json").write_text("{}")
    target = tmp_path / "new" / missing
    target.rmdir() if target.is_dir() else target.unlink()
    result = _ship(str(tmp_path / "new"), str(tmp_path / "run"))
    assert result.returncode == 2 and f"has no {missing}" in result.stderr and "train_tiny" in result.stderr
    assert not (tmp_path / "run").exists()
