"""results.json, results.md (one row per setting, then run details and notes) and the plots."""
from __future__ import annotations

import os

import numpy as np

from fastdit.eval.metrics.registry import PER_SAMPLE_COLUMNS
from fastdit.eval.runner.storage import write_json

__all__ = ["format_cell", "markdown_table", "pareto_front", "write_contact_sheets", "write_plots", "write_reports"]


def _guard_cell(guard):
    """``"3/5 of 96"`` for a setting's guard counts, "-" where the guard did not run."""
    if not guard or not guard.get("head_calls"):
        return "-"
    return f"{guard['widened']}/{guard['dense']} of {guard['head_calls']}"


def format_cell(value, column=None):
    """A results value as a Markdown table cell (``-`` for none)."""
    if value is None:
        return "-"
    if column == "psnr":
        return f"{value:.2f}"
    if column in ("latency_s",):
        return f"{value:.3f}"
    if column == "speedup":
        return f"{value:.2f}x"
    if column in ("peak_memory_mb", "fid"):
        return f"{value:.1f}"
    if column in ("density", "sparse_density"):
        return f"{value:.3f}"
    if column in ("fallback_calls",):
        return str(value)
    return f"{value:.4f}"


def markdown_table(results):
    """The results as Markdown: one row per setting, then run details and notes."""
    columns = list(results["columns"])
    header = ["setting", "samples", "latency (s)", "speedup", "peak mem (MB)", "density (all calls)", "sparse-only",
              "fallbacks", "guard (widened/dense of head-calls)"]
    for c in columns:
        info = results["columns"][c]
        arrow = "↑" if info["higher_is_better"] else "↓"
        header.append(f"{c}{' (' + info['unit'] + ')' if info['unit'] else ''} {arrow}")
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for s in results["settings"]:
        cells = [f"`{s['setting']}`", str(s["samples"]), format_cell(s["latency_s"], "latency_s"),
                 format_cell(s["speedup"], "speedup"), format_cell(s["peak_memory_mb"], "peak_memory_mb"),
                 format_cell(s.get("density"), "density"), format_cell(s.get("sparse_density"), "sparse_density"),
                 format_cell(s.get("fallback_calls"), "fallback_calls"), _guard_cell(s.get("guard"))]
        cells += [format_cell(s.get(c), c) for c in columns]
        lines.append("| " + " | ".join(cells) + " |")
    call = ", ".join(f"{k}={v}" for k, v in results["call"].items())
    out = [f"# fastdit eval: {results['model']}", "", *lines, "",
           f"- device: {results['device']} ({results['num_processes']} process(es)), backend {results['backend']}",
           f"- call: {call}",
           f"- prompts: {len(results['prompts'])} from {results['prompts_file']}; "
           f"seeds: {', '.join(map(str, results['seeds']))}",
           f"- speedup: {results['speedup_definition']}",
           f"- {results['density_definition']}",
           "- psnr/ssim/lpips: against the dense sample of the same prompt and seed; means over samples "
           "(psnr ignores identical pairs)"]
    for s in results["settings"]:
        for reason, count in (s.get("fallbacks") or {}).items():
            out.append(f"- fallbacks of `{s['setting']}`: {count} call(s): {reason}")
    out += [f"- {note}" for note in results["notes"]]
    return "\n".join(out) + "\n"


def pareto_front(points, higher_is_better):
    """Indices of points (speedup, value) not dominated by another (more speedup, better value),
    by increasing speedup."""
    better = (lambda a, b: a >= b) if higher_is_better else (lambda a, b: a <= b)
    front = []
    for i, (x, y) in enumerate(points):
        dominated = any(
            (x2 >= x and better(y2, y)) and (x2 > x or y2 != y) for j, (x2, y2) in enumerate(points) if j != i)
        if not dominated:
            front.append(i)
    return sorted(front, key=lambda i: points[i][0])


