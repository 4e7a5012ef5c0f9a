"""A sweep's rows: one per point, and the figures derived across points with their intervals and verdicts.

``speedup_vs_ddp``, ``scaling_efficiency`` and the ladder's ``relative_throughput`` are ratios of two
points' figures; where both carry their rounds the ratio gets a 95% interval (paired when they ran in
the same rounds on the same workers) and a verdict by :mod:`rayvit.stats`' beyond-noise rule.
"""

from __future__ import annotations

from typing import Any, Optional

from rayvit import stats
from rayvit.config_schema import BASELINE
from rayvit.record.tables import number
from rayvit.results import METRIC_KEYS
from rayvit.studies.outcome import Outcome

# Per point figures derived across points (absent where their reference point is missing).
DERIVED_KEYS = ("speedup_vs_ddp", "scaling_efficiency", "relative_throughput")


def rows_of(outcomes: list[Outcome], mode: str) -> list[dict[str, Any]]:
    """One flat row per point: key, status, conditions, metrics and the derived figures.

    ``round_step_times`` holds each round's timed step times (the slowest rank's), from which the
    derived ratios get their intervals.
    """
    rows = []
    for o in outcomes:
        row: dict[str, Any] = {"point": o.point.key, "series": o.point.series, "world_size": o.point.world_size,
                               "status": o.status, "run_id": o.run_id, "error": o.error,
                               "strategy": o.point.cfg.parallel.strategy,
                               "seconds": round(o.seconds, 2) if o.status == "done" else None,
                               "config_hash": o.point.config_hash}
        if o.result is not None:
            row.update({k: v for k, v in o.result.row().items() if k not in ("series", "point")})
            row["round_step_times"] = [r["step_times"] for r in o.result.rounds] or None
        for key in METRIC_KEYS:
            row.setdefault(key, None)
        rows.append(row)
    add_derived(rows, mode)
    return rows


def _ratio(a: Any, b: Any) -> Optional[float]:
    a, b = number(a), number(b)
    return a / b if a is not None and b else None


def _derive(row: dict[str, Any], ref: Optional[dict[str, Any]], key: str, derived: str, paired: bool) -> None:
    """``row[derived]`` = row's ``key`` / ref's, with ``_lo``/``_hi`` from their rounds where both have them.

    Paired: the points ran in the same rounds on the same workers, so the ratio is taken within each
    round (:func:`rayvit.stats.paired_ratio`); else each side is resampled alone.
    """
    if ref is None:
        return
    if ref is row:
        row.update({derived: 1.0, f"{derived}_lo": 1.0, f"{derived}_hi": 1.0})
        return
    row[derived] = _ratio(row.get(key), ref.get(key))
    a, b = (stats.rounds_blocks({"step_times": t} for t in (r.get("round_step_times") or [])) for r in (row, ref))
    try:
        fa, fb = stats.functions_of(row, row)[key], stats.functions_of(ref, ref)[key]
    except (KeyError, TypeError, ValueError):
        return
    est = (stats.paired_ratio if paired else stats.unpaired_ratio)(a, b, fa, fb)
    if est is not None:
        row.update(est.figures(derived))


def verdict(row: dict[str, Any], derived: str, reference: str) -> Optional[str]:
    """``faster than DDP``, ``slower than DDP`` or ``within noise of DDP``: the beyond-noise rule
    (:meth:`rayvit.stats.Estimate.verdict`) on the ratio's interval (a ratio without one gets no verdict)."""
    lo, hi = number(row.get(f"{derived}_lo")), number(row.get(f"{derived}_hi"))
    if lo is None or hi is None:
        return None
    if (lo, hi) == (1.0, 1.0):
        return reference                          # the reference itself
    side = stats.Estimate(row[derived], lo, hi, 0).verdict(1.0)
    return {stats.WITHIN_NOISE: f"within noise of {reference}", stats.ABOVE: f"faster than {reference}",
            stats.BELOW: f"slower than {reference}"}[side]


def add_derived(rows: list[dict[str, Any]], mode: str) -> None:
    """Fill ``speedup_vs_ddp``, ``scaling_efficiency`` (scaling) or ``relative_throughput`` (ladder),
    each with ``_lo``/``_hi`` where the rows carry their rounds, and the ratio's verdict.

    speedup_vs_ddp = per-chip TFLOPS / DDP's at the same worker count, paired round by round (the two
    ran on the same workers, adjacent in time); scaling_efficiency = per-chip images/s / the same
    strategy's at the sweep's smallest worker count (missing if that point failed: a larger count is
    never silently used as the reference; unpaired); relative_throughput = per-chip TFLOPS / the
    baseline rung's, paired.
    """
    for row in rows:
        for key in DERIVED_KEYS:
            row[key] = None
            row.pop(f"{key}_lo", None)
            row.pop(f"{key}_hi", None)
        row["verdict"] = None
    if mode == "ladder":
        base = next((r for r in rows if r["series"] == "baseline"), None)
        for row in rows:
            _derive(row, base, "tflops_per_chip", "relative_throughput", paired=True)
            row["verdict"] = verdict(row, "relative_throughput", "the baseline")
        return
    ddp = {r["world_size"]: r for r in rows if r["series"] == BASELINE}
    smallest = min((r["world_size"] for r in rows), default=None)
    first = {r["series"]: r for r in rows if r["world_size"] == smallest}
    for row in rows:
        _derive(row, ddp.get(row["world_size"]), "tflops_per_chip", "speedup_vs_ddp", paired=True)
        row["verdict"] = verdict(row, "speedup_vs_ddp", "DDP")
        _derive(row, first.get(row["series"]), "images_per_sec_per_chip", "scaling_efficiency", paired=False)
