"""The ComfyUI node's widgets, package and docs (issue 43): widgets built from the methods' option
metadata with ComfyUI's own input types, the package importable without ComfyUI, the sampler's step,
and docs/comfyui.md's tables and workflow. The node against ComfyUI's models: ``test_comfyui.py``."""
import json
import subprocess
import sys

import pytest
import torch

import comfyui_models as cm
import fastdit
from fastdit.integrations.comfyui import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS, node_widgets, step_of
from fastdit.integrations.comfyui.node import main_specs

NODE = NODE_CLASS_MAPPINGS["FastditSparseAttention"]


@pytest.fixture(scope="module")
def comfy():
    loaded = cm.load_comfy()
    if loaded is None:
        pytest.skip(cm.skip_reason())
    return loaded


def test_package_imports_without_comfyui():
    code = ("import sys; import fastdit.integrations.comfyui as n; "
            "assert 'comfy' not in sys.modules; print(sorted(n.NODE_CLASS_MAPPINGS)[0])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "FastditSparseAttention"


def test_widgets_come_from_option_metadata():
    assert NODE_DISPLAY_NAME_MAPPINGS["FastditSparseAttention"] == "fastdit Sparse Attention"
    generic = NODE.INPUT_TYPES()
    assert list(generic["required"]) == ["model", "method", "dense_steps", "dense_blocks"]
    assert generic["required"]["method"][0] == list(fastdit.method_names())
    assert set(generic["optional"]) == {"calibration_file", "options"}
    for key, cls in NODE_CLASS_MAPPINGS.items():
        if cls.METHOD is None:
            continue
        assert NODE_DISPLAY_NAME_MAPPINGS[key] == f"fastdit Sparse Attention ({cls.METHOD})"
        required = cls.INPUT_TYPES()["required"]
        specs = main_specs(cls.METHOD)
        assert list(required) == ["model", "dense_steps", "dense_blocks"] + [s.name for s in specs]
        for spec in specs:
            kind, params = required[spec.name]
            if isinstance(kind, list):
                assert params["default"] in kind
            elif kind in ("INT", "FLOAT"):
                assert params["min"] <= params["default"] <= params["max"]
                if spec.range and spec.range[0] is not None:
                    assert params["min"] == spec.range[0]
            assert params["tooltip"].startswith(spec.help[:20])
    assert set(node_widgets("sta")["required"]) >= {"tile", "window", "fit_tile"}


def test_step_of_reads_the_samplers_sigmas():
    schedule = torch.tensor([14.6, 6.0, 2.5, 0.9, 0.0])
    assert step_of({"sigmas": torch.tensor([2.5, 2.5]), "sample_sigmas": schedule}) == (2, 4)
    assert step_of({"sigmas": torch.tensor([3.0]), "sample_sigmas": schedule}) == (None, 4)
    assert step_of({"sigmas": torch.tensor([3.0])}) == (None, None)


def test_widgets_use_comfyuis_input_types(comfy):
    """Every input of every node is one of ComfyUI's IO types (or a combo list) with options that
    ComfyUI's ``InputTypeOptions`` defines; the node returns ComfyUI's MODEL type."""
    import typing

    from comfy.comfy_types.node_typing import IO, InputTypeOptions

    known = set(typing.get_type_hints(InputTypeOptions))
    types = {member.value for member in IO}
    for cls in NODE_CLASS_MAPPINGS.values():
        assert cls.RETURN_TYPES == (IO.MODEL.value,) and callable(getattr(cls(), cls.FUNCTION))
        for part in cls.INPUT_TYPES().values():
            for name, spec in part.items():
                assert isinstance(spec[0], list) or spec[0] in types, (cls.__name__, name, spec[0])
                assert set(spec[1] if len(spec) > 1 else {}) <= known, (cls.__name__, name)


# -- docs ------------------------------------------------------------------------------------------------


def test_docs_widget_tables_match_the_metadata():
    from fastdit.integrations.comfyui.node import WIDGETS_END, WIDGETS_START, widgets_markdown
    from fastdit.support import marked_section

    text = (cm.ROOT / "docs" / "comfyui.md").read_text()
    fix = "regenerate them with `python -m fastdit.integrations.comfyui` and paste them between the markers"
    tables = marked_section(text, WIDGETS_START, WIDGETS_END)
    assert tables is not None, f"docs/comfyui.md lacks the markers {WIDGETS_START} / {WIDGETS_END}; {fix}"
    assert tables == widgets_markdown(), f"docs/comfyui.md's widget tables disagree with the options; {fix}"


def test_docs_workflow_uses_the_node_with_valid_widgets(tmp_path):
    """The workflow (ComfyUI's API format) links existing nodes, and its fastdit node's inputs are the
    node's widgets with values the node accepts; the one-line shim loads as ComfyUI loads a custom node."""
    import importlib.util

    from fastdit.integrations.comfyui.node import _given

    workflow = json.loads((cm.ROOT / "docs" / "comfyui_workflow.json").read_text())
    for node in workflow.values():
        for value in node["inputs"].values():
            if isinstance(value, list):
                assert value[0] in workflow and value[1] == 0
    ours = [n for n in workflow.values() if n["class_type"] in NODE_CLASS_MAPPINGS]
    assert len(ours) == 1
    inputs = dict(ours[0]["inputs"])
    widgets = NODE_CLASS_MAPPINGS[ours[0]["class_type"]].INPUT_TYPES()
    assert set(inputs) <= set(widgets["required"]) | set(widgets["optional"])
    assert set(widgets["required"]) <= set(inputs)
    assert inputs["method"] in widgets["required"]["method"][0]
    _given(inputs["method"], {}, inputs["dense_steps"], inputs["dense_blocks"], inputs["options"])
    shim = tmp_path / "fastdit_nodes.py"
    shim.write_text("from fastdit.integrations.comfyui import *\n")
    spec = importlib.util.spec_from_file_location(str(tmp_path / "fastdit_nodes"), shim)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.NODE_CLASS_MAPPINGS is NODE_CLASS_MAPPINGS and module.NODE_DISPLAY_NAME_MAPPINGS
