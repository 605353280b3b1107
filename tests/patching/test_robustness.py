"""Interrupts, shared schedulers, backend changes and bad options: nothing crashes, nothing leaks."""
import os
import signal
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
import torch

import fastdit
from fastdit.pipelines.tiny import TINY_TEST_DEFAULTS, tiny

from helpers import nothing_installed
from tiny_transformers import tiny_wan, wan_inputs

STA = dict(tile=(1, 2, 2), window=(1, 3, 3))


def _generate(pipe, name="wan", **overrides):
    kwargs = {**TINY_TEST_DEFAULTS[name], **overrides}
    with torch.no_grad():
        out = pipe(prompt="a red fox", generator=torch.Generator().manual_seed(0), output_type="np", **kwargs)
    return np.asarray(out.frames)


_CHILD = textwrap.dedent("""
    import signal
    import numpy as np, torch, torch.nn.functional as F, fastdit
    from fastdit.pipelines.tiny import TINY_TEST_DEFAULTS, tiny
    # a shell without job control starts background jobs with SIGINT ignored, and Python then keeps
    # it ignored: the suite run as `... &` (CI, nohup) would wait here forever. Take Ctrl-C as Python does.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    pipe = tiny("wan")
    kwargs = {**TINY_TEST_DEFAULTS["wan"], "num_inference_steps": 4}
    def run(**extra):
        with torch.no_grad():
            return np.asarray(pipe(prompt="a fox", generator=torch.Generator().manual_seed(0), output_type="np",
                                   **{**kwargs, **extra}).frames)
    reference = run(num_inference_steps=2)
    p = fastdit.patch(pipe, "sta", tile=(1, 2, 2), window=(1, 3, 3), dense_steps=0)
    def step_end(pipeline, i, t, tensors):
        if i == 1:  # mid-generation: wait here, however long the parent takes, for its SIGINT
            print("STEP", flush=True)
            while True:
                signal.pause()  # returns only through the KeyboardInterrupt the SIGINT raises
        return tensors
    try:
        run(callback_on_step_end=step_end)
        print("NOT INTERRUPTED", flush=True)
    except KeyboardInterrupt:
        pass
    assert torch._C._len_torch_function_stack() == 0, "a torch function mode was left on the stack"
    q = torch.randn(1, 2, 8, 4)
    assert torch.equal(F.scaled_dot_product_attention(q, q, q), F.scaled_dot_product_attention(q, q, q))
    assert p.stats.sparse_calls > 0
    p.remove()
    for name, module in pipe.transformer.named_modules():
        assert "forward" not in module.__dict__ and not module._forward_pre_hooks, name
        proc = getattr(module, "processor", None)
        assert proc is None or "_attention_backend" not in proc.__dict__, name
    assert "step" not in pipe.scheduler.__dict__
    assert np.array_equal(run(num_inference_steps=2), reference)
    print("OK", flush=True)
""")


