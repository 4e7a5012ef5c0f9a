"""Result rows as text tables and as parquet. A row is a flat dict: one point, trial or projection."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

from rayvit.formats import fmt, number, times  # noqa: F401 - the tables' formatters, here for their users

Row = Mapping[str, Any]
# A column: its header, and how one row's cell is written.
Column = tuple[str, Callable[[Row], str]]


def cell(key: str, spec: Optional[str] = None, scale: float = 1.0) -> Callable[[Row], str]:
    """The cell of ``row[key]``: formatted with ``spec`` (numbers, after dividing by ``scale``) or as text."""
    if spec is None:
        return lambda row: "-" if row.get(key) is None else str(row[key])
    return lambda row: fmt(number(row.get(key)) / scale if number(row.get(key)) is not None else None, spec)


def format_table(rows: Iterable[Row], columns: Sequence[Column]) -> str:
    """Rows as aligned plain text, one line each, under a header and a rule."""
    lines = [[write(row) for _, write in columns] for row in rows]
    headers = [header for header, _ in columns]
    widths = [max([len(h)] + [len(line[i]) for line in lines]) for i, h in enumerate(headers)]
    out = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip(),
           "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines]
    return "\n".join(out)


def write_parquet(rows: Iterable[Row], path: str | Path) -> Path:
    """One row per point, every key a column (lists of numbers as float lists, other lists and dicts as JSON
    text, a column of mixed types as text)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = list(rows)
    keys = list(dict.fromkeys(key for row in rows for key in row))
    columns = {key: _column([row.get(key) for row in rows]) for key in keys}
    path = Path(path)
    pq.write_table(pa.Table.from_pydict(columns), path)
    return path


def _column(values: list[Any]) -> list[Any]:
    if any(isinstance(v, list) for v in values) and all(v is None or (isinstance(v, list) and all(
            x is None or number(x) is not None or isinstance(x, float) for x in v)) for v in values):
        # Lists of numbers (per-rank figures) as lists of floats.
        return [None if v is None else [None if x is None else float(x) for x in v] for v in values]
    if any(isinstance(v, (list, dict)) for v in values):
        return [None if v is None else json.dumps(v, default=str) for v in values]
    kinds = {type(v) for v in values if v is not None}
    if kinds <= {int, float} or kinds <= {bool} or len(kinds) <= 1:
        # ints beside floats store as floats: pyarrow infers that itself.
        return values
    return [None if v is None else str(v) for v in values]
