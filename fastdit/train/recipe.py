"""The LoRA recipe: sparse distillation of a diffusers DiT onto its sparse attention mask.

Target (no data set): for prompts ``p`` and seeds ``s`` of the user's choice, the pipeline's own
dense sample ``x0 = pipe(p, generator=s, output_type="latent")``; a training sample is
``x_t = (1 - sigma) x0 + sigma eps`` (flow matching's interpolation, ``sigma ~ U(0, 1)``, timestep
``1000 sigma``, fresh noise ``eps``) with the prompt's embeddings (or, for a share of the samples,
the empty prompt's: classifier-free guidance's unconditional branch), and its target the **dense**
transformer's output on exactly these inputs (computed once, before any adapter or patch). The
student is the same transformer with a LoRA adapter (diffusers' PEFT path,
``transformer.add_adapter(LoraConfig(...))``) patched with the sparse method
(``fastdit.patch(..., trainable=True)``); the loss is ``mean((student - dense)^2)``. Only the
adapter's weights train (and the method's own parameters, if it has any); the mask (or the method's
selection) is a constant.

Output directory: ``pytorch_lora_weights.safetensors`` (diffusers' LoRA format:
``pipe.load_lora_weights(out)``), ``checkpoints/step-N.pt`` (adapter, optimizer, step, losses:
``resume=True`` continues from the latest), ``losses.json`` and ``loss.png``; for a method with
trainable parameters of its own (``Method.layer_module``: VSA's gates), ``fastdit_method_params.safetensors``
(``fastdit/calibration/method_params.py``; load with ``fastdit.patch(..., method_params=out)``), trained beside
the adapter.
"""
from __future__ import annotations

import json
import math
import os
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from fastdit.jsonutil import dump_json, to_json
from fastdit.methods.base import check_int, check_number

from fastdit.calibration.method_params import (load_method_params, method_parameters, method_record, method_state,
                                               save_method_params)


@dataclass
class LoraTrainConfig:
    """Options of ``train_lora`` (see the module docstring).

    Attributes:
        method, options: the sparse method and its options (``fastdit.patch``).
        prompts, seeds: the distillation prompts and the seeds of their dense samples.
        samples: training samples drawn from them (each a sigma and a noise).
        steps, lr, rank, alpha, target_modules: optimisation and adapter (AdamW on the LoRA
            weights; ``alpha`` defaults to ``rank``).
        checkpoint_every: save a checkpoint every N steps (0: at the end only).
        call_kwargs: the pipeline call that makes the dense samples (size, steps, guidance).
        backend: the kernel backend of the patch.
        seed: sample order, sigmas, noises and the adapter's initialisation.
        negative_share: the share of samples conditioned on the empty prompt (what the
            unconditional branch of classifier-free guidance sees), 0 to 1.
        videos: ``(caption, video)`` pairs (frames ``(F, H, W, 3)`` uint8 / [0, 1], or a video
            file): adds the ordinary flow-matching loss on them, ``flow_weight`` times, to every
            step (``fastdit.train.flow``; Wan-family pipelines). Empty: distillation only.
        flow_weight: weight of that loss (>= 0).
    """

    method: str = "sta"
    options: dict = field(default_factory=dict)
    prompts: tuple = ("a red fox running through snow", "waves on a beach at sunset")
    seeds: tuple = (0, 1)
    samples: int = 16
    steps: int = 100
    lr: float = 1e-3
    rank: int = 8
    alpha: float | None = None
    target_modules: tuple = ("to_q", "to_k", "to_v", "to_out.0")
    checkpoint_every: int = 0
    call_kwargs: dict = field(default_factory=dict)
    backend: str = "auto"
    seed: int = 0
    negative_share: float = 0.5
    videos: tuple = ()
    flow_weight: float = 1.0

    def __post_init__(self):
        for name in ("samples", "steps", "rank"):
            check_int(name, getattr(self, name))
        check_int("checkpoint_every", self.checkpoint_every, low=0)
        if not (isinstance(self.lr, (int, float)) and self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"lr must be a number > 0, got {self.lr!r}")
        check_number("negative_share", self.negative_share, 0, 1)
        if not self.prompts or not self.seeds:
            raise ValueError("prompts and seeds must not be empty")
        if not all(isinstance(v, (tuple, list)) and len(v) == 2 and isinstance(v[0], str) for v in self.videos):
            raise ValueError("videos must be (caption, video) pairs: a str and frames (F, H, W, 3) or a video file")
        check_number("flow_weight", self.flow_weight, 0, math.inf, high_open=True)


