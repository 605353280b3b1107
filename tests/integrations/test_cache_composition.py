"""fastdit methods together with diffusers' own caching hooks (``transformer.enable_cache``).

Every registered method runs on tiny pipelines with FirstBlockCache, PyramidAttentionBroadcast
and FasterCache enabled, installed in either order (patch first or cache first) and taken off in
either order (``remove()`` then ``disable_cache()`` or the reverse); the output is finite and
afterwards the transformer is what it was: the same output bit for bit as before anything was
installed, the same processor objects and backends, each module's forward its class's own, no
fastdit hook or mark left. Token methods give the same result on a second pipeline call (their
per-layer state is reset between calls).

FasterCache in diffusers 0.42 needs classifier-free guidance batched into one transformer call
(it splits the batch in two) or none: the tiny Wan pipeline runs CFG as two calls, so with
FasterCache it runs without guidance (``is_guidance_distilled=True``), as HunyuanVideo does.
"""
import itertools
import warnings

import numpy as np
import pytest
import torch
from diffusers import FasterCacheConfig, FirstBlockCacheConfig, PyramidAttentionBroadcastConfig

import fastdit
from fastdit.intercept import AttentionForward
from fastdit.methods import get_method
from fastdit.pipelines.tiny import TINY_TEST_DEFAULTS, tiny

FAMILIES = ("wan", "hunyuan_video")
CACHES = ("first_block", "pyramid", "faster")
CORE = ("dense", "sta", "todo", "tome")
#: (install order, removal order), cycled over the methods so each cache meets all four
ORDERS = list(itertools.product(("patch_first", "cache_first"), ("remove_first", "disable_first")))
#: The core methods with every cache on Wan (self-attention) and the token methods on HunyuanVideo
#: (joint text attention); every other registered method with one cache (cycled), to stay cheap.
MATRIX = ([("wan", m, c) for m in CORE for c in CACHES] + [("hunyuan_video", m, c) for m in CORE[2:] for c in CACHES]
          + [("wan", m, CACHES[i % len(CACHES)])
             for i, m in enumerate(name for name in fastdit.method_names() if name not in CORE)])
#: small options so sliding tile is sparse on the 3x5x7 test grid
SMALL = {"sta": dict(tile=(1, 2, 2), window=(1, 3, 3))}


def cache_config(kind, pipe, family):
    if kind == "first_block":
        return FirstBlockCacheConfig(threshold=0.5)
    if kind == "pyramid":
        return PyramidAttentionBroadcastConfig(spatial_attention_block_skip_range=2,
                                               spatial_attention_timestep_skip_range=(-1, 1001),
                                               current_timestep_callback=lambda: pipe.current_timestep)
    # Step 0 (t = 1000) computes, step 1 (t ~ 750-875) reuses the cached attention.
    return FasterCacheConfig(spatial_attention_block_skip_range=2, spatial_attention_timestep_skip_range=(-1, 900),
                             current_timestep_callback=lambda: pipe.current_timestep,
                             attention_weight_callback=lambda _: 0.5, is_guidance_distilled=True)


def call_arguments(family, cache=None):
    kwargs = dict(TINY_TEST_DEFAULTS[family])
    if cache == "faster":
        kwargs["guidance_scale"] = 1.0  # see the module docstring
    return kwargs


def generate(pipe, family, cache=None, seed=0):
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = pipe(prompt="a red fox", generator=torch.Generator().manual_seed(seed), output_type="np",
                   **call_arguments(family, cache))
    return np.asarray(out.frames)


def snapshot(transformer):
    """What must be back after everything is removed (objects, not copies)."""
    state = {}
    for name, module in transformer.named_modules():
        processor = getattr(module, "processor", None)
        state[name] = (processor, dict(getattr(processor, "__dict__", {})), tuple(module._forward_pre_hooks.values()),
                       tuple(module._forward_hooks.values()))
    return state


def assert_restored(transformer, before, inputs, expected):
    assert snapshot(transformer) == before
    for name, module in transformer.named_modules():
        forward = module.__dict__.get("forward")
        # diffusers' remove_hook leaves the bound method as an instance attribute: still the class's own
        assert forward is None or getattr(forward, "__func__", None) is type(module).forward, name
        assert not isinstance(forward, AttentionForward)
    assert getattr(transformer, "_fastdit_patch", None) is None
    with torch.no_grad():
        got = transformer(*inputs[0], **inputs[1])
    assert torch.equal(got[0], expected), "not bit-identical after remove() and disable_cache()"


def reference(family):
    """A fresh pipeline of ``family``, its transformer's state, a recorded transformer call with its
    output, and the pipeline's frames, all taken before anything is installed."""
    pipe = tiny(family)
    recorded = []

    def grab(module, args, kwargs):
        if not recorded:
            recorded.append((tuple(a.clone() if torch.is_tensor(a) else a for a in args),
                             {k: v.clone() if torch.is_tensor(v) else v for k, v in kwargs.items()}))

    handle = pipe.transformer.register_forward_pre_hook(grab, with_kwargs=True)
    frames = generate(pipe, family)
    handle.remove()
    with torch.no_grad():
        expected = pipe.transformer(*recorded[0][0], **recorded[0][1])[0]
    return pipe, snapshot(pipe.transformer), recorded[0], expected, frames


@pytest.fixture(scope="module")
def pipes():
    """Per family: ``reference(family)``."""
    return {family: reference(family) for family in FAMILIES}


def options(method):
    cls = get_method(method)
    valid = set(cls.config_cls.__dataclass_fields__)
    chosen = {**cls.tiny_options, **SMALL.get(method, {})}
    extra = {k: v for k, v in chosen.items() if k in valid}
    return extra if method == "dense" else {"dense_steps": 0, **extra}


@pytest.mark.parametrize("family, method, cache", MATRIX)
def test_method_with_diffusers_cache_runs_and_removal_restores(pipes, family, method, cache):
    pipe, before, inputs, expected, _ = pipes[family]
    same_cache = [m for f, m, c in MATRIX if f == family and c == cache]
    install, removal = ORDERS[same_cache.index(method) % len(ORDERS)]
    transformer = pipe.transformer
    if install == "patch_first":
        patch = fastdit.patch(pipe, method, backend="torch", **options(method))
        transformer.enable_cache(cache_config(cache, pipe, family))
    else:
        transformer.enable_cache(cache_config(cache, pipe, family))
        patch = fastdit.patch(pipe, method, backend="torch", **options(method))
    try:
        out = generate(pipe, family, cache)
        assert np.isfinite(out).all()
        assert patch.stats.fallback_calls == 0, patch.stats.fallbacks
        if method != "dense":
            assert patch.stats.sparse_calls > 0
    finally:
        if removal == "remove_first":
            patch.remove()
            transformer.disable_cache()
        else:
            transformer.disable_cache()
            patch.remove()
    assert_restored(transformer, before, inputs, expected)


@pytest.mark.parametrize("method, extra", [("todo", {}), ("tome", {"match_every": 2})])
def test_second_pipeline_call_equals_the_first(pipes, method, extra):
    """Per-layer state (tome's kept matching) is reset at every pipeline call."""
    pipe, before, inputs, expected, unpatched = pipes["hunyuan_video"]
    with fastdit.patch(pipe, method, dense_steps=0, **extra) as patch:
        first = generate(pipe, "hunyuan_video")
        second = generate(pipe, "hunyuan_video")
        assert patch.stats.sparse_calls > 0
    assert np.isfinite(first).all() and np.array_equal(first, second)
    assert not np.array_equal(first, unpatched)  # the method really changed the output
    assert_restored(pipe.transformer, before, inputs, expected)
