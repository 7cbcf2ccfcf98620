"""The benches' table layout (``bench/tables.py``): columns as wide as their widest entry, cells
right-aligned under a rule, or a Markdown table."""

from __future__ import annotations

from tests.bench import load_bench

[tables] = load_bench("tables")
field, ratio, table_lines = tables.field, tables.ratio, tables.table_lines

ROWS = [
    dict(layers=8, base_s=0.5, lime_s=0.55, reads=3 * 2**30, name="blocked"),
    dict(layers=128, base_s=12.25, lime_s=15.0, reads=2**29, name="B=1"),
]
COLUMNS = [
    ("layers", field("layers")),
    ("base s", field("base_s", ".3f")),
    ("LIMe x", ratio("lime_s", "base_s")),
    ("read GiB", field("reads", ".2f", 2**30)),
    ("model", field("name")),
]


def test_text_table_aligns_every_cell_under_its_title():
    lines = table_lines(COLUMNS, ROWS)
    assert lines == [
        "layers  base s  LIMe x  read GiB    model",
        "-----------------------------------------",
        "     8   0.500   1.100      3.00  blocked",
        "   128  12.250   1.224      0.50      B=1",
    ]


def test_markdown_table_has_a_separator_row_and_unpadded_cells():
    lines = table_lines(COLUMNS, ROWS, markdown=True)
    assert lines[:2] == ["| layers | base s | LIMe x | read GiB | model |", "| --- | --- | --- | --- | --- |"]
    assert lines[2] == "| 8 | 0.500 | 1.100 | 3.00 | blocked |"
    assert len(lines) == 2 + len(ROWS)


def test_a_table_without_rows_is_its_header():
    assert table_lines(COLUMNS[:2], []) == ["layers  base s", "--------------"]
