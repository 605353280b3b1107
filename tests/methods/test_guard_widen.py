"""The guard's score widening (``fastdit/methods/guard/widen.py``): a failed block-sparse head gets
the key blocks its sampled rows' exact scores say it dropped, in its own plan's blocks."""
import math

import pytest
import torch

import fastdit
from fastdit.layout import TokenLayout
from fastdit.methods import base
from fastdit.methods.corrections import token_blocks
from fastdit.methods.guard.widen import block_rows, grown_lists, row_block_sums, widenable
from fastdit.plan import BlockPlan

pytestmark = pytest.mark.guard_defaults


def dense64(q, k, v, mask=None):
    """float64 attention of ``(B, H, S, D)``; ``mask`` ``(H, S, S)`` bool (True: computed) or None."""
    scores = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask[None], float("-inf"))
    return torch.softmax(scores, -1).nan_to_num(0.0) @ v.double(), torch.logsumexp(scores, -1)


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def reference_lists(indices, counts, mass, weighted, row_block, target_mass, target_error):
    """A plain float64 loop of the rule: per query block with rows, its kept blocks then the dropped
    ones by decreasing mean mass, the shortest prefix whose rows' relative error and mean mass meet
    the targets (every block of any mass when none does)."""
    mass, weighted = mass.double(), weighted.double()
    exact = weighted.sum(1)
    result = []
    for i in range(indices.shape[0]):
        kept = [int(j) for j in dict.fromkeys(indices[i, :int(counts[i])].tolist())]
        rows = [r for r in range(mass.shape[0]) if int(row_block[r]) == i]
        if not rows:
            result.append(sorted(kept))
            continue
        mean = mass[rows].mean(0)
        dropped = sorted((j for j in range(mass.shape[1]) if j not in kept), key=lambda j: -float(mean[j]))
        walk = kept + [j for j in dropped if float(mean[j]) > 0]
        chosen = walk
        for length in range(len(kept), len(walk) + 1):
            prefix = walk[:length]
            if not prefix:
                continue
            outs = weighted[rows][:, prefix].sum(1) / mass[rows][:, prefix].sum(1, keepdim=True).clamp(min=1e-30)
            error = float((outs - exact[rows]).norm() / exact[rows].norm())
            if error <= target_error and float(mass[rows][:, prefix].sum(1).mean()) >= target_mass:
                chosen = prefix
                break
        result.append(sorted(chosen))
    return result


def test_grown_lists_equal_a_loop():
    gen = torch.Generator().manual_seed(0)
    for trial in range(24):
        n_query_blocks, n_blocks, dim = 1 + trial % 5, 3 + trial % 9, 4
        n_rows = n_query_blocks + trial % 4
        row_block = torch.cat([torch.arange(n_query_blocks), torch.randint(0, n_query_blocks, (n_rows - n_query_blocks,),
                                                                            generator=gen)])
        if trial % 3 == 0 and n_query_blocks > 1:  # a query block without rows keeps its list
            row_block = row_block.clamp(max=n_query_blocks - 2)
        mass = torch.rand(n_rows, n_blocks, generator=gen) ** 4
        mass[:, int(torch.randint(0, n_blocks, (1,), generator=gen))] = 0.0  # a block of no mass
        mass = mass / mass.sum(1, keepdim=True)
        weighted = mass[..., None] * torch.randn(n_rows, n_blocks, dim, generator=gen)
        width = 1 + trial % n_blocks
        indices = torch.stack([torch.randperm(n_blocks, generator=gen)[:width] for _ in range(n_query_blocks)]).int()
        counts = torch.randint(1, width + 1, (n_query_blocks,), generator=gen).int()
        target_mass, target_error = [(0.0, 0.05), (0.9, 0.05), (0.5, 0.3), (0.99, 0.01)][trial % 4]
        got, got_counts = grown_lists(indices, counts, mass, weighted, row_block, target_mass, target_error)
        expected = reference_lists(indices, counts, mass, weighted, row_block, target_mass, target_error)
        assert [got[i, :int(got_counts[i])].tolist() for i in range(n_query_blocks)] == expected  # ascending ids


