"""``rayvit plan``'s output: what was weighed, the ranked table (or ``--json`` rows), and what to do next.

Everything a user gives is checked before anything is projected (profiles, chip counts, the measured
files), as ``rayvit project`` does; no torch (the ``cpu`` profile's matmul rate is timed by the caller, with
torch, only where nothing measured is given).
"""

from __future__ import annotations

import json
from typing import Callable, Optional

from rayvit.config_schema import Study
from rayvit.errors import ConfigError
from rayvit.projection import cluster_file, planner
from rayvit.projection.project_output import check_chips, model_name
from rayvit.projection.hardware_profile import HardwareProfile
from rayvit.projection.profiles import get_profile
from rayvit.projection.rates import load_measured
from rayvit.strategies import STRATEGIES

GIB = 2 ** 30
HEADER = ["rank", "hardware", "chips", "strategy", "batch/chip", "precision", "px", "ckpt", "accuracy",
          "epoch h", "epoch cost", "img/s/chip", "GiB/rank", "dominant", "behind the row above"]


def cells(row: planner.Row) -> list[str]:
    r = row.record()
    cost = "-" if r["epoch_cost"] is None else f"{r['epoch_cost']:,.2f} {r['currency'] or ''}".strip()
    return [str(r["rank"] or "-"), r["hardware"], str(r["chips"]), r["strategy"], str(r["batch_per_chip"]),
            r["precision"], str(r["image_size"]), r["activation_checkpointing"],
            "changes*" if r["changes_accuracy"] else "same", f"{r['epoch_hours']:.3g}", cost,
            f"{r['images_per_sec_per_chip']:.4g}", f"{r['memory_bytes_per_rank'] / GIB:.1f}", r["dominant"],
            r["behind"] or ""]


def table(rows: list[planner.Row]) -> str:
    lines = [cells(r) for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in lines)) if lines else len(h) for i, h in enumerate(HEADER)]
    out = ["  ".join(h.ljust(w) for h, w in zip(HEADER, widths)), "  ".join("-" * w for w in widths)]
    return "\n".join(out + ["  ".join(c.ljust(w) for c, w in zip(line, widths)) for line in lines])


def header(study: Study, profiles: list[HardwareProfile], chips: list[int], epoch: str,
           searched: planner.Searched, sources: list[str]) -> list[str]:
    m = study.run.model
    lines = [f"plan: {model_name(study.run)} ({m.image_size}px in the config), {len(profiles)} hardware "
             f"profile(s) at {', '.join(map(str, chips))} chips; an epoch = {epoch}"]
    for p in profiles:
        price = "no price (a cluster file's price_per_gpu_hour gives one)" if p.price_per_chip_hour is None \
            else f"{p.price_per_chip_hour:g} {p.currency} per GPU-hour"
        lines.append(f"  {p.name}: {p.source}; {price}")
        described = cluster_file.describe(p)
        if described:
            lines.append(f"    {described}")
    batches = sorted(searched.batches)
    lines.append(f"weighed: {searched.settings} settings (strategies and their variants, activation checkpointing "
                 f"none/block, the search space's precisions and image sizes) x batch per chip "
                 f"{batches[0] if batches else '-'}-{batches[-1] if batches else '-'} up to what fits: "
                 f"{searched.rows} projections, {searched.fit} fit")
    lines += [f"compute: {s}" for s in sources]
    return lines


