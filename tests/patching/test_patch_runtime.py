"""Core v2: torch.compile of patched models, threads, copied schedulers, steps actually run, honest
statistics and the functional entry point ``fastdit.attention``."""
import contextvars
import copy
import inspect
import threading
import time

import numpy as np
import pytest
import torch

import fastdit
from fastdit import TokenLayout
from fastdit.pipelines.tiny import TINY_TEST_DEFAULTS, tiny, tiny_image

from layer_capture import LayerCapture, assert_matches_masked_dense, sta_token_mask
from tiny_models import TINY
from tiny_transformers import tiny_wan, wan_inputs

# Sparse at the test grids: one 4x4 tile per query tile (plus text), so the patch changes the output.
STA = dict(tile=(1, 4, 4), window=(1, 1, 1), dense_steps=0)


def _model(family, grid=None, seed=0):
    case = TINY[family]
    grid = grid or ((3, 8, 10) if case.video else (1, 8, 10))
    model = case.build(seed)
    return model, case.inputs(model, grid, seed)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# -- torch.compile ---------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["wan", "flux"])
@pytest.mark.parametrize("backend", ["eager", "aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_compiled_patched_model_matches_eager(family, backend):
    model, inputs = _model(family)
    with torch.no_grad():
        dense = model(**inputs)[0]
        with fastdit.patch(model, "sta", **STA) as p:
            eager = model(**inputs)[0]
            out = torch.compile(model, backend=backend)(**inputs)[0]
            assert p.stats.fallback_calls == 0 and p.stats.sparse_calls == 2 * len(p.layers)
    assert (eager - dense).abs().max() > 1e-3, "the patch did not change attention: the test would prove nothing"
    assert (out - eager).abs().max() <= 1e-4


DYNAMIC = {  # per-call plans chosen from q, k (and v): really sparse on the 3x8x10 grid
    "sparge": dict(tile=(1, 4, 4), topk=0.25, simthresh=-1.0, dense_steps=0),
    "sla": dict(tile=(1, 4, 4), topk_ratio=0.25, dense_steps=0),
    "svg": dict(density=0.34, block_size=16, n_samples=16, dense_steps=0, dense_layers=0),
    "svg2": dict(q_clusters=6, k_clusters=12, top_p=0.5, warm_start=False, dense_steps=0, dense_layers=0),
}


@pytest.mark.parametrize("method", sorted(DYNAMIC))
def test_compiled_dynamic_methods_match_eager(method):
    """The dynamic methods' selection (k-means, sampled errors, block means) runs inside the opaque
    op too: a compiled model gives the eager patched output. (svg2 without warm start, so both
    calls start k-means from the same centroids whatever state the other call left.)"""
    model, inputs = _model("wan")
    with torch.no_grad():
        dense = model(**inputs)[0]
        with fastdit.patch(model, method, **DYNAMIC[method]) as p:
            eager = model(**inputs)[0]
            out = torch.compile(model, backend="aot_eager")(**inputs)[0]
            assert p.stats.fallback_calls == 0 and p.stats.sparse_calls == 2 * len(p.layers)
            assert p.stats.sparse_density < 0.9
    assert (eager - dense).abs().max() > 1e-3, "the patch did not change attention: the test would prove nothing"
    assert (out - eager).abs().max() <= 1e-4


@pytest.mark.parametrize("family", ["wan", "flux", "hunyuan_video", "ltx_video", "cogvideox", "sd3", "pixart_sigma"])
def test_no_graph_break_in_patched_attention_layers(family):
    """Dispatching processors go through fastdit's backend, legacy ones through the SDPA mode; in
    both, dynamo sees one opaque op per attention call and no break (fullgraph compiles)."""
    model, inputs = _model(family)
    with torch.no_grad(), fastdit.patch(model, "sta", **STA) as p:
        eager = model(**inputs)[0]
        explanation = torch._dynamo.explain(model)(**inputs)
        assert explanation.graph_break_count == 0, [str(b.reason)[:200] for b in explanation.break_reasons]
        torch._dynamo.reset()
        out = torch.compile(model, backend="eager", fullgraph=True)(**inputs)[0]
        assert p.stats.fallback_calls == 0
    assert (out - eager).abs().max() <= 1e-5


def test_legacy_processor_with_python_tensor_methods_still_compiles():
    """Mochi's processor uses ``Tensor.unflatten`` under the mode: dynamo breaks the graph there
    (a measured limitation, see README), but the compiled model still runs the sparse method."""
    model, inputs = _model("mochi")
    with torch.no_grad(), fastdit.patch(model, "sta", **STA) as p:
        eager = model(**inputs)[0]
        out = torch.compile(model, backend="eager")(**inputs)[0]
        assert p.stats.sparse_calls == 2 * len(p.layers) and p.stats.fallback_calls == 0
    assert (out - eager).abs().max() <= 1e-5


def test_compiled_model_after_remove_is_unpatched():
    model, inputs = _model("wan")
    with torch.no_grad():
        dense = model(**inputs)[0]
        p = fastdit.patch(model, "sta", **STA)
        compiled = torch.compile(model, backend="eager")
        compiled(**inputs)
        p.remove()
        assert torch.equal(compiled(**inputs)[0], dense)


def test_patch_accepts_a_compiled_transformer():
    model, inputs = _model("wan")
    compiled = torch.compile(model, backend="eager")
    with torch.no_grad(), fastdit.patch(compiled, "sta", **STA) as p:
        out = compiled(**inputs)[0]
        assert p.stats.sparse_calls == len(p.layers)
    with torch.no_grad(), fastdit.patch(model, "sta", **STA):
        assert (model(**inputs)[0] - out).abs().max() <= 1e-5


# -- threads --------------------------------------------------------------------------------

def _overlapping(intervals):
    (a0, a1), (b0, b1) = intervals
    return a0 < b1 and b0 < a1


def _run_threads(jobs, meet_in):
    """Run each job in its own thread; returns (results, (start, end) per job). The jobs really
    overlap whatever the machine's load: each thread's first forward of a module in ``meet_in``
    waits (a forward pre-hook) until every thread has reached its own, so all are mid-job at once."""
    barrier = threading.Barrier(len(jobs))
    met = threading.local()
    results, times = [None] * len(jobs), [None] * len(jobs)

    def meet(module, args):
        if not getattr(met, "done", False):
            met.done = True
            barrier.wait(timeout=600)  # a deadlock guard only: every thread reaches it

    def worker(i, job):
        start = time.perf_counter()
        results[i] = job()
        times[i] = (start, time.perf_counter())

    hooks = [module.register_forward_pre_hook(meet) for module in meet_in]
    try:
        threads = [threading.Thread(target=worker, args=(i, job)) for i, job in enumerate(jobs)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        for hook in hooks:
            hook.remove()
    assert all(t is not None for t in times), "a thread failed"
    return results, times


def test_two_threads_on_one_patched_transformer_at_two_resolutions():
    """Per-call state lives in the call: each thread has its own grid and step position."""
    model = tiny_wan()
    timesteps = {"a": (900.0, 900.0, 700.0, 500.0, 300.0), "b": (800.0, 600.0, 600.0, 400.0)}
    sizes = {"a": dict(frames=3, height=10, width=14), "b": dict(frames=2, height=12, width=8)}

    def job(name, repeats=3):
        def run():
            outs = []
            with torch.no_grad():
                for _ in range(repeats):
                    for t in timesteps[name]:
                        outs.append(model(**wan_inputs(**sizes[name], timestep=t)).sample)
            return outs
        return run

    with fastdit.patch(model, "sta", tile=(1, 2, 2), window=(1, 3, 3), dense_steps=1) as p:
        sequential = [contextvars.Context().run(job(name)) for name in ("a", "b")]
        calls_alone = p.stats.total_calls
        p.reset_stats()
        concurrent, intervals = _run_threads([job("a"), job("b")], [model])
        assert _overlapping(intervals), "the two threads did not overlap"
        assert p.stats.total_calls == calls_alone and p.stats.fallback_calls == 0
        # step 0 of each repeat is dense (one dense step): per repeat a: 2 calls, b: 1 call, x 2 layers
        assert p.stats.dense_calls == 3 * (2 + 1) * 2
    for alone, together in zip(sequential, concurrent):
        assert all(torch.equal(x, y) for x, y in zip(alone, together))


def _generate(pipe, name="wan", seed=0, output_type="np", **overrides):
    kwargs = {**TINY_TEST_DEFAULTS[name], **overrides}
    with torch.no_grad():
        out = pipe(prompt="a red fox in the snow", generator=torch.Generator().manual_seed(seed),
                   output_type=output_type, **kwargs)
    return np.asarray(out.frames)


def test_two_threads_two_pipelines_sharing_one_patched_transformer():
    """A second pipeline over the same patched transformer, with a deep copy of the patched
    scheduler, runs at another resolution at the same time as the first: both equal their runs alone."""
    from diffusers import WanPipeline

    pipe = tiny("wan")
    with fastdit.patch(pipe, "sta", tile=(1, 2, 2), window=(1, 3, 3), dense_steps=1) as p:
        other = WanPipeline(**{**pipe.components, "scheduler": copy.deepcopy(pipe.scheduler)})
        # latents: the two pipelines share one VAE, whose decoder cache is not thread-safe (diffusers')
        sizes = [dict(output_type="latent"), dict(height=96, width=80, num_frames=5, num_inference_steps=3,
                                                  output_type="latent")]
        alone = [_generate(pipe, **sizes[0]), _generate(other, **sizes[1])]
        p.reset_stats()
        together, intervals = _run_threads([lambda: _generate(pipe, **sizes[0]), lambda: _generate(other, **sizes[1])],
                                           [pipe.transformer])
        assert _overlapping(intervals)
        # steps 2 + 3, one dense each, two CFG calls per step, every layer
        layers = len(p.layers)
        assert p.stats.dense_calls == 2 * 2 * layers and p.stats.sparse_calls == (1 + 2) * 2 * layers
    assert np.array_equal(alone[0], together[0]) and np.array_equal(alone[1], together[1])


def test_two_threads_two_patched_pipelines():
    pipes = {"wan": tiny("wan"), "hunyuan_video": tiny("hunyuan_video")}
    patches = [fastdit.patch(pipes["wan"], "sta", tile=(1, 2, 2), window=(1, 3, 3), dense_steps=1),
               fastdit.patch(pipes["hunyuan_video"], "radial", dense_steps=0, block_size=64)]
    try:
        alone = [_generate(pipe, name) for name, pipe in pipes.items()]
        together, intervals = _run_threads([lambda n=name, q=pipe: _generate(q, n) for name, pipe in pipes.items()],
                                           [pipe.transformer for pipe in pipes.values()])
        assert _overlapping(intervals)
    finally:
        for patch in patches:
            patch.remove()
    for a, b in zip(alone, together):
        assert np.array_equal(a, b)


# -- copied schedulers and the steps a call actually runs ---------------------------------------

def test_deep_copied_scheduler_drives_itself():
    pipe = tiny("wan")
    with fastdit.patch(pipe, "dense"):
        original = pipe.scheduler
        clone = copy.deepcopy(original)
        assert clone.step.owner is clone and clone.set_timesteps.owner is clone
        assert "sigmas" in inspect.signature(clone.set_timesteps).parameters or \
            inspect.signature(clone.set_timesteps) == inspect.signature(type(clone).set_timesteps.__get__(clone))
        original.set_timesteps(6)
        clone.set_timesteps(4)
        sample = torch.randn(1, 4, 2, 4, 4)
        clone.step(torch.randn_like(sample), clone.timesteps[0], sample)
        assert clone.step_index == 1
        assert original.step_index is None and len(original.timesteps) == 6  # the original was not driven
    assert "step" not in original.__dict__ and "set_timesteps" not in original.__dict__


def _tiny_skyreels_df(wan):
    from diffusers import SkyReelsV2DiffusionForcingPipeline, SkyReelsV2Transformer3DModel

    params = inspect.signature(SkyReelsV2Transformer3DModel.__init__).parameters
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        transformer = SkyReelsV2Transformer3DModel(
            **{k: v for k, v in dict(wan.transformer.config).items() if k in params}).eval()
    c = wan.components
    return SkyReelsV2DiffusionForcingPipeline(tokenizer=c["tokenizer"], text_encoder=c["text_encoder"],
                                              transformer=transformer, vae=c["vae"],
                                              scheduler=copy.deepcopy(c["scheduler"]))


def test_skyreels_diffusion_forcing_counts_its_steps():
    """The pipeline deep-copies the scheduler per latent frame and steps each copy: one denoising
    iteration is still one step, so exactly the first step runs dense."""
    pipe = _tiny_skyreels_df(tiny("wan"))
    with fastdit.patch(pipe, "sta", tile=(1, 2, 2), window=(1, 3, 3), dense_steps=1) as p:
        frames = _generate(pipe, num_inference_steps=3)
        layers = len(p.layers)
        assert p.stats.dense_calls == 1 * 2 * layers  # step 0, two CFG calls
        assert p.stats.sparse_calls == 2 * 2 * layers
    assert np.isfinite(frames).all()


def test_dense_steps_fraction_counts_the_steps_a_strength_call_runs():
    """video2video at strength 0.5 runs the last 4 of 8 steps: dense_steps=0.5 makes 2 of them
    dense (not 4, the half of the full schedule)."""
    from diffusers import WanVideoToVideoPipeline

    wan = tiny("wan")
    c = wan.components
    pipe = WanVideoToVideoPipeline(tokenizer=c["tokenizer"], text_encoder=c["text_encoder"],
                                   transformer=c["transformer"], vae=c["vae"], scheduler=c["scheduler"])
    video = [tiny_image(80, 112) for _ in range(9)]
    kwargs = {k: v for k, v in TINY_TEST_DEFAULTS["wan"].items() if k != "num_frames"}
    kwargs.update(num_inference_steps=8, strength=0.5)
    with fastdit.patch(pipe, "sta", tile=(1, 2, 2), window=(1, 3, 3), dense_steps=0.5) as p:
        with torch.no_grad():
            pipe(prompt="a fox", video=video, generator=torch.Generator().manual_seed(0), output_type="latent", **kwargs)
        layers = len(p.layers)
        assert p.call_state.num_steps == 4
        assert p.stats.dense_calls == 2 * 2 * layers and p.stats.sparse_calls == 2 * 2 * layers


# -- honest statistics ----------------------------------------------------------------------

def _sta_block_density(grid, tile, window):
    """Closed form: each query tile computes prod(min(w, n)) of prod(n) key tiles (no text)."""
    n = [-(-g // t) for g, t in zip(grid, tile)]
    return float(np.prod([min(w, m) for w, m in zip(window, n)]) / np.prod(n))


def test_effective_density_counts_dense_steps_and_fallbacks():
    pipe = tiny("wan")
    tile, window = (1, 2, 2), (1, 3, 3)
    steps = TINY_TEST_DEFAULTS["wan"]["num_inference_steps"] + 2  # 4 steps, 1 dense
    with fastdit.patch(pipe, "sta", tile=tile, window=window, dense_steps=0.25) as p:
        _generate(pipe, num_inference_steps=steps)
        stats = p.stats
        grid = (3, 5, 7)  # TINY_TEST_DEFAULTS: 9 frames 80x112 -> 3 x 5 x 7 tokens
        sparse = _sta_block_density(grid, tile, window)
        assert stats.sparse_density == pytest.approx(sparse, rel=1e-6)
        calls = stats.dense_calls + stats.sparse_calls
        assert stats.dense_calls == calls // 4
        assert stats.effective_density == pytest.approx((stats.dense_calls + stats.sparse_calls * sparse) / calls)
        assert sparse < stats.effective_density < 1.0
        assert stats.as_dict()["fallbacks"] == {}


def test_float64_calls_fall_back_with_a_reason():
    model, inputs = _model("wan")
    model = model.double()
    inputs = {k: v.double() if isinstance(v, torch.Tensor) and torch.is_floating_point(v) else v
              for k, v in inputs.items()}
    with torch.no_grad():
        reference = model(**inputs)[0]
        with fastdit.patch(model, "sta", **STA) as p:
            out = model(**inputs)[0]
            assert p.stats.fallback_calls == len(p.layers) and p.stats.sparse_calls == 0
            assert any("float64" in reason for reason in p.stats.fallbacks)
            assert p.stats.effective_density == 1.0
    assert torch.equal(out, reference)


# -- fastdit.attention ----------------------------------------------------------------------

def test_functional_attention_equals_the_patched_layer(monkeypatch):
    model = tiny_wan()
    capture = LayerCapture(monkeypatch)
    options = dict(tile=(1, 2, 2), window=(1, 3, 3), dense_steps=0)
    with torch.no_grad(), fastdit.patch(model, "sta", **options):
        model(**wan_inputs(frames=3, height=10, width=14))
    layout = TokenLayout((3, 5, 7))
    q, k, v, scale, out = capture.calls[0]
    functional, info = fastdit.attention(q, k, v, "sta", layout=layout, scale=scale, return_info=True, **options)
    assert torch.equal(functional, out)
    mask = sta_token_mask(layout, options["tile"], options["window"])
    assert_matches_masked_dense(q, k, v, functional, [mask] * q.shape[1], scale)
    assert info["density"] == pytest.approx(mask.double().mean().item())
    assert info["head_density"] == pytest.approx([mask.double().mean().item()] * q.shape[1])


def test_functional_attention_with_text_and_key_mask():
    torch.manual_seed(0)
    layout = TokenLayout((3, 5, 6), 7, "suffix")
    q, k, v = (torch.randn(2, 2, layout.seq_len, 16) for _ in range(3))
    key_mask = torch.ones(2, layout.seq_len, dtype=torch.bool)
    key_mask[0, -3:] = False
    out = fastdit.attention(q, k, v, "sta", layout=layout, key_mask=key_mask, tile=(1, 2, 3), window=(1, 1, 1),
                            dense_steps=0)
    for b in range(2):
        mask = sta_token_mask(layout, (1, 2, 3), (1, 1, 1), key_valid=key_mask[b])
        assert_matches_masked_dense(q[b:b + 1], k[b:b + 1], v[b:b + 1], out[b:b + 1], [mask, mask])
    dense, info = fastdit.attention(q, k, v, "sta", layout=layout, step=0, num_steps=4, return_info=True,
                                    tile=(1, 2, 3), window=(1, 1, 1), dense_steps=0.25)
    assert info["dense"] and info["density"] == 1.0
    reference = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert torch.allclose(dense, reference, atol=1e-6)


def test_functional_attention_rejects_bad_input():
    layout = TokenLayout((2, 3, 4))
    q = torch.randn(1, 2, layout.seq_len, 8)
    with pytest.raises(ValueError, match="tokens but the layout"):
        fastdit.attention(q[:, :, :-1], q[:, :, :-1], q[:, :, :-1], "sta", layout=layout)
    with pytest.raises(ValueError, match="unknown method"):
        fastdit.attention(q, q, q, "nope", layout=layout)
    with pytest.raises(ValueError, match="3 triples"):
        fastdit.attention(q, q, q, "sta", layout=layout, window=[(1, 1, 1)] * 3)
