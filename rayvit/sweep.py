"""Scaling sweeps and the optimization ladder: plan points, run them, resume, summarise.

A *point* is one ``rayvit.trainer.fit`` run: a full :class:`~rayvit.config.Config` plus a stable key
(``fsdp/w2``, ``3-mta_optimizer/w8``). A scaling sweep measures every strategy at every worker count
with otherwise identical settings; the ladder applies the study's optimizations one after another at
one worker count. Points run one at a time, each on the whole slice of the cluster it asks for, so
their timings never share chips.

Results go to MLflow (:mod:`rayvit.tracking`): a parent run per sweep, a child run per point. Rerunning
a sweep of the same name (in the same experiment) reuses finished points whose measured settings are
unchanged and reruns the rest.
"""

from __future__ import annotations

import hashlib
import json
import math
import signal
import sys
import threading
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Optional

from rayvit.config import LADDER_RUNGS, Config, ConfigError
from rayvit.results import METRIC_KEYS, RunResult

# Settings that do not change what a point measures, so a rerun with them changed still reuses it:
# which sweep it belongs to, where it is recorded, and fault injection used to test recovery.
_UNHASHED_SECTIONS = ("sweep", "tracking", "search", "launch")
_UNHASHED_KEYS = ("train.fail_at_step", "train.fail_rank", "train.max_failures")

# Per point figures derived across points (absent where their reference point is missing).
DERIVED_KEYS = ("speedup_vs_ddp", "scaling_efficiency", "relative_throughput")

# Curves logged on the parent run, ``<key>/<series>`` at step = number of chips.
CURVE_KEYS = ("tflops_per_chip", "images_per_sec_per_chip", "mfu", "speedup_vs_ddp", "scaling_efficiency")


@dataclass(frozen=True)
class Point:
    """One training run of a sweep."""

    index: int              # 1-based position in the plan
    key: str                # stable within a sweep; how a rerun recognises a finished point
    series: str             # the strategy (scaling) or the rung (ladder) this point belongs to
    world_size: int
    cfg: Config = field(compare=False, repr=False)

    @property
    def config_hash(self) -> str:
        """A digest of the settings that determine what this point measures."""
        flat = {k: v for k, v in self.cfg.flatten().items()
                if k.split(".")[0] not in _UNHASHED_SECTIONS and k not in _UNHASHED_KEYS}
        return hashlib.sha1(json.dumps(flat, sort_keys=True, default=str).encode()).hexdigest()[:12]

    def describe(self) -> str:
        c = self.cfg
        what = f"{self.series} @ {self.world_size} worker{'s' if self.world_size > 1 else ''}"
        return (f"{what} ({c.parallel.strategy}, {c.model.name} {c.model.image_size}px, batch "
                f"{c.train.batch_size}/chip, {c.precision.mode}"
                f"{'' if c.precision.mode == 'fp32' else '/' + c.precision.dtype}, {c.train.steps} steps)")


# --------------------------------------------------------------------------------------------------
# Planning


def plan(cfg: Config) -> list[Point]:
    """Every point of the sweep ``cfg`` describes, validated; raises ConfigError before anything runs."""
    return plan_ladder(cfg) if cfg.sweep.mode == "ladder" else plan_scaling(cfg)


def plan_scaling(cfg: Config) -> list[Point]:
    """Every strategy at every worker count, smallest counts first and DDP first at each count.

    That order puts each point's references (DDP at its count, its own strategy at the smallest count)
    before it, so derived figures and curves fill in while the sweep runs.
    """
    strategies = ["ddp"] + [s for s in dict.fromkeys(cfg.sweep.strategies) if s != "ddp"]
    points = []
    for n in sorted(set(cfg.sweep.worker_counts)):
        for strategy in strategies:
            point_cfg = _derive(cfg, {"parallel.strategy": strategy, "parallel.num_workers": n},
                                f"{strategy} at {n} workers")
            points.append(Point(len(points) + 1, f"{strategy}/w{n}", strategy, n, point_cfg))
    return points


