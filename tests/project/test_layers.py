"""The house has one direction: every fastdit module imports only its own layer or the ones below,
and no import circle exists anywhere (module level or inside functions).

Layers, bottom to top (docs/architecture.md draws them):
  0 kernels                       fastdit.kernels.*
  1 data types and utilities      layout, plan, context, stats, masks, jsonutil, cpu_load, costmodel
  2 methods                       fastdit.methods.*
  3 patch and model adapters      patching, apply, intercept, steps, functional, calibration.calibration_file,
                                  calibration.method_params, pipelines.*
  4 libraries with entry points   compare, parallel, support, options, media.*, calibration.* (search,
                                  candidates), eval.* (bench, metrics, runner), app.*, caches,
                                  integrations.* (vllm-omni plugins), train.* (the LoRA recipe)
  5 command line                  cli.*, python -m fastdit.eval
"""
import ast
import functools
import importlib.util
import pkgutil
from pathlib import Path

import pytest

import fastdit

LAYERS = [
    ("fastdit.kernels",),
    ("fastdit.layout", "fastdit.plan", "fastdit.context", "fastdit.stats", "fastdit.jsonutil",
     "fastdit.cpu_load", "fastdit.costmodel", "fastdit.import_guard"),
    ("fastdit.methods",),
    ("fastdit.patching", "fastdit.apply", "fastdit.intercept", "fastdit.steps", "fastdit.functional", "fastdit.pipelines",
     "fastdit.calibration.calibration_file", "fastdit.calibration.method_params"),
    ("fastdit.compare", "fastdit.parallel", "fastdit.support", "fastdit.options", "fastdit.media",
     "fastdit.calibration", "fastdit.eval", "fastdit.app", "fastdit.integrations", "fastdit.train"),
    ("fastdit.cli", "fastdit.eval.__main__"),
]


def layer_of(module):
    """The layer of the longest prefix that names ``module`` (``fastdit.eval.__main__`` is an entry point)."""
    best, best_len = None, -1
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    return best


def all_modules():
    """Every module of fastdit, including the subpackages installed from other folders
    (``kernels/``, ``pipelines/``, ``eval/`` become ``fastdit.kernels`` and friends)."""
    found = {"fastdit": Path(fastdit.__file__)}
    packages = ["fastdit", "fastdit.kernels", "fastdit.pipelines", "fastdit.eval"]
    for package in packages:
        module = importlib.import_module(package)
        found[package] = Path(module.__file__)
        for info in pkgutil.walk_packages(module.__path__, package + "."):
            spec = importlib.util.find_spec(info.name)
            if spec is not None and spec.origin and spec.origin.endswith(".py"):
                found[info.name] = Path(spec.origin)
    return found


@functools.lru_cache(maxsize=None)
def tree_of(path):
    """The parsed source of ``path`` (every scan below walks the same trees)."""
    return ast.parse(Path(path).read_text())


