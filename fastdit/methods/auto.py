"""``method="auto"``: per (step bucket, layer, head) the cheapest method within an error budget.

The choices come from a calibration written by ``fastdit.calibrate(pipe, "auto", prompts, budget=B)``
(``fastdit calibrate --method auto --budget B``): for every (step bucket, layer, head) the candidate
(a method and its options: sta windows, radial, sparge thresholds, svg densities, svg2 settings,
ToDo / ToMe, ...) of least predicted time (``fastdit.costmodel.head_times`` on the target GPU)
whose relative error against dense attention is within the budget on every calibration prompt;
dense where none is, or where dense is predicted faster. After DiTFastAttn (Yuan et al., 2024:
per layer the cheapest technique within an error threshold, chosen greedily on calibration data),
here per head and across methods, as heads of one layer differ in kind (spatial, temporal,
semantic, global).

A call runs a layer whose heads use different methods by grouping them: heads with the same
candidate form one group and run as one call of that method on ``q, k, v[:, group]`` (a context
with the group's heads; its state, e.g. svg2's warm-started centroids, kept per (candidate, group)),
dense heads run as one ``scaled_dot_product_attention`` call, and the outputs are put back in head
order. Heads are looked up by their global index ``ctx.head_offset + i``, so under Ulysses context
parallelism (a rank holds a slice of the heads) every head still runs its own choice. The call
reports per head what it computed (``ctx.info["head_density"]``: each group's pairs per head / dense
pairs) and over the call (``performed`` / ``total``), so the patch's statistics count every head.

``fastdit.patch(pipe, "auto")`` without a calibration is refused (no silent default): the message says how
to calibrate. The method is not in ``fastdit.method_names()`` (it is no method of its own, and cannot
run without a calibration); ``fastdit.methods.get_method("auto")`` finds it.
"""
from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fastdit.methods.base import (Method, MethodConfig, bucket_start, get_method, index_key, methods_with, option,
                                  register_method)

NEEDS_CALIBRATION = ("method 'auto' needs a calibration of per-head choices: calibrate one first, e.g. `fastdit "
                     "calibrate --model MODEL --method auto --budget 0.1 --out auto.json` or `fastdit.calibrate(pipe, "
                     "\"auto\", prompts, budget=0.1, out=\"auto.json\")`, then `fastdit.patch(pipe, \"auto\", "
                     "calibration=\"auto.json\")`")


@dataclass
class AutoConfig(MethodConfig):
    """Options of ``auto`` (what a calibration file gives; see the module docstring).

    Attributes:
        candidates: the candidate settings, ``[{"method": name, option: value, ...}, ...]``.
        choices: ``{"s_l_h": index or None}``: per (first step of a step bucket, patched layer, global
            head) the index of its candidate, None for dense. A step uses the bucket with the largest
            start ``<= step``; a (bucket, layer) the choices do not name runs dense.
    """

    candidates: list | None = option(None,
                                     "the candidates: [{'method': name, option: value}, ...] (from a calibration)",
                                     widget="text", advanced=True)
    choices: dict | None = option(None, "per 's_l_h' (bucket start, layer, head) a candidate index or None (dense); "
                                  "from a calibration", widget="text", advanced=True)

    def validate(self):
        super().validate()
        if self.candidates is None or self.choices is None:
            raise ValueError(NEEDS_CALIBRATION)
        if not isinstance(self.candidates, (list, tuple)) or not all(isinstance(c, dict) for c in self.candidates):
            raise ValueError(f"auto: candidates must be a list of {{'method': name, option: value}} dicts, got "
                             f"{self.candidates!r}")
        choosable = methods_with("auto_candidate")
        for index, candidate in enumerate(self.candidates):
            options = dict(candidate)
            name = options.pop("method", None)
            if name in (None, "auto"):
                raise ValueError(f"auto: candidate {index} {candidate!r} must name another method under 'method'")
            # prune and window reuse results across steps (one call's error, which the calibration was
            # chosen on, says little of them); dense is a choice of its own (null), no candidate
            if name not in choosable:
                raise ValueError(f"auto: candidate {index} {candidate!r}: method {name!r} is not one auto chooses "
                                 f"from; its methods: {choosable} (null in choices: dense)")
            # a candidate runs on the steps and layers its choices name: its own dense_steps /
            # dense_layers would be ignored, so they are refused rather than silently dropped
            ignored = sorted({"dense_steps", "dense_layers"} & set(options))
            if ignored:
                raise ValueError(f"auto: candidate {index} {candidate!r} sets {ignored}: a candidate runs where the "
                                 f"choices put it; set dense_steps / dense_layers on auto itself (they apply to "
                                 f"every head)")
            try:
                get_method(name).make_config(**options)
            except (ValueError, TypeError) as error:
                raise ValueError(f"auto: candidate {index} {candidate!r}: {error}") from None
        if not isinstance(self.choices, dict) or not self.choices:
            raise ValueError("auto: choices must be a non-empty dict {'step_layer_head': candidate index or None}")
        for key, value in self.choices.items():
            if index_key(key, 3) is None:
                raise ValueError(f"auto: choices entry {key!r}: keys are 'step_layer_head' (three ints >= 0, ASCII "
                                 "digits)")
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or not 0 <= value < len(self.candidates)):
                raise ValueError(f"auto: choices entry {key!r} = {value!r} is no candidate index (0 to "
                                 f"{len(self.candidates) - 1}) or None (dense)")


