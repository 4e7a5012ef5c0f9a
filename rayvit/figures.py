"""The figure basics every rayvit figure shares: a headless matplotlib, a strategy's colour, and a caption
of the conditions its rows state, so a PNG lifted out of MLflow still says what it measured. A new figure:
``figure, axes = new_figure(...)``, draw, ``save(figure, path, rows)``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence

import matplotlib

matplotlib.use("Agg")  # files only: drivers run headless, on clusters and under `ray job submit`
import matplotlib.pyplot as plt  # noqa: E402

from rayvit.strategies import STRATEGIES  # noqa: E402

Row = Mapping[str, Any]

# Conditions a caption states, in order, with how each is written.
_CAPTION = (
    ("model", "{}"), ("image_size", "{} px"), ("batch_per_chip", "batch {}/chip"), ("precision", "{}"),
    ("strategy", "{}"), ("world_size", "{} chips"), ("accelerator", "{}"), ("data", "data: {}"),
    ("torch_version", "torch {}"), ("ray_version", "ray {}"), ("fairscale_version", "fairscale {}"),
)


def strategy_colour(name: str) -> Optional[str]:
    """A strategy's colour in every figure and in the MLflow UI (``Strategy.colour``; DDP, the baseline,
    grey-black); None for a series that is not a registered strategy (matplotlib's next colour)."""
    strategy = STRATEGIES.get(name)
    return strategy.colour if strategy else None


def conditions_caption(rows: Iterable[Row], omit: Sequence[str] = ()) -> str:
    """The conditions shared by ``rows``; a condition that varies is listed with all its values."""
    rows = list(rows)
    parts = []
    for key, fmt in _CAPTION:
        if key in omit:
            continue
        values = sorted({str(r[key]) for r in rows if r.get(key) not in (None, "")}, key=_natural)
        if not values:
            continue
        parts.append(fmt.format("/".join(values)))
    return " · ".join(parts)


def _natural(text: str) -> tuple:
    return (0, float(text), "") if _is_number(text) else (1, 0.0, text)


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def new_figure(nrows: int = 1, height: float = 4.0, width: float = 7.5, **kwargs):
    figure, axes = plt.subplots(nrows, 1, figsize=(width, height * nrows), squeeze=False, **kwargs)
    return figure, [a for a in axes[:, 0]]


def save(figure, path: str | os.PathLike, rows: Iterable[Row], omit: Sequence[str] = (),
         title: Optional[str] = None) -> Path:
    """Write ``figure`` with a title and the conditions caption; close it; return the path."""
    if title:
        figure.suptitle(title, fontsize=12)
    caption = conditions_caption(rows, omit)
    figure.text(0.5, 0.005, caption, ha="center", va="bottom", fontsize=7, wrap=True, color="#444444")
    figure.tight_layout(rect=(0, 0.04, 1, 0.97 if title else 1))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path
