"""Scaling sweeps and the optimization ladder: run the planned points one by one, derive, record.

Points run one at a time, each on the whole slice of the cluster it asks for, so their timings never
share chips. Results go to MLflow through :class:`~rayvit.studies.runner.StudyRun`: a parent run per
sweep (curves keyed by chip count, results.parquet, a PNG), a child run per point. Rerunning a sweep of
the same name reuses finished points whose measured settings are unchanged and reruns the rest.
"""

from __future__ import annotations

import functools
import tempfile
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Optional

from rayvit import process_state
from rayvit.config_schema import Study
from rayvit.config import tracking_uri
from rayvit.record import plots, tracking
from rayvit.record.tables import Column, cell, fmt, format_table, number, write_parquet
from rayvit.studies.derived import DERIVED_KEYS, add_derived, rows_of, verdict
from rayvit.studies.outcome import Outcome, Report
from rayvit.studies.plan import Point, plan, worker_groups
from rayvit.studies.runner import Progress, StudyRun, attach_ray, print_failures, print_where, with_interval

# The sweep's rows and derived figures are rayvit.studies.derived's; callers import them from here too.
__all__ = ["CURVE_KEYS", "DERIVED_KEYS", "add_derived", "default_sweep_name", "print_summary", "rows_of",
           "run_sweep", "sweep_table", "verdict"]


# Curves logged on the parent run, ``<key>/<series>`` at step = number of chips.
CURVE_KEYS = ("tflops_per_chip", "images_per_sec_per_chip", "mfu", "speedup_vs_ddp", "scaling_efficiency")


def default_sweep_name(study: Study) -> str:
    return f"{study.sweep.mode}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"


@process_state.keeps_process_state
def run_sweep(study: Study, *, experiment: Optional[str] = None, address: Optional[str] = None,
              out: Callable[[str], None] = print, ray_log: Optional[str] = None) -> Report:
    """Run (or resume) the sweep ``study`` describes; one child run per point under one parent run.

    Raises ConfigError (StorageError among them), ConnectError, ClusterTooSmall or TrackingError before
    any point runs; a point that fails is
    recorded and the sweep goes on (``Report.exit_code`` is then 1). Ctrl-C marks the running point and
    the sweep KILLED, so a rerun of the same name picks up from there. ``ray_log``: see
    :func:`~rayvit.studies.runner.attach_ray`.
    """
    name = study.sweep.name or default_sweep_name(study)
    study = study.replace({"sweep.name": name})
    points = plan(study)
    experiment = experiment or study.tracking.experiment or f"rayvit-{study.sweep.mode}"
    run, todo, growth = _prepare(study, points, experiment, address, out, ray_log)
    _announce(run, study, points, todo, growth, out)
    done: dict[str, Outcome] = {}
    links = _Links(study, todo, out)
    try:
        _measure(run, study, points, done, links, out)
    except KeyboardInterrupt:
        missing = [p.key for p in points if p.key not in done]
        run.interrupted(missing[0] if missing else "end")
        raise
    return _finish(run, study, points, [done[p.key] for p in points], links.measured, out)


def _prepare(study: Study, points: list[Point], experiment: str, address: Optional[str],
             out: Callable[[str], None], ray_log: Optional[str]) -> tuple[StudyRun, list[Point], Optional[str]]:
    """Every check before a point runs, the study's record and Ray (only when a point still has to run);
    returns the record, the points to run and what the cluster will grow by (a line, or None)."""
    from rayvit.launch import capacity
    from rayvit.launch.connect import check_cluster
    from rayvit.launch.storage import check_storage
    from rayvit.launch.torch_trainer import check_cluster_fits

    name, mode = study.sweep.name, study.sweep.mode
    # Fail fast, cheapest first and before anything is recorded: the cluster's address (a probe, no Ray
    # yet), the tracking store, then the cluster itself.
    check_cluster(address)
    uri = tracking_uri(study.tracking.uri)
    tracking.check_reachable(uri)
    started = tracking.is_new_store(uri)
    if started:
        # Nothing can be reused from a store that does not exist yet, so Ray is needed: start it while
        # MLflow creates the store's tables (seconds each, on one core each).
        with ThreadPoolExecutor(1, thread_name_prefix="rayvit-store") as pool:
            making = pool.submit(StudyRun, study, name, experiment, mode)
            attach_ray(address, name, ray_log, out)
            run = making.result()
    else:
        run = StudyRun(study, name, experiment, kind=mode)
    # Only the points that still have to run need the cluster: a finished sweep is summarised without Ray.
    todo = [p for p in points if run.reusable(p) is None]
    verdicts = []
    if todo:
        if not started:
            attach_ray(address, name, ray_log, out)
        # Points beyond the autoscaler's maximum (or a fixed cluster's size) are refused here, for the
        # whole plan; points the autoscaler can grow into wait for it just before they run.
        verdicts = check_cluster_fits([p.cfg for p in todo])
        check_storage([p.cfg for p in todo])
    return run, todo, capacity.summary(verdicts)


