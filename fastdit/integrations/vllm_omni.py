"""fastdit methods as vllm-omni sparse-attention plugins (entry-point group ``vllm_omni.sparse_attn``).

vllm-omni (with its sparse-attention plugin interface, vllm-project/vllm-omni#4493: not in the
released 0.30.0, docs/serving.md) serves DiT models and hands the attention of a layer configured with the
``SPARSE_ATTN`` backend to a callable found by name in the entry-point group
``vllm_omni.sparse_attn`` (its ``vllm_omni/diffusion/attention/backends/sparse_attn.py``). The
contract, as that file states it::

    fn(query, key, value, params: dict, is_causal: bool, softmax_scale: float) -> Tensor

with ``query``/``key``/``value`` ``[batch, seq_len, num_heads, head_dim]`` (BSND) and the result in
the same layout. ``params`` is one flat dict merged from three tiers (static < per-forward <
dynamic, ``None`` values dropped): the plugin's configured options (``extra={"backend": ...,
"params": {...}}``), the per-forward state (``denoise_step_idx``, ``total_denoise_steps``: per-sample
tensors; ``latent_shape`` = the pre-patch latent grid ``(T, H, W)`` and ``patch_size`` =
``(p_t, p_h, p_w)``, per-sample ``[n, 3]`` tensors; optionally ``total_latent_frames`` and
``patches_per_frame``, ints or tensors) and opaque per-call extras. ``attn_mask`` and
``full_attn_spans`` (per-sample lists of ``[start, end)`` spans of full attention, e.g. text) reach
a plugin only if ``fn.capabilities`` advertises ``supports_attention_mask`` /
``supports_full_attn_spans``; both are advertised here.

fastdit registers one callable per method that needs no layer identity (``Method.engine_geometry``
set): ``fastdit_sta``, ``fastdit_radial``, ``fastdit_sparge``, ``fastdit_svg``, ``fastdit_svg2``,
``fastdit_todo`` and ``fastdit_tome`` (``prune`` and ``window`` exist to cache a layer's output
across steps, so they are not offered). ``plugin(method)`` makes them (one per method, cached);
the module attributes ``fastdit_<method>`` that ``pyproject.toml``'s entry points name are looked
up through it, and ``entry_points()`` lists them (a test checks pyproject against it). One call:

* **Layout.** The token grid is ``latent_shape // patch_size`` (floor, as a strided patch
  embedding cuts it); with only the derived fields, ``(total_latent_frames, 1,
  patches_per_frame)`` for the methods that use frames only (radial, svg, svg2); sta, sparge, todo
  and tome need the ``(H, W)`` split and run dense then. ``full_attn_spans`` give the text (or other
  conditioning) tokens, which are never sparsified: one span at the start or the end of the
  sequence is a text prefix / suffix; spans covering every token run dense by design. Padding
  comes from ``attn_mask``: a key mask (``(B, Sk)``, ``(B, 1, 1, Sk)``, bool or 0 / -inf float) runs
  the method with masked keys. Per-sample fields: one row per batch element, or one row (or equal
  rows) for all.
* **Step.** ``denoise_step_idx`` (0-based) and ``total_denoise_steps`` drive ``dense_steps``; a
  step index is required when ``dense_steps`` is not 0, the total when it is a fraction.
* **Options** are the static params with the names and validation of ``fastdit.patch`` (a bad
  value raises ``ValueError`` at the first call). The other keys the contract defines (listed in
  ``CONTRACT_KEYS``) are read or ignored; any other key (a per-call extra an engine adds, or a
  misspelt option) is ignored with one warning naming it and the valid options.
* **Runs dense, counted in ``fn.stats`` (a ``PatchStats``) with the reason:** no geometry, a grid
  that does not match the sequence, spans that are neither a prefix nor a suffix, a mask that is
  not a key mask (run with the mask as given), ``is_causal=True`` (causal dense attention),
  cross-attention or grouped-query heads, dtypes the kernels do not take, per-sample fields that
  do not map to the batch. ``ValueError`` where dense would be wrong too: a mask that does not
  broadcast to ``(B, H, S, Sk)``, tensors that are not 4-D, spans or geometry that are not spans or
  triples.
* **State.** The contract carries no layer identity (the same callable serves every layer, and
  the dispatcher passes no layer name), so options whose state lives per layer across steps are
  refused with a message (``REFUSED``): ``correction="cached"``, svg2's ``warm_start=True`` (the
  plugin's default is ``warm_start=False``), tome's ``match_every > 1``, ``reuse_threshold`` (sparge,
  svg, svg2: a selection kept across steps), and the per-layer
  ``dense_layers > 0`` (plugin default 0), ``layer_settings`` and sta's ``strategy``. Every call is
  therefore independent: no state is shared between layers or requests.

The result is ``fastdit.attention`` of the same call in model order (BHSD), bit for bit: both run
``fastdit.functional.run_call``. Reading the per-sample fields costs one small host copy per call.
"""
from __future__ import annotations