def footnotes(rows: list[planner.Row], by: str, shown: int) -> list[str]:
    ranked = [r for r in rows if r.rank]
    lines = []
    if any(r.changes for r in ranked[:shown]):
        lines.append("changes*: a precision or image size other than the config's; what it costs in accuracy only a "
                     "search measures: put it in search.space and run `rayvit search`")
    other = "cost" if by == "hours" else "hours"
    priced = [r for r in ranked if r.epoch_cost is not None]
    if by == "hours" and priced:
        best = min(priced, key=lambda r: r.epoch_cost)
        lines.append(f"cheapest epoch: rank {best.rank} ({best.hardware.name}, {best.chips} chips, {best.point.label}, "
                     f"{best.epoch_cost:,.2f} {best.hardware.currency}; --by cost ranks by it)")
    elif by == "cost":
        best = min(ranked, key=lambda r: r.epoch_hours, default=None)
        if best:
            lines.append(f"fastest epoch: rank {best.rank} ({best.chips} chips, {best.point.label}, "
                         f"{best.epoch_hours:.3g} h; --by {other} ranks by it)")
    firsts = {}
    for r in ranked:
        firsts.setdefault(r.chips, r)
    if len(firsts) > 1:
        lines.append("best at each count: " + "; ".join(
            f"{n} chips: rank {r.rank} {r.hardware.name} {r.point.label} b{r.point.batch} ({r.epoch_hours:.3g} h"
            + (f", {r.epoch_cost:,.2f} {r.hardware.currency}" if r.epoch_cost is not None else "") + ")"
            for n, r in sorted(firsts.items())))
    unfit = len({(r.hardware.name, r.chips, r.point.label) for r in rows if not r.rank})
    if unfit:
        lines.append(f"{unfit} (hardware, chips, strategy) setting(s) fit at no batch weighed: --json lists them "
                     "with fits=false")
    lines.append("next: confirm the top rows' accuracy with `rayvit search` and their speed with `rayvit sweep` "
                 "on the cluster (a measured sweep and this plan agree where the sweep's intervals tell strategies apart)")
    return lines


def run(study: Study, *, hardware: list[str], chips: Optional[list[int]] = None, measured: Optional[list[str]] = None,
        epoch_images: Optional[int] = None, strategies: Optional[list[str]] = None,
        batch_sizes: Optional[list[int]] = None, by: Optional[str] = None, top: int = 15, as_json: bool = False,
        all_batches: bool = False, cpu_peaks: Optional[dict] = None,
        out: Callable[[str], None] = print) -> list[planner.Row]:
    """Weigh, rank and print the plan (``as_json``: one JSON record per row, ranked rows first); returns
    the rows as printed."""
    check_chips(chips)
    unknown = [s for s in strategies or [] if s not in STRATEGIES]
    if unknown:
        raise ConfigError(f"--strategies {unknown[0]!r} is not a registered strategy; choose among: "
                          f"{', '.join(STRATEGIES)}")
    if batch_sizes and min(batch_sizes) < 1:
        raise ConfigError(f"--batch-per-chip takes batch sizes of 1 or more, got {batch_sizes}")
    chips = sorted(set(chips or study.sweep.worker_counts))
    profiles = [get_profile(name, cpu_peaks) for name in hardware]        # every name checked first
    images, epoch = planner.epoch_images(study, epoch_images)
    by = by or ("cost" if all(p.price_per_chip_hour is not None for p in profiles) else "hours")
    if by == "cost" and any(p.price_per_chip_hour is None for p in profiles):
        raise ConfigError("--by cost needs a price for every hardware profile: describe each as a cluster file "
                          "with price_per_gpu_hour (cluster/example_cluster.yaml)")
    searched, rows, sources = planner.Searched(), [], []
    for profile in profiles:
        used, rate, overheads = load_measured(measured, study.run, profile) if measured else (profile, None, {})
        if rate is not None:
            sources.append(f"{profile.name}: {rate.source}" + (
                f"; own overheads measured for {', '.join(sorted(k for k in overheads if overheads[k]))}"
                if any(overheads.values()) else ""))
        rows += planner.rows_for(study, used, chips, rate=rate, overheads=overheads, images=images,
                                 strategies=strategies, batch_sizes=batch_sizes, searched=searched)
    if not rows:
        raise ConfigError("nothing to plan: " + ("; ".join(dict.fromkeys(searched.skipped)) or
                                                 "no strategy allows this config"))
    ranked = planner.rank(rows if all_batches or batch_sizes else planner.best_batches(rows, by), by)
    if as_json:
        for row in ranked:
            out(json.dumps(row.record(), default=float))
        return ranked
    for line in header(study, profiles, chips, epoch, searched, sources or ["roofline of each chip (no --measured)"]):
        out(line)
    for note in dict.fromkeys(searched.skipped):
        out(f"left out: {note}")
    out(f"ranked by {'cost' if by == 'cost' else 'hours'} per epoch, the {min(top, len(ranked))} best of "
        f"{sum(1 for r in ranked if r.rank)} settings that fit (each at its best batch per chip"
        f"{'' if not (all_batches or batch_sizes) else ': every batch weighed'}):")
    out(table([r for r in ranked if r.rank][:top]))
    for line in footnotes(ranked, by, top):
        out(line)
    return ranked


__all__ = ["run", "table"]
