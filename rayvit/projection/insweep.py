"""The projection inside a real sweep: measure the links once, project every point, judge, record.

For scaling sweeps ``rayvit.studies.sweep`` asks the workers of the first point at the largest worker
count still to run for the links (the collective microbenchmark of ``rayvit.measure.links``,
run after that point's training on the same workers: no worker group of its own, and on an autoscaling
cluster no node the points do not need), prints them with :func:`describe_measured`, and calls:

- :func:`judge` for each point once the links are known (the points before that are judged together):
  the point's projection from the sweep's own single-chip (or smallest count) DDP measurement plus the
  measured links and its strategy's own per-step overhead (measured at the strategy's smallest count:
  :func:`strategy_overheads`), logged on the point's child run as ``projected_*`` metrics with
  ``projection_error`` (against the measured median), and a warning when the measured interval lies more
  than 25% beyond it.
- :func:`artifacts` at the end: ``links.json`` and ``projection.png`` (measured points over projected
  lines) for the parent run.
"""

from __future__ import annotations

import json
import math
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

from rayvit.config_schema import BASELINE
from rayvit.formats import fmt, positive as _finite
from rayvit.projection import performance
from rayvit.projection.hardware_profile import HardwareProfile, with_measured_links
from rayvit.projection.profiles import cpu_profile, get_profile, profile_for_accelerator

SHORTFALL = 0.25      # warn when the measured interval lies beyond the projection by more than this


def links_count(points) -> Optional[int]:
    """The worker count the links are measured at: the largest to run, if at least 2 (else none)."""
    return max((p.world_size for p in points if p.world_size > 1), default=None)


def describe_measured(links: dict, where: str) -> str:
    """The links as printed in a sweep: what was measured, on which point's workers, how long it took."""
    from rayvit.projection.profiles import describe_links as describe

    return describe(links) + f"\n  (measured on the workers of {where} after their training, {links.get('seconds', 0):.0f} s)"


def sweep_profile(cfg, rows: list[dict], links: Optional[dict], hardware: Optional[str] = None) -> HardwareProfile:
    """The profile a sweep's points are projected on: ``hardware`` (``sweep.hardware``: a profile's name or a
    cluster file) where given, else the chip the points ran on; with the sweep's measured links on top."""
    if hardware:
        profile = get_profile(hardware)
        if profile.accelerator is None:
            profile = cpu_profile(chips_per_node=max(2, cfg.parallel.num_workers))
    elif cfg.parallel.use_gpu:
        # Never the CPU profile on GPUs: a chip without a profile of its own gets a generic GPU's, with
        # the memory the microbenchmark read from the device.
        measured = links or {}
        accelerator = (next((r.get("accelerator") for r in rows if r.get("accelerator")), None)
                       or measured.get("device_name") or "unknown GPU")
        # The device's memory picks the variant (A100 40 or 80 GB): every point records it.
        memory_bytes = (next((r.get("device_memory_bytes") for r in rows if r.get("device_memory_bytes")), None)
                        or measured.get("device_memory_bytes"))
        profile = profile_for_accelerator(accelerator, memory_bytes)
    else:
        profile = cpu_profile(chips_per_node=max(2, cfg.parallel.num_workers))
    return with_measured_links(profile, links) if links else profile


def compute_source(outcomes, profile: HardwareProfile) -> Optional[tuple[Any, performance.ComputeRate]]:
    """The DDP point at the sweep's smallest worker count (else any strategy's), as a single-chip rate."""
    done = [o for o in outcomes if o.ok and _finite(o.result.metrics.get("images_per_sec_per_chip"))]
    if not done:
        return None
    smallest = min(o.point.world_size for o in done)
    ref = next((o for o in done if o.point.world_size == smallest and o.point.cfg.parallel.strategy == BASELINE),
               next(o for o in done if o.point.world_size == smallest))
    rate = ref.result.metrics["images_per_sec_per_chip"]
    return ref, performance.compute_from_measured(ref.point.cfg, rate, profile, ref.point.key,
                                                  chips=ref.point.world_size)


def strategy_overheads(outcomes, profile: HardwareProfile, rate: performance.ComputeRate
                       ) -> dict[str, tuple[Any, float]]:
    """Per strategy: (its anchor, its own per-step overhead in seconds).

    The anchor is the strategy's point at its smallest measured count; the overhead is that point's
    measured median step less its projection without one (the DDP point the compute rate comes from
    gets 0). What a wrapper costs per step (FSDP2's hooks and DTensor dispatch, ShardedDDP's gradient
    hooks) is host work no link figure shows; measured once, it is carried to every other count.
    """
    out: dict[str, tuple[Any, float]] = {}
    done = sorted((o for o in outcomes if o.ok and _finite(o.result.metrics.get("images_per_sec_per_chip"))),
                  key=lambda o: o.point.world_size)
    for o in done:
        strategy = o.point.cfg.parallel.strategy
        if strategy in out:
            continue
        measured = o.point.cfg.train.batch_size / o.result.metrics["images_per_sec_per_chip"]
        modelled = performance.project(o.point.cfg, o.point.world_size, profile, rate, peak=1.0)
        out[strategy] = (o, measured - modelled.step_s)
    return out


