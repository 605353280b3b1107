"""The model matrix's shared pieces: every adapter family on a tiny random-weight transformer (CPU,
fp32), every registered method, and what the tests check them with.

Nothing here trusts what the patch says about itself (no ``Patch.mask``, ``last_plan``,
``last_layout``): the layout of every patched attention call is OBSERVED in the unpatched model.

* Observation (``observe``): the model runs with its own code but its attention made token-wise
  (``layer_capture.observe_attention_calls``: self-attention returns ``value``, cross-attention
  zeros), so no layer mixes tokens and each row of each patched layer's ``q`` depends on its own
  token only. Run again with new latents: the rows that change are the video tokens; the rows
  that do not are the text / conditioning tokens. Run again with new text embeddings: they must
  reach those rows.
* ``METHODS`` is queried at collection, so a newly registered method joins every matrix test;
  ``method_options`` gives each method its class's ``tiny_options`` and then this module's
  choices for the tiny test grids (``OPTIONS``), with every call sparse (``COMMON``).
* ``check_sta_layers``: every traced sparse call equals float64 attention under ``sta_token_mask``
  of the observed layout, with the text-padding key mask read from the model's inputs.
* ``installed_state`` / ``assert_clean`` / ``assert_installed``: what fastdit may leave on a model.

Models, references and observations are cached per process (``model``, ``reference``, ``observe``),
so the test files that use them share one build per family.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from fastdit.layout import TokenLayout
from fastdit.methods import get_method, method_names
from fastdit.pipelines import find_adapter, registered_adapters

from layer_capture import assert_matches_masked_dense, changed_rows, observe_attention_calls, sta_token_mask
from tiny_models import TINY, run

# Test case -> adapter family (several cases can exercise one adapter, e.g. CogVideoX 1.0 and 1.5).
CASE_FAMILY = {name: name for name in TINY}
CASE_FAMILY["cogvideox15"] = "cogvideox"

UNPATCHABLE = {a.family for a in registered_adapters() if a.unsupported}
CASES = [name for name in TINY if CASE_FAMILY[name] not in UNPATCHABLE]
METHODS = list(method_names())  # queried at collection: new methods join the matrix automatically

#: Sliding tile small enough to be really sparse at tiny sizes (mask density < 0.7 at both grids).
#: The windows differ along H and W (1 and 3 tiles) and the second grid swaps H and W, so a
#: transposed grid shows.
STA = {"video": dict(tile=(1, 2, 2), window=(3, 1, 3)), "image": dict(tile=(1, 2, 2), window=(1, 1, 3))}
#: A second grid per kind, not a multiple of the tile, with H and W the other way round.
OTHER_GRID = {"video": (2, 7, 5), "image": (1, 7, 5)}
#: Options of the other methods, so their plans are sparse at tiny sizes.
OPTIONS = {"radial": {"video": dict(block_size=64)},
           "sparge": {"video": dict(tile=(1, 2, 2)), "image": dict(tile=(1, 2, 2))},
           "sla": {"video": dict(tile=(1, 2, 2), topk_ratio=0.3), "image": dict(tile=(1, 2, 2), topk_ratio=0.3)},
           "vsa": {"video": dict(block_size_3d=(1, 2, 2), top_k_ratio=0.3),
                   "image": dict(block_size_3d=(1, 2, 2), top_k_ratio=0.3)}}
COMMON = dict(dense_steps=0, dense_layers=0)
MAX_DENSITY = 0.7


def kind(case):
    return "video" if TINY[case].video else "image"


def grids(case):
    return (TINY[case].grid, OTHER_GRID[kind(case)])


def sta_options(case):
    return {**COMMON, **STA[kind(case)]}


def method_options(method, case):
    if method == "dense":
        return {}
    if method == "sta":
        return sta_options(case)
    cls = get_method(method)
    valid = {f for f in cls.config_cls.__dataclass_fields__}
    # The method's own tiny-model preset, then this file's choices for the tiny test grids.
    chosen = {**cls.tiny_options, **OPTIONS.get(method, {}).get(kind(case), {})}
    return {**COMMON, **{k: v for k, v in chosen.items() if k in valid}}


def method_applies(method, case):
    adapter = find_adapter(model(case))
    m = get_method(method)
    try:
        m.check_family(adapter, m.resolve(m.make_config(**method_options(method, case)), adapter.family))
    except ValueError:
        return False
    return True


_MODELS, _REFS, _OBSERVED = {}, {}, {}


def model(case):
    if case not in _MODELS:
        _MODELS[case] = TINY[case].build(0)
    return _MODELS[case]


def inputs(case, grid=None):
    return TINY[case].inputs(model(case), grid or TINY[case].grid)


def reference(case, grid=None):
    key = (case, grid)
    if key not in _REFS:
        _REFS[key] = run(model(case), inputs(case, grid))
    return _REFS[key]


def quiet_run(m, kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return run(m, kwargs)


# -- what fastdit may leave on a model ---------------------------------------------------------------

NOT_SET = "<not set>"


def installed_state(module):
    """Per submodule: its hooks, whether it has an instance ``forward`` or the fastdit mark, and its
    processor's instance ``_attention_backend``."""
    state = {}
    for name, sub in module.named_modules():
        processor = getattr(sub, "processor", None)
        backend = None if processor is None else processor.__dict__.get("_attention_backend", NOT_SET)
        state[name] = (tuple(sub._forward_pre_hooks), tuple(sub._forward_hooks), "forward" in sub.__dict__,
                       "_fastdit_patch" in sub.__dict__, backend)
    return state


