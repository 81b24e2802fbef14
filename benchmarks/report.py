"""Plain-text tables and the JSON dump shared by the benchmark scripts."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Left-aligned first column, right-aligned numbers; floats with 2 decimals."""
    def cell(v: Any) -> str:
        return f"{v:,.2f}" if isinstance(v, float) else str(v)

    cells = [[cell(v) for v in row] for row in rows]
    for row in cells:
        if len(row) != len(headers):
            raise ValueError(f"row {row} has {len(row)} cells, expected {len(headers)}")
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h)
              for i, h in enumerate(headers)]

    def line(values: Sequence[str]) -> str:
        return " | ".join(v.ljust(w) if i == 0 else v.rjust(w)
                          for i, (v, w) in enumerate(zip(values, widths)))

    sep = "-+-".join("-" * w for w in widths)
    return "\n".join([line(headers), sep, *(line(r) for r in cells)])


def percent(x: float) -> str:
    return f"{100.0 * x:.1f}%"


def write_json(path: str | Path, payload: dict) -> None:
    Path(path).write_text(json.dumps(payload, indent=2, default=float) + "\n", encoding="utf-8")