def project_outcome(outcome, outcomes, links: Optional[dict], hardware: Optional[str] = None
                    ) -> Optional[performance.Projection]:
    rows = [o.result.row() for o in outcomes if o.ok]
    profile = sweep_profile(outcome.point.cfg, rows, links, hardware)
    source = compute_source(outcomes, profile)
    if source is None:
        return None
    ref, rate = source
    anchor, overhead = strategy_overheads(outcomes, profile, rate).get(outcome.point.cfg.parallel.strategy,
                                                                        (None, 0.0))
    peak = (outcome.result.metrics.get("peak_tflops") or 0) * 1e12 if outcome.ok else None
    proj = performance.project(outcome.point.cfg, outcome.point.world_size, profile, rate, peak=peak or None,
                               overhead_s=overhead if ref is not outcome else 0.0)
    if ref is outcome:
        proj.notes.append("calibration point (the compute rate comes from it)")
    elif anchor is outcome:
        proj.notes.append(f"anchor point (its strategy's own overhead, {overhead * 1e3:+.1f} ms per step, is "
                          "measured from it)")
    return proj


def judge(tracker, outcomes, links: Optional[dict], out: Callable[[str], None] = print, *,
          hardware: Optional[str] = None) -> Optional[performance.Projection]:
    """Project the newest point, log ``projected_*`` on its child run, warn when the projection lies
    outside the measured interval by more than :data:`SHORTFALL`.

    ``projection_error`` (projected / measured median - 1) is logged beside; ``projection_flagged`` is 1
    when the measured interval's upper end falls short of the projection by more than the tolerance (or
    its lower end exceeds it by more), so a noisy point whose interval reaches its projection is not
    blamed on the network.
    """
    outcome = outcomes[-1]
    if not outcome.ok or outcome.status != "done":
        return None
    try:
        proj = project_outcome(outcome, outcomes, links, hardware)
    except Exception:  # noqa: BLE001
        out("projection failed for " + outcome.point.key + ":\n" + traceback.format_exc(limit=2))
        return None
    if proj is None:
        return None
    m = outcome.result.metrics
    measured = m["images_per_sec_per_chip"]
    lo = m.get("images_per_sec_per_chip_lo", measured)
    hi = m.get("images_per_sec_per_chip_hi", measured)
    projected = proj.images_per_sec_per_chip
    short = hi < (1 - SHORTFALL) * projected
    flagged = (short or lo > projected / (1 - SHORTFALL)) and not proj.notes
    if outcome.run_id:
        tracker.log_metrics(outcome.run_id, {**proj.metrics(), "projection_error": projected / measured - 1,
                                             "projection_flagged": float(flagged)},
                            step=outcome.point.world_size)
    if flagged and short:
        from rayvit.projection.inputs import measured_note

        waited = measured_note(m)
        if waited:
            where = (f"The cause was measured: it was {waited}. Give Ray Data more CPUs beside the workers, or "
                     "measure the pipeline's rate with `rayvit bench-data` and project with --data-rate.")
        else:
            where = ("Look for a slow or misconfigured network (NCCL falling back to TCP sockets, EFA/InfiniBand "
                     "not in use), or throttled or shared chips (the input was not the cause: it waited "
                     f"{fmt(m.get('data_wait_fraction'), '.1%')} of the step)." if proj.chips > 1 else
                     "One chip has no communication: a slow or shared chip (the input was not the cause: it waited "
                     f"{fmt(m.get('data_wait_fraction'), '.1%')} of the step).")
        out(f"WARNING: {outcome.point.key} measured {measured:.4g} img/s/chip ({lo:.4g}-{hi:.4g}), "
            f"{1 - measured / projected:.0%} short of its projection {projected:.4g}, beyond its interval by more than "
            f"{SHORTFALL:.0%} (projected step {proj.step_s * 1e3:.1f} ms: compute "
            f"{proj.compute_s * 1e3:.1f}, exposed communication {proj.exposed_comm_s * 1e3:.1f}, optimizer "
            f"{proj.optimizer_s * 1e3:.1f}). {where}")
    elif flagged:
        out(f"WARNING: {outcome.point.key} measured {measured:.4g} img/s/chip ({lo:.4g}-{hi:.4g}), "
            f"{measured / projected - 1:.0%} above its projection {projected:.4g}: the hardware profile or the "
            "measured links understate this point (its compute rate came from another point).")
    return proj


def artifacts(outcomes, links: Optional[dict], folder: Path, title: str, *, hardware: Optional[str] = None
              ) -> list[Path]:
    """``links.json`` and ``projection.png`` for the parent run (nothing for empty sweeps)."""
    files = []
    if links:
        path = Path(folder) / "links.json"
        path.write_text(json.dumps(links, indent=2))
        files.append(path)
    done = [o for o in outcomes if o.ok]
    if not done:
        return files
    from rayvit.projection import render

    profile = sweep_profile(done[0].point.cfg, [o.result.row() for o in done], links, hardware)
    source = compute_source(done, profile)
    if source is None:
        return files
    counts = sorted({o.point.world_size for o in outcomes})
    variants = list({o.point.cfg.parallel.strategy: o.point.cfg for o in outcomes}.values())
    peak = (done[0].result.metrics.get("peak_tflops") or 0) * 1e12 or None
    overheads = {s: extra for s, (_, extra) in strategy_overheads(done, profile, source[1]).items()}
    projected = performance.project_grid(variants[0], _dense(counts), variants, profile, source[1], peak=peak,
                                         overheads=overheads)
    measured = [o.result.row() for o in done]
    files.append(render.measured_vs_projected_figure(measured, projected, Path(folder) / "projection.png",
                                                     title=title))
    return files


def _dense(counts: list[int]) -> list[int]:
    """The sweep's counts plus powers of two between them, so projected lines show their shape."""
    lo, hi = min(counts), max(counts)
    extra = [2 ** k for k in range(int(math.log2(max(lo, 1))), int(math.log2(hi)) + 1) if lo <= 2 ** k <= hi]
    return sorted(set(counts) | set(extra))