def ladder_overrides(cfg: Config) -> list[tuple[str, dict[str, Any]]]:
    """``(rung, cumulative overrides)`` for each rung of ``cfg.sweep.rungs``, in the study's order."""
    if cfg.precision.mode not in ("fp32", "amp"):
        raise ConfigError(f"the ladder's baseline runs in precision.mode fp32 or amp (the study's DDP "
                          f"baseline); got precision.mode={cfg.precision.mode}")
    wanted = set(cfg.sweep.rungs)
    if "baseline" not in wanted:
        raise ConfigError("sweep.rungs must include baseline: every rung is reported relative to it")
    steps: dict[str, dict[str, Any]] = {
        "baseline": {"parallel.strategy": "ddp", "model.classifier": "token",
                     "model.layout": "batch_first", "optim.impl": "loop"},
        "mixed_precision": {"precision.mode": "mixed"},     # O2: half weights, fp32 master copy
        "fsdp": {"parallel.strategy": "fsdp"},
        "mta_optimizer": {"optim.impl": "foreach"},
        "pooled_classifier": {"model.classifier": "pooled"},
        "batch_second": {"model.layout": "batch_second"},
        "image_256": {"model.image_size": cfg.sweep.ladder_image_size},
        "full_half": {"precision.mode": "pure"},            # O3: everything in half precision
    }
    # fp16 has no fast CPU kernels (about 15x slower than fp32 here); bf16 is the CPU's half type.
    half = {} if cfg.parallel.use_gpu else {"precision.dtype": "bf16"}
    rungs, overrides = [], dict(half)
    for rung in LADDER_RUNGS:
        overrides = {**overrides, **steps[rung]}
        if rung in wanted:
            rungs.append((rung, dict(overrides)))
    return rungs


def plan_ladder(cfg: Config) -> list[Point]:
    """The cumulative optimization rungs at ``parallel.num_workers`` workers."""
    n = cfg.parallel.num_workers
    points = []
    for i, (rung, overrides) in enumerate(ladder_overrides(cfg)):
        point_cfg = _derive(cfg, overrides, f"ladder rung {rung}")
        points.append(Point(len(points) + 1, f"{i}-{rung}/w{n}", rung, n, point_cfg))
    return points


def _derive(cfg: Config, overrides: dict[str, Any], what: str) -> Config:
    try:
        return cfg.replace(overrides)
    except ConfigError as e:
        raise ConfigError(f"{what}: {e}") from None


# --------------------------------------------------------------------------------------------------
# Results table and derived figures


@dataclass
class Outcome:
    """What became of one point in this invocation."""

    point: Point
    status: str                       # "done" (ran now), "reused" (finished earlier), "failed", "killed"
    result: Optional[RunResult] = None
    error: Optional[str] = None
    run_id: Optional[str] = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.result is not None


def rows_of(outcomes: list[Outcome], mode: str) -> list[dict[str, Any]]:
    """One flat row per point: key, status, conditions, metrics and the derived figures."""
    rows = []
    for o in outcomes:
        row: dict[str, Any] = {"point": o.point.key, "series": o.point.series, "world_size": o.point.world_size,
                               "status": o.status, "run_id": o.run_id, "error": o.error,
                               "strategy": o.point.cfg.parallel.strategy,
                               "seconds": round(o.seconds, 2) if o.status == "done" else None,
                               "config_hash": o.point.config_hash}
        if o.result is not None:
            row.update({k: v for k, v in o.result.row().items() if k not in ("series", "point")})
        for key in METRIC_KEYS:
            row.setdefault(key, None)
        rows.append(row)
    add_derived(rows, mode)
    return rows


def _num(value: Any) -> Optional[float]:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _ratio(a: Any, b: Any) -> Optional[float]:
    a, b = _num(a), _num(b)
    return a / b if a is not None and b else None


