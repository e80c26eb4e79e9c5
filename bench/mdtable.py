"""One Markdown table renderer for every report the bench writes.

A table is a list of rows (dicts of raw values) and a list of :class:`Column` specs saying which
value each column shows and how it is formatted, so a section states *what* it tabulates and the
pipes, separators and alignment live here once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

Row = Mapping[str, Any]


@dataclass(frozen=True)
class Column:
    """One column: its header, where its value comes from, and how the value is written."""

    header: str
    value: str | Callable[[Row], Any]  # a key of the row, or a function of the whole row
    fmt: Callable[[Any], str] = str  # value -> cell text
    right: bool = False  # right-aligned (`---:`), for columns of numbers

    def cell(self, row: Row) -> str:
        """This column's text in ``row``."""
        v = row[self.value] if isinstance(self.value, str) else self.value(row)
        return self.fmt(v)


def markdown_table(rows: Sequence[Row], columns: Sequence[Column]) -> list[str]:
    """The lines of a Markdown table: header, separator, one line per row."""
    lines = [
        "| " + " | ".join(c.header for c in columns) + " |",
        "|" + "".join("---:|" if c.right else "---|" for c in columns),
    ]
    lines += ["| " + " | ".join(c.cell(r) for c in columns) + " |" for r in rows]
    return lines
