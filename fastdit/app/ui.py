"""The Gradio page: lays out the widgets and wires their events to the service layer (``service``).

Nothing is computed here: a click builds a ``RunRequest`` from the widgets, ``Runner.compare`` runs
it, and ``views`` turns the result into what the page shows.
"""
from __future__ import annotations

import inspect
import logging
import traceback

import gradio as gr

from .errors import AppError, RunCancelled
from .method_options import DEFAULT_CHOICE, method_choices, option_specs
from .models import KNOWN_MODELS, TINY_MODELS, free_cuda, is_oom, size_defaults
from fastdit.calibration.calibration_file import calibration_argument, load_calibration, split_calibration
from fastdit.pipelines.shapes_data import DEMO_CAPTION

from .service import DEFAULT_NEGATIVE, DEFAULT_PROMPT, MAX_SEED, RunRequest, Runner, default_prompt
from .views import CSS, HEADER, history_frame, json_safe, metrics_html, scatter_frame

__all__ = ["FIXED_INPUTS", "build_app", "option_widget"]

log = logging.getLogger("fastdit.app")

#: The API parameters of ``/compare`` before the method options (``sta_window``, ``radial_decay``, ...).
FIXED_INPUTS = ["model", "prompt", "negative_prompt", "seed", "steps", "guidance", "frames", "height", "width",
                "method", "mask_layer", "mask_head", "reuse_dense", "image", "history", "calibration"]


def _shown_presets(model):
    """The option presets of ``model`` the option boxes can show (a preset that is a calibration
    file is applied by the service and shows no box values)."""
    from .service import model_presets

    try:
        presets = model_presets(model) if (model or "").startswith("tiny-") else {}
    except ValueError:  # an unknown tiny name or a broken preset file: the run itself reports it
        presets = {}
    return {method: values for method, values in presets.items() if split_calibration(values)[0] is None}


def option_widget(spec, value):
    """The widget of one method option (``OptionSpec``) showing ``value`` (element id ``fd-opt-<api name>``)."""
    shared = dict(label=spec.label, info=spec.help or None, elem_id=f"fd-opt-{spec.api_name}")
    if spec.kind in ("int", "float", "number"):
        low, high = spec.range or (None, None)
        if value is None:  # blank = the default, which the method or the model family fills in
            return gr.Textbox(value="", max_lines=1, placeholder=f"default: {spec.default_text()}", **shared)
        if spec.widget == "slider" and low is not None and high is not None:
            return gr.Slider(minimum=low, maximum=high, value=value,
                             step=1 if spec.kind == "int" else (high - low) / 100, **shared)
        return gr.Number(value=value, precision=0 if spec.kind == "int" else None, minimum=low, maximum=high,
                         **shared)
    if spec.kind == "bool" and not spec.optional:
        return gr.Checkbox(value=bool(value), **shared)
    if spec.kind == "bool":
        choices = ([DEFAULT_CHOICE] if spec.optional else []) + ["on", "off"]
        return gr.Radio(choices=choices, value=spec.display(value), **shared)
    if spec.kind == "choice":
        choices = ([DEFAULT_CHOICE] if spec.optional else []) + [str(c) for c in spec.choices]
        return gr.Dropdown(choices=choices, value=str(spec.display(value)), **shared)
    placeholder = f"default: {spec.default_text()}" + ("; one per head: 1,3,3; 3,3,3" if spec.kind == "tuple" else "")
    return gr.Textbox(value=spec.display(value), max_lines=1, placeholder=placeholder, **shared)


