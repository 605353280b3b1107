"""The Gradio app, driven like a user would: launched in-process on a free localhost port and called
with ``gradio_client``; plus one headless-browser test of the page (Debian's ``chromium``).

Runs at the tiny test size (9 frames at 80x112, 2 steps: a 3 x 5 x 7 latent grid).
"""
import os
import shutil
import socket
import subprocess
import tempfile
import threading
from pathlib import Path

import numpy as np
import pytest

gr = pytest.importorskip("gradio", reason="the app needs gradio (pip install 'fastdit[app]')")
gradio_client = pytest.importorskip("gradio_client", reason="the app tests need gradio_client")

from fastdit.pipelines.tiny import TINY_TEST_DEFAULTS  # noqa: E402

ARTIFACTS = Path(__file__).parent / "artifacts"
TEST_SIZE = {k: TINY_TEST_DEFAULTS["wan"][k] for k in ("num_frames", "height", "width", "num_inference_steps")}
SMALL = dict(model="tiny-wan", frames=TEST_SIZE["num_frames"], height=TEST_SIZE["height"],
             width=TEST_SIZE["width"], steps=TEST_SIZE["num_inference_steps"], seed=0)
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def app():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # an unknown hub id must fail fast, not try the network
    from fastdit.app import build_app

    demo = build_app("tiny-wan")
    demo.queue(default_concurrency_limit=1)
    port = free_port()
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
    yield demo, f"http://127.0.0.1:{port}/"
    demo.close()


@pytest.fixture(scope="module")
def client(app):
    return gradio_client.Client(app[1], verbose=False)


def compare(client, **kwargs):
    return client.predict(**{**SMALL, **kwargs}, api_name="/compare")


def unpack(result):
    dense, method, _cards, mask, mask_caption, notes, table, _scatter, metrics = result
    path = lambda v: v["video"] if isinstance(v, dict) and "video" in v else (v["value"] if isinstance(v, dict) else v)  # noqa: E731
    return path(dense), path(method), mask, mask_caption, notes, table, metrics


def assert_h264_mp4(path, frames, height, width):
    import imageio.v3 as iio

    assert path and os.path.isfile(path) and path.endswith(".mp4"), path
    head = open(path, "rb").read()
    assert head[4:8] == b"ftyp", "not an mp4"
    assert b"avc1" in head, "not H.264 (no avc1 sample entry)"
    video = iio.imread(path, plugin="pyav") if _has_pyav() else np.stack(list(_ffmpeg_frames(path)))
    assert video.shape[0] == frames and video.shape[1:3] == (height, width), video.shape


def _has_pyav():
    try:
        import av  # noqa: F401
        return True
    except ImportError:
        return False


def _ffmpeg_frames(path):
    import imageio.v2 as imageio

    reader = imageio.get_reader(path, format="ffmpeg")
    try:
        yield from reader
    finally:
        reader.close()


def test_compare_returns_videos_numbers_and_mask(client):
    dense, method, mask, caption, _notes, table, metrics = unpack(compare(client, method="sta", mask_layer=1, mask_head=1))
    for path in (dense, method):
        assert_h264_mp4(path, SMALL["frames"], SMALL["height"], SMALL["width"])
    assert metrics["method"] == "sta" and metrics["size"] == "9x80x112" and metrics["steps"] == 2
    for key in ("dense_latency_s", "method_latency_s", "speedup", "ssim"):
        assert isinstance(metrics[key], float) and metrics[key] > 0, (key, metrics[key])
    assert metrics["psnr_db"] == "inf" or metrics["psnr_db"] > 20  # tiny test grid: the window covers it all
    assert abs(metrics["speedup"] - metrics["dense_latency_s"] / metrics["method_latency_s"]) < 1e-6
    assert metrics["options"]["tile"] == [4, 4, 8]  # the tiny preset
    from PIL import Image

    assert mask and os.path.isfile(mask)
    with Image.open(mask) as image:
        assert image.format == "PNG" and max(image.size) <= 512 and image.size[0] == image.size[1]
        assert image.size[0] >= 105  # 105 video tokens drawn at >= 1 px each
    assert "layer 1" in caption and "head 1" in caption
    assert table["headers"][:3] == ["#", "model", "method"] and len(table["data"]) >= 1