def training_options(transformer, method, options):
    """``(options, note)``: the method's options for training, and why they differ (None if not).

    A training sample is one transformer call at a random noise level, not a step of a denoising
    run, so ``dense_steps`` (which steps of a run are dense) has no meaning there (a fraction even
    has no number of steps to resolve against): the recipe trains every sample under the sparse
    mask (``dense_steps=0``). The adapter is then used with the method's own ``dense_steps`` at
    inference, where the dense steps run the model's attention (with the adapter). The quality
    guard is off while training unless ``options`` set it (it would swap learnt sparse heads for
    dense ones). The options
    are checked here, against the model, before any work (``OptionError`` / ``ValueError``)."""
    from fastdit.methods.base import get_method
    from fastdit.pipelines import find_adapter

    cls = get_method(method)
    config = cls.resolve(cls.make_config(None, **options), find_adapter(transformer))
    changed, notes = {}, []
    if getattr(config, "dense_steps", 0):
        changed["dense_steps"] = 0
        notes.append(f"{method}: dense_steps={config.dense_steps!r} names steps of a denoising run; training samples "
                     "are single transformer calls at random noise levels, so the recipe trains every sample sparse "
                     "(dense_steps=0); pass dense_steps at inference as usual")
    guard = getattr(config, "guard", False)
    if guard is not None and guard is not False and "guard" not in options:
        # the quality guard re-runs failing heads dense: the adapter would learn to match dense where the
        # method failed instead of learning the sparse mask; trained off unless asked, used at inference
        changed["guard"] = False
        notes.append(f"{method}: the quality guard (guard={guard!r}) is off while training (it would replace the "
                     "sparse heads the adapter is meant to learn); it applies at inference as usual")
    if not changed:
        return dict(options), None
    return {**options, **changed}, "; ".join(notes)


def _embed(pipe, prompt, call_kwargs):
    embeds = pipe.encode_prompt(prompt, do_classifier_free_guidance=False,
                                max_sequence_length=call_kwargs.get("max_sequence_length", 226))[0]
    return embeds.detach()


def make_samples(pipe, config):
    """The training samples ``[{"hidden_states", "timestep", "encoder_hidden_states", "target"}]``,
    targets from the dense transformer (call before adding the adapter or patching)."""
    transformer = pipe.transformer
    gen = torch.Generator().manual_seed(config.seed)
    bases = []
    with torch.no_grad():
        negative = _embed(pipe, "", config.call_kwargs) if config.negative_share else None
        for i, prompt in enumerate(config.prompts):
            seed = config.seeds[i % len(config.seeds)]
            x0 = pipe(prompt=prompt, **config.call_kwargs, output_type="latent",
                      generator=torch.Generator().manual_seed(seed), return_dict=False)[0]
            bases.append((x0.detach(), _embed(pipe, prompt, config.call_kwargs)))
        samples = []
        for i in range(config.samples):
            x0, embeds = bases[i % len(bases)]
            if negative is not None and float(torch.rand((), generator=gen)) < config.negative_share:
                embeds = negative  # the unconditional branch of classifier-free guidance
            sigma = float(torch.rand((), generator=gen))
            noise = torch.randn(x0.shape, generator=gen).to(x0)
            x_t = (1 - sigma) * x0 + sigma * noise
            timestep = torch.tensor([1000.0 * sigma], device=x0.device)
            target = transformer(hidden_states=x_t, timestep=timestep, encoder_hidden_states=embeds,
                                 return_dict=False)[0]
            samples.append({"hidden_states": x_t, "timestep": timestep, "encoder_hidden_states": embeds,
                            "target": target.detach()})
    return samples


