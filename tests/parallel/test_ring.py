"""Ring attention and Ulysses x ring (USP) with the block-sparse methods.

Without processes: a plan cut into (query shard, key shard) parts (``shard_part``) and merged over
the ring steps (``ring_attend``) equals the whole plan (``run_plan``) and a float64 masked softmax
built from the plan's token mask, for one-order plans (sta, radial), per-head orders (svg) and
variable-size cluster blocks (svg2), text
prefix / suffix, a key mask, 2 and 4 shards, and key shards without a kept block are skipped.
With 2 and 4 gloo processes: tiny Wan (video only), Flux (text prefix) and Qwen-Image (text prefix
with padding: a key mask) under ring 2, ring 4 and ulysses 2 x ring 2 equal the single-process
output within 1e-5, with no fallback and skipped steps counted; methods that do not run under ring
refuse with one message, at patch time or at the first call.
"""
import numpy as np
import pytest
import torch

from fastdit.layout import TokenLayout
from fastdit.methods import get_method
from fastdit.methods.parallel import ring_attend, ring_shards
from fastdit.plan import run_plan

from cp_worker import run, run_parallel
from test_context_parallel import applicable, method_options

RING = ("sta", "radial", "sparge", "svg", "svg2")


def ring_options(method, family):
    """Options that make the plans really sparse on the tiny models (radial's 64-token blocks cannot
    be on 96 tokens: its sparse parts are checked by ``test_ring_parts_merge_to_the_whole_plan``)."""
    sparse = {"sparge": dict(tile=(1, 2, 2), cdf=0.5), "svg": dict(block_size=16, density=0.25)}
    return {**method_options(method, family), **sparse.get(method, {})}


def _reference(q, k, v, plan, key_mask):
    """float64 softmax over the plan's token mask (each head) and the key mask."""
    b, h, s, d = q.shape
    mask = torch.stack([plan.token_mask(head) for head in range(h)])[None]
    if key_mask is not None:
        mask = mask & key_mask[:, None, None, :]
    scores = (q.double() @ k.double().transpose(-1, -2)) / d ** 0.5
    weights = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1).nan_to_num(0.0)
    return weights @ v.double()


def _plan(method, layout, heads, q, k, v, key_mask):
    from fastdit.context import AttentionContext

    cls = get_method(method)
    options = {"sta": dict(tile=(1, 2, 2), window=[(1, 1, 1), (3, 1, 3), (1, 3, 3)]), "radial": dict(block_size=64),
               "svg": dict(block_size=16, density=0.25),
               "svg2": dict(q_clusters=6, k_clusters=10, top_p=0.3, init_iters=4)}[method]
    instance = cls(cls.resolve(cls.make_config(**options, dense_steps=0, dense_layers=0)))
    ctx = AttentionContext(layer=0, layer_name="x", step=0, num_steps=1, branch=0, layout=layout, call=None,
                           key_mask=key_mask, num_heads=heads, total_heads=heads)
    ctx.info["values"] = v
    return instance.select(ctx, q, k)


@pytest.mark.parametrize("method,layout,ring,ulysses", [
    ("sta", TokenLayout((4, 4, 6)), 4, 1), ("sta", TokenLayout((2, 4, 6), 8, "prefix"), 2, 2),
    ("radial", TokenLayout((16, 4, 8), 8, "suffix"), 2, 1), ("svg", TokenLayout((4, 4, 8)), 2, 1),
    ("svg", TokenLayout((4, 4, 8), 4, "prefix"), 4, 1), ("svg2", TokenLayout((4, 4, 6)), 4, 1),
    ("svg2", TokenLayout((2, 4, 6), 8, "suffix"), 2, 2)])
