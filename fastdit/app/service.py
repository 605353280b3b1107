"""The app's service layer (no gradio): runs dense and a method on cached pipelines.

``Runner.compare(RunRequest(...))`` checks the request (method, options, seed, size) before any
work, then, holding the pipeline's lock, runs dense (``fastdit.compare.generate`` on the unpatched
pipeline; reused from a small cache when asked), patches the pipeline with the method, generates,
reads the patch's statistics and mask, and removes the patch in a ``finally``. So a run that fails
or is stopped (``Runner.cancel`` sets its event; the step callback raises ``RunCancelled``) leaves
the pipeline unpatched; should a pipeline ever be left patched anyway, it is dropped from the
cache and the next request loads a fresh one. Runs on different models proceed in parallel.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import math
import os
import tempfile
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from fastdit.cpu_load import load_warning
from fastdit.pipelines.shapes_data import DEMO_CAPTION

from .errors import AppError, RunCancelled
from .masks import draw_patch_mask
from .method_options import calibration_only, method_choices, options_text, parse_options
from .models import PipelineCache, plan_call

__all__ = ["DEFAULT_NEGATIVE", "DEFAULT_PROMPT", "DENSE_CACHE_SIZE", "FPS", "MAX_SEED", "RunRequest",
           "RunResult", "Runner", "check_seed", "default_prompt", "fallback_text", "frames_digest", "model_presets",
           "patched"]

log = logging.getLogger("fastdit.app")

DEFAULT_PROMPT = "A red fox runs through fresh snow in a pine forest at sunrise"
DEFAULT_NEGATIVE = "blurry, low quality, distorted"
FPS = 16
#: Seeds are 0 .. 2**32 - 1: every seed a browser's number box holds exactly (and numpy's range).
MAX_SEED = 2**32 - 1
#: Dense results kept for reuse when only the method or its options change.
DENSE_CACHE_SIZE = 2


def default_prompt(model):
    """The prompt the page shows for ``model``: a caption of its own grammar for tiny-shapes (the only
    text it was trained on, ``fastdit.pipelines.shapes_data``), else the fox."""
    return DEMO_CAPTION if model == "tiny-shapes" else DEFAULT_PROMPT


def check_seed(seed):
    """``seed`` as an int in ``0 .. MAX_SEED`` (blank is 0); ``AppError`` otherwise."""
    if seed is None or (isinstance(seed, str) and not seed.strip()):
        return 0
    message = f"seed must be a whole number from 0 to {MAX_SEED} (2**32 - 1), got {seed!r}"
    if isinstance(seed, bool):
        raise AppError(message)
    try:
        value = float(seed) if not isinstance(seed, int) else seed
    except (TypeError, ValueError):
        raise AppError(message) from None
    if isinstance(value, float) and (not math.isfinite(value) or not value.is_integer()):
        raise AppError(message)
    value = int(value)
    if not 0 <= value <= MAX_SEED:
        raise AppError(message)
    return value


def frames_digest(frames):
    """A short SHA-256 of the frames' bytes: equal digests mean bit-identical frames."""
    return hashlib.sha256(np.ascontiguousarray(frames).tobytes()).hexdigest()[:16]


def fallback_text(fallbacks):
    """``reason (count); ...`` of a ``PatchStats.fallbacks`` dict ('' when there are none)."""
    return "; ".join(f"{reason} ({count})" for reason, count in sorted(fallbacks.items(), key=lambda kv: -kv[1]))


@contextlib.contextmanager
def patched(pipe, method, options, record_masks=False, calibration=None):
    """``fastdit.patch`` for the length of a ``with`` block, removed whatever happens in it. Bad
    options or a calibration file that does not fit (checked against the model at patch time) raise
    ``AppError`` with nothing installed."""
    import fastdit
    from fastdit.calibration.calibration_file import CalibrationError

    try:
        patch = fastdit.patch(pipe, method, record_masks=record_masks, calibration=calibration, **options)
    except CalibrationError as error:
        raise AppError(str(error)) from None
    except (ValueError, TypeError) as error:
        raise AppError(f"{method} options: {error}") from None
    try:
        yield patch
    except CalibrationError as error:  # the first call on a grid the calibration was not made for
        raise AppError(str(error)) from None
    finally:
        patch.remove()