def fastdit_backends_registered():
    """Private fastdit members still registered with diffusers' attention backends."""
    try:
        from diffusers.models.attention_dispatch import _AttentionBackendRegistry
    except ImportError:
        return []
    return [str(name) for name in _AttentionBackendRegistry._backends if "fastdit" in str(getattr(name, "value", name))]


def assert_clean(module, before=None):
    """Nothing of fastdit is left in ``module``: no forward hook or pre-hook, no instance ``forward``,
    no ``_fastdit_patch`` mark, no processor pinned to a fastdit backend; and with ``before`` (an
    ``installed_state`` taken before patching) every processor's backend is what it was."""
    for name, sub in module.named_modules():
        where = name or type(sub).__name__
        assert not sub._forward_pre_hooks, f"forward pre-hook left on {where}"
        assert not sub._forward_hooks, f"forward hook left on {where}"
        assert "forward" not in sub.__dict__, f"instance forward left on {where}"
        assert "_fastdit_patch" not in sub.__dict__, f"fastdit mark left on {where}"
        processor = getattr(sub, "processor", None)
        if processor is not None:
            backend = processor.__dict__.get("_attention_backend")
            assert "fastdit" not in str(getattr(backend, "value", backend)), f"fastdit backend left on {where}"
    assert not fastdit_backends_registered(), "fastdit backends left registered with diffusers"
    if before is not None:
        assert installed_state(module) == before


def assert_installed(module, layer_names):
    """While patched: each patched module has its instance ``forward`` (the "nothing left" checks
    look for what is really installed)."""
    modules = dict(module.named_modules())
    for name in layer_names:
        assert "forward" in modules[name].__dict__, f"{name} is not intercepted"
    assert module._forward_pre_hooks, "no forward pre-hook on the transformer"


# -- observing the model -------------------------------------------------------------------------------

@dataclass
class Observed:
    """One patched module's attention call in the unpatched model."""

    name: str
    q_len: int
    k_len: int
    video_rows: torch.Tensor  # bool (S,): rows that new latents change
    text_rows_changed: torch.Tensor  # bool (S,): rows that new text embeddings change

    @property
    def text_len(self):
        return int((~self.video_rows).sum())

    @property
    def position(self):
        rows = (~self.video_rows).nonzero().flatten().tolist()
        if not rows:
            return "none"
        if rows == list(range(len(rows))):
            return "prefix"
        if rows == list(range(self.q_len - len(rows), self.q_len)):
            return "suffix"
        return f"rows {rows}"

    def layout(self, grid):
        """The layout of this call: the test's grid and the observed text rows."""
        return TokenLayout(grid, self.text_len, self.position if self.text_len else "none")


def fresh_like(tensor, seed):
    """New standard-normal values of ``tensor``'s shape and dtype (CPU), from ``seed``."""
    return torch.randn(tensor.shape, generator=torch.Generator().manual_seed(seed), dtype=tensor.dtype)