def test_method_options_and_session_table(client):
    # A fresh session: radial with its own options, then sta with a custom window; the table grows.
    fresh = gradio_client.Client(client.src, verbose=False)
    first = unpack(compare(fresh, method="radial", radial_decay="0.5", radial_dense_steps="0"))[-1]
    assert first["method"] == "radial" and first["options"]["decay"] == 0.5 and first["options"]["dense_steps"] == 0
    assert "dense run reused" in " ".join(first["notes"]) or first["dense_latency_s"] > 0
    _d, _m, _mask, _c, _n, table, second = unpack(compare(fresh, method="sta", sta_window="1,1,1", sta_dense_steps="0"))
    assert second["options"]["window"] == [1, 1, 1]
    assert second["density"] < 1.0  # a 1x1x1 window on a 3x5x7 grid with 4x4x8 tiles skips tile pairs
    assert [row[2] for row in table["data"]] == ["radial", "sta"]


def test_size_not_allowed_is_rounded_with_a_note(client):
    *_rest, notes, _table, metrics = unpack(compare(client, height=90, width=100, frames=10))
    assert metrics["size"] == "9x96x96", metrics["size"]
    assert "height 90 -> 96" in notes and "frames 10 -> 9" in notes


@pytest.mark.parametrize("bad, message", [
    (dict(model="tiny-nope"), "unknown tiny model"),
    (dict(model="./no/such/folder"), "no such folder"),
    (dict(height=2048, width=2048, frames=121), "video tokens"),
    (dict(height=100000), "too large"),
    (dict(method="sta", sta_window="2,2,2"), "odd"),
])
def test_bad_input_is_a_gradio_error_and_the_app_keeps_working(client, bad, message):
    with pytest.raises(gradio_client.exceptions.AppError, match=message):
        compare(client, **bad)
    # the next run works (and the pipeline is unpatched: dense equals a fresh dense run)
    metrics = unpack(compare(client, method="sta"))[-1]
    assert metrics["method"] == "sta" and metrics["speedup"] > 0


def test_runs_do_not_leak_patches_between_sessions(app):
    """Two clients with different methods at once: each gets its own method, the pipeline ends unpatched."""
    demo, url = app
    results, errors = {}, []

    def worker(method):
        try:
            results[method] = unpack(compare(gradio_client.Client(url, verbose=False), method=method,
                                             reuse_dense=False))[-1]
        except Exception as error:  # noqa: BLE001
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(m,)) for m in ("sta", "radial")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    assert results["sta"]["method"] == "sta" and "tile" in results["sta"]["options"]
    assert results["radial"]["method"] == "radial" and "decay" in results["radial"]["options"]
    import fastdit

    for entry in demo.runner.pipes._entries.values():
        assert not entry["lock"].locked()
        fastdit.patch(entry["pipe"], "dense").remove()  # AlreadyPatchedError if a run left its patch


def test_cancel_stops_the_run_and_releases_the_pipeline(app):
    """The step callback raises when Stop was pressed; the patch is removed and the lock released."""
    demo, _url = app
    from fastdit.app import RunCancelled

    runner = demo.runner
    cancel = threading.Event()
    seen = []

    def progress(fraction, desc=""):
        seen.append(desc)
        if "dense: step 1" in desc:
            cancel.set()  # as the Stop button does, mid-run

    with pytest.raises(RunCancelled):
        runner.compare("tiny-wan", "a fox", "", 5, 2, 5.0, 9, 80, 112, "sta", {}, reuse_dense=False,
                       progress=progress, cancel=cancel)
    assert any("dense: step 1/2" in d for d in seen), seen
    entry = next(iter(runner.pipes._entries.values()))
    assert not entry["lock"].locked()
    out = runner.compare("tiny-wan", "a fox", "", 5, 2, 5.0, 9, 80, 112, "sta", {}, reuse_dense=False)
    assert out["metrics"]["method"] == "sta"


