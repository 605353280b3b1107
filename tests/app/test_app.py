"""The Gradio app: driven like a user would (launched in-process on a free localhost port, called
with ``gradio_client``) and its service layer called directly (the page in a browser:
``tests/app/test_app_browser.py``).

Runs at the tiny test size (9 frames at 80x112, 2 steps: a 3 x 5 x 7 latent grid). The sparse
sliding-tile setting is one frame per tile (1x5x7 tokens), ``window=1,1,1`` and no dense steps: each
of the three tiles attends itself only (a third of the block pairs), so it really differs from
dense. (The tiny preset, 4x4x8 tiles fitted to the grid, covers this small grid with one tile.)
"""
import ast
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
from app_harness import ROOT, assert_unpatched, drop_repository_root_from_sys_path, launch

drop_repository_root_from_sys_path()  # before gradio and fastdit (see tests/app_harness.py)

gr = pytest.importorskip("gradio", reason="the app needs gradio (pip install 'fastdit[app]')")
gradio_client = pytest.importorskip("gradio_client", reason="the app tests need gradio_client")

from fastdit.pipelines.tiny import TINY_TEST_DEFAULTS  # noqa: E402

APP_DIR = ROOT / "fastdit" / "app"
TEST_SIZE = {k: TINY_TEST_DEFAULTS["wan"][k] for k in ("num_frames", "height", "width", "num_inference_steps")}
SMALL = dict(model="tiny-wan", frames=TEST_SIZE["num_frames"], height=TEST_SIZE["height"],
             width=TEST_SIZE["width"], steps=TEST_SIZE["num_inference_steps"], seed=0)
SPARSE_STA = dict(method="sta", sta_tile="1,5,7", sta_window="1,1,1", sta_dense_steps="0")


@pytest.fixture(scope="module")
def app():
    from fastdit.app import build_app

    demo = build_app("tiny-wan", concurrency=2)  # two runs at once: different models overlap
    demo.queue(default_concurrency_limit=1)
    yield demo, launch(demo)
    demo.close()


@pytest.fixture(scope="module")
def client(app):
    return gradio_client.Client(app[1], verbose=False)


def compare(client, **kwargs):
    return client.predict(**{**SMALL, **kwargs}, api_name="/compare")


def unpack(result):
    dense, method, cards, mask, mask_caption, notes, table, _scatter, metrics, sheet = result
    path = lambda v: v["video"] if isinstance(v, dict) and "video" in v else (v["value"] if isinstance(v, dict) else v)  # noqa: E731
    return dict(dense=path(dense), method=path(method), cards=cards, mask=mask, caption=mask_caption, notes=notes,
                table=table, metrics=metrics, sheet=path(sheet))


def request(**overrides):
    from fastdit.app import RunRequest

    fields = dict(model="tiny-wan", prompt="a fox", seed=5, steps=SMALL["steps"], frames=SMALL["frames"],
                  height=SMALL["height"], width=SMALL["width"], method="sta",
                  options={"tile": "1,5,7", "window": "1,1,1", "dense_steps": "0"})
    return RunRequest(**{**fields, **overrides})


def assert_h264_mp4(path, frames, height, width):
    import imageio.v2 as imageio

    assert path and os.path.isfile(path) and path.endswith(".mp4"), path
    head = open(path, "rb").read()
    assert head[4:8] == b"ftyp", "not an mp4"
    assert b"avc1" in head, "not H.264 (no avc1 sample entry)"
    reader = imageio.get_reader(path, format="ffmpeg")
    try:
        video = np.stack([frame for frame in reader.iter_data()])
    finally:
        reader.close()
    assert video.shape[0] == frames and video.shape[1:3] == (height, width), video.shape


