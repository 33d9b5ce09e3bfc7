"""Plain-text tables for the command line: a header row and aligned columns."""
from __future__ import annotations

from typing import Sequence

__all__ = ["aligned"]


def aligned(rows: Sequence[Sequence[str]]) -> str:
    """``rows`` (the first one the header) as lines whose columns start at the same place, two
    spaces apart, trailing blanks trimmed."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows)
