"""What every study shares: its MLflow records, its progress lines, running one point, its report.

A study (a scaling sweep, the ladder, a search) is a parent run in MLflow with one child run per point.
:class:`StudyRun` owns that record from the first check to the last artifact; the sweep and the search
decide only which points run and how (:mod:`rayvit.studies.sweep`, :mod:`rayvit.studies.search`).
Rerunning a study of the same name in the same experiment adopts its parent run and reuses every point
whose measured settings are unchanged.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

from rayvit.config import Study
from rayvit.record import tracking
from rayvit.record.tables import fmt
from rayvit.results import RunResult
from rayvit.studies.judge import Verdict, last_line
from rayvit.studies.plan import Point

Out = Callable[[str], None]


@dataclass
class Outcome:
    """What became of one point: ``done`` (ran now), ``reused`` (finished earlier), ``failed``,
    ``killed``; search trials also ``diverged`` or ``stopped`` (early, by ASHA)."""

    point: Point
    status: str
    result: Optional[RunResult] = None
    error: Optional[str] = None
    run_id: Optional[str] = None
    seconds: float = 0.0
    verdict: Optional[Verdict] = None     # searches: feasible or not, and why

    @property
    def ok(self) -> bool:
        return self.result is not None


@dataclass
class Report:
    """Where a study went and what it found."""

    name: str
    kind: str                             # scaling | ladder | search
    experiment: str
    tracking_uri: str
    parent_run_id: str
    outcomes: list[Outcome]
    rows: list[dict[str, Any]]
    artifacts: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def failed(self) -> list[Outcome]:
        """Points that ended in an error (a diverged or stopped search trial is a result, not an error)."""
        return [o for o in self.outcomes if o.status in ("failed", "killed")]

    @property
    def exit_code(self) -> int:
        return 1 if self.failed else 0


def clock(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


class Progress:
    """``[i/n] what is running, elapsed, an estimate of what is left`` lines, and a live step count.

    On a terminal the step count rewrites one line in place; in a log (``ray job logs``, a pipe) it is
    a line when training starts and then at most every ``log_interval_s``.
    """

    def __init__(self, total: int, out: Out, tty: Optional[bool] = None, log_interval_s: float = 10.0):
        self.total = total
        self.out = out
        self.start = time.monotonic()
        self.durations: list[float] = []
        self.tty = sys.stdout.isatty() if tty is None else tty
        self.log_interval_s = log_interval_s
        self._live_shown = False

    def live(self, point: Point) -> Callable[[dict], None]:
        """A callback for rank 0's progress items (:func:`rayvit.launch.trainer.fit`'s ``on_progress``)."""
        first: dict[str, float] = {}
        state = {"printed": 0.0}

        def show(item: dict) -> None:
            first.setdefault("step", item["step"])
            first.setdefault("time", item["time"])
            done = item["step"] - first["step"]
            rate = done / (item["time"] - first["time"]) if done and item["time"] > first["time"] else None
            eta = f", about {clock((item['steps'] - item['step']) / rate)} left" if rate else ""
            rate_text = fmt(item.get("images_per_sec_per_chip"), ".1f")
            line = (f"{self.tag(point)} {point.key}: step {item['step']}/{item['steps']}, loss {item['loss']:.4g}"
                    + (f", {rate_text} img/s/chip" if rate_text != "-" else "") + eta)
            if self.tty:
                sys.stdout.write("\r\033[K" + line)
                sys.stdout.flush()
                self._live_shown = True
            elif not state["printed"] or time.monotonic() - state["printed"] >= self.log_interval_s:
                state["printed"] = time.monotonic()
                self.out(line)
        return show

    def _clear_live(self) -> None:
        if self._live_shown:
            sys.stdout.write("\r\033[K")
            sys.stdout.flush()
            self._live_shown = False

    def tag(self, point: Point) -> str:
        return f"[{point.index if point.index else point.key}/{self.total}]"

    def begin(self, point: Point, left: int, what: Optional[str] = None) -> None:
        # Mean of the points actually trained (reused points cost nothing) times the points left.
        estimate = sum(self.durations) / len(self.durations) * left if self.durations else None
        eta = "estimate after the first point" if estimate is None else f"about {clock(estimate)} left"
        self.out(f"{self.tag(point)} running {what or point.describe()} | elapsed "
                 f"{clock(time.monotonic() - self.start)}, {eta}")

    def end(self, outcome: Outcome) -> None:
        self._clear_live()
        p = outcome.point
        if outcome.status == "done":
            self.durations.append(outcome.seconds)
            m = outcome.result.metrics
            self.out(f"{self.tag(p)} {p.key} done in {outcome.seconds:.0f} s: "
                     f"{fmt(m.get('tflops_per_chip'), '.4g')} TFLOPS/chip, "
                     f"{fmt(m.get('images_per_sec_per_chip'), '.1f')} img/s/chip")
        elif outcome.status == "reused":
            self.out(f"{self.tag(p)} {p.key} already finished in run {outcome.run_id}: reused")
        else:
            self.out(f"{self.tag(p)} {p.key} {outcome.status.upper()}: "
                     f"{last_line(outcome.error or '') or 'no message'} (the study continues)")


class StudyRun:
    """One study's MLflow record: the parent run, a child run per point, resume by name, the end."""

    def __init__(self, study: Study, name: str, experiment: str, kind: str):
        # Fail fast and before anything is recorded: an unusable store is found here.
        self.uri = tracking.resolve_tracking_uri(study.tracking.uri)
        tracking.check_reachable(self.uri)
        self.study, self.name, self.experiment, self.kind = study, name, experiment, kind
        self.tracker = tracking.SweepTracker(self.uri, experiment, name)
        self.tracker.find_parent()
        self.done = self.tracker.completed()
        self.parent_id: Optional[str] = None

    @property
    def resumed(self) -> bool:
        return self.tracker.resumed

    def reusable(self, point: Point) -> Optional[Outcome]:
        """The earlier run of ``point`` with the same measured settings, if this study has one."""
        previous = self.done.get(point.key)
        if previous is not None and previous[2] == point.config_hash:
            return Outcome(point, "reused", previous[1], run_id=previous[0])
        return None

    def changed_since(self, point: Point) -> Optional[str]:
        """The run id of an earlier run of ``point`` whose settings differ (it runs again)."""
        previous = self.done.get(point.key)
        return previous[0] if previous is not None and previous[2] != point.config_hash else None

    def start(self, tags: Mapping[str, Any]) -> str:
        self.parent_id = self.tracker.start(params=self.study.flatten(), tags=tags,
                                            config_yaml=self.study.to_yaml())
        return self.parent_id

    def run_point(self, point: Point, fit: Callable[..., RunResult], tags: Mapping[str, Any],
                  progress: Optional[Progress] = None) -> Outcome:
        """Train ``point`` in a child run of its own; an error is recorded and returned, Ctrl-C raised."""
        from rayvit.launch.capacity import ClusterTooSmall
        from rayvit.launch.trainer import TrainingError

        run_id = self.open_point(point, tags)
        start = time.monotonic()
        with _sigint_restored():
            try:
                result = fit(point.cfg, on_progress=progress.live(point) if progress else None)
            except (KeyboardInterrupt, SystemExit) as e:
                self.tracker.fail_point(run_id, f"interrupted ({type(e).__name__}: Ctrl-C / SIGINT)",
                                        status="KILLED")
                raise KeyboardInterrupt from e
            except (TrainingError, ClusterTooSmall) as e:   # ClusterTooSmall: nodes did not come up in time
                return self._failed(point, run_id, str(e) or repr(e), start, e)
            except Exception as e:  # noqa: BLE001 - one broken point must not lose the rest of a long study
                return self._failed(point, run_id, traceback.format_exc(), start, e)
        outcome = Outcome(point, "done", result, run_id=run_id, seconds=time.monotonic() - start)
        self.tracker.finish_point(run_id, result, step=point.world_size)
        self.tracker.log_metrics(run_id, {"driver_seconds": outcome.seconds}, step=point.world_size)
        return outcome

    def _failed(self, point: Point, run_id: str, error: str, start: float, exc: BaseException) -> Outcome:
        from rayvit.studies.judge import is_divergence

        status = "diverged" if self.kind == "search" and is_divergence(exc) else "failed"
        self.tracker.fail_point(run_id, error)
        return Outcome(point, status, error=error, run_id=run_id, seconds=time.monotonic() - start)

    def open_point(self, point: Point, tags: Mapping[str, Any]) -> str:
        c = point.cfg
        tags = {"strategy": c.parallel.strategy, "world_size": point.world_size, "series": point.series,
                "accelerator": c.parallel.accelerator_type or ("gpu" if c.parallel.use_gpu else "cpu"), **tags}
        return self.tracker.start_point(point.key, point.key, point.config_hash, c.flatten(), tags)

    def record(self, outcome: Outcome, tags: Mapping[str, Any], figures: Mapping[str, Any] = {},
               params: Mapping[str, Any] = {}) -> None:
        """A child run for an outcome that ran elsewhere (a Tune trial): its params, figures and result."""
        run_id = self.tracker.start_point(f"{outcome.point.key} · {tags.get('setting', '')}".strip(" ·"),
                                          outcome.point.key, outcome.point.config_hash,
                                          {**outcome.point.cfg.flatten(), **params}, tags)
        outcome.run_id = run_id
        self.tracker.log_metrics(run_id, figures, step=0)
        if outcome.result is not None:
            self.tracker.finish_point(run_id, outcome.result, step=0)
        else:
            status = "KILLED" if outcome.status == "stopped" else "FAILED"
            self.tracker.fail_point(run_id, outcome.error or (outcome.verdict.reason if outcome.verdict else ""),
                                    status=status)

    def interrupted(self, at: str) -> None:
        self.tracker.set_parent_tags({"rayvit.interrupted_at": at})
        self.tracker.end("KILLED")

    def finish(self, files: list, tags: Mapping[str, Any], failed: bool) -> list[str]:
        """Attach ``files`` to the parent run, tag it, end it; returns the artifact names."""
        for f in files:
            self.tracker.log_parent_file(f)
        self.tracker.set_parent_tags(tags)
        self.tracker.end("FAILED" if failed else "FINISHED")
        return [f.name for f in files]