def test_row_block_sums_equal_a_float64_loop_on_a_permuted_plan():
    gen = torch.Generator().manual_seed(1)
    seq, dim, block = 50, 8, 8
    perm = torch.cat([torch.randperm(seq, generator=gen), torch.full((6,), -1)])  # padding slots at the end
    n_blocks = -(-perm.numel() // block)
    plan = BlockPlan(kv_indices=torch.zeros(1, 1, n_blocks, 1, dtype=torch.int32),
                     kv_counts=torch.ones(1, 1, n_blocks, dtype=torch.int32), block_m=block, block_n=block,
                     seq_len=seq, perm=perm, kv_valid=(perm >= 0)[None])
    q, k, v = (torch.randn(seq, dim, generator=gen) * 2 for _ in range(3))
    key_valid = torch.rand(seq, generator=gen) > 0.2
    rows = torch.tensor([0, 7, 13, 29, 30, 49])
    query_block, key_block = (blocks[0, 0] for blocks in token_blocks(plan, 1, 1, seq, "cpu")[:2])
    mass, weighted = row_block_sums(q[rows], k, v, key_block, n_blocks, key_valid)
    # reference: kernel position j holds model token perm[j] (read off perm, not the plan's inverse)
    block_of = {int(t): j // block for j, t in enumerate(perm.tolist()) if t >= 0}
    assert [int(query_block[r]) for r in rows] == [block_of[int(r)] for r in rows]
    probs = torch.softmax(((q.double() @ k.double().T) / math.sqrt(dim)).masked_fill(~key_valid, float("-inf")), -1)
    ref_mass = torch.zeros(len(rows), n_blocks, dtype=torch.float64)
    ref_weighted = torch.zeros(len(rows), n_blocks, dim, dtype=torch.float64)
    for n, r in enumerate(rows.tolist()):
        for t in range(seq):
            ref_mass[n, block_of[t]] += probs[r, t]
            ref_weighted[n, block_of[t]] += probs[r, t] * v[t].double()
    assert torch.allclose(mass.double(), ref_mass, atol=1e-5)
    assert torch.allclose(weighted.double(), ref_weighted, atol=1e-5)


def capture_widened(monkeypatch):
    """Record ``{head: plan}`` of the plans the guard's score widening runs (wrapping
    ``guard.widen_head`` for the head and the engine call it makes for the plan)."""
    from fastdit.methods import guard
    from fastdit.methods.guard import widen

    seen, current = {}, []
    run_plan, widen_head = widen.run_plan, guard.widen_head

    def recording_run(q, k, v, plan, *args, **kwargs):
        seen[current[-1]] = plan
        return run_plan(q, k, v, plan, *args, **kwargs)

    def recording_widen(method, ctx, q, k, v, head, bound):
        current.append(head)
        return widen_head(method, ctx, q, k, v, head, bound)

    monkeypatch.setattr(widen, "run_plan", recording_run)
    monkeypatch.setattr(guard, "widen_head", recording_widen)
    return seen


@pytest.mark.parametrize("method, options", [
    ("sparge", dict(cdf=0.5)), ("svg2", dict(top_p=0.5)), ("svg", dict(density=0.05)),
    ("sta", dict(tile=(2, 4, 4), window=(1, 1, 1))), ("sparge", dict(cdf=0.5, correction="pooled"))])
def test_a_failed_head_is_widened_by_scores_and_runs_its_widened_plan_exactly(monkeypatch, method, options):
    """On heads a too-low threshold (or a too-small window) fails (a spatial, a temporal and a
    semantic head of the structured generator), the guard's first action adds key blocks in the
    plan's own blocks: at least one head passes that way; the widened heads equal float64
    attention under the widened plan's token mask (no correction); every head keeps its error and
    the promised mass."""
    from fastdit.eval.bench.structured import structured_qkv

    grid = (4, 16, 16)
    q, k, v = structured_qkv(grid=grid, heads=3, head_dim=32, kinds=("spatial", "temporal", "semantic"))[:3]
    layout = TokenLayout(grid)
    seen = capture_widened(monkeypatch)
    ref, ref_lse = dense64(q, k, v)
    out, info = fastdit.attention(q, k, v, method, layout=layout, return_info="mass", guard=0.1, **options)
    guard = info["guard"]
    widened = [h for h, level in enumerate(guard["levels"]) if level == 1]
    assert widened and seen, guard  # the first action, taken on at least one head
    assert all(guard["action"][h] == "widened" for h in widened)
    for h in range(q.shape[1]):
        assert guard["action"][h] in ("pass", "widened", "dense")
        if guard["action"][h] != "pass":
            assert rel(out[:, h], ref[:, h]) < 0.15  # at the bound, with the estimate's sampling error
    promise = options.get("cdf", options.get("top_p"))
    if promise is not None:
        true_mass = torch.exp(info["lse"].double() - ref_lse).mean(-1)[0]
        assert (true_mass >= promise - 0.05).all(), true_mass
    if options.get("correction") is None:  # exactly the widened plan, through the engine
        for h in widened:
            plan = seen[h]
            mask = torch.stack([plan.token_mask(0) if not hasattr(plan, "head_inverses") or plan.head_inverses is None
                                else plan.token_mask(0, batch=0)])
            if getattr(plan, "q_blocks", None) is not None:  # clusters: the token mask from the block maps
                qb, kb = plan.q_blocks[0, 0].long(), plan.k_blocks[0, 0].long()
                allowed = torch.zeros(plan.kv_counts.shape[-1], plan.num_kv_blocks, dtype=torch.bool)
                for i in range(allowed.shape[0]):
                    allowed[i, plan.kv_indices[0, 0, i, :int(plan.kv_counts[0, 0, i])].long()] = True
                mask = allowed[qb][:, kb][None]
            expected, _ = dense64(q[:, h:h + 1], k[:, h:h + 1], v[:, h:h + 1], mask)
            assert rel(out[:, h:h + 1], expected) < 1e-4


def test_block_rows_are_spread_over_every_block_and_fixed():
    query_block = torch.tensor([2, 0, 0, 1, 2, 2, 0, 2, 2, 2, 0, 0])  # block 0: 5 tokens, 1: 1, 2: 6
    rows = block_rows(query_block, 4, per_block=2)
    # ranks 0 and floor(size / 2) of each block in model order; block 3 is empty
    assert rows.tolist() == [0, 1, 3, 6, 7]
    assert torch.equal(block_rows(query_block, 4, per_block=2), rows)


def test_only_plans_the_engine_runs_alone_are_widened_by_scores():
    """``correction="cached"`` (its residual belongs to the stored plan), sla / vsa (more than the
    plan's engine call) and a call with no plan: the guard goes on to the wider settings and dense."""
    from types import SimpleNamespace

    plan = BlockPlan(kv_indices=torch.zeros(1, 1, 1, 1, dtype=torch.int32), kv_counts=torch.ones(1, 1, 1, dtype=torch.int32),
                     block_m=4, block_n=4, seq_len=4)
    with_calibration, without = SimpleNamespace(info={"plan": plan}), SimpleNamespace(info={})

    def method(name, **options):
        cls = base.get_method(name)
        return cls(cls.make_config(None, **options))

    assert widenable(method("sparge"), with_calibration) and widenable(method("sta", correction="ear"), with_calibration)
    assert not widenable(method("sparge"), without)
    assert not widenable(method("sparge", correction="cached"), with_calibration)
    assert not widenable(method("sla"), with_calibration) and not widenable(method("vsa"), with_calibration)
    assert not widenable(method("todo"), with_calibration)
