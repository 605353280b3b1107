"""What a method supports lives on the method (``Method`` capabilities), and nothing else lists them.

* No module outside the registry keeps a module-level tuple / list / set of method names, or a dict
  from method names to flags (what ``RING_METHODS``, ``AUTO_METHODS``, vllm-omni's ``METHODS`` and
  ``eval/predict.py``'s ``METHODS`` were): consumers ask ``methods_with(capability)``.
* The vllm-omni entry points in ``pyproject.toml`` are the ones the plugin factory makes.
* Defaults resolve in one order (``Method.resolve``): method < family < where it runs < user.
"""
import ast
import subprocess
import tomllib
from pathlib import Path

import pytest

import fastdit
from fastdit.methods.base import _REGISTRY, WHERE_DEFAULTS, get_method, methods_with

ROOT = Path(__file__).resolve().parents[2]

#: Module-level collections of method names that are no capability list, with the reason.
ALLOWED = {
    ("eval/bench/methods_claims.py", "SVG2_RIVALS"): "the companions one published claim compares svg2 against",
}


def _method_names_in(node, names):
    """The method-name strings of a tuple / list / set literal (or a dict of flags keyed by them)."""
    if isinstance(node, ast.Call) and getattr(node.func, "id", "") in ("frozenset", "set", "tuple", "list") \
            and node.args:
        node = node.args[0]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        elts = node.elts
    elif isinstance(node, ast.Dict) and all(isinstance(v, ast.Constant) and isinstance(v.value, (bool, type(None)))
                                            for v in node.values):
        elts = node.keys
    else:
        return []
    strings = [e.value for e in elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    if len(strings) < 2 or len(strings) != len(elts) or not all(s in names for s in strings):
        return []
    return strings


def test_no_module_level_list_of_method_names_outside_the_registry():
    names = set(_REGISTRY)
    files = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    found = []
    for name in files:
        if name.startswith("tests/") or not (ROOT / name).is_file():
            continue
        tree = ast.parse((ROOT / name).read_text())
        for node in tree.body:
            if isinstance(node, ast.Assign):
                targets, value = [t.id for t in node.targets if isinstance(t, ast.Name)], node.value
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
                targets, value = [node.target.id], node.value
            else:
                continue
            listed = _method_names_in(value, names)
            for target in targets:
                if listed and (name, target) not in ALLOWED:
                    found.append(f"{name}:{node.lineno} {target} = {listed}")
    assert not found, ("module-level lists of method names (declare a capability on the method and ask "
                       "fastdit.methods.base.methods_with instead; docs/adding_a_method.md): " + "; ".join(found))


def test_the_scan_finds_what_it_looks_for():
    names = set(_REGISTRY)
    for text in ('X = ("sta", "radial")', 'X = {"sta": True, "todo": False}', 'X = frozenset({"svg", "svg2"})'):
        assert _method_names_in(ast.parse(text).body[0].value, names), text
    for text in ('X = ("sta",)', 'X = {"sta": {"tile": 1}, "svg": {}}', 'X = ("sta", "fast")'):
        assert not _method_names_in(ast.parse(text).body[0].value, names), text


def test_pyproject_entry_points_are_the_factory_s():
    from fastdit.integrations import vllm_omni

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    listed = config["project"]["entry-points"]["vllm_omni.sparse_attn"]
    assert listed == vllm_omni.entry_points()
    for name, target in listed.items():
        module, attribute = target.split(":")
        plugin = getattr(vllm_omni, attribute)
        assert plugin is vllm_omni.plugin(name[len(vllm_omni.PREFIX):]) and plugin.__name__ == name
    with pytest.raises(ValueError, match="not offered"):
        vllm_omni.plugin("prune")  # keeps a layer's cache across steps: no engine geometry


def test_capabilities_of_the_built_in_methods():
    """The lists the consumers used to keep, now asked of the registry (same members, same order)."""
    from fastdit.calibration.candidates import auto_methods
    from fastdit.eval.predict import modelled_methods
    from fastdit.methods.base import methods_taking
    from fastdit.methods.parallel import ring_methods

    builtin = [n for n in methods_with() if get_method(n).__module__.startswith("fastdit.")]
    assert builtin[0] == "dense"
    assert [n for n in ring_methods() if n in builtin] == ["sta", "radial", "sparge", "svg", "svg2"]
    assert [n for n in methods_taking("quant") if n in builtin] == ["sta", "radial", "sparge", "sla", "svg", "vsa",
                                                                    "svg2"]
    assert [n for n in auto_methods() if n in builtin] == ["sta", "radial", "sparge", "svg", "svg2", "todo", "tome"]
    assert [n for n in modelled_methods() if n in builtin] == ["sta", "radial", "sparge", "sla", "svg", "vsa"]
    grid = {n: get_method(n).engine_geometry for n in methods_with("engine_geometry") if n in builtin}
    assert grid == {"sta": "grid", "radial": "frames", "sparge": "grid", "sla": "grid", "svg": "frames", "vsa": "grid",
                    "svg2": "frames", "todo": "grid", "tome": "grid"}


def test_defaults_resolve_in_one_order():
    """method default < family default < where it runs < the user's option (a plan's options reach
    ``resolve`` merged into the user's by ``fastdit.patch``, which refuses an option set by both)."""
    radial = get_method("radial")
    assert radial.resolve().dense_steps == 0.24 and radial.resolve().decay == 0.95  # the method's
    assert radial.resolve(adapter="wan").decay == 0.2  # the family's
    assert radial.resolve(adapter="wan", where="call").dense_steps == 0  # one call: no step position
    assert radial.resolve(adapter="wan", where="call", options={"dense_steps": 2}).dense_steps == 2  # the user's
    config = radial.make_config(dense_steps=0.5)
    assert radial.resolve(config, "wan", where="call").dense_steps == 0.5  # a config's value is the user's too
    svg2 = get_method("svg2")
    assert svg2.resolve().warm_start is True and svg2.resolve().dense_layers == 1
    engine = svg2.resolve(where="engine")
    assert engine.warm_start is False and engine.dense_layers == 0 and engine.dense_steps == 0.25
    assert svg2.resolve(options={"guard": 0.2}, where="candidate").guard == 0.2
    assert svg2.resolve(where="candidate").guard is False
    assert set(WHERE_DEFAULTS) == {"pipeline", "call", "engine", "candidate"}
    assert fastdit.method_names() == sorted(fastdit.method_names())
