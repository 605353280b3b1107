"""``fastdit.patch``: check the method, its options and the model, then install a ``Patch``
(``fastdit/patching/``) on the pipeline's transformer(s). Nothing is installed when a check
fails: a bad option or model raises and leaves the model untouched."""
from __future__ import annotations

import os

import torch

from fastdit.calibration.calibration_file import calibration_argument
from fastdit.intercept import check_backend, check_parallelism
from fastdit.methods.base import OptionError, get_method
from fastdit.patching import PATCH_MARK, AlreadyPatchedError, Patch


def _unwrap(module):
    """The module behind ``torch.compile(module)``."""
    return getattr(module, "_orig_mod", module) if isinstance(module, torch.nn.Module) else module


def _targets(target):
    """``([(attr_name, transformer)], scheduler)`` of a pipeline or a bare transformer."""
    if isinstance(target, torch.nn.Module) and not hasattr(target, "transformer"):
        return [("transformer", _unwrap(target))], None
    transformer = getattr(target, "transformer", None)
    if transformer is None:
        has_unet = getattr(target, "unet", None) is not None
        unet = " (it has a UNet: fastdit patches DiT transformers only)" if has_unet else ""
        raise ValueError(f"{type(target).__name__} has no `transformer`{unet}; "
                         "pass a diffusers DiT pipeline or its transformer")
    found = [("transformer", _unwrap(transformer))]
    second = getattr(target, "transformer_2", None)
    if second is not None:
        found.append(("transformer_2", _unwrap(second)))
    return found, getattr(target, "scheduler", None)


def patch(target, method="sta", config=None, *, record_masks=False, backend="auto", calibration=None,
          trainable=False, method_params=None, plan=None, **options):
    """Replace the DiT attention of a diffusers pipeline (or transformer) with ``method``.

    Args:
        target: a diffusers pipeline (its ``transformer``, and ``transformer_2`` for Wan 2.2, are
            patched with one step counter) or a transformer (also one wrapped by ``torch.compile``).
        method: a name from ``fastdit.method_names()``.
        config: the method's config dataclass (e.g. ``fastdit.STAConfig(...)``); keyword
            ``options`` override its fields.
        record_masks: keep each layer's latest plan so ``Patch.mask(layer, head)`` can draw it.
        backend: kernel backend, ``"auto"``, ``"triton"`` or ``"torch"``.
        calibration: a calibration file written by ``fastdit.calibrate`` or
            ``fastdit.methods.sta.load_strategy`` (a path, or the loaded dict): its settings per (step
            bucket, layer, head) become the method's options. Options the calibration sets (its
            ``options``, sta's ``strategy`` and so ``window``, the ``layer_settings`` and every option
            they name) cannot be passed beside it (CalibrationError naming them); other keyword
            ``options`` apply on top. A calibration for another method, model family, transformer
            class, layer or head count is refused, naming the mismatch, and so is a grid where its
            settings would change meaning (at the first call on each new grid).
        plan: the earlier name of ``calibration`` (an alias, kept working; passing both is refused).
        trainable: calls needing gradients run the method with them (block plans are constants; docs/training.md),
            not the model's attention (a counted fallback); a method that cannot is refused (OptionError).
        method_params: the method's trained per-layer parameters (its gates: ``Method.layer_module``), a
            ``fastdit_method_params.safetensors`` written by ``fastdit.train`` or its folder; refused
            (CalibrationError naming both) when saved for another method, model, layer set or option, and at the
            first call on a latent grid they were not trained on (docs/training.md).

    Returns:
        a ``Patch``; ``remove()`` restores the model (also on leaving a ``with`` block).
        ``copy.deepcopy`` / ``copy.copy`` / ``torch.save`` of a patched transformer (or pipeline)
        give the *unpatched* model (an EMA copy, a checkpoint); the original stays patched, and a
        copy can be patched on its own.

    Every option is checked here, against the model (e.g. per-head windows against its head
    count), before anything is installed: a bad option raises and leaves the model untouched.

    Example::

        p = fastdit.patch(pipe, "sta", tile=(6, 8, 8), window=(3, 3, 3), dense_steps=0.25)
        video = pipe(prompt).frames
        p.remove()
    """
    from fastdit.pipelines import find_adapter

    calibration = calibration_argument(calibration, plan)
    if calibration is not None:  # checked against the model before anything is installed
        from fastdit.calibration.calibration_file import calibration_options_for, load_calibration, with_calibration

        source = calibration if isinstance(calibration, (str, os.PathLike)) else ""
        options = with_calibration(calibration_options_for(calibration, target, method), options, source)
        calibration = (load_calibration(calibration), source)  # grids: checked at each new grid's first call
    method_cls = get_method(method)
    config = method_cls.make_config(config, **options)
    transformers, scheduler = _targets(target)
    check_backend(backend, transformers)
    adapters = [find_adapter(t) for _, t in transformers]
    adapter = adapters[0]
    for _, transformer in transformers:
        existing = getattr(transformer, PATCH_MARK, None)
        if existing is not None:
            raise AlreadyPatchedError(
                f"{type(transformer).__name__} is already patched by fastdit ({existing!r}); "
                "call remove() on that patch first"
            )
    config = method_cls.resolve(config, adapter)
    method_obj = method_cls(config)
    for _, transformer in transformers:
        check_parallelism(transformer, method_obj)
    for variant in method_obj.variants():  # per-layer settings (layer_settings) are checked like the base
        method_cls.check_family(adapter, variant.config)
        if trainable and variant.trainable_refusal():
            raise OptionError(f"method {method!r} cannot run with trainable=True: {variant.trainable_refusal()}")
    modules_per_transformer = []
    for _, transformer in transformers:
        modules = adapter.attention_modules(transformer)
        if not modules:
            raise ValueError(f"{type(transformer).__name__}: found no attention module matching "
                             f"{adapter.attention_pattern!r} for family {adapter.family!r}")
        for heads in sorted({getattr(m, "heads", None) for _, m in modules} - {None}):
            for variant in method_obj.variants():
                variant.check_heads(heads)
        modules_per_transformer.append(modules)
    n_layers = sum(len(modules) for modules in modules_per_transformer)
    for variant in method_obj.variants():
        variant.check_layers(n_layers)
    result = Patch(target, method_obj, adapter, transformers, scheduler, record_masks, backend)
    result._calibration, result.trainable = calibration, bool(trainable)
    try:
        result._install(modules_per_transformer)
        if method_params is not None:
            from fastdit.calibration.method_params import load_method_params

            load_method_params(result, method_params)
    except BaseException:
        result.remove()
        raise
    return result
