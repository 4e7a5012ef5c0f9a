"""Figures of sweep results, drawn from result rows (one flat dict per point) to PNG files.

Every figure states its conditions (model, image size, batch per chip, precision, accelerator, library
versions) in a caption built from the rows, so a PNG lifted out of MLflow still says what it measured.
New figure kinds (e.g. a Tune search's accuracy-vs-throughput scatter) follow the same pattern:
``figure, axes = new_figure(...)``, draw, ``save(figure, path, rows)``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

from rayvit.figures import Row, conditions_caption, new_figure, save, strategy_colour  # noqa: F401 - also theirs
from rayvit.formats import number as _finite
from rayvit.config_schema import BASELINE


def scaling_figure(rows: Iterable[Row], path: str | os.PathLike, title: Optional[str] = None) -> Path:
    """Per-chip TFLOPS against chips (one line per strategy) over a speedup-vs-DDP panel."""
    rows = [r for r in rows if _finite(r.get("tflops_per_chip")) is not None]
    figure, (top, bottom) = new_figure(2, height=3.4, sharex=True)
    chips = sorted({int(r["world_size"]) for r in rows})
    for strategy in _series_order(rows):
        points = sorted((int(r["world_size"]), r) for r in rows if r["series"] == strategy)
        xs = [n for n, _ in points]
        colour = strategy_colour(strategy)
        top.errorbar(xs, [r["tflops_per_chip"] for _, r in points], yerr=_error_bars(points, "tflops_per_chip"),
                     marker="o", label=strategy, color=colour, capsize=3)
        speedups = [(n, r) for n, r in points if _finite(r.get("speedup_vs_ddp")) is not None]
        if speedups:
            bottom.errorbar([n for n, _ in speedups], [r["speedup_vs_ddp"] for _, r in speedups],
                            yerr=_error_bars(speedups, "speedup_vs_ddp"), marker="o", label=strategy,
                            color=colour, capsize=3)
            for n, r in speedups:
                if strategy != BASELINE:
                    noise = " (noise)" if str(r.get("verdict") or "").startswith("within noise") else ""
                    bottom.annotate(f"{r['speedup_vs_ddp']:.2f}×{noise}", (n, r["speedup_vs_ddp"]),
                                    textcoords="offset points", xytext=(4, 4), fontsize=7, color=colour)
    top.set_ylabel("TFLOPS per chip")
    top.set_ylim(bottom=0)
    top.legend(fontsize=8, loc="best")
    top.margins(x=0.08)
    top.grid(alpha=0.3)
    bottom.axhline(1.0, color="#999999", linewidth=0.8, linestyle="--")
    bottom.set_ylabel("speedup vs DDP\n(per-chip TFLOPS ratio)")
    if any(_finite(r.get("tflops_per_chip_lo")) is not None for r in rows):
        top.set_title("median over rounds; bars: 95% interval", fontsize=8)
    bottom.set_xlabel("chips (workers)")
    bottom.grid(alpha=0.3)
    if chips:
        if len(chips) > 1 and chips[-1] / chips[0] >= 4:
            bottom.set_xscale("log", base=2)
        bottom.set_xticks(chips)
        bottom.set_xticklabels([str(n) for n in chips])
        bottom.minorticks_off()
    return save(figure, path, rows, omit=("strategy", "world_size"),
                title=title or "Per-chip throughput against chips")


def ladder_figure(rows: Iterable[Row], path: str | os.PathLike, title: Optional[str] = None) -> Path:
    """Throughput of each cumulative ladder rung relative to the baseline, absolute figure annotated."""
    rows = [r for r in rows if _finite(r.get("tflops_per_chip")) is not None]
    figure, (axes,) = new_figure(1, height=4.2, width=8.5)
    labels = [("" if i == 0 else "+") + str(r["series"]).replace("_", " ") for i, r in enumerate(rows)]
    relative = [_finite(r.get("relative_throughput")) or 0.0 for r in rows]
    bars = axes.bar(range(len(rows)), relative, color=["#333333"] + ["#1f77b4"] * (len(rows) - 1),
                    yerr=_error_bars(list(enumerate(rows)), "relative_throughput"), capsize=3)
    for bar, row, rel in zip(bars, rows, relative):
        axes.annotate(f"{rel:.2f}×\n{row['tflops_per_chip']:.3g} TFLOPS\n{row.get('precision', '')}",
                      (bar.get_x() + bar.get_width() / 2, bar.get_height()), textcoords="offset points",
                      xytext=(0, 3), ha="center", va="bottom", fontsize=7)
    axes.axhline(1.0, color="#999999", linewidth=0.8, linestyle="--")
    axes.set_xticks(range(len(rows)))
    axes.set_xticklabels(labels, rotation=25, ha="right", fontsize=8)
    axes.set_ylabel("per-chip TFLOPS relative to baseline")
    axes.set_ylim(0, max(relative + [1.0]) * 1.3)
    axes.grid(axis="y", alpha=0.3)
    # Rungs change precision, strategy and image size by design: the caption lists every value seen.
    return save(figure, path, rows, title=title or "Optimization ladder (cumulative)")


def _error_bars(points: Sequence[tuple[Any, Row]], key: str) -> Optional[list[list[float]]]:
    """matplotlib's ``yerr`` (distances below and above) from ``<key>_lo`` / ``<key>_hi``, or None."""
    below, above = [], []
    for _, r in points:
        value, lo, hi = _finite(r.get(key)), _finite(r.get(f"{key}_lo")), _finite(r.get(f"{key}_hi"))
        below.append(value - lo if value is not None and lo is not None else 0.0)
        above.append(hi - value if value is not None and hi is not None else 0.0)
    return [below, above] if any(below) or any(above) else None