def test_sparse_compare_differs_from_dense_and_reports_its_density(client):
    out = unpack(compare(client, **SPARSE_STA, mask_layer=1, mask_head=1))
    for path in (out["dense"], out["method"]):
        assert_h264_mp4(path, SMALL["frames"], SMALL["height"], SMALL["width"])
    metrics = out["metrics"]
    assert metrics["method"] == "sta" and metrics["size"] == "9x80x112" and metrics["steps"] == 2
    assert metrics["options"]["tile"] == [1, 5, 7] and metrics["options"]["window"] == [1, 1, 1]
    assert metrics["options"]["dense_steps"] == 0
    assert metrics["dense_digest"] != metrics["method_digest"]  # the method changed the output
    assert isinstance(metrics["psnr_db"], float) and 10 < metrics["psnr_db"] < 200, metrics["psnr_db"]
    assert 0 < metrics["ssim"] < 1
    assert metrics["effective_density"] == pytest.approx(1 / 3)  # each of the three tiles attends itself only
    assert metrics["sparse_calls"] > 0 and metrics["dense_calls"] == 0
    assert metrics["fallback_calls"] == 0 and metrics["fallbacks"] == {}
    for key in ("dense_latency_s", "method_latency_s", "speedup"):
        assert isinstance(metrics[key], float) and metrics[key] > 0, (key, metrics[key])
    assert metrics["speedup"] == pytest.approx(metrics["dense_latency_s"] / metrics["method_latency_s"], rel=1e-9)
    assert "effective density" in out["cards"] and "33.3%" in out["cards"] and "fallbacks" in out["cards"]
    from PIL import Image

    assert out["mask"] and os.path.isfile(out["mask"])
    with Image.open(out["mask"]) as image:
        assert image.format == "PNG" and max(image.size) <= 512 and image.size[0] == image.size[1]
        assert image.size[0] >= 105  # 105 video tokens drawn at >= 1 px each
    assert "layer 1" in out["caption"] and "head 1" in out["caption"] and "sta_" in out["caption"]
    headers, row = out["table"]["headers"], out["table"]["data"][-1]
    assert headers[:3] == ["#", "model", "method"]
    assert row[headers.index("effective density")] == 0.333 and row[headers.index("fallbacks")] == "0"


def test_session_table_and_dense_reuse(client):
    # A fresh session: radial with its own options, then sta reusing the dense run; the table grows.
    fresh = gradio_client.Client(client.src, verbose=False)
    first = unpack(compare(fresh, method="radial", radial_decay="0.5", radial_dense_steps="0"))["metrics"]
    assert first["method"] == "radial" and first["options"]["decay"] == 0.5 and first["options"]["dense_steps"] == 0
    assert first["dense_reused"] is False
    second_out = unpack(compare(fresh, **SPARSE_STA, reuse_dense=True))
    second = second_out["metrics"]
    assert second["dense_reused"] is True and any("dense run reused" in note for note in second["notes"])
    assert second["dense_digest"] == first["dense_digest"] and second["dense_latency_s"] == first["dense_latency_s"]
    table = second_out["table"]
    assert [row[2] for row in table["data"]] == ["radial", "sta"]
    column = table["headers"].index("effective density")
    assert [row[column] for row in table["data"]] == [round(first["effective_density"], 3), 0.333]


def test_size_not_allowed_is_rounded_with_a_note(client):
    out = unpack(compare(client, method="sta", height=90, width=100, frames=10))
    assert out["metrics"]["size"] == "9x96x96", out["metrics"]["size"]
    options = out["metrics"]["options"]  # the tiny preset, shown in the option boxes
    assert options["tile"] == [4, 4, 8] and options["window"] == [3, 3, 3] and options["fit_tile"] is True
    assert "height 90 -> 96" in out["notes"] and "frames 10 -> 9" in out["notes"]


