"""The projection as a table and as figures (PNG), in the style of ``rayvit.record.plots``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Mapping

from rayvit.formats import fmt as _f
from rayvit.projection.performance import Projection

GIB = 2 ** 30
HEADER = ["chips", "strategy", "step ms", "img/s/chip", "TFLOPS/chip", "MFU", "vs DDP", "scaling eff.",
          "dominant", "comm ms (exposed)", "opt ms", "stragglers ms", "mem GiB/rank", "fits", "max batch"]


def row_cells(p: Projection) -> list[str]:
    m = p.memory
    fits = "-" if m.fits is None else ("fits" if m.fits else "OOM")
    return [str(p.chips), p.label, f"{p.step_s * 1e3:.1f}", f"{p.images_per_sec_per_chip:.4g}",
            f"{p.tflops_per_chip:.4g}", _f(p.mfu, ".1%"), _f(p.vs_ddp, ".2f", "x"),
            _f(p.scaling_efficiency, ".0%"), p.dominant,
            f"{p.comm_s * 1e3:.1f} ({p.exposed_comm_s * 1e3:.1f})", f"{p.optimizer_s * 1e3:.1f}",
            f"{p.straggler_s * 1e3:.1f}", f"{m.total / GIB:.2f}", fits, _f(m.max_batch, ".0f")]


def format_table(points: Iterable[Projection]) -> str:
    lines = [row_cells(p) for p in points]
    widths = [max(len(h), *(len(line[i]) for line in lines)) if lines else len(h) for i, h in enumerate(HEADER)]
    out = ["  ".join(h.ljust(w) for h, w in zip(HEADER, widths)), "  ".join("-" * w for w in widths)]
    return "\n".join(out + ["  ".join(c.ljust(w) for c, w in zip(line, widths)) for line in lines])


def memory_table(points: Iterable[Projection]) -> str:
    """Bytes per rank by part, one line per distinct (strategy, chips)."""
    header = f"{'chips':>5}  {'strategy':<26} {'params':>8} {'grads':>8} {'masters':>8} {'optim':>8} " \
             f"{'activ.':>8} {'transient':>9} {'total':>8}  (GiB per rank)"
    lines = [header]
    for p in points:
        s, m = p.memory.state, p.memory
        lines.append(f"{p.chips:>5}  {p.label:<26} {s.params / GIB:>8.2f} {s.grads / GIB:>8.2f} "
                     f"{s.masters / GIB:>8.2f} {s.optimizer / GIB:>8.2f} {m.activations / GIB:>8.2f} "
                     f"{m.transient / GIB:>9.2f} {m.total / GIB:>8.2f}")
    return "\n".join(lines)


def _series(points: Iterable[Projection]) -> dict[str, list[Projection]]:
    out: dict[str, list[Projection]] = {}
    for p in points:
        out.setdefault(p.label, []).append(p)
    return {k: sorted(v, key=lambda p: p.chips) for k, v in out.items()}


def _chips_axis(axes, chips: list[int]) -> None:
    if len(chips) > 1 and chips[-1] / chips[0] >= 4:
        axes.set_xscale("log", base=2)
    axes.set_xticks(chips)
    axes.set_xticklabels([str(n) for n in chips])
    axes.minorticks_off()
    axes.set_xlabel("chips")
    axes.grid(alpha=0.3)


def projection_figure(points: list[Projection], path: str | os.PathLike, *, title: str,
                      caption_rows: list[Mapping] = ()) -> Path:
    """Projected per-chip TFLOPS against chips per strategy (dashed, hollow x where it would not fit)."""
    from rayvit.figures import new_figure, save, strategy_colour

    figure, (top, bottom) = new_figure(2, height=3.4, sharex=True)
    for label, pts in _series(points).items():
        # A strategy's variant (FSDP without resharding) dashed, in its strategy's colour.
        style = dict(color=strategy_colour(pts[0].strategy), linestyle="-" if label == pts[0].strategy else "--")
        top.plot([p.chips for p in pts], [p.tflops_per_chip for p in pts], marker="o", label=label, **style)
        oom = [p for p in pts if p.memory.fits is False]
        if oom:
            top.scatter([p.chips for p in oom], [p.tflops_per_chip for p in oom], marker="x", s=80,
                        color="#d62728", zorder=5, label=f"{label}: does not fit (OOM)")
        bottom.plot([p.chips for p in pts], [p.vs_ddp or 0 for p in pts], marker="o", **style)
    top.set_ylabel("projected TFLOPS per chip")
    top.set_ylim(bottom=0)
    top.legend(fontsize=7, loc="lower left")
    bottom.axhline(1.0, color="#999999", linewidth=0.8, linestyle="--")
    bottom.set_ylabel("projected vs DDP")
    _chips_axis(top, sorted({p.chips for p in points}))
    _chips_axis(bottom, sorted({p.chips for p in points}))
    return save(figure, path, caption_rows, omit=("strategy", "world_size"), title=title)


def measured_vs_projected_figure(measured: list[Mapping], projected: list[Projection],
                                 path: str | os.PathLike, *, title: str) -> Path:
    """Measured per-chip TFLOPS (dots) over projected lines, per strategy; the 25%-short band shaded."""
    from rayvit.figures import new_figure, save, strategy_colour

    figure, (axes,) = new_figure(1, height=4.2)
    for label, pts in _series(projected).items():
        xs, ys = [p.chips for p in pts], [p.tflops_per_chip for p in pts]
        colour = strategy_colour(pts[0].strategy)
        axes.plot(xs, ys, linestyle="--", color=colour, label=f"{label} projected")
        axes.fill_between(xs, [0.75 * y for y in ys], ys, color=colour, alpha=0.08)
        mine = sorted((r for r in measured if r.get("strategy") == pts[0].strategy), key=lambda r: r["world_size"])
        if mine:
            axes.plot([r["world_size"] for r in mine], [r["tflops_per_chip"] for r in mine], marker="o",
                      linestyle="none", color=colour, label=f"{label} measured")
    axes.set_ylabel("TFLOPS per chip")
    axes.set_ylim(bottom=0)
    axes.legend(fontsize=7, loc="best")
    _chips_axis(axes, sorted({p.chips for p in projected}))
    axes.set_title("shaded: within 25% below the projection (a point under it is flagged)", fontsize=8)
    return save(figure, path, measured, omit=("strategy", "world_size"), title=title)