import dataclasses
import threading
import warnings

import torch

from fastdit.functional import run_call
from fastdit.intercept import plain_sdpa
from fastdit.layout import TokenLayout
from fastdit.layout import key_mask_from_attn_mask
from fastdit.methods.base import get_method, methods_with, step_inputs_needed
from fastdit.stats import PatchStats

__all__ = ["CONTRACT_KEYS", "REFUSED", "SparseAttentionPlugin", "entry_points", "forget_plugin", "plugin",
           "fastdit_radial", "fastdit_sparge", "fastdit_sta", "fastdit_svg", "fastdit_svg2", "fastdit_todo",
           "fastdit_tome"]

#: ``params`` keys defined by vllm-omni's contract (read here, or ignored): never method options.
CONTRACT_KEYS = frozenset({
    "denoise_step_idx", "total_denoise_steps", "latent_shape", "patch_size", "total_latent_frames",
    "patches_per_frame", "attn_mask", "full_attn_spans", "kv_cache_dtype",
})
#: The entry-point names are ``PREFIX + method``.
PREFIX = "fastdit_"
#: option -> (allowed(value), why it needs a layer identity). Checked on the given options.
REFUSED = {
    "dense_layers": (lambda v: v in (None, 0), "needs the layer index"),
    "layer_settings": (lambda v: v is None, "is keyed by layer index"),
    "strategy": (lambda v: v is None, "is keyed by layer index"),
    "correction": (lambda v: v != "cached", "keeps each layer's correction across steps; use 'pooled' or 'none'"),
    "warm_start": (lambda v: not v, "keeps each layer's k-means centroids across steps"),
    "match_every": (lambda v: v in (None, 1), "keeps each layer's token matching across steps"),
    "reuse_threshold": (lambda v: v is None, "keeps each layer's selection across steps"),
}
_ENGINE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class SparseAttentionPlugin:
    """One fastdit method as a vllm-omni ``SPARSE_ATTN`` callable (see the module docstring).

    Attributes:
        method: the fastdit method name.
        capabilities: what the dispatcher reads: attention masks and full-attention spans.
        stats: a ``PatchStats`` over every call of this callable in the process (all layers and
            requests): dense by design, sparse, and fallbacks with their reasons.
    """

    def __init__(self, method):
        self._method_cls = get_method(method)
        if not self._method_cls.engine_geometry:
            raise ValueError(f"method {method!r} is not offered to engines without layer identity (its "
                             f"engine_geometry is None); offered: {methods_with('engine_geometry')}")
        self.method = method
        self.__name__ = f"{PREFIX}{method}"
        self.capabilities = {"supports_attention_mask": True, "supports_full_attn_spans": True}
        self.stats = PatchStats()
        self._options = {}
        self._lock = threading.Lock()
        self._warned = set()

    def __repr__(self):
        return f"<fastdit vllm-omni plugin {self.__name__}>"

    def reset_stats(self):
        self.stats = PatchStats()

    # -- options ---------------------------------------------------------------------------------
    def options(self, params):
        """The method options in ``params`` (every key outside ``CONTRACT_KEYS``), validated as
        ``fastdit.patch`` validates them, and the resolved config (``Method.resolve`` with the
        engine's defaults: no ``dense_layers``, no svg2 ``warm_start``); cached per distinct options."""
        cls = self._method_cls
        prefix = f"vllm-omni plugin {self.__name__}"
        fields = {f.name for f in dataclasses.fields(cls.config_cls)}
        given = {name: value for name, value in params.items() if name not in CONTRACT_KEYS}
        extras = sorted(str(name) for name in given if name not in fields)
        if extras:  # per-call extras an engine adds: not options of the method, ignored (warned once per set)
            given = {name: value for name, value in given.items() if name in fields}
            with self._lock:
                first = ("extras", tuple(extras)) not in self._warned
                self._warned.add(("extras", tuple(extras)))
            if first:
                warnings.warn(f"fastdit: {prefix}: ignoring params keys {extras}: neither options of {self.method!r} "
                              f"(valid: {sorted(fields)}) nor keys of the plugin contract", stacklevel=3)
        key = repr(sorted(given.items()))
        cached = self._options.get(key)
        if cached is not None:
            return cached
        try:
            cls.make_config(None, **given)  # checked here: the error names the plugin
        except (ValueError, TypeError) as error:
            raise ValueError(f"{prefix}: {error} (contract keys, not options: {sorted(CONTRACT_KEYS)})") from None
        for name, (allowed, why) in REFUSED.items():
            if name in given and not allowed(given[name]):
                raise ValueError(f"{prefix}: option {name}={given[name]!r} {why}, and vllm-omni's plugin contract "
                                 "passes no layer identity (one callable serves every layer); "
                                 "it is not supported here")
        resolved = cls.resolve(options=given, where="engine")
        with self._lock:
            self._options[key] = resolved
        return resolved

    # -- the call ----------------------------------------------------------------------------------
    def __call__(self, query, key, value, params=None, is_causal=False, softmax_scale=None):
        for name, tensor in (("query", query), ("key", key), ("value", value)):
            if not isinstance(tensor, torch.Tensor) or tensor.dim() != 4:
                shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
                raise ValueError(f"{self.__name__}: {name} must be a [batch, seq_len, num_heads, head_dim] tensor, "
                                 f"got {shape}")
        # shapes checked here, in the caller's [batch, seq_len, num_heads, head_dim] layout: deeper
        # down the message named the internal layout and the sequence padded to whole tiles
        shapes = ", ".join(f"{n} {list(t.shape)}" for n, t in (("query", query), ("key", key), ("value", value)))
        if query.shape[-1] != key.shape[-1]:
            raise ValueError(f"{self.__name__}: key head_dim {key.shape[-1]} differs from query head_dim "
                             f"{query.shape[-1]} ({shapes}; [batch, seq_len, num_heads, head_dim])")
        if key.shape[:3] != value.shape[:3] or query.shape[0] != key.shape[0]:
            raise ValueError(f"{self.__name__}: query, key and value must share batch, and key and value seq_len "
                             f"and num_heads ({shapes}; [batch, seq_len, num_heads, head_dim])")
        params = dict(params or {})
        options = self.options(params)
        batch, seq, heads, _ = query.shape
        if batch == 0 or seq == 0:  # nothing to attend: the empty output
            return query.new_zeros(batch, seq, heads, value.shape[-1])
        keys = key.shape[1]
        mask = _mask_4d(params.get("attn_mask"), batch, heads, seq, keys, self.__name__)
        q, k, v = (t.permute(0, 2, 1, 3) for t in (query, key, value))
        size = batch * heads * seq * keys

        def dense(reason, causal=False):
            self._note(reason, size)
            attn_mask = _with_causal(mask, seq, keys) if causal and mask is not None else mask
            out = plain_sdpa(q, k, v, attn_mask=attn_mask, is_causal=causal and mask is None, scale=softmax_scale,
                             enable_gqa=k.shape[1] != heads)
            return out.permute(0, 2, 1, 3)

        if is_causal:
            return dense("is_causal=True: fastdit's methods are bidirectional (ran causal dense attention)", True)
        if query.dtype not in _ENGINE_DTYPES:
            return dense(f"{query.dtype} attention (the kernels take float16, bfloat16 and float32)")
        if keys != seq or key.shape[2] != heads:
            return dense("cross-attention or grouped-query heads (the methods need self-attention)")
        if value.shape[-1] != key.shape[-1]:
            return dense("value head_dim differs from the key's (the methods need equal head dims)")
        key_mask, query_mask, ok = key_mask_from_attn_mask(mask, batch, seq, keys)
        if not ok or query_mask is not None:
            return dense("attn_mask is not a key (padding) mask")
        samples = self._samples(params, batch, seq)
        if isinstance(samples, str):
            return dense(samples)
        if len(set(samples)) == 1:
            return self._run(q, k, v, key_mask, samples[0], options, softmax_scale, mask).permute(0, 2, 1, 3)
        # Samples of one batch at different steps or geometries: one call per sample.
        outs = []
        for b in range(batch):
            row = slice(b, b + 1)
            sample_mask = mask[row] if mask is not None and mask.shape[0] > 1 else mask
            outs.append(self._run(q[row], k[row], v[row], None if key_mask is None else key_mask[row], samples[b],
                                  options, softmax_scale, sample_mask))
        return torch.cat(outs).permute(0, 2, 1, 3)

    def _run(self, q, k, v, key_mask, sample, options, scale, mask):
        """One homogeneous call (BHSD): the method, or dense with the sample's reason."""
        layout, step, total = sample
        size = q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2]
        if not isinstance(layout, TokenLayout):  # a reason (str) or "all": every token is full attention
            if layout == "all":
                self.stats.count_dense(size)
            else:
                self._note(layout, size)
            return plain_sdpa(q, k, v, attn_mask=mask, scale=scale)
        dense_steps = options.dense_steps
        needs_step, needs_total = step_inputs_needed(options)
        if needs_step and step is None:
            raise ValueError(f"{self.__name__}: dense_steps={dense_steps!r} needs denoise_step_idx in params "
                             f"(vllm-omni passes it); or set dense_steps=0")
        if needs_total and total is None:
            raise ValueError(f"{self.__name__}: dense_steps={dense_steps!r} is a fraction and needs "
                             f"total_denoise_steps in params; or give an int count of steps")
        out, ctx = run_call(q, k, v, self.method, options, layout=layout, key_mask=key_mask, step=step or 0,
                            num_steps=total, scale=scale)
        self.stats.count_call(ctx.info, size)
        return out

    def _note(self, reason, size):
        self.stats.count_fallback(reason, size)
        if reason not in self._warned:
            self._warned.add(reason)
            warnings.warn(f"fastdit ({self.__name__}): {reason}; running dense attention", stacklevel=4)

    # -- per-sample fields -----------------------------------------------------------------------------
    def _samples(self, params, batch, seq):
        """Per batch element ``(layout or reason, step, total steps)``, or one reason for the call."""
        steps = _rows(params.get("denoise_step_idx"), 1, batch, "denoise_step_idx")
        totals = _rows(params.get("total_denoise_steps"), 1, batch, "total_denoise_steps")
        for field in (steps, totals):
            if isinstance(field, str):
                return field
        grids = self._grids(params, batch)
        if isinstance(grids, str):
            return grids
        spans = params.get("full_attn_spans")
        spans = [None] * batch if spans is None else _span_rows(spans, batch, self.__name__)
        if isinstance(spans, str):
            return spans
        return [(_layout(grids[b], spans[b], seq),
                 None if steps is None else int(steps[b][0]), None if totals is None else int(totals[b][0]))
                for b in range(batch)]

    def _grids(self, params, batch):
        """Per batch element the post-patch grid ``(T, H, W)``, or a reason (str) for the call."""
        latent, patch = params.get("latent_shape"), params.get("patch_size")
        if latent is not None:
            if patch is None:
                return "latent_shape without patch_size (the grid is latent_shape // patch_size)"
            latent, patch = _rows(latent, 3, batch, "latent_shape"), _rows(patch, 3, batch, "patch_size")
            if isinstance(latent, str) or isinstance(patch, str):
                return latent if isinstance(latent, str) else patch
            for b in range(batch):
                if min(int(x) for x in latent[b]) < 1 or min(int(x) for x in patch[b]) < 1:
                    raise ValueError(f"{self.__name__}: latent_shape {list(latent[b])} and patch_size {list(patch[b])} "
                                     "must be positive ints (T, H, W)")
            return [tuple(int(x) // int(p) for x, p in zip(latent[b], patch[b])) for b in range(batch)]
        frames, per_frame = params.get("total_latent_frames"), params.get("patches_per_frame")
        if frames is not None and per_frame is not None:
            if self._method_cls.engine_geometry == "grid":
                return (f"only frame counts given (total_latent_frames, patches_per_frame): {self.method} needs the "
                        f"(H, W) split of a frame from latent_shape and patch_size")
            frames = _rows(frames, 1, batch, "total_latent_frames")
            per_frame = _rows(per_frame, 1, batch, "patches_per_frame")
            if isinstance(frames, str) or isinstance(per_frame, str):
                return frames if isinstance(frames, str) else per_frame
            return [(int(frames[b][0]), 1, int(per_frame[b][0])) for b in range(batch)]
        return "no geometry in params (latent_shape and patch_size, or total_latent_frames and patches_per_frame)"


def _rows(value, width, batch, name):
    """A per-sample field as ``batch`` rows of ``width`` ints; None when absent; a reason (str) when
    its rows do not map to the batch (one row, or equal rows, serve every element)."""
    if value is None:
        return None
    try:
        flat = torch.as_tensor(value).detach().to("cpu").reshape(-1).tolist()
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(f"{name} must be ints or a tensor, got {value!r}") from None
    if not flat or len(flat) % width:
        raise ValueError(f"{name} must hold rows of {width} value(s) per sample, got {value!r}")
    rows = [tuple(flat[i:i + width]) for i in range(0, len(flat), width)]
    if len(rows) == batch:
        return rows
    if len(set(rows)) == 1:
        return rows[:1] * batch
    return f"{name} has {len(rows)} different samples for a batch of {batch}"


def _span_rows(spans, batch, name):
    """``full_attn_spans`` as one sorted, merged list of ``(start, end)`` per batch element."""
    if isinstance(spans, torch.Tensor):
        spans = spans.tolist()
    try:
        rows = [sorted((int(s), int(e)) for s, e in sample) for sample in spans]
    except (TypeError, ValueError):
        raise ValueError(f"{name}: full_attn_spans must be per-sample lists of [start, end) pairs, got {spans!r}") \
            from None
    if len(rows) != batch:
        if len(rows) == 1 or len({tuple(r) for r in rows}) == 1:
            rows = rows[:1] * batch
        else:
            return f"full_attn_spans has {len(rows)} different samples for a batch of {batch}"
    merged_rows = []
    for row in rows:
        merged = []
        for start, end in row:
            if start < 0 or end < start:
                raise ValueError(f"{name}: full_attn_spans entry [{start}, {end}) is not a span")
            if end == start:
                continue
            if merged and start <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], end))
            else:
                merged.append((start, end))
        merged_rows.append(tuple(merged))
    return merged_rows


