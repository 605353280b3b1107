"""A method defined in this file (no list edited anywhere) gets every generic check from the registry.

``docs/adding_a_method.md`` walks through the same toy: a block-sparse method that keeps, for each
query block, the key blocks within ``band`` blocks of it (model token order). Registered by the
fixture, unregistered afterwards; what it supports follows from its declared capabilities
(``Method.ring``, ``auto_candidate``, ``engine_geometry``, ``cost_model``, ``candidates``).
"""
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

import fastdit
from fastdit import TokenLayout
from fastdit.methods.base import methods_taking, methods_with, option, register_method, unregister_method
from fastdit.methods.block_sparse import BlockSparseConfig, BlockSparseMethod
from fastdit.plan import BlockPlan

from tiny_transformers import tiny_wan, wan_inputs


@dataclass
class BandConfig(BlockSparseConfig):
    """Options of the toy band method."""

    band: int = option(1, "key blocks kept on each side of a query block", range=(0, None), widget="number")
    block: int = option(16, "tokens per block", range=(1, None), widget="number")


class Band(BlockSparseMethod):
    """Each query block attends the key blocks within ``band`` blocks of it (model token order)."""

    name = "toy_band"
    config_cls = BandConfig
    default_options = {"dense_steps": 0, "dense_layers": 0}
    auto_candidate = True  # auto may choose it per head
    engine_geometry = "frames"  # offered to vllm-omni: it needs no (H, W) split
    cost_model = "plan"  # python -m fastdit.eval.predict models the plan prepare builds

    @classmethod
    def candidates(cls, layout):
        return [{"band": 0}, {"band": 1}]

    def prepare(self, layout, heads, device):
        block, seq = self.config.block, layout.seq_len
        blocks = -(-seq // block)
        rows = [[j for j in range(blocks) if abs(i - j) <= self.config.band] for i in range(blocks)]
        width = max(len(r) for r in rows)
        indices = torch.zeros(1, 1, blocks, width, dtype=torch.int32)
        for i, row in enumerate(rows):
            indices[0, 0, i, :len(row)] = torch.tensor(row, dtype=torch.int32)
        counts = torch.tensor([[[len(r) for r in rows]]], dtype=torch.int32)
        return BlockPlan(kv_indices=indices.to(device), kv_counts=counts.to(device), block_m=block, block_n=block,
                         seq_len=seq, name=f"toy_band_b{self.config.band}")


@pytest.fixture
def toy():
    register_method(Band)
    try:
        yield Band
    finally:
        unregister_method(Band.name)
        from fastdit.integrations import vllm_omni

        vllm_omni.forget_plugin(Band.name)


def qkv(seq, heads=2, dim=16, seed=0, batch=1):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(batch, heads, seq, dim, generator=gen) for _ in range(3))


def run(model, inputs):
    with torch.no_grad():
        return model(**inputs).sample


# -- the generic checks (any registered method name and options) --------------------------------
def check_exact_at_full_density(name, options, layout):
    q, k, v = qkv(layout.seq_len)
    out, info = fastdit.attention(q, k, v, name, layout=layout, return_info=True, **options)
    assert info["density"] == pytest.approx(1.0)
    assert (out - F.scaled_dot_product_attention(q, k, v)).abs().max() <= 1e-5


def check_patch_remove_and_stats(name, options):
    model, inputs = tiny_wan(), wan_inputs()
    reference = run(model, inputs)
    with fastdit.patch(model, name, **options) as p:
        patched = run(model, inputs)
        assert p.stats.sparse_calls == len(p.layers) and p.stats.fallback_calls == 0
        assert p.stats.effective_density < 1.0
    assert (patched - reference).abs().max() > 1e-4, "the method changed nothing: the check would prove nothing"
    assert torch.equal(run(model, inputs), reference)  # remove() restores the model bit for bit
    assert not hasattr(model, "_fastdit_patch")


def check_compile(name, options):
    """torch.compile with the aot_eager backend (the graph capture, no code generation: seconds on a
    CPU; inductor is covered for the built-in methods by the slow tests of test_patch_runtime.py)."""
    torch._dynamo.reset()
    model, inputs = tiny_wan(), wan_inputs()
    try:
        with torch.no_grad(), fastdit.patch(model, name, **options) as p:
            eager = model(**inputs).sample
            compiled = torch.compile(model, backend="aot_eager")(**inputs).sample
            assert p.stats.fallback_calls == 0
    finally:
        torch._dynamo.reset()
    assert (compiled - eager).abs().max() <= 1e-5


# -- the toy -------------------------------------------------------------------------------------
def test_toy_method_is_exact_at_density_one(toy):
    assert "toy_band" in fastdit.method_names()
    check_exact_at_full_density("toy_band", {"band": 100}, TokenLayout((2, 4, 6)))


