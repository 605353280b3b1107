"""fastdit methods composed with cache-dit (``pip install fastdit[cache]``), as a user stacks them.

Every registered method runs on the tiny Wan pipeline with ``cache_dit.enable_cache(pipe, ...)``
(DBCache computing 1 front and 1 back block of the 4, or DBCache with a first-order TaylorSeer
calibrator, cycled over the methods), and the core methods also on the tiny HunyuanVideo (joint
text attention, DBCache 1 front block). Each case installs in one of the two orders
(``fastdit.patch`` first or ``enable_cache`` first) and removes in one of the two orders
(``remove()`` first or ``cache_dit.disable_cache`` first), cycled so each order pair is met.

Checked: the run is finite; fastdit's statistics count exactly the attention calls that ran
(counted independently by forward pre-hooks on the patched attention modules), which are fewer
than without the cache (cache-dit really skipped blocks, and skipped blocks are neither counted as
computed nor as fallbacks); after both are removed the transformer is what it was (processors,
hooks, forwards) and the pipeline's output equals, bit for bit, the output before anything was
installed.
"""
import itertools
import warnings

import numpy as np
import pytest
import torch

import fastdit
from fastdit.pipelines.tiny import tiny
from test_cache_composition import assert_restored, generate, options, reference

cache_dit = pytest.importorskip("cache_dit", reason="cache-dit is the optional extra fastdit[cache]")

CORE = ("dense", "sta", "todo", "tome")
ORDERS = list(itertools.product(("patch_first", "cache_first"), ("remove_first", "disable_first")))
#: every method on Wan (caches cycled), the core methods on HunyuanVideo
MATRIX = ([("wan", m, ("dbcache", "taylorseer")[i % 2]) for i, m in enumerate(fastdit.method_names())]
          + [("hunyuan_video", m, "dbcache") for m in CORE])
#: front / back blocks that fit the 4-layer tiny models (cache-dit's defaults, 8 front blocks, assert)
BLOCKS = {"wan": (1, 1), "hunyuan_video": (1, 0)}


def enable(pipe, family, cache):
    front, back = BLOCKS[family]
    # warm-up step 0 computes everything; a threshold this high caches every block it may at step 1
    config = cache_dit.DBCacheConfig(Fn_compute_blocks=front, Bn_compute_blocks=back, max_warmup_steps=1,
                                     residual_diff_threshold=10.0)
    calibrator = cache_dit.TaylorSeerCalibratorConfig(taylorseer_order=1) if cache == "taylorseer" else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cache_dit.enable_cache(pipe, cache_config=config, calibrator_config=calibrator)


@pytest.fixture(scope="module")
def pipes():
    """Per family: the pipeline, its transformer's state, one recorded transformer call with its
    output, the pipeline's frames, and the attention calls of a run without cache."""
    found = {}
    for family in ("wan", "hunyuan_video"):
        pipe, before, recorded, expected, frames = reference(family)
        with fastdit.patch(pipe, "dense") as probe:
            layers = list(probe.layers)
            counter = CallCounter(pipe, layers)
            generate(pipe, family)
            uncached = counter.total
            counter.remove()
        found[family] = (pipe, before, recorded, expected, frames, layers, uncached)
    return found


class CallCounter:
    """Forward pre-hooks on the attention modules named ``layers``: ``total`` calls that ran."""

    def __init__(self, pipe, layers):
        modules = dict(pipe.transformer.named_modules())
        self.total = 0
        self.handles = [modules[name].register_forward_pre_hook(self._count) for name in layers]

    def _count(self, *_):
        self.total += 1

    def remove(self):
        for handle in self.handles:
            handle.remove()


@pytest.mark.parametrize("family, method, cache", MATRIX)
def test_method_with_cache_dit_counts_what_ran_and_removal_restores(pipes, family, method, cache):
    pipe, before, inputs, expected, frames, layers, uncached = pipes[family]
    same_family = [m for f, m, _ in MATRIX if f == family]
    install, removal = ORDERS[same_family.index(method) % len(ORDERS)]
    counter = CallCounter(pipe, layers)
    try:
        if install == "patch_first":
            patch = fastdit.patch(pipe, method, backend="torch", **options(method))
            enable(pipe, family, cache)
        else:
            enable(pipe, family, cache)
            patch = fastdit.patch(pipe, method, backend="torch", **options(method))
        try:
            # the same layers; their order may differ: see test_cache_dit_run_reorders_block_lists
            assert sorted(patch.layers) == sorted(layers)
            out = generate(pipe, family)
            assert np.isfinite(out).all()
            ran = counter.total
            assert ran < uncached, "cache-dit skipped no attention call"
            stats = patch.stats
            assert stats.fallback_calls == 0, stats.fallbacks
            assert stats.dense_calls + stats.sparse_calls == ran
            if method != "dense":
                assert stats.sparse_calls > 0
        finally:
            if removal == "remove_first":
                patch.remove()
                cache_dit.disable_cache(pipe)
            else:
                cache_dit.disable_cache(pipe)
                patch.remove()
    finally:
        counter.remove()
    assert_restored(pipe.transformer, before, inputs, expected)
    assert np.array_equal(generate(pipe, family), frames), "not bit-identical after remove() and disable_cache()"


def test_uncached_call_count_is_the_full_count(pipes):
    """The reference the counts are checked against: every layer in every transformer call."""
    pipe, *_, layers, uncached = pipes["wan"]
    steps, cfg_calls = 2, 2  # TINY_TEST_DEFAULTS["wan"]: 2 steps, classifier-free guidance as two calls
    assert uncached == steps * cfg_calls * len(layers) == 16


def test_cache_dit_run_reorders_block_lists():
    """A pipeline call under cache-dit 1.5.3 swaps the block lists in and out of the transformer,
    which moves them to the end of its module registry: on a model with two block lists
    (HunyuanVideo, Flux) ``named_modules()`` then lists the single-stream blocks first, also after
    ``disable_cache``. fastdit numbers patched layers in that order, so per-layer options
    (``dense_layers``, ``layer_settings``, plan files) mean other layers in a patch made after a
    cached run; a patch made before it keeps the model's order (documented in docs/serving.md)."""
    pipe = tiny("hunyuan_video")
    before = [name for name, _ in pipe.transformer.named_children()]
    with fastdit.patch(pipe, "dense") as patch:
        order = list(patch.layers)
        enable(pipe, "hunyuan_video", "dbcache")
        generate(pipe, "hunyuan_video")
        assert list(patch.layers) == order  # numbering fixed at patch time
    cache_dit.disable_cache(pipe)
    after = [name for name, _ in pipe.transformer.named_children()]
    assert after != before and sorted(after) == sorted(before)
    with fastdit.patch(pipe, "dense") as later:
        assert later.layers[0].startswith("single_transformer_blocks") and sorted(later.layers) == sorted(order)