def head_density(info, batch, heads, seq, keys):
    """Per head, float64 ``(heads,)``: the query-key pairs one method call computed over dense's
    (a block plan's ``pair_counts``, a token method's ``head_density`` or ``performed / total``,
    1 for a dense call or one that reported nothing)."""
    plan = info.get("plan")
    if info.get("dense") or (plan is None and "performed" not in info):
        return torch.ones(heads, dtype=torch.float64)
    if "performed" in info:
        if info.get("head_density") is not None:
            return torch.as_tensor(info["head_density"], dtype=torch.float64).cpu()
        return torch.full((heads,), float(info["performed"]) / float(info["total"]), dtype=torch.float64)
    pairs = plan.pair_counts().double().expand(batch, heads).mean(0)
    return (pairs / (float(seq) * keys)).cpu()


@register_method
class Auto(Method):
    """Per (step bucket, layer, head) the method a calibration chose (see the module docstring)."""

    name = "auto"
    config_cls = AutoConfig
    listed = False  # not in fastdit.method_names(): it runs only from a calibration
    calibration_only = True
    untrainable = "auto mixes methods per head from a calibration; train with one method"

    def __init__(self, config=None, **options):
        super().__init__(config, **options)
        self.methods = []
        for candidate in self.config.candidates:
            options = {k: v for k, v in candidate.items() if k != "method"}
            cls = get_method(candidate["method"])
            # the calibration chose each candidate by its own measured error: no guard unless the candidate sets one,
            # and it runs where the choices put it (dense_steps / dense_layers 0; validate refuses them)
            config = cls.resolve(options=options, where="candidate")
            self.methods.append(cls(config))
        self.table = {}  # (bucket start, layer) -> {head: candidate index or None}
        for key, value in self.config.choices.items():
            step, layer, head = map(int, key.split("_"))
            self.table.setdefault((step, layer), {})[head] = value
        self.starts = sorted({step for step, _ in self.table})
        self._warned_early = False

    def check_heads(self, num_heads):
        for (step, layer), heads in sorted(self.table.items()):
            if sorted(heads) != list(range(num_heads)):
                raise ValueError(f"auto: the calibration gives heads {sorted(heads)} of step bucket {step}, "
                                 f"layer {layer}, but the model's layers have {num_heads} heads: the calibration "
                                 f"is for another model")

    def check_layers(self, num_layers):
        outside = sorted({layer for _, layer in self.table if layer >= num_layers})
        if outside:
            raise ValueError(f"auto: the calibration names layer {outside[0]} but the model has {num_layers} patched "
                             "attention layers: the calibration is for another model")

    def choices_of(self, step, layer):
        """``{global head: candidate index or None}`` of ``layer`` at ``step`` (None: the calibration names
        no such (bucket, layer), which runs dense)."""
        start = bucket_start(self.starts, step)
        return None if start is None else self.table.get((start, layer))

    def _warn_early(self, ctx):
        """Warn once when a call comes before the calibration's first step bucket: such steps run dense, and
        a calibration whose first bucket lies past the run's last step (``step_buckets: [5]`` on a 2-step
        run) would otherwise make the whole run dense without a word."""
        if self._warned_early:
            return
        self._warned_early = True
        first = self.starts[0]
        steps = getattr(ctx, "num_steps", None)
        whole = (f": every step of this {steps}-step run does, so the whole run is dense"
                 if steps is not None and steps <= first else f": steps 0 to {first - 1} run dense")
        warnings.warn(f"auto: step {ctx.step} comes before the calibration's first step bucket ({first}){whole} "
                      f"(the calibration was calibrated for a longer run, or its step_buckets were edited)",
                      UserWarning, stacklevel=2)

    def attend(self, ctx, q, k, v):
        row = self.choices_of(ctx.step, ctx.layer)
        if row is None and self.starts and ctx.step < self.starts[0]:
            self._warn_early(ctx)
        heads = [None if row is None else row.get(ctx.head_offset + i) for i in range(q.shape[1])]
        groups = {}
        for local, choice in enumerate(heads):
            groups.setdefault(choice, []).append(local)
        if list(groups) == [None]:
            ctx.info["dense"] = True
            return ctx.dense()
        batch, count, seq, _ = q.shape
        keys = k.shape[2]
        out = q.new_empty(batch, count, seq, v.shape[-1])
        density = torch.ones(count, dtype=torch.float64)
        mask = None if ctx.key_mask is None else ctx.key_mask[:, None, None, :]
        for choice, members in groups.items():
            whole = len(members) == count
            index = torch.tensor(members, device=q.device)
            qg, kg, vg = (t if whole else t.index_select(1, index) for t in (q, k, v))
            if choice is None:  # the dense heads: one SDPA call on them
                result = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, scale=ctx.scale)
            else:
                sub = dataclasses.replace(
                    ctx, head_offset=0, num_heads=len(members), total_heads=len(members), info={},
                    state=ctx.state.setdefault(("auto", choice, tuple(members)), {}),
                    dense_fn=lambda qg=qg, kg=kg, vg=vg: F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask,
                                                                                          scale=ctx.scale))
                result = self.methods[choice](sub, qg, kg, vg)
                density[members] = head_density(sub.info, batch, len(members), seq, keys)
            if whole:
                out = result
            else:
                out.index_copy_(1, index, result.to(out.dtype))
        ctx.info["head_density"] = density.tolist()
        ctx.info["performed"] = float(density.sum()) * batch * seq * keys
        ctx.info["total"] = float(count) * batch * seq * keys
        ctx.info["groups"] = len(groups)
        return out
