"""What the app tests share: the repository root off ``sys.path``, a free port, launching a page,
and the check that a run left its model unpatched.

The repository's ``kernels/`` is installed as ``fastdit.kernels``; with the repository root on
sys.path (``python -m pytest`` from it) it would also be importable as a top-level ``kernels``,
which transformers takes for Hugging Face's ``kernels`` library and imports from the app's worker
thread, registering fastdit's custom ops a second time and breaking them (see app.py). Every app
test module calls ``drop_repository_root_from_sys_path()`` before it imports gradio or fastdit.
"""
import os
import socket
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = Path(__file__).parent / "artifacts"


def drop_repository_root_from_sys_path():
    sys.path[:] = [p for p in sys.path if Path(p or os.curdir).resolve() != ROOT]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(demo, **kwargs):
    """Launch ``demo`` on a free localhost port without blocking; returns its URL."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # an unknown hub id must fail fast, not try the network
    port = free_port()
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True, **kwargs)
    return f"http://127.0.0.1:{port}/"


def assert_unpatched(runner, free=False):
    """No cached pipeline is left patched (and, with ``free``, none is left locked by a run)."""
    import fastdit

    for entry in runner.pipes.entries():
        if free:
            assert not entry.lock.locked()
        fastdit.patch(entry.pipe, "dense").remove()  # AlreadyPatchedError if a run left its patch