def _announce(run: StudyRun, study: Study, points: list[Point], todo: list[Point], growth: Optional[str],
              out: Callable[[str], None]) -> None:
    """The parent run started, and the sweep's first lines: what runs, where it is recorded, how to resume."""
    name = study.sweep.name
    parent = run.start(_sweep_tags(study, points))
    out(f"sweep {name!r}: {len(points)} points ({len(todo)} to run), experiment {run.experiment!r}, "
        f"parent run {parent}")
    out(f"tracking: {run.uri}" + ("  (resuming: finished points are reused)" if run.resumed else ""))
    out(f"resume with: --name {name}")
    abandoned = [p.key for p in points if p.key in run.abandoned]
    if abandoned:
        out(f"{', '.join(abandoned)}: left running by a driver that stopped; measuring again")
    if growth:
        out(growth)


def _measure(run: StudyRun, study: Study, points: list[Point], done: dict[str, Outcome], links: "_Links",
             out: Callable[[str], None]) -> None:
    """Each worker group in plan order: reused points report first, then the group measures the rest
    together; ``done`` fills as they finish, curves and projections after each group."""
    from rayvit.launch import capacity
    from rayvit.launch.torch_trainer import fit_group as fit_group_of_workers

    mode = study.sweep.mode
    progress = Progress(len(points), out)
    fit_group = capacity.waiting(fit_group_of_workers, out)
    outcomes: list[Outcome] = []
    for group in worker_groups(points, study.sweep.share_workers):
        todo_here = []
        for point in group:
            outcome = run.reusable(point)
            if outcome is None:
                todo_here.append(point)
            else:
                done[point.key] = outcome
                progress.end(outcome)
        if todo_here:
            for point in todo_here:
                if run.changed_since(point):
                    out(f"{progress.tag(point)} {point.key}: its settings changed since run "
                        f"{run.changed_since(point)}; running it again")
            progress.begin_group(todo_here, study.sweep.rounds, len(points) - len(done))
            run.links = None
            for outcome in run.run_group(todo_here, study.sweep.rounds, links.fit_for(todo_here, fit_group),
                                         lambda p: _point_tags(p, mode), progress):
                done[outcome.point.key] = outcome
        outcomes = [done[p.key] for p in points if p.key in done]
        links.after(run, outcomes)
        _log_curves(run, rows_of(outcomes, mode), mode)
    links.after(run, outcomes, last=True)


class _Links:
    """The sweep's measured links and the points' projections against them (scaling sweeps only).

    The collective microbenchmark runs on the workers of the first point at the largest worker count
    still to run, right after that point's training (``fit(..., measure_links=...)``): no worker group of
    its own, the placement the points get, and on an autoscaling cluster no node the points do not need.
    Points are judged once the links are known, those before it together.
    """

    def __init__(self, study: Study, todo: list[Point], out: Callable[[str], None]):
        from rayvit.projection import insweep

        self.insweep, self.out, self.hardware = insweep, out, study.sweep.hardware
        self.scaling = study.sweep.mode == "scaling"
        self.count = insweep.links_count(todo) if self.scaling else None
        self.measured: Optional[dict] = None
        self.pending = self.count is not None      # no microbenchmark below 2 workers
        self.judged = 0

    def fit_for(self, points: list[Point], fit: Callable[..., Any]) -> Callable[..., Any]:
        """``fit``, asking these points' workers for the links when they are the ones to measure them."""
        if self.pending and points[0].world_size == self.count:
            return functools.partial(fit, measure_links={})
        return fit

    def after(self, run: StudyRun, outcomes: list[Outcome], last: bool = False) -> None:
        if not self.scaling:
            return
        newest = run.links
        if self.pending and newest and newest.get("error"):
            self.pending = False
            self.out(f"projection: measuring the links failed ({newest['error']}); projecting with the "
                     "hardware profile's links")
        elif self.pending and newest:
            self.pending, self.measured = False, newest
            where = ", ".join(o.point.key for o in outcomes if o.point.world_size == self.count and o.status == "done")
            run.tracker.set_parent_tags({"rayvit.links_measured_on": where})
            self.out(self.insweep.describe_measured(self.measured, where or f"{self.count} workers"))
        elif self.pending and last:
            self.pending = False
            self.out(f"projection: no point at {self.count} workers finished, so the links were not measured; "
                     "projecting with the hardware profile's links")
        if self.pending:
            return
        for k in range(self.judged, len(outcomes)):
            self.insweep.judge(run.tracker, outcomes[:k + 1], self.measured, self.out, hardware=self.hardware)
        self.judged = len(outcomes)