def test_ring_parts_merge_to_the_whole_plan(method, layout, ring, ulysses):
    torch.manual_seed(len(method) + ring)
    heads, seq = 3, layout.seq_len
    q, k, v = (torch.randn(1, heads, seq, 8) for _ in range(3))
    key_mask = torch.rand(1, seq) > 0.2 if layout.text_len else None
    plan = _plan(method, layout, heads, q, k, v, key_mask)
    assert plan.density < 0.7
    whole = run_plan(q, k, v, plan, key_mask=key_mask)
    shard, position = ring_shards(layout, ring, ulysses)
    local = seq // ring
    order = shard * local + position  # call position of each model token
    call = [torch.empty_like(t).index_copy_(2, order, t) for t in (q, k, v)]
    mask_call = None if key_mask is None else torch.empty_like(key_mask).index_copy_(1, order, key_mask)
    outs, skipped = [], 0
    for rank in range(ring):
        def key_shard(s):
            part = slice(s * local, (s + 1) * local)
            return call[1][:, :, part], call[2][:, :, part], None if mask_call is None else mask_call[:, part]

        out, lse, steps, skips, pairs = ring_attend(plan, call[0][:, :, rank * local:(rank + 1) * local], key_shard,
                                                    shard, position, rank, ring)
        assert steps + skips == ring and pairs > 0
        outs.append(out)
        skipped += skips
    merged = torch.cat(outs, 2).index_select(2, order)
    assert torch.isfinite(merged).all()
    assert (merged - whole.float()).abs().max() <= 1e-5
    assert (merged.double() - _reference(q, k, v, plan, key_mask)).abs().max() <= 1e-5
    if method == "sta" and ring == 4:  # windows of one frame keep no block of the other frames' shards
        assert skipped > 0


def test_every_ring_method_equals_one_process_on_two_ranks():
    """Ring 2 on tiny Wan, Flux and Qwen-Image (padding mask): each supported method equals the
    single-process output; token methods refuse (patched before or after enabling)."""
    jobs, expected = [], {}
    for family, methods in (("wan", RING), ("flux", ("sparge",)), ("qwen", ("sta",))):
        for method in methods:
            if applicable(method, family):
                options = ring_options(method, family)
                jobs.append(((family, method), family, method, options, method != "radial", True))
                expected[family, method] = run(family, method, options)
    local = {"tile": (1, 2, 2), "window": (1, 3, 3), "dense_steps": 0}  # one frame: rank 1's keys are never needed
    jobs.append((("wan", "sta", "local"), "wan", "sta", local, True, True))
    expected["wan", "sta", "local"] = run("wan", "sta", local)
    for method, patch_first in (("todo", True), ("tome", False), ("prune", True)):
        jobs.append((("refused", method), "wan", method, method_options(method, "wan"), patch_first, True))
    jobs.append((("odd",), "wan_odd", "sta", method_options("sta", "wan"), True, True))  # 45 tokens, 2 ranks
    results = run_parallel(jobs, world=2)
    _check(results, expected)
    out, error = results["odd",]
    assert out is None and "ValueError" in error and "2 equal chunks" in error and "45 video tokens" in error, error
    for method in ("todo", "tome", "prune"):
        out, error = results["refused", method]
        assert out is None and "ring attention" in error and f"{method!r}" in error and "ulysses_degree" in error, error


def test_ring_four_and_ulysses_by_ring_equal_one_process():
    """Ring 4 on Wan; Ulysses 2 x ring 2 on Wan and on Qwen-Image / Flux with 8 text tokens (half of
    Qwen's padding, so two of the four text chunks are all padding)."""
    jobs, expected = [], {}
    for method in ("sta", "svg", "svg2"):
        options = ring_options(method, "wan")
        jobs.append((("wan", method, 4), "wan", method, options, True, (4, 1)))
        expected["wan", method, 4] = run("wan", method, options)
    for family, methods in (("wan", ("sparge",)), ("qwen", ("sta", "svg2")), ("flux", ("svg",))):
        for method in methods:
            if applicable(method, family):
                options = ring_options(method, family)
                jobs.append(((family, method, "usp"), family, method, options, True, (2, 2), 8))
                expected[family, method, "usp"] = run(family, method, options, text=8)
    _check(run_parallel(jobs, world=4), expected)