def test_real_sigint_mid_generation_leaves_nothing_behind():
    """A real Ctrl-C (SIGINT) in the middle of a patched generation: the child blocks in its step
    callback until the signal arrives, so the outcome does not depend on the machine's load."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    child = subprocess.Popen([sys.executable, "-c", _CHILD], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=env)
    try:
        line = child.stdout.readline()
        assert line.strip() == "STEP", line + child.stderr.read()
        child.send_signal(signal.SIGINT)
        out, err = child.communicate(timeout=300)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == 0, err[-3000:]
    assert "NOT INTERRUPTED" not in out, "the signal arrived after the generation finished"
    assert out.strip().splitlines()[-1] == "OK", out + err[-3000:]


def test_keyboard_interrupt_in_a_hook_leaves_nothing_behind():
    model = tiny_wan()
    inputs = wan_inputs(frames=2, height=8, width=8)
    with torch.no_grad():
        reference = model(**inputs).sample
    p = fastdit.patch(model, "sta", dense_steps=0, **STA)
    attn = model.blocks[1].attn1

    def interrupt(module, args):
        raise KeyboardInterrupt

    handle = attn.register_forward_pre_hook(interrupt)
    with pytest.raises(KeyboardInterrupt), torch.no_grad():
        model(**inputs)
    handle.remove()
    assert torch._C._len_torch_function_stack() == 0
    q = torch.randn(1, 2, 8, 4)
    torch.nn.functional.scaled_dot_product_attention(q, q, q)  # plain SDPA is not intercepted
    p.remove()
    nothing_installed(model)
    with torch.no_grad():
        assert torch.equal(model(**inputs).sample, reference)


def test_two_patches_sharing_a_scheduler_keep_their_own_tracking():
    from diffusers import WanPipeline

    first = tiny("wan")
    second = WanPipeline(**{**first.components, "transformer": tiny("wan", seed=1).transformer})
    assert second.scheduler is first.scheduler
    older = fastdit.patch(first, "sta", dense_steps=1, **STA)
    newer = fastdit.patch(second, "sta", dense_steps=1, **STA)
    newer.remove()  # the older patch's step tracking must survive
    _generate(first, num_inference_steps=3)
    layers = len(older.layers)
    assert older.stats.dense_calls == 1 * 2 * layers and older.stats.sparse_calls == 2 * 2 * layers
    older.remove()
    assert "step" not in first.scheduler.__dict__ and "set_timesteps" not in first.scheduler.__dict__


@pytest.fixture
def restore_active_backend():
    """``set_attention_backend`` also sets diffusers' process-wide active backend: put it back."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    active = _AttentionBackendRegistry._active_backend
    yield
    _AttentionBackendRegistry.set_active_backend(active)


def test_attention_backend_set_while_patched_is_kept_out_and_restored(restore_active_backend):
    from diffusers.models.attention_dispatch import AttentionBackendName

    model = tiny_wan()
    inputs = wan_inputs(frames=2, height=8, width=8)
    with fastdit.patch(model, "sta", dense_steps=0, **STA) as p:
        model.set_attention_backend("_native_math")
        with warnings.catch_warnings(record=True) as caught, torch.no_grad():
            warnings.simplefilter("always")
            model(**inputs)
        assert any("_native_math" in str(w.message) for w in caught)
        assert p.stats.sparse_calls == len(p.layers) and p.stats.fallback_calls == 0  # fastdit stayed in charge
    processor = model.blocks[0].attn1.processor
    assert processor._attention_backend == AttentionBackendName("_native_math")  # the user's choice, restored


def test_patch_time_errors_are_clear():
    model = tiny_wan()
    with pytest.raises(TypeError, match="method name"):
        fastdit.patch(model, ["sta"])
    with pytest.raises(ValueError, match="method name"):
        fastdit.patch(model, ["sta"])
    with pytest.raises(ValueError, match="backend must be one of"):
        fastdit.patch(model, "sta", backend="cuda")
    with pytest.raises(ValueError, match="window must be"):
        fastdit.patch(model, "sta", window=3)
    nothing_installed(model)
    with fastdit.patch(model, "sta", window=[3, 3, 3]) as p:  # any sequence of three ints
        assert p.config.window == (3, 3, 3)


def test_triton_backend_without_a_gpu_is_refused_at_patch_time(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    model = tiny_wan()
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        fastdit.patch(model, "sta", backend="triton")
    nothing_installed(model)


def test_mask_and_plan_errors_name_the_problem():
    model = tiny_wan()
    p = fastdit.patch(model, "sta", record_masks=True, dense_steps=0, **STA)
    with torch.no_grad():
        model(**wan_inputs(frames=2, height=8, width=8))
    with pytest.raises(TypeError, match="layer must be an int"):
        p.mask(1.5)
    with pytest.raises(ValueError, match="head must be an int"):
        p.mask(0, 0.5)
    assert p.mask(0).shape == (32, 32) and p.last_plan(0) is not None
    p.remove()
    with pytest.raises(RuntimeError, match="removed"):
        p.mask(0)
    q = fastdit.patch(model, "sta", dense_steps=0, **STA)
    with pytest.raises(RuntimeError, match="record_masks=True"):
        q.last_plan(0)
    q.remove()
