"""The quality guard under ring attention (issue 39): every rank decides as one process would.

With 2 gloo processes (ring 2) on tiny Wan (video only) and Qwen-Image (text with padding: a key
mask), each guarded layer call reports, on every rank, the actions and levels of the one-process
run of the same model, its estimates (error, bound, kept mass) within float tolerance, and the
output equals the one-process output; heads forced to fail (a threshold far below what sliding
tile can reach) are caught and the output equals dense attention's; ``guard=False`` under ring
changes nothing. With 4 processes (Ulysses 2 x ring 2): each ring group decides for its heads as
one process. Without processes: the exact log-sum-exp merge of per-shard partial rows equals the
rows attended over every key.
"""
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist

from cp_worker import build, free_port, inputs

SPARGE = dict(tile=(1, 2, 2), cdf=0.5, dense_steps=0)
_MISSING = object()
STA = dict(tile=(1, 2, 2), window=(1, 3, 3), dense_steps=0)
#: name: (family, method, options, whether a failed head is first widened by the sampled rows' scores
#: (``Method.guard_scores_widen``, where the guard has that level) or goes to the method's wider settings)
JOBS = {
    "mixed": ("wan", "sparge", dict(SPARGE, guard=0.5), True),  # heads passing and failing
    "settings": ("wan", "sparge", dict(SPARGE, guard=0.15), False),  # sparge's wider cdf, then dense
    "masked": ("qwen", "svg2", dict(dense_steps=0, guard=0.15), True),  # a key mask; text prefix
    "failing": ("wan", "sta", dict(STA, guard=1e-4), True),  # far below what sliding tile reaches
    "failing_dense": ("wan", "sta", dict(STA, guard=1e-4), False),  # sta has no wider setting: dense
    "off": ("wan", "sparge", dict(SPARGE, guard=False), True),
}


def run_guarded(family, method, options, scores_widen=True, parallel=None):
    """The tiny model's output, the guard reports of its calls (in call order) and the patch stats."""
    import fastdit
    from fastdit.methods import get_method

    cls = None if method is None else get_method(method)
    own = None if cls is None else vars(cls).get("guard_scores_widen", _MISSING)
    if cls is not None and not scores_widen:
        cls.guard_scores_widen = False  # an attribute of the class: put back below
    model = build(family)
    patch = None if method is None else fastdit.patch(model, method, backend="torch", **options)
    if parallel is not None:
        model.enable_parallelism(config=parallel)
    reports = []
    if patch is not None:
        count = patch.stats.count_guard
        patch.stats.count_guard = lambda report, size: (reports.append(report), count(report, size))
    try:
        with torch.no_grad():
            out = model(**inputs(family))[0]
        stats = None if patch is None else patch.stats.as_dict()
        return out.numpy(), [{k: v for k, v in r.items() if k != "seconds"} for r in reports], stats
    finally:
        if patch is not None:
            patch.remove()
        if cls is not None and not scores_widen:
            if own is _MISSING:
                del cls.guard_scores_widen
            else:
                cls.guard_scores_widen = own


