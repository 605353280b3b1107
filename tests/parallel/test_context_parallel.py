"""fastdit under diffusers' context parallelism: two gloo processes on the CPU.

Ulysses: every method gives the single-process output (max abs diff <= 1e-5 in fp32), with
per-head settings (which index the layer's global heads), patched before or after
``enable_parallelism``, for a video-only model (Wan) and joint attention with a text prefix
(Flux), and with a padding key mask (Qwen-Image, whose last text shard is all padding). Ring
attention and Ulysses x ring: tests/parallel/test_ring.py. HunyuanVideo (text suffix) has no
context-parallel plan in diffusers 0.42 (``enable_parallelism`` refuses it); the suffix order is
checked by ``test_shard_order_matches_the_chunked_sequences``.
"""
import numpy as np
import pytest
import torch

import fastdit
from fastdit.layout import TokenLayout
from fastdit.methods import get_method
from fastdit.layout import shard_order

from cp_worker import HEADS, run, run_parallel

#: Per-head windows differ between the heads each rank gets (0, 1 on rank 0; 2, 3 on rank 1).
STA = {"wan": dict(tile=(1, 2, 2), window=[(1, 1, 1), (3, 1, 3), (3, 3, 3), (1, 3, 1)]),
       "flux": dict(tile=(1, 2, 2), window=[(1, 1, 1), (1, 1, 3), (1, 3, 3), (1, 3, 1)]),
       "qwen": dict(tile=(1, 1, 2), window=[(1, 1, 1), (1, 1, 3), (1, 3, 3), (1, 3, 1)])}


def method_options(method, family):
    if method == "sta":
        return {"dense_steps": 0, **STA[family]}
    cls = get_method(method)
    fields = cls.config_cls.__dataclass_fields__
    # guard off on both sides: the worker processes do not see tests/conftest.py's default (the
    # guard's own Ulysses equivalence is tests/methods/test_guard.py's)
    options = {**cls.tiny_options, "dense_steps": 0, "dense_layers": 0, "guard": False}
    if method == "radial":
        options["block_size"] = 64
    return {k: v for k, v in options.items() if k in fields}


def applicable(method, family):
    from fastdit.pipelines import find_adapter
    from cp_worker import build

    cls = get_method(method)
    adapter = find_adapter(build(family))
    try:
        cls.check_family(adapter, cls.resolve(cls.make_config(**method_options(method, family)), adapter))
    except ValueError:
        return False
    return True


def _explicit_shards(layout, shards):
    """Each rank's local sequence as diffusers builds it (every stream cut into equal chunks, the
    rank's chunks joined in model order), concatenated over ranks: model token at each position."""
    video = torch.arange(layout.video_start, layout.video_start + layout.video_len).chunk(shards)
    text = layout.text_positions().chunk(shards) if layout.text_len else [torch.empty(0, dtype=torch.long)] * shards
    parts = []
    for r in range(shards):
        parts += [text[r], video[r]] if layout.text_position == "prefix" else [video[r], text[r]]
    return torch.cat(parts)


@pytest.mark.parametrize("layout", [TokenLayout((4, 4, 6)), TokenLayout((1, 6, 8), 8, "prefix"),
                                    TokenLayout((3, 4, 6), 8, "suffix")])
@pytest.mark.parametrize("shards", [2, 4])
def test_shard_order_matches_the_chunked_sequences(layout, shards):
    sequence = _explicit_shards(layout, shards)  # position -> model token
    order = shard_order(layout, shards)  # model token -> position
    assert torch.equal(sequence[order], torch.arange(layout.seq_len))


def test_shard_order_refuses_uneven_streams():
    assert shard_order(TokenLayout((1, 5, 7)), 2) is None
    assert shard_order(TokenLayout((1, 4, 6), 5, "prefix"), 2) is None


