"""What the app shows of a run, as plain values (HTML text, pandas frames, JSON): no gradio here."""
from __future__ import annotations

import html
import math


from fastdit.jsonutil import to_json

from .service import fallback_text

__all__ = ["CSS", "HEADER", "SCATTER_COLUMNS", "TABLE_COLUMNS", "history_frame", "json_safe", "metrics_html",
           "scatter_frame"]

HEADER = """
<div class="fd-header">
  <h1>⚡ fastdit</h1>
  <p>Sparse attention for diffusers video DiTs, in one line:
  <code>fastdit.patch(pipe, "sta")</code>. <b>Compare</b> runs the dense pipeline and the chosen method
  with the same seed: both videos, the speedup, the quality against dense, how much of the attention
  was actually computed (effective density) and the attention mask.
  The <code>tiny-*</code> models are built in (random weights: their videos are noise-like, but timing,
  fidelity and masks are real); type a hub id or a local folder for a real model.</p>
</div>
"""

CSS = """
.fd-header h1 {margin-bottom: 0.2em;}
.fd-header p {margin-top: 0; opacity: 0.85;}
.fd-cards {display: grid; grid-template-columns: repeat(auto-fit, minmax(110px, 1fr)); gap: 8px;}
.fd-card {border: 1px solid var(--border-color-primary); border-radius: 10px; padding: 8px 10px;
          background: var(--background-fill-secondary);}
.fd-card .fd-label {font-size: 0.78em; opacity: 0.75; text-transform: uppercase; letter-spacing: 0.03em;}
.fd-card .fd-value {font-size: 1.35em; font-weight: 600;}
.fd-card.fd-accent .fd-value {color: var(--color-accent);}
.fd-fallbacks {font-size: 0.85em; opacity: 0.85; padding: 4px 2px;}
.fd-empty {opacity: 0.7; padding: 8px 2px;}
#fd-compare {min-height: 48px;}
.fd-options {padding: 2px;}
"""

TABLE_COLUMNS = ["#", "model", "method", "options", "size", "steps", "dense (s)", "method (s)", "speedup",
                 "PSNR (dB)", "SSIM", "LPIPS", "effective density", "sparse density", "fallbacks"]
SCATTER_COLUMNS = ["speedup", "PSNR (dB)", "method", "run"]


def _fmt(value, spec, suffix=""):
    if value is None:
        return "–"
    if isinstance(value, float) and math.isinf(value):
        return "∞" + suffix
    return format(value, spec) + suffix


def _percent(value):
    return _fmt(None if value is None else 100 * value, ".1f", "%")


def metrics_html(metrics):
    """The result cards of one run (a hint before the first run)."""
    if not metrics:
        return '<div class="fd-empty">Press <b>Compare</b> to run dense and the chosen method with the same seed.</div>'
    cards = [
        ("dense", _fmt(metrics["dense_latency_s"], ".2f", " s"), ""),
        (metrics["method"], _fmt(metrics["method_latency_s"], ".2f", " s"), ""),
        ("speedup", _fmt(metrics["speedup"], ".2f", "×"), " fd-accent"),
        ("PSNR", _fmt(metrics["psnr_db"], ".2f", " dB"), " fd-accent"),
        ("SSIM", _fmt(metrics["ssim"], ".4f"), ""),
        ("LPIPS", _fmt(metrics.get("lpips"), ".4f"), ""),
        ("effective density", _percent(metrics.get("effective_density")), " fd-accent"),
        ("sparse density", _percent(metrics.get("sparse_density")), ""),
        ("fallbacks", str(metrics.get("fallback_calls", 0)), ""),
    ]
    guard = metrics.get("guard") or {}
    if guard.get("head_calls"):
        cards.append(("guard: widened / dense", f"{guard['widened']} / {guard['dense']} of {guard['head_calls']}", ""))
    body = "".join(f'<div class="fd-card{extra}"><div class="fd-label">{html.escape(str(label))}</div>'
                   f'<div class="fd-value">{html.escape(value)}</div></div>' for label, value, extra in cards)
    reasons = fallback_text(metrics.get("fallbacks") or {})
    footer = (f'<div class="fd-fallbacks">fallbacks (the model\'s own attention ran): {html.escape(reasons)}</div>'
              if reasons else "")
    return f'<div class="fd-cards">{body}</div>{footer}'


def _round(value, digits):
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return None
    return round(value, digits)


def history_frame(history):
    """The session table: one row per run (``history``: the runs' metrics with a ``run`` number)."""
    import pandas as pd

    rows = []
    for run in history:
        count = run.get("fallback_calls", 0)
        reasons = fallback_text(run.get("fallbacks") or {})
        rows.append([run["run"], run["model"], run["method"], run.get("options_text", ""), run["size"], run["steps"],
                     _round(run["dense_latency_s"], 3), _round(run["method_latency_s"], 3), _round(run["speedup"], 3),
                     _round(run["psnr_db"], 2), _round(run["ssim"], 4), _round(run.get("lpips"), 4),
                     _round(run.get("effective_density"), 3), _round(run.get("sparse_density"), 3),
                     f"{count}: {reasons}" if count else "0"])
    return pd.DataFrame(rows, columns=TABLE_COLUMNS)


def scatter_frame(history):
    """Speedup against PSNR of the session's runs (runs equal to dense, PSNR inf, are left out)."""
    import pandas as pd

    rows = [{"speedup": run["speedup"], "PSNR (dB)": run["psnr_db"], "method": run["method"],
             "run": f"#{run['run']} {run['method']} {run.get('options_text', '')}"}
            for run in history if run["psnr_db"] is not None and math.isfinite(run["psnr_db"])]
    return pd.DataFrame(rows, columns=SCATTER_COLUMNS)


def json_safe(value):
    """``value`` for the JSON panel: infinities as text (PSNR of identical runs), numpy numbers as
    Python numbers (``fastdit.jsonutil.to_json``, the one JSON cleaner)."""
    return to_json(value, nonfinite_as_text=True)