def add_lora(transformer, config):
    """Add the LoRA adapter (diffusers' PEFT path); returns its trainable parameters."""
    try:
        from peft import LoraConfig
    except ImportError as error:  # pragma: no cover - the train extra installs it
        raise ImportError("the LoRA recipe needs peft: pip install 'fastdit[train]'") from error
    transformer.requires_grad_(False)
    with torch.random.fork_rng(devices=[]):  # PEFT draws lora_A from the global generator: seed it
        torch.manual_seed(config.seed)
        transformer.add_adapter(LoraConfig(r=config.rank, lora_alpha=config.alpha or config.rank,
                                           init_lora_weights=True, target_modules=list(config.target_modules)))
    return [p for p in transformer.parameters() if p.requires_grad]


def _order(config, epoch):
    return torch.randperm(config.samples, generator=torch.Generator().manual_seed(config.seed * 7919 + epoch)).tolist()


def _sample_at(config, step):
    """The sample index of step ``step`` (a fresh permutation per pass: resume needs no state)."""
    return _order(config, step // config.samples)[step % config.samples]


def _loss(transformer, sample):
    pred = transformer(hidden_states=sample["hidden_states"], timestep=sample["timestep"],
                       encoder_hidden_states=sample["encoder_hidden_states"], return_dict=False)[0]
    return torch.nn.functional.mse_loss(pred.float(), sample["target"].float())


def train_steps(transformer, params, samples, config, out=None, start=0, losses=None, optimizer=None,
                progress=True, flow=None, patch=None):
    """Run steps ``start .. config.steps - 1``; returns ``(losses, seconds per step, optimizer)``.
    ``flow``: flow-matching samples (``fastdit.train.flow``), step ``n`` adds ``flow_weight`` times
    the loss on ``flow[n % len(flow)]``; the losses recorded are the totals. ``patch``: the live
    patch, whose method parameters (``method_params.py``) checkpoints carry."""
    from tqdm.auto import tqdm

    optimizer = optimizer or torch.optim.AdamW(params, lr=config.lr)
    losses = list(losses or [])
    times = []
    bar = tqdm(range(start, config.steps), desc=f"LoRA ({config.method})", disable=not progress,
               initial=start, total=config.steps)
    for step in bar:
        sample = samples[_sample_at(config, step)]
        t0 = time.perf_counter()
        loss = _loss(transformer, sample)
        if flow:
            loss = loss + config.flow_weight * _loss(transformer, flow[step % len(flow)])
        if not torch.isfinite(loss):
            raise TrainingDiverged(_diverged(step, f"the loss is {loss.item()}", config, out))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if not all(torch.isfinite(p.grad).all() for p in params if p.grad is not None):
            raise TrainingDiverged(_diverged(step, "a gradient is not finite", config, out))
        optimizer.step()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.4g}")
        done = step + 1
        if out is not None and config.checkpoint_every and done % config.checkpoint_every == 0 and done < config.steps:
            save_checkpoint(out, transformer, optimizer, done, losses, config, patch=patch)
    return losses, times, optimizer


class TrainingDiverged(FloatingPointError):
    """A non-finite loss or gradient: training stopped before the optimizer step, no checkpoint or
    adapter of the diverged state was written."""


def _diverged(step, what, config, out):
    """The message; a checkpoint of the state that gave the non-finite value (written after step
    ``step``) is renamed ``step-N.pt.diverged``, so that ``resume`` takes the one before."""
    last = latest_checkpoint(out) if out is not None else None
    if last is not None and last.name == f"step-{step:06d}.pt":
        os.replace(last, last.with_name(last.name + ".diverged"))
        last = latest_checkpoint(out)
    kept = f"the last good checkpoint is {last}" if last else "no checkpoint was written"
    return (f"training diverged at step {step + 1}: {what} (method {config.method!r}, lr={config.lr}); stopped before "
            f"updating the adapter, {kept}; try a lower lr")


