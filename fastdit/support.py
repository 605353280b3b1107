"""The family x method support matrix, computed from the adapter and method registries.

``python -m fastdit.support`` prints the Markdown table that the README carries between
``<!-- support-table:start -->`` and ``<!-- support-table:end -->`` (a test keeps them equal).

A method is supported on a family unless the family is marked unpatchable (``Adapter.unsupported``)
or the method's ``check_family(adapter, config)`` raises for it.
"""
from __future__ import annotations

from dataclasses import dataclass

TABLE_START = "<!-- support-table:start -->"
TABLE_END = "<!-- support-table:end -->"


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


def readme_table(text):
    """The text between the support-table markers of ``text`` (stripped), or None without markers."""
    if TABLE_START not in text or TABLE_END not in text:
        return None
    return text.split(TABLE_START, 1)[1].split(TABLE_END, 1)[0].strip()


if __name__ == "__main__":
    print(support_table_markdown())
