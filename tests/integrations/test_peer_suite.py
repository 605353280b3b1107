"""diffusers' own transformer model tests, patched by fastdit (issue 46): the peer suite's parts, and in
CI a run of scripts/peer_suite.sh for one dense, one block-sparse and one token method on the cheapest
test files, failing on a changed outcome that tests/peer/allowed_changes.txt does not list.

The run needs diffusers' tests tarball (``../shared/thirdparty/diffusers-tests-58eb52c.tar.gz``, or
``FASTDIT_PEER_TARBALL``) and is skipped without it, or with ``FASTDIT_SKIP_PEER=1``."""
import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from tiny_transformers import tiny_wan, wan_inputs

ROOT = Path(__file__).resolve().parents[2]
PEER = ROOT / "tests" / "peer"
TARBALL_NAME = "diffusers-tests-58eb52c.tar.gz"

#: What CI runs (measured on the 2-core CPU, see BENCHMARKS.md "Peer suite"): the methods, and the
#: test files of the families whose diffusers tests are cheapest while covering video and image models.
CI_METHODS = "dense,sparge,todo"
CI_FILES = "test_models_transformer_wan.py test_models_transformer_flux.py"
CI_OPTIONS = '{"dense_steps": 0, "dense_layers": 0, "guard": false}'


def _load(name):
    spec = importlib.util.spec_from_file_location(name, PEER / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tarball():
    if os.environ.get("FASTDIT_PEER_TARBALL"):
        return Path(os.environ["FASTDIT_PEER_TARBALL"])
    for folder in (ROOT.parent / "shared" / "thirdparty", ROOT / "shared" / "thirdparty"):
        if (folder / TARBALL_NAME).is_file():
            return folder / TARBALL_NAME
    return None


def _junit(path, cases):
    body = "".join(f'<testcase classname="tests.models.transformers.test_models_transformer_wan.WanTests" name="{n}" time="0.1">{c}</testcase>'
                   for n, c in cases)
    path.write_text(f'<?xml version="1.0"?><testsuites><testsuite name="pytest">{body}</testsuite></testsuites>')
    return path


def test_compare_counts_outcomes_and_lists_changes(tmp_path, capsys):
    compare = _load("peer_compare")
    fail, err, skip = '<failure message="AssertionError: x"/>', '<error message="boom"/>', '<skipped message="no"/>'
    base = _junit(tmp_path / "a.xml", [("test_a", ""), ("test_b", ""), ("test_c", skip), ("test_d", err)])
    patched = _junit(tmp_path / "b.xml", [("test_a", ""), ("test_b", fail), ("test_c", skip), ("test_d", err)])
    run = compare.outcomes(patched)
    assert compare.counts(run) == {"passed": 1, "failed": 1, "errors": 1, "skipped": 1}
    changed = compare.changes(compare.outcomes(base), run)
    test_id = "tests/models/transformers/test_models_transformer_wan.py::WanTests::test_b"
    assert changed == [(test_id, "passed", "failed", "AssertionError: x")]
    allow = tmp_path / "allow.txt"
    allow.write_text("# comment\n")
    assert compare.main([str(base), str(patched), "--method", "todo", "--allow", str(allow)]) == 1
    allow.write_text("todo | *::WanTests::test_b | merged tokens change the output\n")
    assert compare.main([str(base), str(patched), "--method", "todo", "--allow", str(allow)]) == 0
    assert compare.main([str(base), str(patched), "--method", "sta", "--allow", str(allow)]) == 1
    assert "passed -> failed" in capsys.readouterr().out
    allow.write_text("todo | *::WanTests::test_b |\n")  # no reason
    with pytest.raises(SystemExit, match="reason is required"):
        compare.main([str(base), str(patched), "--method", "todo", "--allow", str(allow)])


def test_allow_list_in_the_repository_is_well_formed():
    entries = _load("peer_compare").load_allow_list(PEER / "allowed_changes.txt")
    for method, pattern, reason in entries:
        assert "::" in pattern and len(reason) > 10, (method, pattern, reason)


def test_plugin_patches_a_supported_model_before_its_first_forward(monkeypatch):
    plugin = _load("fastdit_peer_plugin")
    monkeypatch.setenv("FASTDIT_PEER_METHOD", "sparge")
    monkeypatch.setenv("FASTDIT_PEER_OPTIONS", '{"dense_steps": 0, "dense_layers": 0, "guard": false}')
    monkeypatch.delenv("FASTDIT_PEER_REPORT", raising=False)
    from diffusers import AutoencoderKL
    from diffusers.models.modeling_utils import ModelMixin

    original = ModelMixin.__init__
    plugin.pytest_configure(None)
    model = None
    try:
        model = tiny_wan()
        vae = AutoencoderKL(block_out_channels=(8,), norm_num_groups=4, latent_channels=4,
                            down_block_types=("DownEncoderBlock2D",), up_block_types=("UpDecoderBlock2D",))
        assert getattr(model, "_fastdit_patch", None) is None  # nothing before the first forward
        with torch.no_grad():
            model(**wan_inputs(frames=5, height=10, width=14, batch=1))
            vae(torch.randn(1, 3, 8, 8))
        patch = model._fastdit_patch
        assert patch.stats.sparse_calls == len(patch.layers) and patch.stats.fallback_calls == 0  # the first call ran patched
        assert getattr(vae, "_fastdit_patch", None) is None
        summary = plugin._summary()
        assert summary["patched"] == {"WanTransformer3DModel": 1} and summary["unsupported"] == {"AutoencoderKL": 1}
    finally:
        plugin.pytest_unconfigure(None)
        if getattr(model, "_fastdit_patch", None) is not None:  # the plugin's run ends with its process; here, remove
            model._fastdit_patch.remove()
    assert ModelMixin.__init__ is original
    assert not any(h is plugin._first_forward for h in tiny_wan()._forward_pre_hooks.values())


def test_plugin_is_not_collected_by_the_project_run():
    assert not any(p.name.startswith("test_") for p in PEER.iterdir())
    assert not (PEER / "conftest.py").exists()


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("FASTDIT_SKIP_PEER") == "1", reason="FASTDIT_SKIP_PEER=1")
def test_peer_suite_has_no_unlisted_changed_outcome():
    tarball = _tarball()
    if tarball is None or not tarball.is_file():
        pytest.skip(f"{TARBALL_NAME} not found (../shared/thirdparty/ or FASTDIT_PEER_TARBALL)")
    pytest.importorskip("parameterized")
    env = {**os.environ, "FASTDIT_PEER_TARBALL": str(tarball), "FASTDIT_PEER_FILES": os.environ.get("FASTDIT_PEER_FILES", CI_FILES),
           "PYTHON": sys.executable}
    result = subprocess.run(["bash", str(ROOT / "scripts" / "peer_suite.sh"), os.environ.get("FASTDIT_PEER_METHODS", CI_METHODS),
                             CI_OPTIONS], env=env, capture_output=True, text=True, timeout=1500)
    report = textwrap.indent(result.stdout + result.stderr, "  ")
    print(report)
    assert result.returncode == 0, f"peer suite: changed outcomes not in tests/peer/allowed_changes.txt\n{report}"