def test_method_widgets_come_from_the_config_dataclasses():
    import fastdit
    from fastdit.app import option_specs, parse_option

    for method in fastdit.methods():
        names = [name for name, *_ in option_specs(method)]
        assert "dense_steps" in names
    kinds = {name: kind for name, kind, *_ in option_specs("sta")}
    assert kinds["tile"] == "triple" and kinds["dense_steps"] == "steps"
    assert parse_option("triple", "6, 8, 8", None) == (6, 8, 8)
    assert parse_option("triple", "1,3,3; 3,3,3", None) == [(1, 3, 3), (3, 3, 3)]
    assert parse_option("triple", "", None) is None
    assert parse_option("steps", 2.0, None) == 2 and parse_option("steps", 0.25, None) == 0.25
    assert parse_option("bool", "model default", None) is None and parse_option("bool", "off", None) is False


def test_mask_picture_pools_large_masks(tmp_path):
    import torch

    from fastdit.app import mask_picture, pooled_mask

    mask = torch.zeros(1500, 1500, dtype=torch.bool)
    mask[:10, :10] = True
    pooled, factor = pooled_mask(mask)
    assert factor == 3 and pooled.shape == (500, 500) and pooled[:4, :4].all() and not pooled[4:, 4:].any()
    path = mask_picture(pooled, factor, str(tmp_path / "m.png"), boundaries=[1000])
    from PIL import Image

    with Image.open(path) as image:
        assert image.size == (500, 500)


def test_pooled_plan_mask_matches_the_token_mask():
    import fastdit
    from fastdit.app import pooled_mask, pooled_plan_mask

    layout = fastdit.TokenLayout((4, 6, 10), text_len=7, text_position="suffix")
    method = fastdit.methods.get_method("sta")
    config = method.resolve(method.make_config(tile=(2, 3, 4), window=(1, 1, 3)), "generic")
    plan = method.plan(layout, config, 2, "cpu")
    for size in (512, 50):
        exact, factor = pooled_mask(plan.token_mask(1), size)
        fast, factor2 = pooled_plan_mask(plan, 1, size)
        assert factor == factor2 and (exact == fast).all()


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (CI: apt-get install -y chromium)")
def test_browser_renders_the_page(app):
    _demo, url = app
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "app_screenshot.png"
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--disable-dev-shm-usage", "--hide-scrollbars", "--window-size=1400,1000",
             "--virtual-time-budget=20000"]
    with tempfile.TemporaryDirectory() as profile:
        dom = subprocess.run([CHROMIUM, *flags, f"--user-data-dir={profile}", "--dump-dom", url],
                             capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    html = dom.stdout
    for element in ("fd-prompt", "fd-method", "fd-compare", "fd-dense-video", "fd-method-video", "fd-metrics"):
        assert f'id="{element}"' in html, f"{element} missing from the rendered page"
    assert "Compare" in html and "fastdit" in html
    with tempfile.TemporaryDirectory() as profile:
        run = subprocess.run([CHROMIUM, *flags, f"--user-data-dir={profile}", f"--screenshot={shot}", url],
                             capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and shot.is_file() and shot.stat().st_size > 10_000, run.stderr[-2000:]


def test_cli_subcommand_parses():
    import argparse

    from fastdit.app import add_app_parser, cmd_app

    parser = argparse.ArgumentParser(prog="fastdit")
    add_app_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["app", "--host", "0.0.0.0", "--port", "7861", "--model", "tiny-wan", "--max-tokens", "4096"])
    assert args.func is cmd_app and args.port == 7861 and args.host == "0.0.0.0" and not args.share
    assert args.max_tokens == 4096
