"""The family x method support matrix, computed from the adapter and method registries.

``python -m fastdit.support`` prints the Markdown table that docs/models.md carries between
``<!-- support-table:start -->`` and ``<!-- support-table:end -->``; ``python -m fastdit.support
--options`` the option tables of docs/methods.md (between ``<!-- method-options:start -->`` and
``<!-- method-options:end -->``). A test keeps both equal to the registries.

A method is supported on a family unless the family is marked unpatchable (``Adapter.unsupported``)
or the method's ``check_family(adapter, config)`` raises for it.
"""
from __future__ import annotations

from dataclasses import dataclass

TABLE_START = "<!-- support-table:start -->"
TABLE_END = "<!-- support-table:end -->"
OPTIONS_START = "<!-- method-options:start -->"
OPTIONS_END = "<!-- method-options:end -->"


@dataclass
class SupportRow:
    """One family of the matrix."""

    family: str
    kind: str  # "video" or "image"
    pipelines: tuple
    methods: dict  # method name -> bool
    reasons: dict  # method name -> why not (only for unsupported ones)
    transformer_classes: tuple = ()
    unsupported: str = ""

    def __iter__(self):
        """``family, kind, pipelines, methods`` (so a row unpacks as a 4-tuple)."""
        return iter((self.family, self.kind, self.pipelines, self.methods))


def _class_names(adapter):
    return tuple(c if isinstance(c, str) else c.__name__ for c in adapter.transformer_classes)


def support_matrix():
    """Rows ``(family, kind, pipelines, {method: supported})`` for every registered adapter."""
    from fastdit.methods import get_method, method_names
    from fastdit.pipelines import registered_adapters

    names = method_names()
    rows = []
    for adapter in registered_adapters():
        supported, reasons = {}, {}
        for name in names:
            method = get_method(name)
            if adapter.unsupported:
                supported[name], reasons[name] = False, adapter.unsupported
                continue
            try:
                config = method.resolve(method.make_config(), adapter.family)
                method.check_family(adapter, config)
            except ValueError as error:
                supported[name], reasons[name] = False, str(error)
            else:
                supported[name] = True
        rows.append(SupportRow(adapter.family, "video" if adapter.video else "image", tuple(adapter.pipelines),
                               supported, reasons, _class_names(adapter), adapter.unsupported))
    return rows


def support_table_markdown():
    """The support table in Markdown (no trailing newline)."""
    from fastdit.methods import method_names

    names = method_names()
    header = ["Family", "Kind", "Transformer", "Pipelines"] + [f"`{n}`" for n in names]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] * 4 + [":---:"] * len(names)) + "|"]
    for row in support_matrix():
        cells = [f"`{row.family}`", row.kind, ", ".join(f"`{c}`" for c in row.transformer_classes),
                 ", ".join(row.pipelines)]
        cells += ["yes" if row.methods[n] else "no" for n in names]
        lines.append("| " + " | ".join(cells) + " |")
    notes = [f"`{row.family}`: not patchable: {row.unsupported}." for row in support_matrix() if row.unsupported]
    if notes:
        lines.append("")
        lines.extend(f"- {note}" for note in notes)
    return "\n".join(lines)


def options_markdown():
    """Every method's options in Markdown: one table per method (option, default, meaning, and
    whether the app keeps it under "Advanced"), read from the config dataclasses (no trailing newline)."""
    from fastdit.app.method_options import option_specs
    from fastdit.methods import get_method, method_names
    from fastdit.options import format_value

    def cell(text):
        return str(text).replace("|", "\\|").replace("\n", " ")

    parts = []
    for name in method_names():
        config = get_method(name).config_cls.__name__
        lines = [f"### {name} options", "", f"`fastdit.patch(pipe, \"{name}\", ...)` or `fastdit.{config}(...)`.", "",
                 "| option | default | meaning | app |", "|---|---|---|---|"]
        for spec in option_specs(name):
            default = spec.default_text() if spec.default is None else f"`{format_value(spec.default)}`"
            lines.append(f"| `{spec.name}` | {cell(default)} | {cell(spec.help)} | "
                         f"{'advanced' if spec.advanced else ''} |")
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


def marked_section(text, start=TABLE_START, end=TABLE_END):
    """The text between the markers ``start`` and ``end`` of ``text`` (stripped), or None without them."""
    if start not in text or end not in text:
        return None
    return text.split(start, 1)[1].split(end, 1)[0].strip()


def readme_table(text):
    """The text between the support-table markers of ``text`` (stripped), or None without markers."""
    return marked_section(text, TABLE_START, TABLE_END)


if __name__ == "__main__":
    import sys

    print(options_markdown() if "--options" in sys.argv[1:] else support_table_markdown())
