"""The same call gives the same output, for every method (issue 46).

A bare patched transformer is called twice with the same inputs (same timestep, hidden states,
seed option), as diffusers' own model tests do; the two outputs must be equal bit for bit. Also
inside a run of several calls: a call's output depends on its inputs, never on how many calls came
before (optiprune's random draw is keyed to the timestep and its ``seed`` option)."""
import pytest
import torch
from tiny_transformers import tiny_wan, wan_inputs

import fastdit
from fastdit.methods import base

#: Small options so that every method really runs sparse on the tiny grid (3 x 5 x 7 tokens).
SMALL = {"sta": dict(tile=(1, 2, 2), window=(1, 3, 3)), "sparge": dict(tile=(1, 2, 2), topk=0.3),
         "svg": dict(block_size=16, density=0.3), "svg2": dict(q_clusters=4, k_clusters=6, top_p=0.5),
         "radial": dict(block_size=64), "window": dict(tile=(1, 2, 2), window=(1, 3, 3)),
         "optiprune": dict(randomness=0.5), "auto": None}


def every_method():
    return sorted(name for name in base._REGISTRY if SMALL.get(name, {}) is not None)


@pytest.mark.guard_defaults
@pytest.mark.parametrize("guard", [None, False], ids=["guard-default", "guard-off"])
@pytest.mark.parametrize("method", every_method())
def test_two_identical_calls_give_identical_outputs(method, guard):
    model = tiny_wan()
    inputs = wan_inputs(frames=5, height=10, width=14, batch=1)
    patch = fastdit.patch(model, method, dense_steps=0, dense_layers=0, guard=guard, **SMALL.get(method, {}))
    try:
        with torch.no_grad():
            first = model(**inputs, return_dict=False)[0]
            second = model(**inputs, return_dict=False)[0]
            # another timestep in between, then the first again: same output as the first call
            model(**{**inputs, "timestep": torch.full((1,), 500.0)}, return_dict=False)
            third = model(**inputs, return_dict=False)[0]
        assert patch.stats.sparse_calls > 0 or method == "dense"
    finally:
        patch.remove()
    assert torch.equal(first, second), f"{method}: two identical calls differ"
    assert torch.equal(first, third), f"{method}: a call's output depends on the calls before it"


def test_optiprune_draw_follows_the_timestep_and_seed():
    model = tiny_wan()
    inputs = wan_inputs(frames=5, height=10, width=14, batch=1)
    outs = {}
    for seed in (0, 1):
        patch = fastdit.patch(model, "optiprune", dense_steps=0, dense_layers=0, randomness=1.0, seed=seed, guard=False)
        with torch.no_grad():
            outs[seed] = model(**inputs, return_dict=False)[0]
            outs[seed, "t"] = model(**{**inputs, "timestep": torch.full((1,), 400.0)}, return_dict=False)[0]
        patch.remove()
    assert not torch.equal(outs[0], outs[1])  # the seed option changes the draw
