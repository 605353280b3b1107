"""Every ```python block of README.md and docs/*.md runs as printed.

The convention (shared with the docs' authors): a block is executed unless the line just before its
opening fence is ``<!-- no-test: REASON -->`` with a non-empty reason (e.g. it needs a real
pipeline, real weights or a GPU). ```bash and other blocks are not executed.

The blocks of one file run in order in one namespace, in a fresh temporary working directory: a
page may build on its earlier blocks (import once, define ``q, k, v`` once), as a reader running
them top to bottom would. A block that fails names its file and line.
"""
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
_MARKER = re.compile(r"^\s*<!--\s*no-test:(.*?)-->\s*$")


def code_blocks(text):
    """``[(line, language, code, skip reason or None)]`` of the fenced blocks in ``text``."""
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        indent, language = match.group(1), match.group(2)
        start = i
        body = []
        i += 1
        while i < len(lines) and not re.match(rf"^{re.escape(indent)}```\s*$", lines[i]):
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i].lstrip())
            i += 1
        marker = _MARKER.match(lines[start - 1]) if start > 0 else None
        blocks.append((start + 1, language, "\n".join(body) + "\n", None if marker is None else marker.group(1).strip()))
        i += 1
    return blocks


def test_code_blocks_are_found():
    blocks = code_blocks("text\n```python\nx = 1\n```\n<!-- no-test: needs a GPU -->\n```python\ny\n```\n"
                         "  ```bash\n  ls\n  ```\n")
    assert blocks == [(2, "python", "x = 1\n", None), (6, "python", "y\n", "needs a GPU"), (9, "bash", "ls\n", None)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_python_blocks_run_as_printed(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__docs__"}
    for line, language, code, reason in code_blocks(page.read_text(encoding="utf-8")):
        if language != "python":
            continue
        if reason is not None:
            assert reason, f"{page.name}:{line}: a no-test marker needs a reason"
            continue
        try:
            exec(compile(code, f"{page.name}:{line}", "exec"), namespace)
        except Exception as error:  # noqa: BLE001 - reported with the block's place
            raise AssertionError(f"{page.name}, the python block at line {line} fails: "
                                 f"{type(error).__name__}: {error}") from error
