"""The app's page in headless Chromium (Debian's ``chromium``: CI installs it; without it these tests
skip): the page renders, and its first screen at 1280 x 800 holds what a user needs.

Positions come from the page itself: the app is launched with a script (``launch(js=...)``, run on
page load) that writes the bounding boxes of the elements named below onto ``<body>`` as JSON, and
Chromium's ``--dump-dom`` (after the page's scripts have run, ``--virtual-time-budget``) returns
the document with that attribute.
"""
import json
import re
import shutil
import subprocess
import tempfile

import pytest
from app_harness import ARTIFACTS, drop_repository_root_from_sys_path, launch

drop_repository_root_from_sys_path()  # before gradio and fastdit (see tests/app_harness.py)

gr = pytest.importorskip("gradio", reason="the app needs gradio (pip install 'fastdit[app]')")

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (CI: apt-get install -y chromium)")

WIDTH, HEIGHT = 1280, 800
ELEMENTS = ["fd-compare", "fd-prompt", "fd-method", "fd-dense-video", "fd-method-video", "fd-metrics", "fd-calibration",
            "fd-advanced", "fd-opt-sta_window", "fd-opt-sta_dense_steps", "fd-opt-sta_strategy",
            "fd-opt-sta_skip_threshold", "fd-opt-sta_correction", "fd-opt-sta_refresh_every",
            "fd-opt-sta_layer_settings"]

# With ``?open-advanced`` in the URL the script first opens the "Advanced" group, then measures;
# ``upload`` lists the boxes of the plan input's upload prompt ("Drop File Here - or - Click to Upload").
MEASURE = """() => {
  const box = (e) => { if (!e) return null; const r = e.getBoundingClientRect();
                       return {top: r.top, bottom: r.bottom, left: r.left, right: r.right, height: r.height}; };
  const ids = %s;
  const measure = () => {
    if (!document.getElementById('fd-compare')) { setTimeout(measure, 100); return; }
    const plan = document.getElementById('fd-calibration');
    const upload = plan ? [...plan.querySelectorAll('[data-testid="upload-text"]')].map(box) : [];
    const found = Object.fromEntries(ids.map((id) => [id, box(document.getElementById(id))]));
    document.body.setAttribute('data-fd-layout', JSON.stringify(
        {viewport: [window.innerWidth, window.innerHeight], scrollY: window.scrollY, boxes: found, upload: upload}));
  };
  const start = () => {
    if (!document.getElementById('fd-advanced')) { setTimeout(start, 100); return; }
    if (window.location.search.includes('open-advanced')) {
      const header = document.querySelector('#fd-advanced button, #fd-advanced .label-wrap');
      if (header) header.click();
    }
    setTimeout(measure, 1500);
  };
  setTimeout(start, 500);
}""" % json.dumps(ELEMENTS)

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--hide-scrollbars", "--virtual-time-budget=25000"]
#: Window height that gives a HEIGHT-pixel viewport: headless Chromium's --dump-dom keeps room for
#: browser chrome inside --window-size (measured once, on the first page load).
WINDOW_HEIGHT = [HEIGHT]


@pytest.fixture(scope="module")
def page():
    from fastdit.app import build_app

    demo = build_app("tiny-wan")
    demo.queue(default_concurrency_limit=1)
    yield launch(demo, js=MEASURE)
    demo.close()


def chromium(*args, window_height=HEIGHT):
    with tempfile.TemporaryDirectory() as profile:
        run = subprocess.run([CHROMIUM, *FLAGS, f"--window-size={WIDTH},{window_height}", f"--user-data-dir={profile}",
                              *args], capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout


def layout(url):
    """The page's HTML and the measuring script's record, in a WIDTH x HEIGHT viewport."""
    for _ in range(2):
        html = chromium("--dump-dom", url, window_height=WINDOW_HEIGHT[0])
        found = re.search(r'data-fd-layout="([^"]*)"', html)
        assert found, "the page's measuring script wrote no layout (did the page load?)"
        record = json.loads(found.group(1).replace("&quot;", '"').replace("&amp;", "&"))
        if record["viewport"][1] == HEIGHT:
            break
        WINDOW_HEIGHT[0] += HEIGHT - record["viewport"][1]
    return html, record


def visible(box):
    return box is not None and box["height"] > 0


def test_page_renders_with_its_parts(page):
    html, _ = layout(page)
    for element in ("fd-prompt", "fd-method", "fd-compare", "fd-dense-video", "fd-method-video", "fd-metrics",
                    "fd-seed"):
        assert f'id="{element}"' in html, f"{element} missing from the rendered page"
    assert "Compare" in html and "fastdit" in html
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "app_screenshot.png"
    chromium(f"--screenshot={shot}", page)
    assert shot.is_file() and shot.stat().st_size > 10_000


def test_first_screen_at_1280x800_holds_compare_and_the_results(page):
    """Compare, the prompt and the two result videos are inside the first 1280 x 800 screen without
    scrolling; the method's everyday options are shown, the expert ones are in the collapsed group."""
    _, found = layout(page)
    width, height = found["viewport"]
    assert (width, height) == (WIDTH, HEIGHT) and found["scrollY"] == 0, found["viewport"]
    boxes = found["boxes"]
    for element in ("fd-compare", "fd-prompt", "fd-method"):
        box = boxes[element]
        assert visible(box) and 0 <= box["top"] and box["bottom"] <= height, (element, box)
        assert 0 <= box["left"] and box["right"] <= width, (element, box)
    for element in ("fd-dense-video", "fd-method-video"):  # the results start on the first screen
        assert visible(boxes[element]) and boxes[element]["top"] < height - 150, (element, boxes[element])
    for everyday in ("fd-opt-sta_window", "fd-opt-sta_dense_steps"):
        assert visible(boxes[everyday]), everyday
    assert visible(boxes["fd-advanced"])
    for expert in ("fd-opt-sta_strategy", "fd-opt-sta_skip_threshold", "fd-opt-sta_correction",
                   "fd-opt-sta_refresh_every", "fd-opt-sta_layer_settings", "fd-calibration"):
        assert not visible(boxes[expert]), f"{expert} shows although the Advanced group is closed"


def test_advanced_group_opens_with_the_expert_options_and_an_unclipped_plan_upload(page):
    _, found = layout(page + "?open-advanced=1")
    boxes = found["boxes"]
    for expert in ("fd-opt-sta_strategy", "fd-opt-sta_skip_threshold", "fd-opt-sta_correction", "fd-calibration"):
        assert visible(boxes[expert]), f"{expert} is not shown in the opened Advanced group"
    plan = boxes["fd-calibration"]
    assert found["upload"], "the plan input shows no upload prompt"
    for text in found["upload"]:  # "Click to Upload" lies wholly inside the plan input's box
        if text["height"] > 0:
            assert plan["top"] <= text["top"] and text["bottom"] <= plan["bottom"], (text, plan)