@dataclass
class RunRequest:
    """One comparison. ``options``: method option values, typed or as the app's text boxes give
    them (``"1,1,1"``); blank ones keep the config dataclass's default. ``calibration``: a
    calibration file (``fastdit calibrate``) for the method; its options then replace ``options``
    and the tiny models' presets (``plan``: its earlier name, an alias)."""

    model: str = "tiny-wan"
    prompt: str = DEFAULT_PROMPT
    negative_prompt: str = ""
    seed: int = 0
    steps: int | None = None
    guidance: float | None = None
    frames: int | None = None
    height: int | None = None
    width: int | None = None
    method: str = "sta"
    options: dict = field(default_factory=dict)
    mask_layer: int = -1
    mask_head: int = 0
    reuse_dense: bool = False
    image: object = None
    calibration: str | None = None
    plan: str | None = None  # the earlier name of ``calibration``

    def __post_init__(self):
        from fastdit.calibration.calibration_file import CalibrationError, calibration_argument

        try:
            self.calibration, self.plan = calibration_argument(self.calibration, self.plan), None
        except CalibrationError as error:
            raise AppError(str(error)) from None


@dataclass
class RunResult:
    """Videos (mp4 paths), the mask picture, ``metrics`` (JSON-ready), notes, the frames, and the
    contact sheet (PNG: first / middle / last frame of dense and the method, labelled with the
    speedup and the PSNR of this run)."""

    dense_video: str
    method_video: str
    mask: str | None
    mask_caption: str
    metrics: dict
    notes: list
    dense_frames: np.ndarray = None
    method_frames: np.ndarray = None
    contact_sheet: str | None = None


def model_presets(model, grid=None):
    """``{method: options}`` a built-in model runs a method with unless the user sets them: the
    presets calibrated for a trained model and shipped with its weights (an option dict, or
    ``{"calibration": path}`` where the calibration fits the run's latent ``grid``), the random-weight tiny
    models' own presets otherwise."""
    from fastdit.eval.runner.settings import method_presets

    return method_presets(model, grid)[0]


def _no_calibration_text(model, method, pipe, call):
    """Why ``method`` (calibration-only) cannot run here, and what to do about it."""
    from fastdit.eval.runner.settings import method_presets
    from fastdit.pipelines.loading import builtin_model, latent_grid

    grid = latent_grid(pipe, call)
    note = ""
    if builtin_model(model):
        try:
            note = method_presets(model, grid)[1] or ""
        except ValueError:
            pass
    return (f"{method} runs from a calibration, and none is shipped with {model} for the latent grid {tuple(grid)}"
            f"{f' ({note})' if note else ''}. Give one in Advanced > calibration file (made by `fastdit calibrate "
            f"--model {model} --method {method} --budget 0.05 --out {method}.json`), or choose tiny-shapes at its "
            "native size, which ships one.")


def _calibration_path(calibration):
    """The calibration file of a request: a path, or what Gradio's file input gives (a path or a
    dict with ``path``); None when none is given."""
    if isinstance(calibration, dict):
        calibration = calibration.get("path") or calibration.get("name")
    if calibration is None or (isinstance(calibration, str) and not calibration.strip()):
        return None
    return os.fspath(calibration)


def _plain(value):
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return value


def _lpips(frames, reference):
    """LPIPS against dense, or None when its weights are not present (or frames are too small)."""
    try:
        from fastdit.eval.metrics.fidelity import lpips_distance

        return float(lpips_distance(frames, reference))
    except (FileNotFoundError, ValueError, ImportError):
        return None


