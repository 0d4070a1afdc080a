"""Tables for a terminal of any width: a grid where it fits, one block per row where it does not.

A grid squeezed below its natural width folds every cell into fragments; listing each row's
figures under its name keeps them readable at 80 columns.
"""

from __future__ import annotations

import shutil
import textwrap
from collections.abc import Sequence


def grid_width(header: Sequence[str], body: Sequence[Sequence[str]]) -> int:
    """Columns a rich ``Table`` needs to show every cell on one line (its box: ``│ cell │``)."""
    widths = [max(len(cell) for cell in column) for column in zip(header, *body)]
    return sum(widths) + 3 * len(widths) + 1


def stacked(
    header: Sequence[str], body: Sequence[Sequence[str]], width: int, name_columns: int = 1
) -> list[str]:
    """Each row as its name (the first ``name_columns`` cells) and then its ``heading: value``
    pairs, wrapped to ``width``; empty cells are left out."""
    lines = []
    for row in body:
        lines.append(" · ".join(row[:name_columns]))
        # a pair breaks across lines only if it alone is wider than the terminal
        pairs = [
            f"{h}: {v}".replace(" ", _KEEP) for h, v in zip(header[name_columns:], row[name_columns:]) if v
        ]
        wrapped = textwrap.wrap(
            ", ".join(pairs), width, initial_indent="  ", subsequent_indent="  ", break_on_hyphens=False
        )
        lines += [line.replace(_KEEP, " ") for line in wrapped]
    return lines


def wrapped(text: str, width: int, indent: int = 2) -> list[str]:
    """A long line of prose as lines of at most ``width`` columns, continuations indented."""
    return textwrap.wrap(text, width, subsequent_indent=" " * indent, break_on_hyphens=False) or [""]


def terminal_width() -> int:
    """``COLUMNS``, else the terminal's width, else (a file or a pipe) 160: one line per row."""
    return shutil.get_terminal_size((160, 24)).columns


_KEEP = "\x00"  # stands for a space textwrap must not break at