def _finish(run: StudyRun, study: Study, points: list[Point], outcomes: list[Outcome],
            links: Optional[dict], out: Callable[[str], None] = print) -> Report:
    mode = study.sweep.mode
    rows = rows_of(outcomes, mode)
    report = Report(run.name, mode, run.experiment, run.uri, run.parent_id, outcomes, rows)
    with tempfile.TemporaryDirectory() as tmp:
        files = [write_parquet(rows, Path(tmp) / "results.parquet")]
        ok = [r for r in rows if r["status"] in ("done", "reused")]
        if ok and mode == "scaling":
            files.append(plots.scaling_figure(ok, Path(tmp) / "scaling.png",
                                              title=f"{run.name}: per-chip throughput against chips"))
        elif ok:
            n = points[0].world_size
            files.append(plots.ladder_figure(ok, Path(tmp) / "ladder.png", title=f"{run.name}: optimization "
                                             f"ladder at {n} chip{'s' if n > 1 else ''}"))
        if mode == "scaling":
            from rayvit.projection import insweep as projection

            files += projection.artifacts(outcomes, links, Path(tmp), f"{run.name}: measured against projected",
                                          hardware=study.sweep.hardware)
            _log_curve_runs(run, rows, out)
        report.artifacts = run.finish(files, {"rayvit.points": len(points), "rayvit.failed_points":
                                              len(report.failed)}, failed=bool(report.failed))
    return report


def _sweep_tags(study: Study, points: list[Point]) -> dict[str, Any]:
    c = study.run
    return {"mode": study.sweep.mode, "model": c.model.name, "image_size": c.model.image_size,
            "batch_per_chip": c.train.batch_size, "precision": c.precision.mode,
            "accelerator": "gpu" if c.parallel.use_gpu else "cpu",
            "strategies": ",".join(dict.fromkeys(p.cfg.parallel.strategy for p in points)),
            "world_sizes": ",".join(str(n) for n in sorted({p.world_size for p in points}))}


def _point_tags(point: Point, mode: str) -> dict[str, Any]:
    return {"rayvit.rung": point.series} if mode == "ladder" else {}


# --------------------------------------------------------------------------------------------------
# Tables


def _interval(key: str, spec: str, suffix: str = "") -> Callable[[dict], str]:
    return lambda r: with_interval(r, key, spec, suffix)


SCALING_COLUMNS: list[Column] = [
    ("point", cell("point")), ("status", cell("status")), ("chips", cell("world_size")),
    ("img/s/chip (95% CI)", _interval("images_per_sec_per_chip", ".1f")),
    ("TFLOPS/chip", cell("tflops_per_chip", ".4g")),
    ("MFU", cell("mfu", ".1%")), ("vs DDP (95% CI)", _interval("speedup_vs_ddp", ".2f", "x")),
    ("verdict", cell("verdict")), ("scaling eff.", cell("scaling_efficiency", ".0%")),
    ("state MB/rank", cell("model_state_bytes_per_rank", ".1f", scale=2 ** 20)),
    ("data wait (95% CI)", _interval("data_wait_fraction", ".1%")), ("rounds", cell("rounds", ".0f")),
    ("time s", cell("seconds", ".0f")),
]
LADDER_COLUMNS: list[Column] = [
    ("rung", cell("series")), ("status", cell("status")), ("chips", cell("world_size")),
    ("strategy", cell("strategy")), ("precision", cell("precision")), ("img px", cell("image_size")),
    ("img/s/chip (95% CI)", _interval("images_per_sec_per_chip", ".1f")),
    ("TFLOPS/chip", cell("tflops_per_chip", ".4g")),
    ("MFU", cell("mfu", ".1%")), ("vs baseline (95% CI)", _interval("relative_throughput", ".2f", "x")),
    ("verdict", cell("verdict")), ("data wait (95% CI)", _interval("data_wait_fraction", ".1%")),
    ("rounds", cell("rounds", ".0f")),
]


def _device_columns(rows: list[dict[str, Any]]) -> list[Column]:
    """Peak memory per rank (max over ranks); on GPU also the reserved peak, utilisation and power."""
    columns: list[Column] = [("peak MB/rank", cell("peak_memory_bytes_per_rank", ".1f", scale=2 ** 20))]
    optional: list[tuple[str, str, Callable[[dict], str]]] = [
        ("reserved MB/rank", "peak_memory_reserved_bytes_per_rank",
         cell("peak_memory_reserved_bytes_per_rank", ".1f", scale=2 ** 20)),
        ("GPU util", "gpu_utilization_pct",
         lambda r: fmt(r.get("gpu_utilization_pct"), ".0f") + ("%" if number(r.get("gpu_utilization_pct")) is not None else "")),
        ("W/GPU", "gpu_power_w", cell("gpu_power_w", ".0f"))]
    return columns + [(title, write) for title, key, write in optional
                      if any(number(r.get(key)) is not None for r in rows)]