class Runner:
    """Runs comparisons on cached pipelines; one per app, shared by every session."""

    def __init__(self, device=None, dtype=None, max_tokens=None):
        self.pipes = PipelineCache(device, dtype)
        self.max_tokens = max_tokens
        self.out_root = tempfile.mkdtemp(prefix="fastdit_app_")
        self._runs = {}  # session -> the cancel event of its latest run
        self._runs_lock = threading.Lock()
        self._dense = OrderedDict()
        self._dense_lock = threading.Lock()

    # -- cancellation: one event per run, the latest run of each session ------------------------
    def start_run(self, session):
        """A new cancel event for ``session``'s next run (Stop cancels the latest run)."""
        event = threading.Event()
        with self._runs_lock:
            self._runs[session] = event
        return event

    def finish_run(self, session, event):
        with self._runs_lock:
            if self._runs.get(session) is event:
                del self._runs[session]

    def cancel(self, session):
        """Stop ``session``'s running run at its next denoising step; False when none runs."""
        with self._runs_lock:
            event = self._runs.get(session)
        if event is None:
            return False
        event.set()
        return True

    @contextlib.contextmanager
    def run_scope(self, session):
        event = self.start_run(session)
        try:
            yield event
        finally:
            self.finish_run(session, event)

    # -- a comparison -------------------------------------------------------------------------
    def check(self, request):
        """``(seed, parsed options)`` of ``request``, or ``AppError`` before any work."""
        import fastdit

        if request.method not in method_choices():
            raise AppError(f"unknown method {request.method!r}; available: {', '.join(method_choices())}")
        if not (request.prompt or "").strip():
            raise AppError("Write a prompt.")
        seed = check_seed(request.seed)
        if _calibration_path(request.calibration) is not None:  # its options replace the option boxes
            from fastdit.calibration.calibration_file import CalibrationError, calibration_options

            try:
                return seed, calibration_options(_calibration_path(request.calibration),  # file, method only
                                                 request.method)
            except CalibrationError as error:
                raise AppError(str(error)) from None
        options = parse_options(request.method, dict(request.options or {}))
        if calibration_only(request.method):  # its settings come from the model's shipped calibration (run time)
            return seed, options
        try:
            fastdit.methods.get_method(request.method).make_config(**options)
        except (ValueError, TypeError) as error:
            raise AppError(f"{request.method} options: {error}") from None
        return seed, options

    def compare(self, request, progress=None, cancel=None):
        """Dense, then ``request.method``, with the same seed; returns a ``RunResult``."""
        started_at = time.time()
        progress = progress or (lambda *a, **k: None)
        cancel = cancel or threading.Event()
        seed, options = self.check(request)
        progress(0.0, desc=f"loading {request.model}")
        entry = self.pipes.get(request.model)
        try:
            with entry.lock:  # one run per pipeline at a time: dense, patch, generate, remove
                run = self._run_locked(entry, request, seed, options, progress, cancel)
        except BaseException:
            self._recover(entry)
            raise
        return self._finish(run, started_at)

    def _recover(self, entry):
        """After a failed run: a pipeline left patched (it should never be) is dropped from the cache."""
        import fastdit

        with entry.lock:
            try:
                fastdit.patch(entry.pipe, "dense").remove()
            except fastdit.AlreadyPatchedError:
                log.error("a failed run left %s patched; the pipeline is dropped and loads afresh", entry.model)
                self.pipes.evict(entry)
            except Exception:  # noqa: BLE001 - a pipeline fastdit cannot patch cannot be left patched
                pass

    def _call_for(self, entry, request):
        from fastdit.pipelines.loading import call_parameters

        pipe = entry.pipe
        call, notes, tokens = plan_call(pipe, request.model, request.steps, request.guidance, request.frames,
                                        request.height, request.width, self.max_tokens)
        params = call_parameters(pipe)
        negative = (request.negative_prompt or "").strip()
        if negative and "negative_prompt" in params:
            call["negative_prompt"] = negative
        if "image" in params:
            if request.image is not None:
                call["image"] = request.image
            elif "image" not in call:
                raise AppError(f"{request.model} is an image-to-video model: give a conditioning image.")
        return call, notes, tokens

    def _run_locked(self, entry, request, seed, options, progress, cancel):
        from fastdit.compare import generate
        from fastdit.pipelines.loading import builtin_model, call_parameters

        pipe, method = entry.pipe, request.method
        call, notes, tokens = self._call_for(entry, request)
        calibration = _calibration_path(request.calibration)
        if calibration is not None:  # checked against this model before the dense run; patch applies it
            from fastdit.calibration.calibration_file import CalibrationError, calibration_options_for

            try:
                calibration_options_for(calibration, pipe, method)
            except CalibrationError as error:
                raise AppError(str(error)) from None
            options = {}
            notes.append(f"calibration {os.path.basename(calibration)} applied: its settings replace the {method} "
                         "option boxes")
        elif builtin_model(request.model):
            from fastdit.calibration.calibration_file import split_calibration
            from fastdit.pipelines.loading import latent_grid

            preset = dict(model_presets(request.model, latent_grid(pipe, call)).get(method, {}))
            calibration, preset = split_calibration(preset)  # one shipped with the trained model
            if calibration is not None:
                notes.append(f"{method}: the calibration made for {request.model} ({os.path.basename(calibration)}) "
                             "applied")
            options = {**preset, **{k: v for k, v in options.items() if v is not None}}
        if calibration is None and calibration_only(method):
            raise AppError(_no_calibration_text(request.model, method, pipe, call))
        n_steps = int(call.get("num_inference_steps", request.steps))
        size = f"{call.get('num_frames', 1)}x{call.get('height', '?')}x{call.get('width', '?')}"
        dense_key = (request.model, request.prompt, call.get("negative_prompt"), seed, repr(sorted(
            (k, v) for k, v in call.items() if isinstance(v, (int, float, str)))))
        with self._dense_lock:
            dense = self._dense.get(dense_key) if request.reuse_dense and request.image is None else None
        phases = 1 if dense is not None else 2
        state = {"offset": 0, "phase": ""}

        def on_step(_pipe, step, _timestep, _callback_kwargs):
            if cancel.is_set():
                raise RunCancelled()
            progress((state["offset"] + step + 1) / (phases * n_steps),
                     desc=f"{state['phase']}: step {step + 1}/{n_steps}")
            return {}

        timed = dict(call)
        if "callback_on_step_end" in call_parameters(pipe):
            timed["callback_on_step_end"] = on_step
        if cancel.is_set():
            raise RunCancelled()
        self._warm_up(entry, request.prompt, seed, call, method, options, size, n_steps, progress, calibration)
        if dense is None:
            state["phase"] = "dense"
            progress(0.0, desc="dense")
            dense = generate(pipe, request.prompt, seed, timed)
            if request.image is None:
                with self._dense_lock:
                    self._dense[dense_key] = dense
                    while len(self._dense) > DENSE_CACHE_SIZE:
                        self._dense.popitem(last=False)
        else:
            notes.append("dense run reused from an earlier run with the same inputs")
        state["phase"], state["offset"] = method, n_steps * (phases - 1)
        mask_path, mask_caption = None, ""
        with patched(pipe, method, options, record_masks=True, calibration=calibration) as patch:
            result = generate(pipe, request.prompt, seed, timed)  # the pipeline is patched: the method runs
            stats = patch.stats.as_dict()
            config = {k: _plain(v) for k, v in dataclasses.asdict(patch.config).items()}
            layers = len(patch.layers)
            out_dir = tempfile.mkdtemp(prefix="run_", dir=self.out_root)
            layer = -1 if request.mask_layer is None else request.mask_layer
            try:
                mask_path, mask_caption = draw_patch_mask(patch, layer, request.mask_head or 0,
                                                          os.path.join(out_dir, "mask.png"))
            except AppError as error:
                notes.append(f"mask: {error}")
        return dict(request=request, seed=seed, dense=dense, result=result, stats=stats, config=config, layers=layers,
                    notes=notes, size=size, steps=n_steps, tokens=tokens, out_dir=out_dir, mask=mask_path,
                    mask_caption=mask_caption, device=str(pipe.device), reused=phases == 1)

    def _warm_up(self, entry, prompt, seed, call, method, options, size, n_steps, progress, calibration=None):
        """First-call costs (allocation; Triton compilation on CUDA) stay out of the timings."""
        from fastdit.compare import generate, warm_up_options

        warm = {**call, "num_inference_steps": 1}
        if (size, n_steps) not in entry.warm:
            progress(0.0, desc="warm-up (1 step, not timed)")
            generate(entry.pipe, prompt, seed, warm)
            entry.warm.add((size, n_steps))
        key = (size, n_steps, method, repr(sorted(options.items())), calibration)
        if str(entry.pipe.device).startswith("cuda") and key not in entry.warm:
            progress(0.0, desc=f"{method} warm-up (1 step, not timed)")
            with patched(entry.pipe, method, options if calibration is not None else warm_up_options(options),
                         calibration=calibration):
                generate(entry.pipe, prompt, seed, warm)
            entry.warm.add(key)

    def _finish(self, run, started_at):
        from fastdit.compare import fidelity
        from fastdit.media.contact_sheet import contact_sheet, row_label
        from fastdit.media.video import write_video

        dense, result, stats, notes = run["dense"], run["result"], run["stats"], run["notes"]
        method = run["request"].method
        calibration_path = _calibration_path(run["request"].calibration)
        dense_path = write_video(os.path.join(run["out_dir"], "dense.mp4"), dense.frames, fps=FPS)
        method_path = write_video(os.path.join(run["out_dir"], f"{method}.mp4"), result.frames, fps=FPS)
        psnr_db, ssim_value = fidelity(result.frames, dense.frames)
        speedup = dense.latency_s / result.latency_s
        sheet = contact_sheet([dense.frames, result.frames],
                              [row_label({"method": "dense"}),
                               row_label({"method": method, "speedup": speedup, "psnr_db": psnr_db})],
                              os.path.join(run["out_dir"], "contact_sheet.png"))
        guard = stats.get("guard") or {}
        if guard.get("head_calls"):
            notes.append(f"quality guard: {guard['widened']} of {guard['head_calls']} head-calls widened, "
                         f"{guard['dense']} run dense ({100 * guard['density']:.1f}% of dense attention's work went "
                         f"to the guard's checks and re-runs)")
        if stats["fallback_calls"]:
            notes.append(f"{stats['fallback_calls']} attention calls ran the model's own attention (fallbacks): "
                         + fallback_text(stats["fallbacks"]))
        for label, generation in (("dense", dense), (method, result)):
            warning = load_warning(generation.load, f"the {label} run")
            if warning:
                notes.append(warning)
        metrics = {
            "model": run["request"].model, "method": method, "options": run["config"],
            "calibration": None if calibration_path is None else os.path.basename(calibration_path),
            "options_text": options_text(run["config"]), "size": run["size"], "steps": run["steps"],
            "tokens": run["tokens"], "seed": run["seed"],
            "dense_latency_s": dense.latency_s, "method_latency_s": result.latency_s,
            "speedup": speedup, "psnr_db": psnr_db, "ssim": ssim_value,
            "lpips": _lpips(result.frames, dense.frames),
            "effective_density": stats["effective_density"], "sparse_density": stats["sparse_density"],
            "dense_calls": stats["dense_calls"], "sparse_calls": stats["sparse_calls"],
            "fallback_calls": stats["fallback_calls"], "fallbacks": stats["fallbacks"], "plans": stats["plans"],
            "padding_fraction": stats["padding_fraction"], "guard": stats.get("guard"),
            "layers": run["layers"], "device": run["device"],
            "dense_reused": run["reused"], "dense_digest": frames_digest(dense.frames),
            "method_digest": frames_digest(result.frames), "started_at": started_at, "finished_at": time.time(),
            "dense_load": dense.load, "method_load": result.load, "notes": list(notes),
        }
        return RunResult(dense_path, method_path, run["mask"], run["mask_caption"], metrics, notes,
                         dense.frames, result.frames, sheet)