#: Fields a resumed run may change: how long it runs, how often it saves, the kernel backend.
RESUMABLE_CHANGES = ("steps", "checkpoint_every", "backend")


def _comparable(record):
    return json.loads(json.dumps(to_json(record), sort_keys=True))


def check_resume(state, config, checkpoint):
    """ValueError naming each setting in which ``config`` differs from the run that wrote
    ``checkpoint`` (its record ``state["config"]``), except ``RESUMABLE_CHANGES``: a resumed run
    must continue the same run, not mix two."""
    saved = _comparable(state.get("config") or {})
    current = _comparable(_config_record(config))
    differ = [name for name in sorted(current) if name not in RESUMABLE_CHANGES and saved.get(name) != current[name]]
    if differ:
        detail = "; ".join(f"{name}: checkpoint {saved.get(name)!r}, this run {current[name]!r}" for name in differ)
        raise ValueError(f"--resume / resume=True: {checkpoint} was written by a run with other settings ({detail}); "
                         "resume with the same settings (only steps, checkpoint_every and backend may change) or use "
                         "another output folder")


def _config_record(config):
    """``asdict(config)`` with each user video named by its file or its frames' shape."""
    record = asdict(config)
    record["videos"] = [(caption, str(video) if isinstance(video, (str, Path)) else f"frames {tuple(video.shape)}")
                        for caption, video in config.videos]
    return record


def save_checkpoint(out, transformer, optimizer, step, losses, config, patch=None):
    """``checkpoints/step-N.pt``: adapter, optimizer, step, losses, config and, when the method has
    parameters of its own (``patch.method_modules``), their record and state (``method_params``)."""
    from peft.utils import get_peft_model_state_dict

    folder = Path(out) / "checkpoints"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"step-{step:06d}.pt"
    partial = path.with_name(path.name + ".partial")  # written whole, then renamed: never a truncated step-N.pt
    own = None
    if patch is not None and patch.method_modules:
        own = {"record": method_record(patch), "state": method_state(patch)}
    torch.save({"lora": get_peft_model_state_dict(transformer), "optimizer": optimizer.state_dict(), "step": step,
                "losses": losses, "config": _config_record(config), "method_params": own}, partial)
    os.replace(partial, path)


def latest_checkpoint(out):
    folder = Path(out) / "checkpoints"
    found = sorted(folder.glob("step-*.pt")) if folder.is_dir() else []
    return found[-1] if found else None


def load_latest_checkpoint(out):
    """``(path, state)`` of the newest readable checkpoint in ``out`` (None, None when there is none);
    an unreadable newer one (truncated, damaged) is skipped with a warning naming it."""
    folder = Path(out) / "checkpoints"
    found = sorted(folder.glob("step-*.pt"), reverse=True) if folder.is_dir() else []
    broken = []
    for path in found:
        try:
            state = torch.load(path, weights_only=False)
            if not isinstance(state, dict) or not {"lora", "optimizer", "step", "losses"} <= set(state):
                raise ValueError("not a fastdit.train checkpoint")
        except Exception as error:  # noqa: BLE001 - a damaged file: the next older one is tried
            first_line = str(error).splitlines()[0][:120] if str(error) else ""
            broken.append(f"{path.name} ({type(error).__name__}: {first_line})")
            continue
        if broken:
            warnings.warn(f"fastdit.train: resume: skipped unreadable checkpoint(s) {', '.join(broken)}; resuming from "
                          f"{path.name}", stacklevel=2)
        return path, state
    if broken:
        raise ValueError(f"resume: no readable checkpoint in {folder}: {', '.join(broken)}")
    return None, None


