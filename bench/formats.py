"""Bench results as tables to paste: markdown (one table a scenario) or CSV (one flat table for a spreadsheet).

A script describes its figures once, as `Column`s, and hands over `Table`s; the plain-text
layout each script prints by default stays its own.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Sequence
from typing import Any, NamedTuple

FORMATS = ("text", "markdown", "csv", "json")


class Column(NamedTuple):
    key: str  # the CSV header: a stable name for scripts and spreadsheets
    title: str  # the markdown header
    digits: int | None = None  # decimals shown; None: the value as it is (names, counts)


class Table(NamedTuple):
    name: str  # the value of the group column in CSV (a scenario, a section)
    title: str  # the heading above the markdown table
    columns: Sequence[Column]
    rows: Sequence[Sequence[Any]]  # one value a column; None is a missing figure


def _cell(value: Any, digits: int | None, missing: str) -> str:
    if value is None:
        return missing
    if isinstance(value, float) and digits is not None:
        return f"{value:.{digits}f}"
    return str(value)


def markdown(tables: Sequence[Table]) -> str:
    """Each table under its title, numbers right-aligned; `-` where a figure is missing."""
    out = []
    for table in tables:
        head = [c.title.replace("|", "\\|") for c in table.columns]
        align = ["---:" if c.digits is not None else "---" for c in table.columns]
        lines = [f"**{table.title}**", "", f"| {' | '.join(head)} |", f"|{'|'.join(align)}|"]
        for row in table.rows:
            cells = [_cell(v, c.digits, "-").replace("|", "\\|") for c, v in zip(table.columns, row, strict=True)]
            lines.append(f"| {' | '.join(cells)} |")
        out.append("\n".join(lines))
    return "\n\n".join(out)


def csv_text(tables: Sequence[Table], group: str) -> str:
    """One table: `group` (each table's name), then every column any table has, in order; empty where absent."""
    # Two more decimals than the markdown table: a spreadsheet rounds for itself.
    digits: dict[str, int | None] = {}
    for table in tables:
        for column in table.columns:
            digits.setdefault(column.key, None if column.digits is None else column.digits + 2)
    keys = list(digits)
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow([group, *keys])
    for table in tables:
        for row in table.rows:
            values = {c.key: v for c, v in zip(table.columns, row, strict=True)}
            writer.writerow([table.name, *(_cell(values.get(k), digits[k], "") for k in keys)])
    return buffer.getvalue().rstrip("\n")