def _series_order(rows: Iterable[Row]) -> list[str]:
    seen: list[str] = []
    for r in rows:
        if r["series"] not in seen:
            seen.append(r["series"])
    # DDP first so it is drawn beneath and listed first in the legend.
    return sorted(seen, key=lambda s: (s != BASELINE, seen.index(s)))


def search_figure(rows: Iterable[Row], path: str | os.PathLike, *, objective: str, baseline_accuracy: float,
                  max_accuracy_drop: float, best: Optional[str] = None, title: Optional[str] = None) -> Path:
    """A Tune search: validation accuracy against the objective per trial, the constraint line, the best.

    Feasible trials are filled dots, infeasible ones hollow; the dashed line is the lowest accuracy
    allowed (baseline minus ``max_accuracy_drop``); the star is the best feasible trial. Trials without
    both figures (diverged, stopped early) are counted in the legend.
    """
    rows = list(rows)
    drawn = [r for r in rows if _finite(r.get("objective")) is not None and _finite(r.get("val_accuracy")) is not None]
    figure, (axes,) = new_figure(1, height=4.6, width=8.0)
    for feasible, style in ((True, dict(color="#1f77b4")), (False, dict(facecolors="none", edgecolors="#d62728"))):
        mine = [r for r in drawn if bool(r.get("feasible")) == feasible and r.get("trial") != "baseline"]
        if mine:
            axes.scatter([r["objective"] for r in mine], [r["val_accuracy"] for r in mine], s=40, zorder=3,
                         label="feasible" if feasible else "infeasible", **style)
        # Trial ids only (search_trials.txt maps them to settings), staggered: close points are common.
        for i, r in enumerate(sorted(mine, key=lambda r: (r["val_accuracy"], r["objective"]))):
            axes.annotate(str(r["trial"]), (r["objective"], r["val_accuracy"]), textcoords="offset points",
                          xytext=(5, (-10, 2, 14)[i % 3]), fontsize=7, color="#444444")
    base = next((r for r in drawn if r.get("trial") == "baseline"), None)
    if base is not None:
        axes.scatter([base["objective"]], [base["val_accuracy"]], marker="s", s=50, color="#333333", zorder=4,
                     label=f"baseline ({base.get('setting', '')})")
    floor = baseline_accuracy - max_accuracy_drop
    axes.axhline(floor, color="#d62728", linestyle="--", linewidth=1,
                 label=f"constraint: accuracy ≥ {floor:.1%} (baseline − {max_accuracy_drop * 100:.1f} pts)")
    chosen = next((r for r in drawn if r.get("trial") == best), None)
    if chosen is not None:
        axes.scatter([chosen["objective"]], [chosen["val_accuracy"]], marker="*", s=260, color="#ffbf00",
                     edgecolors="#333333", zorder=5, label=f"best feasible: {chosen['trial']}")
    missing = [r for r in rows if r not in drawn]
    if missing:
        axes.plot([], [], " ", label=f"not drawn (no figures): {', '.join(str(r.get('trial')) for r in missing)}")
    labels = {"tflops_per_chip": "TFLOPS per chip", "images_per_sec": "images/s (all chips)",
              "time_to_accuracy": "time to target accuracy, s (lower is better)"}
    axes.set_xlabel(labels.get(objective, objective))
    axes.set_ylabel("validation accuracy")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=7, loc="best")
    axes.margins(x=0.15, y=0.15)
    # Trials vary precision and image size by design: the caption lists every value seen.
    return save(figure, path, rows, title=title or f"Validation accuracy against {objective}")