def _check(results, expected):
    for key, (reference, stats) in expected.items():
        out, detail = results[key]
        assert out is not None, f"{key}: {detail}"
        assert np.isfinite(out).all()
        diff = float(np.abs(out - reference.numpy()).max())
        assert diff <= 1e-5, (key, diff)
        assert detail["fallback_calls"] == 0 and detail["sparse_calls"] == stats["sparse_calls"], (key, detail, stats)
        assert detail["ring_steps"] > 0, (key, detail)
        if key[1] != "radial":
            assert detail["effective_density"] < 0.7 and stats["effective_density"] < 0.7, (key, detail, stats)
        if key[1:] == ("sta", "local"):  # every layer's call skips the other shard's keys
            assert detail["ring_skipped_steps"] == detail["ring_steps"] == detail["sparse_calls"], detail
            # rank 0 holds frames 0-1 (the first half of the tiles); one plan shared by the heads; 2 layers
            plan = get_method("sta")(tile=(1, 2, 2), window=(1, 3, 3)).prepare(TokenLayout((4, 4, 6)), 1, "cpu")
            assert detail["ring_block_pairs"] == 2 * int(plan.kv_counts[0, 0, :plan.kv_counts.shape[-1] // 2].sum())


def test_rank_work_of_a_static_plan_and_the_balancing_orders():
    """A band plan of one block per frame and per rank (4 ranks): rank r's block pairs are its
    block's key count (2 at the ends, 3 inside: max/mean 3 / 2.5); every order's shares are equal,
    and a block on two ranks is computed (in part) by both."""
    from fastdit.eval.ring_balance import main as bench_main
    from fastdit.methods.parallel.balance import ORDERS, imbalance, rank_block_pairs, zigzag_shards
    from fastdit.plan import BlockPlan

    layout = TokenLayout((4, 4, 8))
    band = torch.tensor([[0, 1, 0], [0, 1, 2], [1, 2, 3], [2, 3, 0]], dtype=torch.int32)
    plan = BlockPlan(band[None, None], torch.tensor([[[2, 3, 3, 2]]], dtype=torch.int32), 32, 32, 128)
    counts = plan.kv_counts[0, 0]
    work = rank_block_pairs(plan, layout, 4)
    assert work == counts.tolist() and imbalance(work) == 1.2
    assert rank_block_pairs(plan, layout, 4, "kernel") == work
    for order in ORDERS:
        pairs = rank_block_pairs(plan, layout, 2, order)
        assert sum(pairs) >= int(counts.sum())  # a block on two ranks is computed (in part) by both
    owner = zigzag_shards(layout, 4)
    assert torch.bincount(owner).tolist() == [32] * 4 and owner[:16].tolist() == [0] * 16
    assert owner[-16:].tolist() == [0] * 16  # rank 0 holds the first and the last chunk
    assert rank_block_pairs(plan, TokenLayout((1, 5, 7)), 2) is None
    assert bench_main(["--grid", "4,4,8", "--ranks", "2", "--methods", "sta"]) == 0


@pytest.mark.parametrize("command", ["compare", "eval"])
def test_cp_ring_without_a_launcher_is_a_clear_error(command, monkeypatch, capsys, tmp_path):
    from fastdit.cli import main

    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    prompts = tmp_path / "p.txt"
    prompts.write_text("a cat\n")
    extra = ["--prompts", str(prompts)] if command == "eval" else []
    with pytest.raises(SystemExit) as info:
        main([command, "--cp", "2", "--cp-ring", "2", "--out", str(tmp_path / "out"), *extra])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--cp 2 --cp-ring 2 needs a distributed launcher" in err and "torchrun --nproc_per_node 4" in err, err
    assert not (tmp_path / "out").exists()