def _examples(model, sizes, methods):
    """Example rows (prompt, negative, seed, steps, guidance, frames, height, width, method) for ``model``."""
    if not sizes:
        return []
    steps, guidance = sizes.get("num_inference_steps", 3), sizes.get("guidance_scale", 5.0)
    frames, height, width = sizes.get("num_frames", 29), sizes.get("height", 384), sizes.get("width", 384)
    if model == "tiny-shapes":  # captions of its grammar, at its native size (it was trained there)
        captions = [(DEMO_CAPTION, "sta"), ("a yellow triangle moving left", "sparge"),
                    ("a green square moving up and a red circle moving left", "radial"),
                    ("a blue circle moving down and a yellow square moving right and a red triangle moving up", "sta")]
        return [[caption, "", seed, steps, guidance, frames, height, width, method]
                for seed, (caption, method) in enumerate(captions) if method in methods]
    tiny = model.startswith("tiny-")
    quick = (9, 256, 256, 2) if tiny else (max((frames - 1) // 2 + 1, 1), height, width, max(steps // 2, 1))
    longer = (45, 256, 256, steps) if tiny else (frames, height, width, steps)
    rows = [
        [DEFAULT_PROMPT, DEFAULT_NEGATIVE, 0, steps, guidance, frames, height, width, "sta"],
        ["A paper boat drifts down a rain-soaked street, cinematic lighting", DEFAULT_NEGATIVE, 7, steps, guidance,
         frames, height, width, "radial"],
        ["A corgi astronaut floats inside a space station, soft light", DEFAULT_NEGATIVE, 3, quick[3], guidance,
         *quick[:3], "sta"],
        ["Aerial shot of waves breaking on a black sand beach, golden hour", "", 42, longer[3], guidance,
         *longer[:3], "radial"],
    ]
    return [row for row in rows if row[-1] in methods]


class _App(gr.Blocks):
    def launch(self, *args, **kwargs):
        kwargs.setdefault("theme", gr.themes.Soft(primary_hue="indigo", secondary_hue="orange"))
        kwargs.setdefault("css", CSS)
        return super().launch(*args, **kwargs)


#: The model selected when the page opens: trained here, so its videos can be judged by eye.
DEFAULT_MODEL = "tiny-shapes"


def build_app(default_model=DEFAULT_MODEL, device=None, dtype=None, max_tokens=None, concurrency=1, calibration=None,
              plan=None):
    """The Gradio app (a ``gr.Blocks``; ``.launch()`` it; its ``runner`` is the service).

    ``calibration``: a calibration file (``fastdit calibrate``) preset in the calibration input
    (``--calibration PATH``); ``plan``: its earlier name, an alias.

    ``device``/``dtype``: default CUDA + bf16 when available, else CPU + fp32. ``max_tokens``: the
    largest latent token count a run may take. ``concurrency``: comparisons that may run at once
    (runs on one model always take turns; runs on different models overlap).
    """
    runner = Runner(device, dtype, max_tokens)
    methods = method_choices()
    default_method = "sta" if "sta" in methods else methods[0]
    calibration = calibration_argument(calibration, plan)
    if calibration is not None:  # the calibration's method is selected when the page opens
        calibrated = load_calibration(calibration)["method"]
        default_method = calibrated if calibrated in methods else default_method
    sizes = size_defaults(default_model) or {}
    presets = _shown_presets(default_model)
    option_widgets = []  # (OptionSpec, component)
    groups = {}

    with _App(title="fastdit: sparse attention for video DiTs") as demo:
        demo.runner = runner
        history = gr.State([])
        gr.HTML(HEADER)
        with gr.Row(equal_height=False):
            with gr.Column(scale=2, min_width=340):
                model = gr.Dropdown(choices=TINY_MODELS + list(KNOWN_MODELS), value=default_model, label="model",
                                    allow_custom_value=True, elem_id="fd-model",
                                    info="built-in tiny models, a hub id or a local folder")
                prompt = gr.Textbox(value=default_prompt(default_model), label="prompt", lines=2, elem_id="fd-prompt")
                # The primary action sits right under the prompt, so it is on the first screen
                # whatever the method's option count.
                with gr.Row(equal_height=True):
                    method = gr.Dropdown(choices=methods, value=default_method, label="method", elem_id="fd-method",
                                         scale=2, min_width=120)
                    run_btn = gr.Button("Compare", variant="primary", elem_id="fd-compare", scale=2, min_width=100)
                    stop_btn = gr.Button("Stop", variant="stop", elem_id="fd-stop", scale=1, min_width=60)
                notes = gr.Markdown(label="notes", elem_id="fd-notes")
                with gr.Row():
                    seed = gr.Number(value=0, label="seed", precision=0, info=f"0 .. {MAX_SEED}", elem_id="fd-seed")
                    steps = gr.Number(value=sizes.get("num_inference_steps", 3), label="steps", precision=0, minimum=1)
                    guidance = gr.Number(value=sizes.get("guidance_scale", 5.0), label="guidance", step=0.5)
                with gr.Row():
                    frames = gr.Number(value=sizes.get("num_frames", 29), label="frames", precision=0, minimum=1)
                    height = gr.Number(value=sizes.get("height", 384), label="height", precision=0, minimum=16, step=16)
                    width = gr.Number(value=sizes.get("width", 384), label="width", precision=0, minimum=16, step=16)

                def option_group(name, specs):
                    """The widgets of ``specs`` (two per row) in a group shown while ``name`` is chosen."""
                    with gr.Group(visible=name == default_method, elem_classes=["fd-options"]) as group:
                        for start in range(0, len(specs), 2):
                            with gr.Row():
                                for spec in specs[start:start + 2]:
                                    shown = presets.get(name, {}).get(spec.name, spec.default)
                                    option_widgets.append((spec, option_widget(spec, shown)))
                    groups.setdefault(name, []).append(group)

                for name in methods:  # everyday options: always in view
                    option_group(name, [spec for spec in option_specs(name) if not spec.advanced])
                with gr.Accordion("Advanced", open=False, elem_id="fd-advanced"):
                    for name in methods:  # expert options (OptionSpec.advanced, from the config's metadata)
                        option_group(name, [spec for spec in option_specs(name) if spec.advanced])
                    calibration_file = gr.File(value=calibration, label="calibration file (fastdit calibrate)",
                                               file_types=[".json"], type="filepath", elem_id="fd-calibration")
                    gr.Markdown("A calibration file sets the method's settings per step bucket, layer and head (its "
                                "method must be the one chosen above); its options replace the boxes.",
                                elem_classes=["fd-calibration-help"])
                    negative = gr.Textbox(value=DEFAULT_NEGATIVE, label="negative prompt", lines=1)
                    with gr.Row():
                        mask_layer = gr.Number(value=-1, label="mask: layer", precision=0,
                                               info="patched layer to draw (-1 = the last)")
                        mask_head = gr.Number(value=0, label="mask: head", precision=0, minimum=0)
                    reuse_dense = gr.Checkbox(value=False, label="reuse the dense run when its inputs are unchanged",
                                              info="faster exploring; the speedup then compares against an earlier "
                                                   "dense timing")
                    image = gr.Image(label="conditioning image (image-to-video models)", type="pil", height=160)
            with gr.Column(scale=3, min_width=480):
                with gr.Row():
                    dense_video = gr.Video(label="dense (reference)", elem_id="fd-dense-video", autoplay=True,
                                           loop=True, interactive=False, height=300)
                    method_video = gr.Video(label="sparse attention (chosen method)", elem_id="fd-method-video",
                                            autoplay=True, loop=True, interactive=False, height=300)
                metrics_box = gr.HTML(metrics_html(None), label="metrics", elem_id="fd-metrics")
                with gr.Row():
                    mask_image = gr.Image(label="attention mask", type="filepath", interactive=False, height=300,
                                          elem_id="fd-mask")
                    scatter = gr.ScatterPlot(scatter_frame([]), x="speedup", y="PSNR (dB)", color="method",
                                             tooltip=["run", "speedup", "PSNR (dB)"], title="speed against quality",
                                             label="scatter", height=300, elem_id="fd-scatter")
                mask_caption = gr.Markdown(label="mask caption")
                sheet_image = gr.Image(label="contact sheet: first, middle and last frame (speedup, PSNR of this run)",
                                       type="filepath", interactive=False, elem_id="fd-contact-sheet")
        table = gr.Dataframe(history_frame([]), label="runs in this session", interactive=False, elem_id="fd-table",
                             wrap=True)
        with gr.Accordion("run details (JSON)", open=False):
            details = gr.JSON(label="metrics")
        example_rows = _examples(default_model, sizes, methods)
        if example_rows:
            gr.Examples(example_rows, [prompt, negative, seed, steps, guidance, frames, height, width, method],
                        label=f"examples (sizes for {default_model})", examples_per_page=8)

        group_list = [(name, group) for name, method_groups in groups.items() for group in method_groups]

        def show_options(selected):
            return [gr.update(visible=name == selected) for name, _ in group_list]

        method.change(show_options, method, [group for _, group in group_list], queue=False,
                      api_visibility="private")

        preset_names = {(method, name) for model_name in TINY_MODELS for method, values in
                        _shown_presets(model_name).items() for name in values}
        preset_widgets = [(spec, c) for spec, c in option_widgets if (spec.method, spec.name) in preset_names]

        def on_model(selected, shown_prompt):
            defaults = size_defaults(selected)
            size_updates = [gr.update()] * 5 if not defaults else [
                gr.update(value=defaults.get(key)) for key in
                ("num_inference_steps", "guidance_scale", "num_frames", "height", "width")]
            shown = _shown_presets(selected)
            option_updates = [gr.update(value=spec.display(shown.get(spec.method, {}).get(spec.name, spec.default)))
                              for spec, _ in preset_widgets]
            # a caption of the shapes grammar for tiny-shapes; the fox back for the others
            prompt_update = gr.update(value=default_prompt(selected)) if shown_prompt in (
                DEFAULT_PROMPT, default_prompt("tiny-shapes")) else gr.update()
            return size_updates + [prompt_update] + option_updates

        model.change(on_model, [model, prompt],
                     [steps, guidance, frames, height, width, prompt] + [c for _, c in preset_widgets],
                     queue=False, api_visibility="private")

        def run(*args):
            # Gradio passes the inputs in order, then the request and the progress tracker (see the
            # signature set below: it names the API parameters after the options).
            *values, request, progress = args
            fixed = dict(zip(FIXED_INPUTS, values[:len(FIXED_INPUTS)]))
            options = {spec.name: value for (spec, _), value in zip(option_widgets, values[len(FIXED_INPUTS):])
                       if spec.method == fixed["method"]}
            run_request = RunRequest(
                model=fixed["model"], prompt=fixed["prompt"], negative_prompt=fixed["negative_prompt"],
                seed=fixed["seed"], steps=fixed["steps"], guidance=fixed["guidance"], frames=fixed["frames"],
                height=fixed["height"], width=fixed["width"], method=fixed["method"], options=options,
                mask_layer=fixed["mask_layer"], mask_head=fixed["mask_head"], reuse_dense=bool(fixed["reuse_dense"]),
                image=fixed["image"], calibration=fixed["calibration"])
            with runner.run_scope(getattr(request, "session_hash", None) or "default") as cancel:
                out = _compare(runner, run_request, progress, cancel)
            past = list(fixed["history"] or [])
            past.append({**out.metrics, "run": len(past) + 1})
            for note in out.notes:
                gr.Info(note)
            return (out.dense_video, out.method_video, metrics_html(out.metrics), out.mask, out.mask_caption,
                    "\n".join(f"- {note}" for note in out.notes), history_frame(past), scatter_frame(past),
                    json_safe(out.metrics), out.contact_sheet, past)

        P = inspect.Parameter
        input_names = FIXED_INPUTS + [s.api_name for s, _ in option_widgets]
        run.__signature__ = inspect.Signature(
            [P(n, P.POSITIONAL_OR_KEYWORD, default=None) for n in input_names]
            + [P("request", P.POSITIONAL_OR_KEYWORD, default=None, annotation=gr.Request),
               P("progress", P.POSITIONAL_OR_KEYWORD, default=gr.Progress())])
        run.__annotations__ = {"request": gr.Request}

        inputs = [model, prompt, negative, seed, steps, guidance, frames, height, width, method, mask_layer, mask_head,
                  reuse_dense, image, history, calibration_file] + [c for _, c in option_widgets]
        outputs = [dense_video, method_video, metrics_box, mask_image, mask_caption, notes, table, scatter, details,
                   sheet_image, history]
        run_event = run_btn.click(run, inputs, outputs, api_name="compare", concurrency_limit=concurrency,
                                  show_progress_on=[dense_video, method_video])

        def stop(request: gr.Request = None):
            runner.cancel(getattr(request, "session_hash", None) or "default")

        stop_btn.click(stop, None, None, cancels=[run_event], queue=False, api_name="stop")
    return demo


def _compare(runner, run_request, progress, cancel):
    """``runner.compare`` with every failure as a ``gr.Error`` (the app keeps working)."""
    try:
        return runner.compare(run_request, progress=progress, cancel=cancel)
    except RunCancelled:
        raise gr.Error("Run cancelled.", title="cancelled") from None
    except AppError as error:
        raise gr.Error(str(error), title="fastdit") from None
    except Exception as error:  # noqa: BLE001 - every failure becomes a message
        log.error("run failed:\n%s", traceback.format_exc())
        free_cuda()
        if is_oom(error):
            raise gr.Error("Out of memory at this size: use fewer frames, a smaller size or a smaller model.",
                           title="fastdit") from None
        raise gr.Error(f"{type(error).__name__}: {error}", title="run failed") from None