class _sigint_restored:
    """Ray Train's fit() installs its own SIGINT handler (abort the run, then sys.exit) and leaves it
    installed; put ours back afterwards so a Ctrl-C between points is a plain KeyboardInterrupt."""

    def __enter__(self):
        main = threading.current_thread() is threading.main_thread()
        self.handler = signal.getsignal(signal.SIGINT) if main else None
        return self

    def __exit__(self, *exc):
        if self.handler is not None:
            signal.signal(signal.SIGINT, self.handler)
        return False


def attach_ray(address: Optional[str], name: str, ray_log: Optional[str], out: Out) -> None:
    """Start or attach to Ray; with ``ray_log`` (``quiet`` or ``verbose``) route its workers' output to
    a log file named after the study and say where it is."""
    from rayvit.config import rayvit_home
    from rayvit.launch.console import quiet_ray
    from rayvit.launch.trainer import ensure_ray

    ensure_ray(address)
    if ray_log:
        path = quiet_ray(rayvit_home() / "logs" / f"{name}.log", verbose=ray_log == "verbose")
        if path and ray_log == "quiet":
            out(f"Ray's worker and controller output: {path} (--verbose shows it here)")


def print_failures(report: Report, out: Out) -> None:
    for o in report.failed:
        out(f"FAILED {o.point.key} (run {o.run_id}): {last_line(o.error or '') or 'no message'}")


def print_where(report: Report, out: Out) -> None:
    """Where the study's records are, and how to browse them."""
    out(f"{report.kind} {report.name!r} in experiment {report.experiment!r}, parent run "
        f"{report.parent_run_id}; artifacts: {', '.join(report.artifacts)}")
    out("browse the curves with:" if report.kind != "search" else "browse the trials with:")
    out(f"  {tracking.ui_command(report.tracking_uri)}")