def sweep_table(rows: list[dict[str, Any]], mode: str) -> str:
    """The results as a plain-text table, one line per point, with what the memory column measures."""
    device = _device_columns(rows)
    columns = (LADDER_COLUMNS + device if mode == "ladder"
               else SCALING_COLUMNS[:-1] + device + SCALING_COLUMNS[-1:])
    text = format_table(rows, columns)
    if any(r.get("memory_measure") == "process_rss" for r in rows):
        text += "\npeak MB/rank on CPU: the worker process's peak resident set, Python and libraries included"
    from rayvit.projection.inputs import INPUT_BOUND_FRACTION, input_bound

    bound = [r["point"] for r in rows if r["status"] in ("done", "reused") and input_bound(r)]
    if bound:
        text += (f"\ninput-bound (the interval of their steady wait for data above {INPUT_BOUND_FRACTION:.0%} of "
                 f"their step time; their "
                 f"throughput and epoch time are the input's): {', '.join(bound)}")
    return text


# --------------------------------------------------------------------------------------------------
# Curves in MLflow


def _log_curves(run: StudyRun, rows: list[dict[str, Any]], mode: str) -> None:
    """Curves on the parent (``<key>/<series>`` at step = chips) and derived figures on each child."""
    tracker = run.tracker
    ok = [r for r in rows if r["status"] in ("done", "reused")]
    for row in ok:
        if row["run_id"]:
            tracker.log_metrics(row["run_id"], {k + end: row.get(k + end) for k in DERIVED_KEYS
                                                for end in ("", "_lo", "_hi")}, step=row["world_size"])
            if row.get("verdict"):
                tracker.set_tags(row["run_id"], {"rayvit.verdict": row["verdict"]})
    if mode == "ladder":
        for i, row in enumerate(rows):
            if row["status"] in ("done", "reused"):
                # One chart of the whole ladder: step = rung number.
                tracker.log_metrics(run.parent_id, {"relative_throughput": row["relative_throughput"],
                                                    "relative_throughput_lo": row.get("relative_throughput_lo"),
                                                    "relative_throughput_hi": row.get("relative_throughput_hi"),
                                                    "ladder_tflops_per_chip": row["tflops_per_chip"]}, step=i)
        return
    for row in ok:
        tracker.log_metrics(run.parent_id, {f"{k}{end}/{row['series']}": row.get(k + end) for k in CURVE_KEYS
                                            for end in ("", "_lo", "_hi")}, step=row["world_size"])


def _log_curve_runs(run: StudyRun, rows: list[dict[str, Any]], out: Callable[[str], None] = print) -> None:
    ok = [r for r in rows if r["status"] in ("done", "reused")]
    for series in dict.fromkeys(r["series"] for r in ok):
        mine = [r for r in ok if r["series"] == series]
        curves = {k + end: {r["world_size"]: r.get(k + end) for r in mine} for k in CURVE_KEYS
                  for end in ("", "_lo", "_hi")}
        shared = {k: mine[0].get(k) for k in ("model", "image_size", "batch_per_chip", "precision",
                                              "accelerator") if mine[0].get(k) is not None}
        run.tracker.log_curve_run(series, curves, {"strategy": series, **shared})
    if ok:
        # The UI's chart of them all against chips, each figure between its interval's ends.
        try:
            run.tracker.save_curve_view(CURVE_KEYS, bands=[k for k in CURVE_KEYS
                                                           if any(number(r.get(f"{k}_lo")) is not None for r in ok)])
        except Exception as e:  # noqa: BLE001 - the view is a convenience over records that are all written
            import mlflow

            out(f"note: MLflow {mlflow.__version__} did not take rayvit's chart view ({type(e).__name__}: {e}); "
                f"the curve runs ('<strategy> · {run.name}') and scaling.png hold the same curves")


def print_summary(report: Report, out: Callable[[str], None] = print) -> None:
    """The results table, the failures, and how to browse the runs."""
    out("")
    out(sweep_table(report.rows, report.kind))
    print_failures(report, out)
    reused = sum(o.status == "reused" for o in report.outcomes)
    ran = sum(o.status == "done" for o in report.outcomes)
    out(f"\n{ran} points ran, {reused} reused, {len(report.failed)} failed.")
    if report.failed:
        out(f"rerun the failed points with: --name {report.name}")
    print_where(report, out)
    link = report.kind == "scaling" and tracking.curve_view_link(report.tracking_uri, report.experiment, report.name)
    if link:
        out(f"  then open {link}  (or the link atop the experiment's page)")