def add_derived(rows: list[dict[str, Any]], mode: str) -> None:
    """Fill ``speedup_vs_ddp``, ``scaling_efficiency`` (scaling) or ``relative_throughput`` (ladder).

    speedup_vs_ddp = per-chip TFLOPS / DDP's at the same worker count; scaling_efficiency = per-chip
    images/s / the same strategy's at the sweep's smallest worker count (missing if that point failed:
    a larger count is never silently used as the reference); relative_throughput = per-chip TFLOPS /
    the baseline rung's.
    """
    for row in rows:
        for key in DERIVED_KEYS:
            row[key] = None
    if mode == "ladder":
        base = next((r for r in rows if r["series"] == "baseline"), None)
        for row in rows:
            row["relative_throughput"] = _ratio(row.get("tflops_per_chip"), base and base.get("tflops_per_chip"))
        return
    ddp = {r["world_size"]: r for r in rows if r["series"] == "ddp"}
    smallest = min((r["world_size"] for r in rows), default=None)
    first = {r["series"]: r for r in rows if r["world_size"] == smallest}
    for row in rows:
        ref = ddp.get(row["world_size"])
        row["speedup_vs_ddp"] = _ratio(row.get("tflops_per_chip"), ref and ref.get("tflops_per_chip"))
        ref = first.get(row["series"])
        row["scaling_efficiency"] = _ratio(row.get("images_per_sec_per_chip"),
                                           ref and ref.get("images_per_sec_per_chip"))


def _fmt(value: Any, spec: str) -> str:
    value = _num(value)
    return "-" if value is None else format(value, spec)


