"""Test helpers that several test files share (independent references, seeded inputs, the CLI tests' error
check, the check that a removed patch left nothing behind)."""
import importlib.util
import math
from pathlib import Path

import torch


def seeded_qkv(batch, heads, seq, dim, seed=0):
    """``(q, k, v)``: standard normal ``(batch, heads, seq, dim)`` tensors from one seeded generator."""
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(batch, heads, seq, dim, generator=g) for _ in range(3))


def randn_qkv(layout, batch=2, heads=3, dim=16, seed=0):
    """``seeded_qkv`` for every token of ``layout`` (text included)."""
    return seeded_qkv(batch, heads, layout.seq_len, dim, seed)


def sta_mask(grid, tile, window):
    """Independent sliding-tile rule in model order (no text): per axis a window of w tiles (0: all)
    whose start is the query tile minus w // 2, clamped into the axis. ``(tokens, tokens)`` bool."""
    n_tiles = [math.ceil(g / t) for g, t in zip(grid, tile)]
    pos = torch.stack(torch.meshgrid(*(torch.arange(g) for g in grid), indexing="ij"), -1).reshape(-1, 3)
    tiles = pos // torch.tensor(tile)
    ok = torch.ones(len(pos), len(pos), dtype=torch.bool)
    for axis in range(3):
        w = n_tiles[axis] if window[axis] == 0 else min(window[axis], n_tiles[axis])
        start = (tiles[:, axis] - w // 2).clamp(0, n_tiles[axis] - w)
        ok &= (tiles[None, :, axis] >= start[:, None]) & (tiles[None, :, axis] < start[:, None] + w)
    return ok


def one_line_error(capsys, info, code=2):
    """The single stderr line of a CLI error that exited with ``code`` (and printed no traceback)."""
    assert info.value.code == code
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert "Traceback" not in captured.err + captured.out
    return lines[0]


def nothing_installed(model):
    """Nothing of a patch is left on ``model``: no instance forward, hook, patch record or attention backend."""
    for name, module in model.named_modules():
        assert "forward" not in module.__dict__, f"instance forward left on {name}"
        assert not module._forward_pre_hooks and not module._forward_hooks, f"hook left on {name}"
        assert "_fastdit_patch" not in module.__dict__
        processor = getattr(module, "processor", None)
        if processor is not None:
            assert "_attention_backend" not in processor.__dict__, f"backend left on {name}"


def record_train_calls(monkeypatch, read):
    """A list that fills with ``read(args)`` of every transformer call ``train_tiny`` makes (its ``build_pipeline``
    wrapped to hook each pipeline it builds; ``args`` the call's positional arguments)."""
    from fastdit.pipelines import train_tiny

    seen = []
    build = train_tiny.build_pipeline

    def recording_build(*args, **kwargs):
        pipe = build(*args, **kwargs)
        pipe.transformer.register_forward_pre_hook(lambda module, call_args: seen.append(read(call_args)))
        return pipe

    monkeypatch.setattr(train_tiny, "build_pipeline", recording_build)
    return seen


def record_train_timesteps(monkeypatch):
    """A list that fills with the timestep argument of every transformer call ``train_tiny`` makes."""
    return record_train_calls(monkeypatch, lambda args: args[1].clone())


def load_script(name):
    """The module of ``scripts/<name>.py`` (scripts are not a package), loaded from its file."""
    path = Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
