"""sta per (step bucket, layer, head) windows and the FastVideo mask-strategy import.

The reference here is FastVideo's rule written independently (its flex-attention reference mask):
per axis the kernel centre is ``clamp(q_tile, k // 2, n - 1 - k // 2)`` (torch's clamp: the upper
bound wins when the bounds cross) and key tiles within ``k // 2`` of it are attended; video
queries also see every text key, text queries see every key.
"""
import json
from types import SimpleNamespace

import pytest
import torch

import fastdit
from fastdit.layout import TokenLayout
from fastdit.methods.sta import SlidingTile, load_strategy

from helpers import sta_mask


def fastvideo_mask(grid, tile, window, text_len):
    """FastVideo's STA mask in model token order (video frame-major, then text), independent of fastdit."""
    t_, h_, w_ = grid
    n_tiles = [g // t for g, t in zip(grid, tile)]
    pos = torch.stack(torch.meshgrid(torch.arange(t_), torch.arange(h_), torch.arange(w_), indexing="ij"), -1).reshape(-1, 3)
    tiles = pos // torch.tensor(tile)
    ok = torch.ones(len(pos), len(pos), dtype=torch.bool)
    for axis in range(3):
        k, n = window[axis], n_tiles[axis]
        centre = torch.clamp(tiles[:, axis], min=k // 2).clamp(max=n - 1 - k // 2)
        ok &= (centre[:, None] - tiles[None, :, axis]).abs() <= k // 2
    video = len(pos)
    seq = video + text_len
    mask = torch.zeros(seq, seq, dtype=torch.bool)
    mask[:video, :video] = ok
    mask[:video, video:] = True
    mask[video:, :] = True
    return mask


def fastdit_mask(method, layout, step, layer, heads, head):
    windows = method.window_list(step, layer, heads)
    plan = method.windows_plan(layout, windows, "cpu")
    if plan is None:
        return torch.ones(layout.seq_len, layout.seq_len, dtype=torch.bool)
    return plan.token_mask(head)


GRID, TILE, TEXT = (10, 4, 6), (2, 2, 2), 3  # tile grid 5 x 2 x 3


def write_strategy(tmp_path, entries, name="mask_strategy_test.json"):
    path = tmp_path / name
    path.write_text(json.dumps(entries))
    return path


def test_import_reproduces_fastvideo_rule_with_grid(tmp_path):
    # whole-axis entries (5, 2, 3 = the axis lengths, even or odd), an even entry below the axis (2 of 5 tiles:
    # FastVideo attends 3) and plain odd windows; two steps x two layers x two heads
    windows = {"0_0_0": [5, 2, 3], "0_0_1": [1, 1, 1], "0_1_0": [2, 1, 3], "0_1_1": [4, 2, 1],
               "1_0_0": [3, 1, 1], "1_0_1": [5, 2, 3], "1_1_0": [1, 2, 1], "1_1_1": [3, 1, 3]}
    plan = load_strategy(write_strategy(tmp_path, windows), grid=GRID, tile=TILE)
    assert plan["version"] == 2 and plan["method"] == "sta" and plan["step_buckets"] == [0, 1]
    method = SlidingTile(**{k: tuple(v) if isinstance(v, list) else v for k, v in plan["options"].items()},
                         strategy={k: tuple(v) for k, v in plan["strategy"].items()})
    layout = TokenLayout(GRID, TEXT, "suffix")
    for key, window in windows.items():
        step, layer, head = map(int, key.split("_"))
        expected = fastvideo_mask(GRID, TILE, window, TEXT)
        assert torch.equal(fastdit_mask(method, layout, step, layer, 2, head), expected), key
    # the last bucket covers every later step
    assert torch.equal(fastdit_mask(method, layout, 7, 1, 2, 0), fastvideo_mask(GRID, TILE, [1, 2, 1], TEXT))


def test_import_without_grid_even_entries_are_the_whole_axis(tmp_path):
    # as in FastVideo's published files: the even entries are the axis lengths (2 tiles of h here)
    windows = {"0_0_0": [5, 2, 3], "0_0_1": [3, 2, 1], "0_1_0": [1, 1, 1], "0_1_1": [5, 2, 1]}
    plan = load_strategy(write_strategy(tmp_path, windows), tile=TILE)
    assert plan["model"]["grids"] == [] and plan["strategy"]["0_0_0"] == [5, 0, 3]
    method = SlidingTile(tile=TILE, strategy={k: tuple(v) for k, v in plan["strategy"].items()}, dense_steps=0)
    layout = TokenLayout(GRID, TEXT, "suffix")
    for key, window in windows.items():
        _, layer, head = map(int, key.split("_"))
        assert torch.equal(fastdit_mask(method, layout, 0, layer, 2, head), fastvideo_mask(GRID, TILE, window, TEXT))
    # every head of layer 0 is dense-equivalent? no: head 1 is not, so layer 0 has a plan; a layer whose heads
    # all cover the grid runs the model's own attention (no plan)
    dense = SlidingTile(tile=TILE, strategy={"0_0_0": (0, 0, 0), "0_0_1": (5, 0, 3)})
    assert dense.windows_plan(layout, dense.window_list(0, 0, 2), "cpu") is None


def test_consecutive_equal_steps_share_a_bucket(tmp_path):
    entries = {}
    for step in range(6):
        window = [5, 2, 3] if step < 3 else ([1, 1, 1] if step < 5 else [3, 1, 1])
        for head in range(2):
            entries[f"{step}_0_{head}"] = window
    plan = load_strategy(write_strategy(tmp_path, entries), grid=GRID, tile=TILE)
    assert plan["step_buckets"] == [0, 3, 5]
    method = SlidingTile(tile=TILE, strategy=plan["strategy"])
    assert method.window_list(2, 0, 2) == ((0, 0, 0), (0, 0, 0))
    assert method.window_list(4, 0, 2) == ((1, 1, 1), (1, 1, 1))
    assert method.window_list(40, 0, 2) == ((3, 1, 1), (3, 1, 1))


@pytest.mark.parametrize("content, needle", [
    ('{"0_0": [1, 1, 1]}', "'0_0'"),
    ('{"a_b_c": [1, 1, 1]}', "'a_b_c'"),
    ('{"0_0_0": [1, 1]}', "'0_0_0'"),
    ('{"0_0_-1": [1, 1, 1]}', "'0_0_-1'"),
    ('{"0_0_0": [1, 1, 1], ', "not a valid JSON"),
    ('[1, 2]', "non-empty JSON object"),
])
def test_bad_strategy_files_name_the_file_and_entry(tmp_path, content, needle):
    path = tmp_path / "mask_strategy_bad.json"
    path.write_text(content)
    with pytest.raises(ValueError) as error:
        load_strategy(path)
    assert str(path) in str(error.value) and needle in str(error.value)


def test_strategy_option_validation():
    with pytest.raises(ValueError, match="'0_0_0'.*odd"):
        SlidingTile(strategy={"0_0_0": (2, 1, 1)})
    with pytest.raises(ValueError, match="'x'"):
        SlidingTile(strategy={"x": (1, 1, 1)})
    with pytest.raises(ValueError, match="strategy must be a dict"):
        SlidingTile(strategy=[(1, 1, 1)])
    method = SlidingTile(strategy={"0_0_3": (1, 1, 1)})
    with pytest.raises(ValueError, match="'0_0_3'.*2 heads"):
        method.check_heads(2)
    # tuple keys and list windows are accepted and normalized
    assert SlidingTile(strategy={(1, 0, 0): [3, 1, 1]}).config.strategy == {"1_0_0": (3, 1, 1)}


def test_context_parallel_heads_use_global_head_index():
    layout = TokenLayout(GRID)
    method = SlidingTile(tile=TILE, strategy={"0_0_0": (1, 1, 1), "0_0_1": (3, 1, 1), "0_0_2": (1, 1, 1)})
    q = torch.zeros(1, 1, layout.seq_len, 8)
    for offset in range(3):
        ctx = SimpleNamespace(step=0, layer=0, head_offset=offset, num_heads=1, total_heads=3, layout=layout)
        plan = method.select(ctx, q, q)
        window = method.config.strategy[f"0_0_{offset}"]
        assert torch.equal(plan.token_mask(0), fastvideo_mask(GRID, TILE, window, 0)), offset


def test_per_head_strategy_output_matches_float64_reference():
    torch.manual_seed(7)
    grid, tile, text = (5, 3, 4), (2, 2, 2), 2  # odd grid: tiles overhang (padding slots)
    layout = TokenLayout(grid, text, "prefix")
    strategy = {"0_1_0": (1, 1, 1), "0_1_1": (3, 0, 1), "0_1_2": (0, 0, 0)}
    q, k, v = (torch.randn(2, 3, layout.seq_len, 16) for _ in range(3))
    out = fastdit.attention(q, k, v, "sta", layout=layout, layer=1, tile=tile, strategy=strategy, dense_steps=0)
    method = SlidingTile(tile=tile, strategy=strategy)
    for head in range(3):
        mask = fastdit_mask(method, layout, 0, 1, 3, head)
        window = strategy[f"0_1_{head}"]
        ok = sta_mask(grid, tile, window)  # independent: tile coordinates in model order, clamped windows
        reference_mask = torch.ones(layout.seq_len, layout.seq_len, dtype=torch.bool)
        reference_mask[text:, text:] = ok
        assert torch.equal(mask, reference_mask), head
        if head < 2:
            assert not reference_mask.all()  # really sparse
        scores = (q[:, head].double() @ k[:, head].double().transpose(-1, -2)) / 4.0
        expected = torch.softmax(scores.masked_fill(~reference_mask, float("-inf")), -1) @ v[:, head].double()
        assert torch.allclose(out[:, head].double(), expected, atol=2e-5), head
    assert not torch.isnan(out).any()