@pytest.mark.parametrize("bad, message", [
    (dict(model="tiny-nope"), "unknown tiny model"),
    (dict(model="./no/such/folder"), "no such folder"),
    (dict(height=2048, width=2048, frames=121), "video tokens"),
    (dict(height=100000), "too large"),
    (dict(method="sta", sta_window="2,2,2"), "odd"),
    (dict(method="sta", sta_window="1,1,1; 3,3,3; 1,1,1"), "3 triples but the model's attention layers have 2 heads"),
    (dict(seed=2**70), r"seed must be a whole number from 0 to 4294967295"),
    (dict(seed=-1), r"seed must be a whole number from 0 to 4294967295"),
])
def test_bad_input_is_a_gradio_error(app, client, bad, message):
    with pytest.raises(gradio_client.exceptions.AppError, match=message):
        compare(client, **bad)
    assert_unpatched(app[0].runner, free=True)


def test_largest_seed_runs(client):
    assert unpack(compare(client, seed=2**32 - 1))["metrics"]["seed"] == 2**32 - 1


def test_failed_and_stopped_runs_leave_the_model_unpatched(app):
    """A run that fails at patch time, one that fails mid-generation and one that is stopped while
    the method runs (the pipeline patched): the next run starts from the unpatched model, so its
    dense frames equal a fresh pipeline's bit for bit (and the method's frames too)."""
    from fastdit.app import AppError, RunCancelled, Runner

    runner = app[0].runner
    with pytest.raises(AppError, match="3 triples"):  # per-head windows that do not match the 2 heads
        runner.compare(request(options={"window": "1,1,1; 3,3,3; 1,1,1", "dense_steps": "0"}))
    assert_unpatched(runner, free=True)

    def failing(fraction, desc=""):
        if desc.startswith("sta: step 1"):
            raise RuntimeError("boom in the middle of the method run")

    with pytest.raises(RuntimeError, match="boom"):
        runner.compare(request(), progress=failing)
    assert_unpatched(runner, free=True)

    cancel, seen = threading.Event(), []

    def stop_during_method(fraction, desc=""):
        seen.append(desc)
        if desc.startswith("sta: step 1"):
            cancel.set()  # as the Stop button does, mid-run, while the pipeline is patched

    with pytest.raises(RunCancelled):
        runner.compare(request(), progress=stop_during_method, cancel=cancel)
    assert "sta: step 1/2" in seen and "sta: step 2/2" not in seen, seen
    assert_unpatched(runner, free=True)

    after = runner.compare(request())
    fresh = Runner().compare(request())
    assert np.array_equal(after.dense_frames, fresh.dense_frames)
    assert np.array_equal(after.method_frames, fresh.method_frames)
    assert not np.array_equal(after.method_frames, after.dense_frames)
    assert after.metrics["effective_density"] == pytest.approx(1 / 3)
    check_contact_sheet(after)