def format_table(rows: list[dict[str, Any]], mode: str) -> str:
    """The results as a plain-text table, one line per point."""
    if mode == "ladder":
        header = ["rung", "status", "chips", "strategy", "precision", "img px", "img/s/chip",
                  "TFLOPS/chip", "MFU", "vs baseline"]
        lines = [[r["series"], r["status"], str(r["world_size"]), r["strategy"], str(r.get("precision") or "-"),
                  str(r.get("image_size") or "-"), _fmt(r["images_per_sec_per_chip"], ".1f"),
                  _fmt(r["tflops_per_chip"], ".4g"), _fmt(r["mfu"], ".1%"),
                  _fmt(r["relative_throughput"], ".2f") + ("x" if r["relative_throughput"] else "")]
                 for r in rows]
    else:
        header = ["point", "status", "chips", "img/s/chip", "TFLOPS/chip", "MFU", "vs DDP", "scaling eff.",
                  "state MB/rank", "time s"]
        lines = [[r["point"], r["status"], str(r["world_size"]), _fmt(r["images_per_sec_per_chip"], ".1f"),
                  _fmt(r["tflops_per_chip"], ".4g"), _fmt(r["mfu"], ".1%"),
                  _fmt(r["speedup_vs_ddp"], ".2f") + ("x" if r["speedup_vs_ddp"] else ""),
                  _fmt(r["scaling_efficiency"], ".0%"),
                  _fmt((_num(r["model_state_bytes_per_rank"]) or math.nan) / 2**20, ".1f"),
                  _fmt(r["seconds"], ".0f")] for r in rows]
    widths = [max(len(h), *(len(line[i]) for line in lines)) if lines else len(h)
              for i, h in enumerate(header)]
    out = ["  ".join(h.ljust(w) for h, w in zip(header, widths)),
           "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(line, widths)) for line in lines]
    return "\n".join(out)


def write_parquet(rows: list[dict[str, Any]], path: str | Path) -> Path:
    """``results.parquet``: one row per point, every condition and metric as a column."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    columns: dict[str, list] = {}
    for row in rows:
        for key in row:
            columns.setdefault(key, [])
    for key in columns:
        values = [row.get(key) for row in rows]
        # A column of mixed scalar types (e.g. ints and None and floats) stores as float; anything
        # non-scalar (lists) as JSON text, so every column has one arrow type.
        if any(isinstance(v, (list, dict)) for v in values):
            values = [None if v is None else json.dumps(v, default=str) for v in values]
        elif any(isinstance(v, float) for v in values) and all(
                v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)) for v in values):
            values = [None if v is None else float(v) for v in values]
        elif len({type(v) for v in values if v is not None}) > 1:
            values = [None if v is None else str(v) for v in values]
        columns[key] = values
    path = Path(path)
    pq.write_table(pa.table(columns), path)
    return path


# --------------------------------------------------------------------------------------------------
# Progress


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


class Progress:
    """``[i/n] what is running, elapsed, an estimate of what is left`` lines."""

    def __init__(self, total: int, out: Callable[[str], None]):
        self.total = total
        self.out = out
        self.start = time.monotonic()
        self.durations: list[float] = []

    def remaining(self, left: int) -> Optional[float]:
        # Mean of the points actually trained (reused points cost nothing) times the points left.
        return sum(self.durations) / len(self.durations) * left if self.durations else None

    def begin(self, point: Point, left: int) -> None:
        estimate = self.remaining(left)
        eta = "estimate after the first point" if estimate is None else f"about {_clock(estimate)} left"
        self.out(f"[{point.index}/{self.total}] running {point.describe()} | elapsed "
                 f"{_clock(time.monotonic() - self.start)}, {eta}")

    def end(self, outcome: Outcome) -> None:
        p = outcome.point
        if outcome.status == "done":
            self.durations.append(outcome.seconds)
            m = outcome.result.metrics
            self.out(f"[{p.index}/{self.total}] {p.key} done in {outcome.seconds:.0f} s: "
                     f"{_fmt(m.get('tflops_per_chip'), '.4g')} TFLOPS/chip, "
                     f"{_fmt(m.get('images_per_sec_per_chip'), '.1f')} img/s/chip")
        elif outcome.status == "reused":
            self.out(f"[{p.index}/{self.total}] {p.key} already finished in run {outcome.run_id}: reused")
        else:
            first = (outcome.error or "").strip().splitlines()
            self.out(f"[{p.index}/{self.total}] {p.key} {outcome.status.upper()}: "
                     f"{first[-1] if first else 'no message'} (sweep continues)")


# --------------------------------------------------------------------------------------------------
# Running a sweep


@dataclass
class SweepReport:
    """Where a sweep went and what it found."""

    name: str
    mode: str
    experiment: str
    tracking_uri: str
    parent_run_id: str
    rows: list[dict[str, Any]]
    outcomes: list[Outcome]
    artifacts: list[str] = field(default_factory=list)

    @property
    def failed(self) -> list[Outcome]:
        return [o for o in self.outcomes if not o.ok]

    @property
    def exit_code(self) -> int:
        return 1 if self.failed else 0


def default_sweep_name(cfg: Config) -> str:
    return f"{cfg.sweep.mode}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"


def default_experiment(cfg: Config) -> str:
    return cfg.tracking.experiment or f"rayvit-{cfg.sweep.mode}"


def describe_plan(cfg: Config, points: list[Point]) -> str:
    """The planned points and the resources each asks of the cluster (what ``--dry-run`` prints)."""
    from rayvit.trainer import resources_for

    lines = [f"{cfg.sweep.mode} sweep: {len(points)} points, run one after another"]
    needs = []
    header = f"  {'#':>3}  {'point':<28} {'strategy':<14} {'workers':>7}  resources"
    lines += [header]
    for p in points:
        res = resources_for(p.cfg)
        needs.append(res)
        text = ", ".join(f"{k} {v:g}" for k, v in sorted(res.items()))
        lines.append(f"  {p.index:>3}  {p.key:<28} {p.cfg.parallel.strategy:<14} {p.world_size:>7}  {text}")
    peak = {k: max(r.get(k, 0.0) for r in needs) for r in needs for k in r}
    lines.append("largest point needs: " + ", ".join(f"{k} {v:g}" for k, v in sorted(peak.items())))
    return "\n".join(lines)


def run_sweep(cfg: Config, *, experiment: Optional[str] = None, address: Optional[str] = None,
              out: Callable[[str], None] = print) -> SweepReport:
    """Run (or resume) the sweep ``cfg`` describes; one child run per point under one parent run.

    Raises ConfigError, ClusterTooSmall or TrackingError before any point runs; a point that fails is
    recorded and the sweep goes on (``SweepReport.exit_code`` is then 1). Ctrl-C marks the running
    point and the sweep KILLED, so a rerun of the same name picks up from there.
    """
    from rayvit import plots, tracking
    from rayvit.trainer import check_cluster_fits, ensure_ray, fit

    name = cfg.sweep.name or default_sweep_name(cfg)
    cfg = cfg.replace({"sweep.name": name})
    mode = cfg.sweep.mode
    points = plan(cfg)
    experiment = experiment or default_experiment(cfg)

    # Fail fast, in order of cost, and before any run is recorded: tracking store, then the cluster
    # (only for the points that still have to run: a finished sweep is summarised without Ray).
    uri = tracking.resolve_tracking_uri(cfg.tracking.uri)
    tracking.check_reachable(uri)
    tracker = tracking.SweepTracker(uri, experiment, name)
    tracker.find_parent()
    done = tracker.completed()
    todo = [p for p in points if done.get(p.key, (None, None, None))[2] != p.config_hash]
    if todo:
        ensure_ray(address)
        check_cluster_fits([p.cfg for p in todo])

    parent = tracker.start(params=cfg.flatten(), tags=_sweep_tags(cfg, points), config_yaml=cfg.to_yaml())
    out(f"sweep {name!r}: {len(points)} points ({len(todo)} to run), experiment {experiment!r}, "
        f"parent run {parent}")
    out(f"tracking: {uri}" + ("  (resuming: finished points are reused)" if tracker.resumed else ""))
    out(f"resume with: --name {name}")

    progress = Progress(len(points), out)
    outcomes: list[Outcome] = []
    try:
        for i, point in enumerate(points):
            previous = done.get(point.key)
            if previous is not None and previous[2] == point.config_hash:
                outcome = Outcome(point, "reused", previous[1], run_id=previous[0])
            else:
                if previous is not None:
                    out(f"[{point.index}/{len(points)}] {point.key}: its settings changed since run "
                        f"{previous[0]}; running it again")
                progress.begin(point, len(points) - i)
                outcome = _run_point(point, tracker, fit)
            outcomes.append(outcome)
            progress.end(outcome)
            _log_curves(tracker, rows_of(outcomes, mode), mode)
    except KeyboardInterrupt:
        tracker.set_parent_tags({"rayvit.interrupted_at": points[len(outcomes)].key
                                 if len(outcomes) < len(points) else "end"})
        tracker.end("KILLED")
        raise

    rows = rows_of(outcomes, mode)
    report = SweepReport(name, mode, experiment, uri, parent, rows, outcomes)
    with tempfile.TemporaryDirectory() as tmp:
        files = [write_parquet(rows, Path(tmp) / "results.parquet")]
        ok = [r for r in rows if r["status"] in ("done", "reused")]
        if ok and mode == "scaling":
            files.append(plots.scaling_figure(ok, Path(tmp) / "scaling.png",
                                              title=f"{name}: per-chip throughput against chips"))
        elif ok:
            files.append(plots.ladder_figure(ok, Path(tmp) / "ladder.png",
                                             title=f"{name}: optimization ladder at {points[0].world_size} "
                                                   f"chip{'s' if points[0].world_size > 1 else ''}"))
        for f in files:
            tracker.log_parent_file(f)
            report.artifacts.append(f.name)
    if mode == "scaling":
        _log_curve_runs(tracker, rows)
    tracker.set_parent_tags({"rayvit.points": len(points), "rayvit.failed_points": len(report.failed)})
    tracker.end("FAILED" if report.failed else "FINISHED")
    return report


def _sweep_tags(cfg: Config, points: list[Point]) -> dict[str, Any]:
    c = cfg
    return {"mode": c.sweep.mode, "model": c.model.name, "image_size": c.model.image_size,
            "batch_per_chip": c.train.batch_size, "precision": c.precision.mode,
            "accelerator": "gpu" if c.parallel.use_gpu else "cpu",
            "strategies": ",".join(dict.fromkeys(p.cfg.parallel.strategy for p in points)),
            "world_sizes": ",".join(str(n) for n in sorted({p.world_size for p in points}))}


def _run_point(point: Point, tracker, fit: Callable[[Config], RunResult]) -> Outcome:
    from rayvit.trainer import TrainingError

    c = point.cfg
    tags = {"strategy": c.parallel.strategy, "world_size": point.world_size, "series": point.series,
            "accelerator": c.parallel.accelerator_type or ("gpu" if c.parallel.use_gpu else "cpu")}
    if c.sweep.mode == "ladder":
        tags["rayvit.rung"] = point.series
    run_id = tracker.start_point(point.key, point.key, point.config_hash, c.flatten(), tags)
    start = time.monotonic()
    # Ray Train's fit() installs its own SIGINT handler (abort the run, then sys.exit) and leaves it
    # installed; put ours back afterwards so a Ctrl-C between points is a plain KeyboardInterrupt.
    main_thread = threading.current_thread() is threading.main_thread()
    handler = signal.getsignal(signal.SIGINT) if main_thread else None
    try:
        result = fit(c)
    except (KeyboardInterrupt, SystemExit) as e:
        tracker.fail_point(run_id, f"interrupted ({type(e).__name__}: Ctrl-C / SIGINT)", status="KILLED")
        raise KeyboardInterrupt from e
    except TrainingError as e:
        error = str(e) or repr(e)
        tracker.fail_point(run_id, error)
        return Outcome(point, "failed", error=error, run_id=run_id, seconds=time.monotonic() - start)
    except Exception:  # noqa: BLE001 - one broken point must not lose the rest of a long sweep
        error = traceback.format_exc()
        tracker.fail_point(run_id, error)
        return Outcome(point, "failed", error=error, run_id=run_id, seconds=time.monotonic() - start)
    finally:
        if main_thread and handler is not None:
            signal.signal(signal.SIGINT, handler)
    seconds = time.monotonic() - start
    tracker.finish_point(run_id, result, step=point.world_size)
    tracker.log_metrics(run_id, {"driver_seconds": seconds}, step=point.world_size)
    return Outcome(point, "done", result, run_id=run_id, seconds=seconds)


def _log_curves(tracker, rows: list[dict[str, Any]], mode: str) -> None:
    """Curves on the parent (``<key>/<series>`` at step = chips) and derived figures on each child."""
    for row in rows:
        if row["run_id"] and row["status"] in ("done", "reused"):
            tracker.log_metrics(row["run_id"], {k: row[k] for k in DERIVED_KEYS}, step=row["world_size"])
    ok = [r for r in rows if r["status"] in ("done", "reused")]
    if mode == "ladder":
        for i, row in enumerate(rows):
            if row["status"] in ("done", "reused"):
                # One chart of the whole ladder: step = rung number.
                tracker.log_metrics(tracker.parent_id, {"relative_throughput": row["relative_throughput"],
                                                        "ladder_tflops_per_chip": row["tflops_per_chip"]},
                                    step=i)
        return
    for row in ok:
        tracker.log_metrics(tracker.parent_id, {f"{k}/{row['series']}": row.get(k) for k in CURVE_KEYS},
                            step=row["world_size"])


def _log_curve_runs(tracker, rows: list[dict[str, Any]]) -> None:
    ok = [r for r in rows if r["status"] in ("done", "reused")]
    for series in dict.fromkeys(r["series"] for r in ok):
        mine = [r for r in ok if r["series"] == series]
        curves = {k: {r["world_size"]: r.get(k) for r in mine} for k in CURVE_KEYS}
        shared = {k: mine[0].get(k) for k in ("model", "image_size", "batch_per_chip", "precision",
                                              "accelerator") if mine[0].get(k) is not None}
        tracker.log_curve_run(series, curves, {"strategy": series, **shared})
    if ok:
        tracker.save_curve_view(CURVE_KEYS)  # the UI's chart of them all against chips


def print_summary(report: SweepReport, out: Callable[[str], None] = print) -> None:
    """The results table, the failures, and how to browse the runs."""
    from rayvit.tracking import curve_view_link, ui_command

    out("")
    out(format_table(report.rows, report.mode))
    for o in report.failed:
        lines = (o.error or "").strip().splitlines()
        out(f"FAILED {o.point.key} (run {o.run_id}): {lines[-1] if lines else 'no message'}")
    reused = sum(o.status == "reused" for o in report.outcomes)
    ran = sum(o.status == "done" for o in report.outcomes)
    out(f"\n{ran} points ran, {reused} reused, {len(report.failed)} failed. "
        f"Sweep {report.name!r} in experiment {report.experiment!r}, parent run {report.parent_run_id}; "
        f"artifacts: {', '.join(report.artifacts)}")
    if report.failed:
        out(f"rerun the failed points with: --name {report.name}")
    out("browse the curves with:")
    out(f"  {ui_command(report.tracking_uri)}")
    link = report.mode == "scaling" and curve_view_link(report.tracking_uri, report.experiment, report.name)
    if link:
        out(f"  then open {link}  (or the link atop the experiment's page)")


def eprint(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
