"""The benches' tables: one place that lays rows out as columns.

A column is a title and a function from a row (the dict a bench measured) to the cell's text;
``field`` makes the usual one, a row's value under a key in a format spec (``MISSING`` where the
row lacks the key: a quantity the bench was told to skip).  ``print_table`` prints
the columns right-aligned, each as wide as its title or widest cell and two spaces apart, under
a rule of dashes, or as a Markdown table (the form BENCHMARKS.md holds) with ``markdown=True``.
``write_json`` writes the rows themselves, with the command that measured them, for a script
(the GPU session, ``tools/gpu/session.py``) to read.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable

Column = tuple[str, Callable[[dict], str]]
"""A column's title and the function that writes its cell of a row."""


MISSING = "-"
"""The cell of a quantity the row does not hold."""


def field(key: str, spec: str = "", scale: float = 1.0) -> Callable[[dict], str]:
    """The cell of ``row[key] / scale`` in the format ``spec`` (e.g. ``".3f"``, ``",.0f"``);
    ``MISSING`` without ``key``."""
    if scale == 1.0:
        return lambda row: format(row[key], spec) if key in row else MISSING
    return lambda row: format(row[key] / scale, spec) if key in row else MISSING


def ratio(numerator: str, denominator: str, spec: str = ".3f") -> Callable[[dict], str]:
    """The cell of ``row[numerator] / row[denominator]`` in the format ``spec``; ``MISSING``
    without either key."""
    return lambda row: (
        format(row[numerator] / row[denominator], spec) if numerator in row and denominator in row else MISSING
    )


def table_lines(columns: list[Column], rows: list[dict], markdown: bool = False) -> list[str]:
    """The table's lines: the header, its rule and one line per row."""
    titles = [title for title, _ in columns]
    cells = [[cell(row) for _, cell in columns] for row in rows]
    if markdown:
        return ["| " + " | ".join(line) + " |" for line in [titles, ["---"] * len(titles)] + cells]
    widths = [max(len(text) for text in column) for column in zip(titles, *cells)]
    lines = ["  ".join(text.rjust(width) for text, width in zip(line, widths)) for line in [titles] + cells]
    return lines[:1] + ["-" * len(lines[0])] + lines[1:]


def print_table(columns: list[Column], rows: list[dict], markdown: bool = False) -> None:
    """Print ``table_lines(columns, rows, markdown)``."""
    print("\n".join(table_lines(columns, rows, markdown)))


def write_json(path: str, args: argparse.Namespace, rows: list[dict], **sections) -> None:
    """``{"command": argv, "args": args, "rows": rows}`` and any further ``sections`` (e.g. a
    profile beside the rows) at ``path``, replaced whole (a reader never sees half a file: a bench
    killed between cases leaves the cases before)."""
    document = dict(command=sys.argv, args=vars(args), rows=rows, **sections)
    with open(path + ".part", "w") as file:
        json.dump(document, file, indent=1)
    os.replace(path + ".part", path)