def _layout(grid, spans, seq):
    """The ``TokenLayout`` of one sample, ``"all"`` when every token is full attention, or a reason."""
    spans = spans or ()
    if len(spans) > 1:
        return f"full_attn_spans {list(spans)} are not one span at the start or the end of the sequence"
    text_len, position = 0, "none"
    if spans:
        start, end = spans[0]
        if start >= seq:
            raise ValueError(f"full_attn_spans [{start}, {end}) starts past the {seq} tokens of the call: is the query "
                             "[batch, seq_len, num_heads, head_dim]? (a [batch, num_heads, seq_len, head_dim] tensor "
                             "puts the heads in seq_len)")
        end = min(end, seq)
        if start == 0 and end >= seq:
            return "all"
        if start == 0:
            text_len, position = end, "prefix"
        elif end == seq:
            text_len, position = end - start, "suffix"
        else:
            return f"full_attn_spans [{start}, {end}) is neither at the start nor at the end of {seq} tokens"
    video = grid[0] * grid[1] * grid[2]
    if min(grid) < 1 or video != seq - text_len:
        return (f"geometry mismatch: grid {grid} has {video} tokens but the call has {seq - text_len} "
                f"(of {seq}, {text_len} full-attention)")
    return TokenLayout(grid, text_len, position)