def save_outputs(pipe, out, losses, times, config, extra=None):
    """The LoRA in diffusers' format, the loss history (JSON) and its plot."""
    from peft.utils import get_peft_model_state_dict

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    type(pipe).save_lora_weights(out, transformer_lora_layers=get_peft_model_state_dict(pipe.transformer))
    record = {"config": _config_record(config), "losses": losses, "seconds_per_step": times, **(extra or {})}
    dump_json(out / "losses.json", record, indent=1)  # standard JSON (no NaN), written atomically
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3))
    ax.plot(range(1, len(losses) + 1), losses)
    ax.set_xlabel("step")
    ax.set_ylabel("MSE to the dense output")
    if losses and all(x > 0 and math.isfinite(x) for x in losses):
        ax.set_yscale("log")
    ax.set_title(f"sparse distillation ({config.method})")
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=80)
    plt.close(fig)


def load_lora(pipe, path):
    """``pipe.load_lora_weights(path)``; diffusers' error for a file of another model is re-raised
    naming the file."""
    try:
        pipe.load_lora_weights(path)
    except Exception as error:  # noqa: BLE001 - surfaced with the file name
        raise ValueError(f"cannot load the LoRA {path} into {type(pipe.transformer).__name__}: {error}") from error


def train_lora(pipe, config, out, resume=False, progress=True):
    """Sparse distillation of ``pipe.transformer`` (module docstring). Returns a dict with the
    losses, seconds per step and the patch statistics; the pipeline is left with the adapter
    and without the patch."""
    import fastdit

    out = Path(out)
    options, note = training_options(pipe.transformer, config.method, config.options)
    notes = [note] if note else []
    checkpoint, state = load_latest_checkpoint(out) if resume else (None, None)
    if checkpoint is not None:  # before any work
        check_resume(state, config, checkpoint)
    samples = make_samples(pipe, config)
    flow, kept = None, []
    if config.videos:
        from .flow import flow_samples

        flow, kept = flow_samples(pipe, config, lambda prompt: _embed(pipe, prompt, config.call_kwargs))
    transformer = pipe.transformer
    params = add_lora(transformer, config)
    start, losses = 0, []
    transformer.train()
    with fastdit.patch(transformer, config.method, trainable=True, backend=config.backend, **options) as p:
        own = method_parameters(p)  # the method's gates / projections (method_params.py), trained beside the LoRA
        params = params + own
        optimizer = torch.optim.AdamW(params, lr=config.lr)
        if checkpoint is not None:
            from peft.utils import set_peft_model_state_dict

            set_peft_model_state_dict(transformer, state["lora"])
            if own:
                load_method_params(p, (state["method_params"]["record"], state["method_params"]["state"]))
            optimizer.load_state_dict(state["optimizer"])
            start, losses = state["step"], state["losses"]
        losses, times, optimizer = train_steps(transformer, params, samples, config, out, start, losses, optimizer,
                                               progress, flow, patch=p)
        stats = p.stats.as_dict()
    transformer.eval()
    if not stats["sparse_calls"] or abs((stats["sparse_density"] or 1.0) - 1.0) < 1e-3 or not any(losses):
        notes.append(f"{config.method} ran every training call at density 1 (its mask covers the whole latent grid: "
                     "the options do not fit this grid's size); the student equals the dense target and the adapter "
                     "learns nothing: choose a smaller tile / window or another method")
        warnings.warn(f"fastdit.train: {notes[-1]}", stacklevel=2)
    extra = {"stats": stats, "resumed_from": start, "videos_kept": kept, "options_trained": options, "notes": notes}
    save_checkpoint(out, transformer, optimizer, config.steps, losses, config, patch=p)
    saved = save_method_params(p, out)
    extra["method_params"] = None if saved is None else str(saved)
    save_outputs(pipe, out, losses, times, config, extra)
    return {"losses": losses, "seconds_per_step": times, **extra}