def worker(rank, world, port, jobs, results, ring=None):
    """Every rank runs ``jobs`` under ring ``ring`` (default ``world``; Ulysses the rest) and puts
    ``(rank, {name: result or error})``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.accelerator.device_count = lambda: 1
    from diffusers import ContextParallelConfig

    outputs = {}
    try:
        for name, (family, method, options, scores_widen) in jobs.items():
            try:
                ring = ring or world
                parallel = ContextParallelConfig(ring_degree=ring, ulysses_degree=world // ring)
                outputs[name] = run_guarded(family, method, options, scores_widen, parallel)
            except Exception as error:  # noqa: BLE001 - the test reads the message
                outputs[name] = f"{type(error).__name__}: {error}"
    finally:
        results.put((rank, outputs))
        dist.destroy_process_group()


def run_ring(jobs, world=2, ring=None, timeout=600):
    """``{rank: outputs}`` of ``jobs`` in ``world`` spawned gloo processes (ring ``ring``, default ``world``)."""
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    procs = [context.Process(target=worker, args=(rank, world, port, jobs, results, ring)) for rank in range(world)]
    for proc in procs:
        proc.start()
    try:
        return dict(results.get(timeout=timeout) for _ in range(world))
    finally:
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()


@pytest.fixture(scope="module")
def ring_results():
    return run_ring(JOBS)


def _same_decisions(ring_reports, reports, name, shares=True):
    assert len(ring_reports) == len(reports) > 0, (name, len(ring_reports), len(reports))
    for ring_report, report in zip(ring_reports, reports):
        for field in ("action", "levels", "rows", "nonfinite", "bound", "promise"):
            assert ring_report[field] == report[field], (name, field, ring_report[field], report[field])
        for field in ("error", "kept_mass", "first_error", "first_error_bound", "first_kept_mass"):
            assert np.allclose(ring_report[field], report[field], rtol=1e-4, atol=1e-5), (name, field, ring_report,
                                                                                          report)
        if shares:  # the guard's work over the call's (under Ulysses: over the rank's heads)
            assert ring_report["extra_density"] == pytest.approx(report["extra_density"], rel=1e-6)
        densities = [(a is None, b is None) for a, b in zip(ring_report["head_density"], report["head_density"])]
        assert all(a == b for a, b in densities), (name, ring_report["head_density"], report["head_density"])


@pytest.mark.parametrize("name", ["mixed", "settings", "masked", "failing", "failing_dense"])
def test_ring_guard_decides_as_one_process(ring_results, name):
    family, method, options, scores_widen = JOBS[name]
    reference, reports, stats = run_guarded(family, method, options, scores_widen)
    outputs = [ring_results[rank][name] for rank in (0, 1)]
    for output in outputs:
        assert not isinstance(output, str), output
    (out, ring_reports, ring_stats), (out_1, reports_1, _) = outputs
    assert reports_1 == ring_reports  # every rank: the same numbers, the same decisions
    _same_decisions(ring_reports, reports, name)
    assert np.abs(out - reference).max() <= 1e-5 and np.array_equal(out, out_1)
    guard, ring_guard = stats["guard"], ring_stats["guard"]
    assert ring_guard["head_calls"] == guard["head_calls"] == 4 * len(reports)
    assert (ring_guard["widened"], ring_guard["dense"]) == (guard["widened"], guard["dense"])
    assert ring_guard["density"] == pytest.approx(guard["density"], rel=1e-6)  # each rank counts its share
    actions = {a for report in reports for a in report["action"]}
    assert actions & {"widened", "dense"}, actions  # the guard acted
    if name == "mixed":  # and not the same way on every head
        assert "pass" in actions, actions
    if name == "settings":  # heads re-run at sparge's wider cdf through the ring, and heads run dense
        assert actions == {"widened", "dense"}, actions
    if name == "failing_dense":
        assert actions == {"dense"}, actions
    if name.startswith("failing"):  # caught on every head: the output is dense attention's
        assert actions <= {"widened", "dense"}, actions
        dense, _, _ = run_guarded(family, None, {})
        assert np.abs(out - dense).max() <= 1e-4, np.abs(out - dense).max()
        plain, _, _ = run_guarded(family, method, dict(options, guard=False))
        assert np.abs(plain - dense).max() > 1e-2  # the method alone is far from it


def test_ring_guard_off_changes_nothing(ring_results):
    family, method, options, _ = JOBS["off"]
    reference, reports, stats = run_guarded(family, method, options)
    out, ring_reports, ring_stats = ring_results[0]["off"]
    assert reports == ring_reports == [] and ring_stats["guard"]["head_calls"] == 0
    assert np.abs(out - reference).max() <= 1e-5
    guarded = ring_results[0]["mixed"][0]
    assert np.abs(guarded - out).max() > 1e-3  # the guard's repairs show in the output when it is on


def test_partial_rows_merge_to_the_rows_over_every_key():
    from fastdit.methods.guard import exact_rows
    from fastdit.methods.parallel.ring_guard import merge_partials

    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 3, 60, 8, generator=gen) for _ in range(3))
    key_mask = torch.rand(2, 60, generator=gen) > 0.3
    key_mask[1, :40] = False  # the first two of three shards hold no valid key of batch element 1
    rows = torch.tensor([0, 7, 33, 59])
    whole = exact_rows(q, k, v, rows, key_mask)
    parts = [exact_rows(q, k[:, :, s:s + 20], v[:, :, s:s + 20], rows, key_mask[:, s:s + 20]) for s in (0, 20, 40)]
    out, lse = merge_partials(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
    torch.testing.assert_close(out, whole[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse, whole[1], rtol=1e-5, atol=1e-5)
    none = torch.full((1, 2), float("-inf"))
    empty_out, empty_lse = merge_partials(torch.zeros(2, 1, 2, 3), torch.stack([none, none]))
    assert torch.equal(empty_out, torch.zeros(1, 2, 3)) and torch.isinf(empty_lse).all()


def _heads(report, start, count):
    """The part of a one-process report about heads ``start .. start + count``."""
    per_head = ("error", "kept_mass", "first_error", "first_error_bound", "first_kept_mass", "action", "levels",
                "head_density")
    return {k: (v[start:start + count] if k in per_head else v) for k, v in report.items()}


@pytest.mark.slow
def test_ulysses_by_ring_decides_as_one_process():
    """Ulysses 2 x ring 2 (4 processes): each ring group holds 2 of the 4 heads; both ranks of a group
    report one process's decisions for those heads, and the output is one process's."""
    name = "settings"
    family, method, options, scores_widen = JOBS[name]
    reference, reports, _ = run_guarded(family, method, options, scores_widen)
    results = run_ring({name: JOBS[name]}, world=4, ring=2)
    offsets = []
    for rank in range(4):
        output = results[rank][name]
        assert not isinstance(output, str), output
        out, ring_reports, _ = output
        assert np.abs(out - reference).max() <= 1e-5
        first_half = [report["action"][:2] for report in reports]  # the calls differ between the halves
        start = 0 if [report["action"] for report in ring_reports] == first_half else 2
        _same_decisions(ring_reports, [_heads(report, start, 2) for report in reports], (name, rank), shares=False)
        offsets.append(start)
    assert sorted(offsets) == [0, 0, 2, 2], offsets
    assert {a for report in reports for a in report["action"]} == {"widened", "dense"}