def _mask_4d(mask, batch, heads, seq, keys, name):
    """``attn_mask`` as a 4-D mask that broadcasts to ``(B, H, S, Sk)`` (a 2-D mask is per-sample
    key padding, a 3-D one ``(B, S, Sk)``); ValueError otherwise."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor) or mask.dim() > 4 or mask.dim() < 1:
        raise ValueError(f"{name}: attn_mask must be a tensor of 1 to 4 dimensions broadcasting to "
                         f"(batch, heads, seq, keys) = {(batch, heads, seq, keys)}, got "
                         f"{tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__}")
    shaped = mask
    while shaped.dim() < 4:
        shaped = shaped.unsqueeze(0) if shaped.dim() < 2 else shaped.unsqueeze(1)
    if any(m not in (1, n) for m, n in zip(shaped.shape, (batch, heads, seq, keys))):
        raise ValueError(f"{name}: attn_mask of shape {tuple(mask.shape)} does not broadcast to (batch, heads, seq, "
                         f"keys) = {(batch, heads, seq, keys)} (a 2-D mask is read as (batch, keys))")
    if shaped.dtype != torch.bool and not torch.is_floating_point(shaped):
        raise ValueError(f"{name}: attn_mask must be bool (True = attend) or a float bias, got {shaped.dtype}")
    return shaped


def _with_causal(mask, seq, keys):
    """``mask`` combined with the causal mask (SDPA takes one or the other)."""
    causal = torch.ones(seq, keys, dtype=torch.bool, device=mask.device).tril()
    if mask.dtype == torch.bool:
        return mask & causal
    return mask.masked_fill(~causal, float("-inf"))


_PLUGINS = {}


def plugin(method):
    """The ``SparseAttentionPlugin`` of ``method`` (one per method in the process: its ``stats`` count
    every call); ValueError for a method not offered to engines (``Method.engine_geometry`` None)."""
    with _PLUGINS_LOCK:
        if method not in _PLUGINS:
            _PLUGINS[method] = SparseAttentionPlugin(method)
        return _PLUGINS[method]


_PLUGINS_LOCK = threading.Lock()


def forget_plugin(method):
    """Drop ``method``'s plugin (and its stats), e.g. after the method is unregistered."""
    with _PLUGINS_LOCK:
        _PLUGINS.pop(method, None)


def entry_points():
    """``{entry-point name: "module:attribute"}`` of every method offered to engines, as
    ``pyproject.toml``'s ``[project.entry-points."vllm_omni.sparse_attn"]`` lists them."""
    return {f"{PREFIX}{name}": f"{__name__}:{PREFIX}{name}" for name in methods_with("engine_geometry")}


def __getattr__(name):
    """``fastdit_<method>``: the plugin of a method offered to engines (what the entry points load)."""
    if name.startswith(PREFIX) and name[len(PREFIX):] in methods_with("engine_geometry"):
        return plugin(name[len(PREFIX):])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