def write_plots(results, out_dir):
    """``speedup_vs_<metric>.png`` (Pareto front marked) and ``per_prompt_<metric>.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    written = []
    for column, info in results["columns"].items():
        pts = [(s["speedup"], s.get(column), s["setting"]) for s in results["settings"]
               if s.get("speedup") is not None and s.get(column) is not None]
        if not pts:
            continue
        fig, ax = plt.subplots(figsize=(6, 4.5))
        xs, ys = [p[0] for p in pts], [p[1] for p in pts]
        ax.scatter(xs, ys, s=40, color="tab:blue", zorder=3, label="setting")
        for x, y, name in pts:
            ax.annotate(name, (x, y), textcoords="offset points", xytext=(5, 4), fontsize=8)
        front = pareto_front(list(zip(xs, ys)), info["higher_is_better"])
        ax.plot([xs[i] for i in front], [ys[i] for i in front], "-o", color="tab:red", mfc="none", ms=12,
                zorder=2, label="Pareto front")
        unit = f" ({info['unit']})" if info["unit"] else ""
        ax.set_xlabel("speedup over dense (x)")
        ax.set_ylabel(f"{column}{unit} {'(higher is better)' if info['higher_is_better'] else '(lower is better)'}")
        ax.set_title(f"speedup vs {column}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = os.path.join(out_dir, f"speedup_vs_{column}.png")
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    for column in ["speedup", *[c for c in results["columns"] if c in PER_SAMPLE_COLUMNS]]:
        names, data = [], []
        for s in results["settings"]:
            per_prompt = {}
            for r in results["samples"]:
                if r["setting"] == s["setting"] and r.get(column) is not None:
                    per_prompt.setdefault(r["prompt_index"], []).append(r[column])
            if per_prompt:
                names.append(s["setting"])
                data.append([float(np.mean(v)) for _, v in sorted(per_prompt.items())])
        if not data:
            continue
        fig, ax = plt.subplots(figsize=(max(4.5, 1.4 * len(names) + 2), 4.5))
        ax.boxplot(data, showfliers=False)
        ax.set_xticks(range(1, len(names) + 1), names, rotation=20, ha="right", fontsize=8)
        rng = np.random.default_rng(0)
        for i, values in enumerate(data, start=1):
            ax.scatter(i + rng.uniform(-0.12, 0.12, len(values)), values, s=14, alpha=0.7, color="tab:blue", zorder=3)
        info = results["columns"].get(column, {"unit": "x"})
        ax.set_ylabel(f"{column}{' (' + info['unit'] + ')' if info.get('unit') else ''}")
        ax.set_title(f"per-prompt {column} (mean over seeds; one point per prompt)")
        ax.grid(alpha=0.3, axis="y")
        fig.tight_layout()
        path = os.path.join(out_dir, f"per_prompt_{column}.png")
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def write_reports(cfg, results, log=print):
    """``results.json``, ``results.md`` and (``cfg.plots``, matplotlib installed) ``plots/``.
    Returns the plot paths."""
    write_json(os.path.join(cfg.out, "results.json"), results)
    with open(os.path.join(cfg.out, "results.md"), "w") as f:
        f.write(markdown_table(results))
    if not cfg.plots:
        return []
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        log("note: matplotlib is not installed, so no plots were drawn (pip install 'fastdit[eval]')")
        return []
    return write_plots(results, os.path.join(cfg.out, "plots"))


#: Contact sheets are drawn for at most this many prompts (the first ones), first seed only.
MAX_SHEETS = 16


def write_contact_sheets(cfg, samples, results, log=print):
    """``contact_sheets/p<prompt>_s<seed>.png``: for each of the first ``MAX_SHEETS`` prompts (first
    seed), the first / middle / last frame of dense and of every setting, one row each, labelled
    with the sample's speedup and PSNR against dense (``fastdit.media.contact_sheet``): where people
    would rather look than read. Returns the paths; none when ``cfg.plots`` is off."""
    from fastdit.media.contact_sheet import contact_sheet, row_label

    from .storage import load_frames

    if not cfg.plots or not samples:
        return []
    by_key = {(row["setting"], row["prompt_index"], row["seed"]): row for row in results.get("samples", [])}
    seed = samples[0].seed
    prompts = sorted({s.prompt_index for s in samples})[:MAX_SHEETS]
    folder = os.path.join(cfg.out, "contact_sheets")
    os.makedirs(folder, exist_ok=True)
    paths = []
    for index in prompts:
        chosen = [s for s in samples if s.prompt_index == index and s.seed == seed]
        videos, labels = [], []
        for sample in chosen:
            row = by_key.get(sample.key, {})
            label = {"method": sample.setting.name, "speedup": row.get("speedup") or 1.0, "psnr_db": row.get("psnr")}
            if sample.setting.method == "dense":
                label = {"method": "dense"}
            videos.append(load_frames(cfg, sample))
            labels.append(row_label(label))
        paths.append(contact_sheet(videos, labels, os.path.join(folder, f"p{index}_s{seed}.png")))
    if len({s.prompt_index for s in samples}) > MAX_SHEETS:
        log(f"contact sheets for the first {MAX_SHEETS} prompts only")
    return paths