def imports_of(name, path, modules):
    """fastdit modules imported anywhere in ``path`` (resolved to the deepest known module)."""
    tree = tree_of(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    targets = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            candidates = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for candidate in candidates:
            while candidate and candidate not in modules:
                candidate = candidate.rpartition(".")[0]
            if candidate.startswith("fastdit") and candidate != name:
                targets.add(candidate)
                break
    return targets


MODULES = all_modules()
GRAPH = {name: imports_of(name, path, MODULES) for name, path in MODULES.items()}


def test_every_module_has_a_layer():
    missing = [name for name in MODULES if name != "fastdit" and layer_of(name) is None]
    assert not missing, f"add these modules to a layer in tests/project/test_layers.py and docs/architecture.md: {missing}"


@pytest.mark.parametrize("name", sorted(n for n in MODULES if n != "fastdit"))
def test_imports_point_down(name):
    mine = layer_of(name)
    assert mine is not None, f"{name} has no layer (see test_every_module_has_a_layer)"
    upward = sorted(t for t in GRAPH[name] if t != "fastdit" and layer_of(t) is not None and layer_of(t) > mine)
    assert not upward, f"{name} (layer {mine}) imports higher layers: {upward}"
    if mine <= 3:
        assert "fastdit" not in GRAPH[name], f"{name} imports the fastdit package root (import what you need directly)"


def test_no_import_circle():
    # Package __init__ modules re-export their children; an edge from a child to its own package's
    # __init__ is how Python imports work, not a circle of the code's design.
    def edges(name):
        return {t for t in GRAPH[name] if not name.startswith(t + ".")}

    state, stack = {}, []

    def visit(name):
        state[name] = "open"
        stack.append(name)
        for target in sorted(edges(name)):
            if state.get(target) == "open":
                cycle = stack[stack.index(target):] + [target]
                raise AssertionError("import circle: " + " -> ".join(cycle))
            if target not in state:
                visit(target)
        stack.pop()
        state[name] = "done"

    for name in sorted(GRAPH):
        if name not in state:
            visit(name)


def test_repository_folders_do_not_load_twice_under_top_level_names():
    """Run from the repository root, transformers probes for Hugging Face's ``kernels`` package and
    finds the ``kernels/`` folder (which installs as ``fastdit.kernels``); it must stay inert there,
    or the engine's torch.library ops would be registered twice (seen as a crash in the app). Where the
    package is installed, importing fastdit binds the real one first (``fastdit.import_guard``)."""
    import subprocess
    import sys

    code = ("import threading, torch, fastdit\n"
            "t = threading.Thread(target=lambda: __import__('transformers.modeling_utils')); t.start(); t.join()\n"
            "from fastdit.kernels import block_sparse_attention\n"
            "import os, kernels\n"
            "folder = os.path.join(os.getcwd(), 'kernels')\n"
            "inside = os.path.dirname(os.path.abspath(kernels.__file__ or '')) == folder\n"
            "assert not inside or kernels.__all__ == []  # the installed package, or the folder kept inert\n"
            "q = torch.randn(1, 1, 8, 4); i = torch.zeros(1, 1, 1, 1, dtype=torch.int32)\n"
            "print(block_sparse_attention(q, q, q, i, torch.ones(1, 1, 1, dtype=torch.int32), 8, 8)[0].shape)\n")
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "torch.Size([1, 1, 8, 4])" in result.stdout


MAX_LINES = 500


def test_no_python_file_over_500_lines():
    """Every tracked ``.py`` file of the repository stays at most ``MAX_LINES`` lines: a longer one is
    split by role (see how eval/bench/attention*.py and tests/model_matrix.py are cut)."""
    import shutil
    import subprocess

    root = Path(__file__).resolve().parents[2]
    if shutil.which("git") is None or not (root / ".git").exists():
        pytest.skip("needs the git checkout (git ls-files)")
    listed = subprocess.run(["git", "ls-files", "-z", "--", "*.py"], cwd=root, capture_output=True, check=True)
    files = [name for name in listed.stdout.decode().split("\0") if name]
    assert files, "git ls-files found no Python file"
    lengths = {}
    for name in files:
        path = root / name
        if path.is_file():  # a tracked file deleted in the working tree is not there to count
            with open(path, "rb") as handle:
                lengths[name] = sum(1 for _ in handle)
    over = sorted((n, name) for name, n in lengths.items() if n > MAX_LINES)
    assert not over, f"files over {MAX_LINES} lines (split them by role): " + ", ".join(
        f"{name} ({n})" for n, name in reversed(over))


MAX_MODULES = 16  # "about 15": a folder with more modules groups them in sub-folders


def test_no_folder_holds_too_many_modules():
    """Every package folder (``fastdit/``, ``kernels/``, ``pipelines/``, ``eval/`` and their sub-folders)
    holds at most ``MAX_MODULES`` modules besides ``__init__`` and ``__main__``: a person who adds a
    metric, a benchmark or a subcommand should see where it goes from the folder names."""
    root = Path(__file__).resolve().parents[2]
    counts = {}
    for top in ("fastdit", "kernels", "pipelines", "eval"):
        for init in (root / top).rglob("__init__.py"):
            modules = [p for p in init.parent.glob("*.py") if p.name not in ("__init__.py", "__main__.py")]
            counts[str(init.parent.relative_to(root))] = len(modules)
    assert counts.get("fastdit") and counts.get("eval") is not None, counts
    over = {folder: n for folder, n in counts.items() if n > MAX_MODULES}
    assert not over, f"folders over {MAX_MODULES} modules (group them in sub-folders): {over}"


def test_every_package_folder_is_installed():
    """``pip install .`` (not editable) installs only the packages pyproject lists: every folder
    of fastdit with an ``__init__.py`` must be there, or a user's import fails where the editable
    checkout works (``fastdit.train`` and ``fastdit.methods.tokens`` were missing once)."""
    import subprocess
    import tomllib

    root = Path(__file__).resolve().parents[2]
    config = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {name: Path(folder) for name, folder in config["package-dir"].items()}

    def folder_of(package):
        best = max((name for name in folders if package == name or package.startswith(name + ".")), key=len)
        return folders[best].joinpath(*package[len(best):].split(".")[1:])

    listed = {folder_of(package).as_posix() for package in config["packages"]}
    tracked = subprocess.run(["git", "ls-files", "*__init__.py"], cwd=root, capture_output=True, text=True,
                             check=True).stdout.split()
    packages = {Path(path).parent.as_posix() for path in tracked if not path.startswith("tests/")}
    assert packages, "git ls-files found no package"
    assert not packages - listed, f"package folders missing from pyproject's packages: {sorted(packages - listed)}"
    assert not listed - packages, f"pyproject lists packages without a folder: {sorted(listed - packages)}"



def private_imports_across_packages(modules):
    """``(importer, module, name)`` for each ``from module import _name`` (a private name, not a
    dunder) where ``module`` is a fastdit module outside the importer's own package."""
    found = []
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(tree_of(path)):
            if not isinstance(node, ast.ImportFrom):
                continue
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            if not base.startswith("fastdit"):
                continue
            source = base if base in modules and Path(modules[base]).name == "__init__.py" else base.rsplit(".", 1)[0]
            for alias in node.names:
                private = alias.name.startswith("_") and not alias.name.startswith("__")
                if private and source != package:
                    found.append((name, base, alias.name))
    return found


def test_no_private_name_crosses_a_package():
    """Issue 41: a helper another package needs gets a public name where it belongs."""
    crossing = private_imports_across_packages(MODULES)
    assert not crossing, f"private names imported from another package (give them public names): {crossing}"


def test_the_private_import_scan_finds_one(tmp_path):
    importer = tmp_path / "user.py"
    importer.write_text("from fastdit.kernels.triton_tuning import _hidden\nfrom .sibling import _fine\n")
    sibling = tmp_path / "sibling.py"
    sibling.write_text("")
    found = private_imports_across_packages({"fastdit.eval.user": importer, "fastdit.eval.sibling": sibling})
    assert found == [("fastdit.eval.user", "fastdit.kernels.triton_tuning", "_hidden")]


def test_attention_context_is_built_in_one_function():
    """Issue 41: ``fastdit.context.new_context`` is the one place that makes an ``AttentionContext``
    (the patched path, the ring path, ``fastdit.attention`` and the benchmarks call it)."""
    builders = []
    for name, path in MODULES.items():
        for node in ast.walk(tree_of(path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for inner in ast.walk(node):
                    func = getattr(inner, "func", None) if isinstance(inner, ast.Call) else None
                    called = getattr(func, "id", None) or getattr(func, "attr", None)
                    if called == "AttentionContext":
                        builders.append(f"{name}.{node.name}")
    assert sorted(set(builders)) == ["fastdit.context.new_context"], builders
