"""The README's support table is the one generated from the adapter and method registries."""
from pathlib import Path

from fastdit.support import TABLE_END, TABLE_START, readme_table, support_matrix, support_table_markdown

ROOT = Path(__file__).resolve().parent.parent
FIX = "regenerate it with `python -m fastdit.support` and paste it between the markers"


def test_readme_table_matches_registry():
    text = (ROOT / "README.md").read_text()
    table = readme_table(text)
    assert table is not None, f"README.md lacks the markers {TABLE_START} / {TABLE_END}; {FIX}"
    assert table == support_table_markdown(), f"README.md's support table disagrees with the registry; {FIX}"


def test_docs_table_matches_registry():
    text = (ROOT / "docs" / "support_table.md").read_text()
    table = readme_table(text)
    assert table == support_table_markdown(), f"docs/support_table.md disagrees with the registry; {FIX}"


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
