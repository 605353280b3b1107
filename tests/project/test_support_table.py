"""The generated tables (support table in docs/models.md, option tables in docs/methods.md) are the
ones the registries give, and the README links every docs page."""
import re
from pathlib import Path

from fastdit.support import (OPTIONS_END, OPTIONS_START, marked_section, options_markdown, readme_table,
                             support_matrix, support_table_markdown)

ROOT = Path(__file__).resolve().parents[2]
FIX = "regenerate it with `python -m fastdit.support` and paste it between the markers"


def test_models_page_table_matches_registry():
    text = (ROOT / "docs" / "models.md").read_text()
    table = readme_table(text)
    assert table is not None, f"docs/models.md lacks the support-table markers; {FIX}"
    assert table == support_table_markdown(), f"docs/models.md's support table disagrees with the registry; {FIX}"


def test_methods_page_option_tables_match_the_configs():
    text = (ROOT / "docs" / "methods.md").read_text()
    tables = marked_section(text, OPTIONS_START, OPTIONS_END)
    fix = "regenerate them with `python -m fastdit.support --options` and paste them between the markers"
    assert tables is not None, f"docs/methods.md lacks the markers {OPTIONS_START} / {OPTIONS_END}; {fix}"
    assert tables == options_markdown(), f"docs/methods.md's option tables disagree with the config dataclasses; {fix}"


def test_readme_links_every_docs_page_and_every_link_exists():
    readme = (ROOT / "README.md").read_text()
    linked = set(re.findall(r"\]\((docs/[\w.-]+\.md)(?:#[\w-]+)?\)", readme))
    pages = {f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")}
    assert pages - linked == set(), f"docs pages the README does not link: {sorted(pages - linked)}"
    for path in (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))):
        for target in re.findall(r"\]\(([^)#\s]+\.md)(?:#[\w-]+)?\)", path.read_text()):
            if "://" not in target:
                assert (path.parent / target).resolve().is_file(), f"{path.name} links a missing page: {target}"


def test_readme_first_screen_has_what_a_newcomer_needs():
    """Install, the main job, the one-line patch, the methods and what to expect, in the first 80 lines."""
    head = "\n".join((ROOT / "README.md").read_text().splitlines()[:80])
    for needed in ("pip install torch==2.13.0 && pip install -e . && fastdit compare",
                   'pip install torch==2.13.0 && pip install -e ".[test,eval,app,cache,train]" && TRITON_INTERPRET=1 python -m pytest -q',
                   'fastdit.patch(pipe, "sta")', "## Methods", "## What to expect", "BENCHMARKS.md"):
        assert needed in head, f"the README's first 80 lines lack {needed!r}"


def test_matrix_rows():
    import fastdit
    from fastdit.pipelines import registered_adapters

    rows = support_matrix()
    assert [r.family for r in rows] == [a.family for a in registered_adapters()]
    for row in rows:
        family, kind, pipelines, methods = row
        assert kind in ("video", "image")
        assert set(methods) == set(fastdit.method_names())
        assert methods["dense"] == (not row.unsupported)
        if kind == "image" and "radial" in methods and not row.unsupported:
            assert not methods["radial"] and "image" in row.reasons["radial"]