def observe_calls(m, modules, kwargs, latents="hidden_states", text="encoder_hidden_states"):
    """``{name: Observed}`` for each module in ``modules`` (``[(name, module)]``): three runs of the
    unpatched model with token-wise attention, the second with new latents, the third with new text
    embeddings (when the model takes ``text``)."""
    base = observe_attention_calls(m, modules, kwargs)
    new_latents = observe_attention_calls(m, modules, dict(kwargs, **{latents: fresh_like(kwargs[latents], 1234)}))
    new_text = (observe_attention_calls(m, modules, dict(kwargs, **{text: fresh_like(kwargs[text], 4321)}))
                if text in kwargs else base)
    assert [c[0] for c in base] == [c[0] for c in new_latents] == [c[0] for c in new_text]
    observed = {}
    for (name, q, k), (_, q_latents, _), (_, q_text, _) in zip(base, new_latents, new_text):
        assert name not in observed, f"{name}: more than one attention call per forward (batch 1)"
        observed[name] = Observed(name, q.shape[-2], k.shape[-2], changed_rows(q, q_latents), changed_rows(q, q_text))
    assert set(observed) == {name for name, _ in modules}, "a patched module made no attention call"
    return observed


def observe(case, grid=None):
    grid = grid or TINY[case].grid
    if (case, grid) not in _OBSERVED:
        m = model(case)
        _OBSERVED[(case, grid)] = observe_calls(m, find_adapter(m).attention_modules(m), inputs(case, grid))
    return _OBSERVED[(case, grid)]


# -- text padding, from the model's inputs ----------------------------------------------------------------

#: Families whose attention mask also drops padded query rows (HunyuanVideo 1.5's valid[q] & valid[k]).
QUERY_MASKED = {"hunyuan_video15"}


def text_validity(case, kwargs):
    """Bool validity of the non-video tokens of the joint attention calls, in sequence order, read
    from the inputs; None when every such token is valid."""
    family = CASE_FAMILY.get(case, case)
    if family == "hunyuan_video":
        return kwargs["encoder_attention_mask"][0].bool()
    if family == "qwen_image":
        return kwargs["encoder_hidden_states_mask"][0].bool()
    if family == "hunyuan_video15":
        # The model lines its conditioning up as [valid image, valid byT5, valid text, invalid image,
        # invalid byT5, invalid text]; image tokens are invalid for text-to-video (all-zero image_embeds).
        image = kwargs["image_embeds"][0]
        text, text_2 = kwargs["encoder_attention_mask"][0].bool(), kwargs["encoder_attention_mask_2"][0].bool()
        valid = int(text.sum()) + int(text_2.sum()) + (image.shape[0] if bool(image.any()) else 0)
        return torch.arange(image.shape[0] + text.numel() + text_2.numel()) < valid
    return None  # (Mochi drops its padded text tokens before attention: the ones it passes are valid)


def key_validity(case, kwargs, layout):
    """Bool ``(S,)`` key validity of a call with ``layout``, or None (all valid)."""
    text = text_validity(case, kwargs) if layout.text_len else None
    if text is None:
        return None
    assert text.numel() == layout.text_len, f"{layout.text_len} text rows observed, the inputs have {text.numel()}"
    valid = torch.ones(layout.seq_len, dtype=torch.bool)
    valid[layout.text_positions()] = text
    return valid


def reference_mask(case, kwargs, layout, tile, window):
    """The sliding-tile token mask of a call, built from the layout and the inputs alone."""
    valid = key_validity(case, kwargs, layout)
    mask = sta_token_mask(layout, tile, window, valid)
    if valid is not None and CASE_FAMILY.get(case, case) in QUERY_MASKED:
        mask &= valid[:, None]
    return mask


def check_sta_layers(case, kwargs, grid, observed, trace, tile, window):
    """Every traced sparse call == float64 attention under the independently built mask."""
    assert trace.calls, "no sparse attention call was made"
    densities = []
    for name, (q, k, v, scale, out) in zip(trace.layers, trace.calls):
        layout = observed[name].layout(grid)
        assert q.shape[0] == 1 and q.shape[2] == k.shape[2] == layout.seq_len, f"{name}: {tuple(q.shape)} vs {layout}"
        mask = reference_mask(case, kwargs, layout, tile, window)
        density = mask.double().mean().item()
        assert density < MAX_DENSITY, f"{name}: mask density {density:.2f}, not sparse enough to prove anything"
        densities.append(density)
        try:
            assert_matches_masked_dense(q, k, v, out, [mask] * q.shape[1], scale)
        except AssertionError as error:
            raise AssertionError(f"{name} ({layout.describe()}): {error}") from None
    return densities