def test_every_method_under_ulysses_equals_one_process():
    jobs, expected = [], {}
    for family in ("wan", "flux", "qwen"):
        for method in fastdit.method_names():
            if not applicable(method, family):
                continue
            options = method_options(method, family)
            for patch_first in ((True, False) if method == "sta" else (True,)):
                key = (family, method, patch_first)
                jobs.append((key, family, method, options, patch_first, False))
                expected[key] = run(family, method, options)
    results = run_parallel(jobs)

    for key, (reference, stats) in expected.items():
        out, detail = results[key]
        assert out is not None, f"{key}: {detail}"
        assert np.isfinite(out).all()
        diff = float(np.abs(out - reference.numpy()).max())
        assert diff <= 1e-5, (key, diff)
        # Each rank's patch ran the method on its own heads: no fallback, nothing dense that is not dense alone.
        assert detail["fallback_calls"] == 0, (key, detail["fallbacks"])
        assert detail["sparse_calls"] == stats["sparse_calls"], (key, detail, stats)
    # The per-head windows really are sparse and differ across heads (rank 0 holds the sparser ones).
    assert expected[("wan", "sta", True)][1]["effective_density"] < 0.5
    assert results[("wan", "sta", True)][1]["effective_density"] < expected[("wan", "sta", True)][1]["effective_density"]


def test_heads_per_rank_come_from_the_global_head_index():
    """A per-head window list is checked against the layer's global head count, not a rank's."""
    with pytest.raises(ValueError, match=f"{HEADS} heads"):
        from cp_worker import build
        fastdit.patch(build("wan"), "sta", window=[(1, 1, 1)] * (HEADS // 2), tile=(1, 2, 2))


@pytest.mark.parametrize("command", ["compare", "eval"])
def test_cp_without_a_launcher_is_a_clear_error(command, monkeypatch, capsys, tmp_path):
    from fastdit.cli import main

    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    prompts = tmp_path / "p.txt"
    prompts.write_text("a cat\n")
    extra = ["--prompts", str(prompts)] if command == "eval" else []
    with pytest.raises(SystemExit) as info:
        main([command, "--cp", "2", "--out", str(tmp_path / "out"), *extra])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--cp" in err and "torchrun --nproc_per_node 2" in err and command in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flag", ["--cp", "--cp-ring"])
def test_compare_under_torchrun_writes_one_report(tmp_path, flag):
    """``torchrun --nproc_per_node 2 -m fastdit.cli compare --cp 2`` (Ulysses) or ``--cp-ring 2`` (ring)
    on the tiny model: one report by rank 0 with the mesh, latency of the slowest rank, the method ran
    on both ranks without fallbacks (under ring: skipping no step it needs, see tests/parallel/test_ring.py)."""
    import json
    import os
    import signal
    import subprocess
    import sys

    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    from cp_worker import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()), "-m",
           "fastdit.cli", "compare", "--model", "tiny-wan", flag, "2", "--steps", "2", "--frames", "5", "--height", "64", "--width", "96",
           "--methods", "dense,sta", "--set", "sta.tile=1,2,2", "--set", "sta.window=1,1,1", "--set", "sta.dense_steps=0", "--no-warmup",
           "--out", str(out)]
    # A new session, so that a hung worker is killed with the launcher (not left behind) on timeout.
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    done = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    degrees = (report["context_parallel"]["ulysses_degree"], report["context_parallel"]["ring_degree"])
    assert degrees == ((2, 1) if flag == "--cp" else (1, 2))
    mesh = f"data 1 x ring {degrees[1]} x ulysses {degrees[0]} (2 processes)"
    assert report["context_parallel"]["mesh"] == mesh and done.stdout.count(f"context parallel mesh: {mesh}") == 1
    rows = {row["method"]: row for row in report["runs"]}
    assert rows["sta"]["fallback_calls"] == 0 and rows["sta"]["density"] < 1.0
    assert rows["sta"]["psnr_db"] is not None and rows["sta"]["latency_s"] > 0
    assert done.stdout.count("method  latency") == 1  # the table is printed once, by rank 0