def check_contact_sheet(out):
    """The run's contact sheet: a PNG whose rows hold dense's and the method's first / middle / last
    frames, pixel for pixel (frames this small are not scaled down; the two runs differ, so a
    swapped or repeated row fails)."""
    from PIL import Image

    from fastdit.media.contact_sheet import FRAME_PIXELS, LABEL_WIDTH

    with Image.open(out.contact_sheet) as image:
        assert image.format == "PNG"
        sheet = np.asarray(image.convert("RGB"))
    frames, height, width = out.dense_frames.shape[:3]
    factor = max(1, FRAME_PIXELS // max(height, width))
    assert sheet.shape[0] == 2 * (height * factor + 4)
    for row, video in enumerate((out.dense_frames, out.method_frames)):
        video = (np.clip(video, 0, 1) * 255).round().astype(np.uint8) if video.dtype != np.uint8 else video
        top = row * (height * factor + 4) + 2
        for column, index in enumerate((0, (frames - 1) // 2, frames - 1)):
            left = LABEL_WIDTH + column * (width * factor + 4)
            tile = sheet[top:top + height * factor:factor, left:left + width * factor:factor]
            # one level of rounding apart at most (x.5 rounds either way)
            assert np.abs(tile.astype(int) - video[index].astype(int)).max() <= 1, (row, index)


def test_stop_button_cancels_the_sessions_run():
    from fastdit.app import Runner

    runner = Runner()
    assert runner.cancel("nobody") is False
    with runner.run_scope("s1") as first:
        with runner.run_scope("s2") as second:
            assert runner.cancel("s1") is True
            assert first.is_set() and not second.is_set()
    assert runner.cancel("s1") is False  # finished runs are forgotten


def test_two_models_at_once_overlap_and_each_equals_its_run_alone(app):
    """Two clients, two different models, at the same time: the runs overlap (their recorded start
    and end times), each gives the frames of its run alone, and both pipelines end unpatched."""
    demo, url = app
    jobs = {"tiny-wan": dict(model="tiny-wan", **SPARSE_STA),
            "tiny-hunyuan-video": dict(model="tiny-hunyuan-video", **SPARSE_STA, seed=3)}
    alone = {name: unpack(compare(gradio_client.Client(url, verbose=False), **job))["metrics"]
             for name, job in jobs.items()}  # also loads and warms both pipelines
    together, errors = {}, []
    # The runs really overlap whatever the machine's load: each model's first transformer forward of
    # the run waits (a pre-hook) until the other model's run has reached its own.
    meet, met = threading.Barrier(len(jobs)), set()

    def meeting(name):
        def hook(module, args):
            if name not in met:
                met.add(name)
                meet.wait(timeout=600)  # a deadlock guard only
        return hook

    hooks = [demo.runner.pipes.get(name).pipe.transformer.register_forward_pre_hook(meeting(name)) for name in jobs]

    def worker(name):
        try:
            together[name] = unpack(compare(gradio_client.Client(url, verbose=False), **jobs[name]))["metrics"]
        except Exception as error:  # noqa: BLE001
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(name,)) for name in jobs]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        for hook in hooks:
            hook.remove()
    assert not errors, errors
    assert met == set(jobs)
    a, b = together["tiny-wan"], together["tiny-hunyuan-video"]
    assert a["started_at"] < b["finished_at"] and b["started_at"] < a["finished_at"], (a, b)  # they overlapped
    for name in jobs:
        assert together[name]["model"] == name
        for key in ("dense_digest", "method_digest", "effective_density", "psnr_db", "options"):
            assert together[name][key] == alone[name][key], (name, key)
        assert together[name]["dense_digest"] != together[name]["method_digest"]
    assert_unpatched(demo.runner, free=True)


def test_fallbacks_are_counted_and_shown():
    """float64 attention is not handled by the kernels: every call falls back, and the app says so."""
    from fastdit.app import Runner
    from fastdit.app.views import history_frame, metrics_html

    out = Runner(dtype="float64").compare(request())
    metrics = out.metrics
    assert metrics["fallback_calls"] > 0 and metrics["sparse_calls"] == 0
    assert metrics["effective_density"] == 1.0 and metrics["sparse_density"] is None
    (reason, count), = metrics["fallbacks"].items()
    assert "float64" in reason and count == metrics["fallback_calls"]
    assert np.array_equal(out.method_frames, out.dense_frames)
    assert any("fallbacks" in note and "float64" in note for note in out.notes)
    assert "float64" in metrics_html(metrics)
    cell = history_frame([{**metrics, "run": 1}])["fallbacks"][0]
    assert cell.startswith(f"{count}: ") and "float64" in cell


def test_seed_bounds():
    from fastdit.app import MAX_SEED, AppError, check_seed

    assert MAX_SEED == 2**32 - 1
    assert check_seed(None) == 0 and check_seed(7.0) == 7 and check_seed("12") == 12 and check_seed(MAX_SEED) == MAX_SEED
    for bad in (2**70, MAX_SEED + 1, -1, 1.5, float("inf"), True, "x"):
        with pytest.raises(AppError, match="seed must be a whole number from 0 to 4294967295"):
            check_seed(bad)


def test_method_options_come_from_the_config_dataclasses():
    import dataclasses

    import fastdit
    from fastdit.app import option_specs, parse_option, parse_options

    for method in fastdit.method_names():
        config_cls = fastdit.methods.get_method(method).config_cls
        specs = option_specs(method)
        fields = dataclasses.fields(config_cls)
        assert [s.name for s in specs] == [f.name for f in fields]
        assert [s.default for s in specs] == [f.default for f in fields]
        assert all(s.help for s in specs), [s.name for s in specs if not s.help]  # from the docstrings
    kinds = {s.name: s for s in option_specs("sta")}
    assert kinds["tile"].kind == "tuple" and kinds["window"].kind == "tuple" and kinds["dense_steps"].kind == "number"
    assert kinds["dense_layers"].kind == "int"
    radial = {s.name: s for s in option_specs("radial")}
    assert radial["sink"].kind == "bool" and radial["sink"].optional and radial["block_size"].default == 128
    assert "wan 0.2" in radial["decay"].default_text()  # the model families' defaults
    tile, window, steps = kinds["tile"], kinds["window"], kinds["dense_steps"]
    assert parse_option(tile, "6, 8, 8") == (6, 8, 8) and parse_option(tile, "") is None
    assert parse_option(window, "1,3,3; 3,3,3") == [(1, 3, 3), (3, 3, 3)] and parse_option(window, "") == (3, 3, 3)
    assert parse_option(steps, 2) == 2 and parse_option(steps, "2") == 2 and parse_option(steps, "0.25") == 0.25
    assert parse_option(radial["sink"], "model default") is None and parse_option(radial["sink"], "off") is False
    assert parse_options("sta", {"window": "1,1,1", "tile": None}) == {"window": (1, 1, 1), "tile": None}
    from fastdit.app import AppError

    with pytest.raises(AppError, match="unknown option"):
        parse_options("sta", {"decay": "1"})
    with pytest.raises(AppError, match="dense_layers"):
        parse_option(kinds["dense_layers"], "1.5")


def test_field_metadata_drives_the_widgets():
    from dataclasses import dataclass, field
    from typing import Literal

    from fastdit import Method, MethodConfig
    from fastdit.app import AppError, option_specs, parse_option
    from fastdit.methods.base import option
    from fastdit.app.ui import option_widget

    @dataclass
    class ToyConfig(MethodConfig):
        """Toy.

        Attributes:
            strength: how strong. From the docstring.
        """

        strength: float = field(default=0.5, metadata={"range": (0.0, 1.0), "widget": "slider"})
        rule: Literal["a", "b"] = "a"
        budget: int = field(default=4, metadata={"help": "blocks per row", "label": "budget (blocks)",
                                                 "range": (1, None)})
        flag: bool = option(False, "a flag", widget="checkbox")  # the methods' helper: None entries
        size: int = option(128, "block size", choices=(64, 128), widget="dropdown")

    class Toy(Method):
        name = "toy"
        config_cls = ToyConfig

    specs = {s.name: s for s in option_specs(Toy)}
    strength, rule, budget = specs["strength"], specs["rule"], specs["budget"]
    assert strength.help == "how strong. From the docstring." and strength.range == (0.0, 1.0)
    assert rule.kind == "choice" and rule.choices == ("a", "b") and rule.api_name == "toy_rule"
    assert budget.help == "blocks per row" and budget.label == "budget (blocks)"
    assert parse_option(budget, "3") == 3 and parse_option(rule, "b") == "b"
    assert specs["flag"].kind == "bool" and specs["flag"].help == "a flag" and specs["flag"].range is None
    assert specs["size"].kind == "choice" and parse_option(specs["size"], "64") == 64
    with pytest.raises(AppError, match="outside"):
        parse_option(strength, "1.5")
    with pytest.raises(AppError, match="outside"):
        parse_option(budget, 0)
    with pytest.raises(AppError, match="choose one of a, b"):
        parse_option(rule, "c")
    with gr.Blocks():
        slider = option_widget(strength, 0.5)
        dropdown = option_widget(rule, "a")
        checkbox = option_widget(specs["flag"], True)
    assert isinstance(slider, gr.Slider) and (slider.minimum, slider.maximum) == (0.0, 1.0)
    assert isinstance(dropdown, gr.Dropdown) and isinstance(checkbox, gr.Checkbox) and checkbox.value is True


def test_mask_picture_is_patch_mask_pooled(tmp_path, monkeypatch):
    """The picture is ``Patch.mask`` max-pooled (here a stand-in patch over a real plan: 967 tokens,
    2 tokens per pixel), and sequences above the limit are not drawn."""
    import torch
    from PIL import Image

    import fastdit
    from fastdit.app import AppError, draw_patch_mask, pooled_mask

    layout = fastdit.TokenLayout((4, 12, 20), text_len=7, text_position="suffix")
    method = fastdit.methods.get_method("sta")
    plan = method(method.resolve(method.make_config(tile=(2, 3, 4), window=(1, 1, 3)), "generic")).prepare(layout, 2, "cpu")
    calls = []

    class StandIn:  # the public Patch API that the app uses
        layers = ["blocks.0.attn1"]

        def layer_index(self, layer):
            return layer % 1

        def last_layout(self, layer):
            return layout

        def last_plan(self, layer):
            return plan

        def mask(self, layer, head=0):
            calls.append(head)
            return plan.token_mask(head)

    path, caption = draw_patch_mask(StandIn(), -1, 1, str(tmp_path / "m.png"))
    assert calls == [1] and "2x2 tokens per pixel" in caption and "video | text" in caption
    expected, factor = pooled_mask(plan.token_mask(1))
    assert factor == 2 and expected.shape == (484, 484)
    with Image.open(path) as image:
        pixels = np.asarray(image.convert("RGB"))
    assert pixels.shape == (484, 484, 3)  # one pixel per cell
    dark = (pixels == (49, 70, 160)).all(-1)  # attended
    light = (pixels == (240, 243, 250)).all(-1)
    lines = ~dark & ~light  # frame starts (grey) and the video | text boundary (orange)
    assert 0 < lines.mean() < 0.05 and (dark == expected)[~lines].all()
    mask = torch.zeros(1500, 1500, dtype=torch.bool)
    mask[:10, :10] = True
    pooled, factor = pooled_mask(mask)
    assert factor == 3 and pooled.shape == (500, 500) and pooled[:4, :4].all() and not pooled[4:, 4:].any()
    monkeypatch.setenv("FASTDIT_APP_MASK_TOKENS", "900")
    with pytest.raises(AppError, match="not drawn"):
        draw_patch_mask(StandIn(), 0, 0, str(tmp_path / "big.png"))


def test_package_layout():
    """Small modules, gradio only in the UI, no CLI import, no other module's private names."""
    for path in APP_DIR.glob("*.py"):
        source = path.read_text()
        assert len(source.splitlines()) <= 500, path
        tree = ast.parse(source)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + ([node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                assert not any(n == "fastdit.cli" or n.startswith("fastdit.cli.") for n in names), path
                if path.name != "ui.py":
                    assert "gradio" not in names, path
                if isinstance(node, ast.ImportFrom):
                    assert not [a.name for a in node.names if a.name.startswith("_")], (path, node.lineno)
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                assert isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"), (path, node.attr, node.lineno)
    code = ("import sys, fastdit.app, fastdit.app.service, fastdit.app.views; "
            "assert 'gradio' not in sys.modules; print(sorted(fastdit.app.__all__))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_cli_subcommand_parses():
    import argparse

    from fastdit.app import add_app_parser, cmd_app

    parser = argparse.ArgumentParser(prog="fastdit")
    add_app_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["app", "--host", "0.0.0.0", "--port", "7861", "--model", "tiny-wan", "--max-tokens", "4096",
                              "--concurrency", "2"])
    assert args.func is cmd_app and args.port == 7861 and args.host == "0.0.0.0" and not args.share
    assert args.max_tokens == 4096 and args.concurrency == 2
