"""How rayvit reads and writes a number, once for every layer: finite or missing, formatted or ``-``,
a ratio as ``1.23x``, a duration as ``m:ss``. No imports beyond the standard library."""

from __future__ import annotations

import math
from typing import Any, Optional


def number(value: Any) -> Optional[float]:
    """``value`` as a finite float, or None (missing, NaN, inf, bool, text)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def positive(value: Any) -> bool:
    """Whether ``value`` is a finite number above zero (a rate that can be divided by)."""
    value = number(value)
    return value is not None and value > 0


def fmt(value: Any, spec: str, suffix: str = "") -> str:
    """``value`` formatted with ``spec`` (and ``suffix``), or ``-`` when it is not a finite number."""
    value = number(value)
    return "-" if value is None else format(value, spec) + suffix


def times(value: Any) -> str:
    """A ratio as ``1.23x`` (``-`` when missing)."""
    return fmt(value, ".2f", "x")


def interval(value: Any, lo: Any, hi: Any, spec: str, suffix: str = "") -> str:
    """``0.67x (0.61-0.72)``: a figure with its interval where both ends are numbers, else the figure alone."""
    text = fmt(value, spec, suffix)
    if number(lo) is not None and number(hi) is not None:
        text += f" ({fmt(lo, spec)}-{fmt(hi, spec)})"
    return text


def clock(seconds: float) -> str:
    """``m:ss``, or ``h:mm:ss`` from an hour on."""
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"
