"""The repository's kernels/ folder does not shadow an installed top-level ``kernels`` package.

Run from the repository root, ``import kernels`` finds the folder (fastdit.kernels' sources) before the
installed package that diffusers imports when it is installed (transformers 5 requires Hugging Face's
``kernels``): every pipeline load then failed. Each case runs in a fresh interpreter.
"""
import json
import os
import subprocess
import sys
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(code, cwd, env=None):
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env={**os.environ, **(env or {})})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _fake_layout(tmp_path):
    """A repository root with a kernels/ folder and a site folder with an installed ``kernels`` (metadata too)."""
    root, site = tmp_path / "repo", tmp_path / "site"
    (root / "kernels").mkdir(parents=True)
    (root / "kernels" / "__init__.py").write_text("WHO = 'repository folder'\n")
    (site / "kernels").mkdir(parents=True)
    (site / "kernels" / "__init__.py").write_text("WHO = 'installed package'\n")
    (site / "kernels-9.9.dist-info").mkdir()
    (site / "kernels-9.9.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: kernels\nVersion: 9.9\n")
    return root, site


GUARDED = """
    import json, sys
    sys.path[:0] = ["", {site!r}]
    import fastdit.import_guard as guard
    guard.REPOSITORY_ROOT = {root!r}
    found = guard.import_installed_kernels()
    import kernels
    print(json.dumps({{"returned": getattr(found, "WHO", None), "bound": kernels.WHO}}))
"""


def test_the_installed_package_wins_over_the_repository_folder(tmp_path):
    root, site = _fake_layout(tmp_path)
    # without the guard the folder wins (the failure being guarded against)
    plain = _run(f"""
        import json, sys
        sys.path[:0] = ["", {str(site)!r}]
        import kernels
        print(json.dumps({{"bound": kernels.WHO}}))
    """, cwd=root)
    assert plain["bound"] == "repository folder"
    guarded = _run(GUARDED.format(site=str(site), root=str(root)), cwd=root)
    assert guarded == {"returned": "installed package", "bound": "installed package"}


def test_the_folder_bound_first_gives_way_to_the_installed_package(tmp_path):
    """transformers probes the name before fastdit is imported: the folder, bound first, is replaced."""
    root, site = _fake_layout(tmp_path)
    out = _run(f"""
        import json, sys
        sys.path[:0] = ["", {str(site)!r}]
        import kernels
        first = kernels.WHO
        import fastdit.import_guard as guard
        guard.REPOSITORY_ROOT = {str(root)!r}
        found = guard.import_installed_kernels()
        import kernels
        print(json.dumps({{"first": first, "returned": getattr(found, "WHO", None), "bound": kernels.WHO}}))
    """, cwd=root)
    assert out == {"first": "repository folder", "returned": "installed package", "bound": "installed package"}


def test_nothing_is_bound_when_no_package_is_installed(tmp_path):
    root, site = _fake_layout(tmp_path)
    out = _run(f"""
        import importlib.metadata, json, sys
        sys.path[:0] = ["", {str(site)!r}]
        import fastdit.import_guard as guard
        guard.REPOSITORY_ROOT = {str(root)!r}

        def not_installed(name):  # as on a machine without the package's metadata (the real one may be here)
            raise importlib.metadata.PackageNotFoundError(name)

        guard.importlib.metadata.distribution = not_installed
        before = "kernels" in sys.modules
        found = guard.import_installed_kernels()
        print(json.dumps({{"returned": found is not None, "bound": "kernels" in sys.modules, "before": before}}))
    """, cwd=root)
    if out["before"]:
        pytest.skip("this interpreter imported a kernels package before the guard ran")
    assert out == {"returned": False, "bound": False, "before": False}


def test_diffusers_loads_a_pipeline_when_run_from_the_repository_root():
    """The real layout: python run in the repository root imports fastdit, then diffusers' pipeline code."""
    out = _run("""
        import json
        import fastdit
        from diffusers.pipelines.pipeline_utils import DiffusionPipeline
        import fastdit.kernels
        import sys
        print(json.dumps({"kernels": getattr(sys.modules.get("kernels"), "__file__", None),
                          "fastdit_kernels": fastdit.kernels.__file__}))
    """, cwd=REPO)
    assert os.path.dirname(out["fastdit_kernels"]) == os.path.join(REPO, "kernels")
    if out["kernels"] is not None:  # an installed kernels package is the one bound to the bare name
        assert os.path.dirname(out["kernels"]) != os.path.join(REPO, "kernels")