def test_toy_method_patches_removes_and_counts(toy):
    check_patch_remove_and_stats("toy_band", {"band": 0, "block": 8})


def test_toy_method_under_torch_compile(toy):
    check_compile("toy_band", {"band": 0, "block": 8})


def test_toy_method_runs_under_ring_attention(toy):
    """``ring`` comes with ``BlockSparseMethod``: its plans are cut into ring steps that merge to the
    whole plan (the two-process run itself is tests/parallel/test_ring.py's, over the built-in methods)."""
    from fastdit.methods.parallel import ring_attend, ring_methods, ring_refusal, ring_shards
    from fastdit.plan import run_plan

    assert "toy_band" in ring_methods()
    instance = Band(band=1, block=8)
    assert ring_refusal(instance) is None
    layout, ring = TokenLayout((4, 4, 4)), 2
    q, k, v = qkv(layout.seq_len, heads=3)
    plan = instance.prepared(layout, 3, "cpu")
    assert plan.density < 0.7
    whole = run_plan(q, k, v, plan)
    shard, position = ring_shards(layout, ring)
    local = layout.seq_len // ring
    order = shard * local + position
    call = [torch.empty_like(t).index_copy_(2, order, t) for t in (q, k, v)]
    outs = []
    for rank in range(ring):
        def key_shard(s):
            part = slice(s * local, (s + 1) * local)
            return call[1][:, :, part], call[2][:, :, part], None

        outs.append(ring_attend(plan, call[0][:, :, rank * local:(rank + 1) * local], key_shard, shard, position,
                                rank, ring)[0])
    merged = torch.cat(outs, 2).index_select(2, order)
    assert (merged - whole.float()).abs().max() <= 1e-5


def test_toy_method_is_an_auto_candidate(toy):
    from fastdit.calibration.candidates import auto_candidates, auto_methods, candidates_for, has_candidates

    assert auto_methods()[-1] == "toy_band"  # rank 100: after the built-in ones
    assert has_candidates("toy_band") and candidates_for("toy_band") == [{"band": 0}, {"band": 1}]
    assert {"method": "toy_band", "band": 1} in auto_candidates(None)
    layout = TokenLayout((2, 4, 6))
    q, k, v = qkv(layout.seq_len)
    candidates = [{"method": "toy_band", "band": 0, "block": 8}]
    out = fastdit.attention(q, k, v, "auto", layout=layout, candidates=candidates, choices={"0_0_0": 0, "0_0_1": None})
    alone = fastdit.attention(q[:, :1], k[:, :1], v[:, :1], "toy_band", layout=layout, band=0, block=8)
    assert torch.allclose(out[:, :1], alone, atol=1e-6)
    assert torch.allclose(out[:, 1:], F.scaled_dot_product_attention(q[:, 1:], k[:, 1:], v[:, 1:]), atol=1e-5)


def test_toy_method_is_served_to_engines(toy):
    from fastdit.integrations import vllm_omni

    assert vllm_omni.entry_points()["fastdit_toy_band"] == "fastdit.integrations.vllm_omni:fastdit_toy_band"
    layout = TokenLayout((2, 4, 6))
    q, k, v = qkv(layout.seq_len)
    params = {"band": 0, "block": 8, "total_latent_frames": 2, "patches_per_frame": 24, "dense_steps": 0}
    out = vllm_omni.fastdit_toy_band(*(t.permute(0, 2, 1, 3) for t in (q, k, v)), params)
    alone = fastdit.attention(q, k, v, "toy_band", layout=TokenLayout((2, 1, 24)), band=0, block=8)
    assert torch.equal(out.permute(0, 2, 1, 3), alone)
    assert vllm_omni.fastdit_toy_band.stats.sparse_calls == 1


def test_capabilities_follow_the_declaration(toy):
    """Quantisation with the block-sparse config, the cost model from ``cost_model``; a subclass that
    declares no engine geometry is not served."""
    from fastdit.eval.predict import modelled_methods
    from fastdit.integrations import vllm_omni

    assert "toy_band" in methods_taking("quant") and "toy_band" in methods_with("block_sparse")
    assert "toy_band" in modelled_methods()

    class Private(Band):
        name = "toy_private"
        engine_geometry = None
        ring = False

    register_method(Private)
    try:
        assert "fastdit_toy_private" not in vllm_omni.entry_points()
        with pytest.raises(AttributeError):
            vllm_omni.fastdit_toy_private  # noqa: B018
        from fastdit.methods.parallel import ring_refusal

        assert "does not run under ring attention" in ring_refusal(Private())
    finally:
        unregister_method(Private.name)
    assert "toy_private" not in fastdit.method_names()
