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
from typing import Any, Callable, Mapping, Optional

from rayvit.config_schema import Study
from rayvit.config import tracking_uri
from rayvit.record import tracking
from rayvit.formats import clock, fmt, interval
from rayvit.results import RunResult
from rayvit.studies.outcome import Outcome, Report, is_divergence, last_line
from rayvit.studies.plan import Point

# Outcome and Report are imported from here by the sweep, the search and callers: they live in
# rayvit.studies.outcome, beside what a search trial's verdict is.
__all__ = ["Outcome", "Out", "Progress", "Report", "StudyRun", "attach_ray", "print_failures", "print_where",
           "with_interval"]

Out = Callable[[str], None]


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
        self._printed = 0.0

    def live(self, point: Point, label: str = "") -> Callable[[dict], None]:
        """A callback for rank 0's progress items (:func:`rayvit.launch.torch_trainer.fit`'s ``on_progress``);
        ``label`` (e.g. ``round 2/3``) goes before the step count."""
        first: dict[str, float] = {}
        label = f"{label}, " if label else ""

        def show(item: dict) -> None:
            first.setdefault("step", item["step"])
            first.setdefault("time", item["time"])
            done = item["step"] - first["step"]
            rate = done / (item["time"] - first["time"]) if done and item["time"] > first["time"] else None
            eta = f", about {clock((item['steps'] - item['step']) / rate)} left" if rate else ""
            rate_text = fmt(item.get("images_per_sec_per_chip"), ".1f")
            line = (f"{self.tag(point)} {point.key}: {label}step {item['step']}/{item['steps']}, loss {item['loss']:.4g}"
                    + (f", {rate_text} img/s/chip" if rate_text != "-" else "") + eta)
            if self.tty:
                sys.stdout.write("\r\033[K" + line)
                sys.stdout.flush()
                self._live_shown = True
            elif not self._printed or time.monotonic() - self._printed >= self.log_interval_s:
                # One line per interval across all runs (a worker group's rounds share it).
                self._printed = time.monotonic()
                self.out(line)
        return show

    def _clear_live(self) -> None:
        if self._live_shown:
            sys.stdout.write("\r\033[K")
            sys.stdout.flush()
            self._live_shown = False

    def show_next_step(self) -> None:
        """Show the next step line whatever the log interval (the first step of what begins)."""
        self._printed = 0.0

    def tag(self, point: Point) -> str:
        return f"[{point.index if point.index else point.key}/{self.total}]"

    def begin(self, point: Point, left: int, what: Optional[str] = None) -> None:
        self.show_next_step()                      # the first step of what begins is always shown
        # Mean of the points actually trained (reused points cost nothing) times the points left.
        estimate = sum(self.durations) / len(self.durations) * left if self.durations else None
        eta = "estimate after the first point" if estimate is None else f"about {clock(estimate)} left"
        self.out(f"{self.tag(point)} running {what or point.describe()} | elapsed "
                 f"{clock(time.monotonic() - self.start)}, {eta}")

    def begin_group(self, points: list[Point], rounds: int, left: int) -> None:
        """The line before a worker group measures ``points`` in ``rounds`` interleaved rounds."""
        if len(points) == 1:
            what = points[0].describe() + (f", {rounds} rounds" if rounds > 1 else "")
        else:
            c, n = points[0].cfg, points[0].world_size
            what = (f"{', '.join(p.series for p in points)} @ {n} worker{'s' if n > 1 else ''} on one worker group, "
                    f"{rounds} interleaved round{'s' if rounds > 1 else ''} ({c.model.name} {c.model.image_size}px, "
                    f"batch {c.train.batch_size}/chip, {c.train.steps} steps each)")
        self.begin(points[0], left, what)

    def round_line(self, round: int, rounds: int, figures: list[tuple[Point, Optional[float], Optional[str]]]) -> None:
        """``round 1/3: ddp/w2 586.0, fsdp/w2 350.9 img/s/chip`` once every point of a round reported."""
        self._clear_live()
        parts = [f"{p.key} {fmt(rate, '.1f')}" if error is None else f"{p.key} FAILED" for p, rate, error in figures]
        self.out(f"{self.tag(figures[0][0])} round {round + 1}/{rounds}: {', '.join(parts)} img/s/chip")

    def end(self, outcome: Outcome) -> None:
        self._clear_live()
        p = outcome.point
        if outcome.status == "done":
            self.durations.append(outcome.seconds)
            m = outcome.result.metrics
            rounds = int(m.get("rounds") or 1)
            self.out(f"{self.tag(p)} {p.key} done in {outcome.seconds:.0f} s: "
                     f"{with_interval(m, 'tflops_per_chip', '.4g')} TFLOPS/chip, "
                     f"{with_interval(m, 'images_per_sec_per_chip', '.1f')} img/s/chip"
                     + (f" (median of {rounds} rounds, 95% interval)" if rounds > 1 else ""))
            for note in _data_notes(m):
                self.out(f"{self.tag(p)} {p.key} {note}")
        elif outcome.status == "reused":
            self.out(f"{self.tag(p)} {p.key} already finished in run {outcome.run_id}: reused")
        else:
            self.out(f"{self.tag(p)} {p.key} {outcome.status.upper()}: "
                     f"{last_line(outcome.error or '') or 'no message'} (the study continues)")


def _data_notes(metrics: Mapping[str, Any]) -> list[str]:
    """What the console says about a point's input: input-bound (data_wait_fraction), corrupt images skipped."""
    from rayvit.projection.inputs import measured_note

    notes = [measured_note(metrics)]
    skipped = metrics.get("skipped_images")
    if skipped:
        notes.append(f"skipped {skipped:.0f} corrupt image(s) (data.skip_corrupt=true; each named in a warning)")
    return [n for n in notes if n]


def with_interval(figures: Mapping[str, Any], key: str, spec: str, suffix: str = "") -> str:
    """``586.0 (560.2-601.3)``: ``figures[key]`` with its interval where it has one, else the figure alone."""
    return interval(figures.get(key), figures.get(f"{key}_lo"), figures.get(f"{key}_hi"), spec, suffix)


class _GroupLive:
    """The driver's view of one worker group: live step lines, a line per round, the rounds received.

    Round results arrive as each run finishes (``"kind": "round"`` items), so when the group dies the
    points whose rounds all finished are kept (:meth:`finished`).
    """

    def __init__(self, progress: Optional[Progress], points: list[Point], rounds: int):
        self.progress, self.points, self.rounds = progress, points, rounds
        self.received: dict[int, list[tuple[int, int, dict]]] = {i: [] for i in range(len(points))}
        self.errors: dict[int, str] = {}
        self.by_round: dict[int, dict[int, tuple[Optional[float], Optional[str]]]] = {}
        self._live: dict[tuple[int, int], Callable[[dict], None]] = {}

    def __call__(self, item: dict) -> None:
        index, r = item.get("index", 0), item.get("round", 0)
        if item.get("kind") == "round":
            self._round(index, r, item)
        elif self.progress is not None:
            if (index, r) not in self._live:
                label = f"round {r + 1}/{self.rounds}" if self.rounds > 1 else ""
                self._live[(index, r)] = self.progress.live(self.points[index], label)
            self._live[(index, r)](item)

    def _round(self, index: int, r: int, item: dict) -> None:
        result, error = item.get("result"), item.get("error")
        if error is not None:
            self.errors[index] = error
        elif result is not None:
            self.received[index].append((r, item.get("slot", 0), result))
        row = self.by_round.setdefault(r, {})
        row[index] = ((result or {}).get("metrics", {}).get("images_per_sec_per_chip"), error)
        alive = [i for i in range(len(self.points)) if i not in self.errors or i in row]
        if self.progress is not None and self.rounds > 1 and all(i in row for i in alive):
            self.progress.round_line(r, self.rounds, [(self.points[i], *row[i]) for i in sorted(row)])

    def finished(self, index: int) -> Optional[RunResult]:
        """Point ``index``'s result if all its rounds arrived before the group ended, else None."""
        got = self.received[index]
        if index in self.errors or len(got) < self.rounds:
            return None
        return RunResult.of_rounds([RunResult.from_dict(res) for _, _, res in got], [(r, s) for r, s, _ in got])


class StudyRun:
    """One study's MLflow record: the parent run, a child run per point, resume by name, the end."""

    def __init__(self, study: Study, name: str, experiment: str, kind: str):
        # Fail fast and before anything is recorded: an unusable store is found here.
        self.uri = tracking_uri(study.tracking.uri)
        tracking.check_reachable(self.uri)
        self.study, self.name, self.experiment, self.kind = study, name, experiment, kind
        self.tracker = tracking.SweepTracker(self.uri, experiment, name)
        self.tracker.find_parent()
        self.done = self.tracker.completed()
        self.parent_id: Optional[str] = None
        self.links: Optional[dict] = None     # the links the last group measured, if it was asked to
        self.abandoned: list[str] = []        # points a killed driver left running (marked KILLED at start)

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
        # A driver killed without a word (SIGKILL, a lost head node) left its points RUNNING.
        self.abandoned = self.tracker.close_abandoned() if self.resumed else []
        return self.parent_id

    def run_point(self, point: Point, fit: Callable[..., RunResult], tags: Mapping[str, Any],
                  progress: Optional[Progress] = None) -> Outcome:
        """Train ``point`` in a child run of its own; an error is recorded and returned, Ctrl-C raised."""
        from rayvit.launch.capacity import ClusterTooSmall
        from rayvit.launch.torch_trainer import TrainingError

        run_id = self.open_point(point, tags)
        start = time.monotonic()
        with _sigint_restored():
            try:
                result = fit(point.cfg, on_progress=progress.live(point) if progress else None)
            except (KeyboardInterrupt, SystemExit) as e:
                self._killed([run_id], e)
            except (TrainingError, ClusterTooSmall) as e:   # ClusterTooSmall: nodes did not come up in time
                return self._failed(point, run_id, str(e) or repr(e), start, e)
            except Exception as e:  # noqa: BLE001 - one broken point must not lose the rest of a long study
                return self._failed(point, run_id, traceback.format_exc(), start, e)
        return self._done(point, run_id, result, time.monotonic() - start)

    def run_group(self, points: list[Point], rounds: int, fit_group: Callable[..., Any],
                  tags: Callable[[Point], Mapping[str, Any]], progress: Optional[Progress] = None,
                  run_ids: Optional[dict[str, str]] = None) -> list[Outcome]:
        """Measure ``points`` on one worker group in ``rounds`` interleaved rounds, each point recorded
        in a child run of its own (:func:`rayvit.launch.torch_trainer.fit_group`).

        A point that fails in its round is recorded failed and the others go on. When the group itself
        fails (a lost worker, a group that cannot start), points whose rounds had all finished keep them
        and every other point runs again in a group of its own; Ctrl-C marks every open point KILLED.
        """
        from rayvit.launch.capacity import ClusterTooSmall
        from rayvit.launch.torch_trainer import TrainingError

        run_ids = dict(run_ids or {})
        for p in points:
            run_ids.setdefault(p.key, self.open_point(p, tags(p)))
        live = _GroupLive(progress, points, rounds)
        start = time.monotonic()
        with _sigint_restored():
            try:
                group = fit_group([p.cfg for p in points], rounds, on_progress=live)
            except (KeyboardInterrupt, SystemExit) as e:
                self._killed([run_ids[p.key] for p in points], e)
            except Exception as e:  # noqa: BLE001 - the group died: keep what finished, rerun the rest alone
                error = str(e) if isinstance(e, (TrainingError, ClusterTooSmall)) else traceback.format_exc()
                if len(points) == 1:
                    outcome = self._failed(points[0], run_ids[points[0].key], error or repr(e), start, e)
                    if progress is not None:
                        progress.end(outcome)
                    return [outcome]
                return self._after_group_failure(points, rounds, fit_group, tags, progress, run_ids, live,
                                                 error, start)
        self.links = group.links
        share = (time.monotonic() - start) / len(points)
        outcomes = []
        for p, result, error in zip(points, group.results, group.errors):
            if result is None:
                self.tracker.fail_point(run_ids[p.key], error or "no round finished")
                outcomes.append(Outcome(p, "failed", error=error or "no round finished", run_id=run_ids[p.key],
                                        seconds=share))
            else:
                outcomes.append(self._done(p, run_ids[p.key], result, share))
        if progress is not None:
            for outcome in outcomes:
                progress.end(outcome)
        return outcomes

    def _after_group_failure(self, points: list[Point], rounds: int, fit_group: Callable[..., Any],
                             tags: Callable[[Point], Mapping[str, Any]], progress: Optional[Progress],
                             run_ids: dict[str, str], live: "_GroupLive", error: str, start: float) -> list[Outcome]:
        kept = {i: live.finished(i) for i in range(len(points))}
        # A point whose failure reached the driver (agreed by every rank, or from the rank that ended the
        # group over it) failed as it would alone: recorded, not run again.
        failed = {i: live.errors[i] for i in range(len(points)) if i in live.errors}
        rest = [p for i, p in enumerate(points) if kept[i] is None and i not in failed]
        if progress is not None:
            progress.out(f"the worker group at {points[0].world_size} workers failed: {last_line(error)}; "
                         + (f"keeping {', '.join(p.key for i, p in enumerate(points) if kept[i])} (all rounds "
                            "finished) and " if any(kept.values()) else "")
                         + (f"recording {', '.join(points[i].key for i in failed)} failed and " if failed else "")
                         + (f"measuring {', '.join(p.key for p in rest)} in separate runs" if rest else "measuring nothing again"))
        share = (time.monotonic() - start) / len(points)
        outcomes: dict[str, Outcome] = {p.key: self._done(p, run_ids[p.key], kept[i], share)
                                        for i, p in enumerate(points) if kept[i] is not None}
        for i, text in failed.items():
            p = points[i]
            self.tracker.fail_point(run_ids[p.key], text)
            outcomes[p.key] = Outcome(p, "failed", error=text, run_id=run_ids[p.key], seconds=share)
        if progress is not None:
            for outcome in outcomes.values():
                progress.end(outcome)
        for p in rest:
            if progress is not None:
                progress.begin_group([p], rounds, len(rest))
            outcomes[p.key] = self.run_group([p], rounds, fit_group, tags, progress, run_ids)[0]
        return [outcomes[p.key] for p in points]

    def _killed(self, run_ids: list[str], interrupt: BaseException) -> None:
        """Ctrl-C (or a SystemExit) while these points ran: mark them KILLED and raise KeyboardInterrupt."""
        for run_id in run_ids:
            self.tracker.fail_point(run_id, f"interrupted ({type(interrupt).__name__}: Ctrl-C / SIGINT)",
                                    status="KILLED")
        raise KeyboardInterrupt from interrupt

    def _done(self, point: Point, run_id: str, result: RunResult, seconds: float) -> Outcome:
        outcome = Outcome(point, "done", result, run_id=run_id, seconds=seconds)
        self.tracker.finish_point(run_id, result, step=point.world_size)
        self.tracker.log_metrics(run_id, {"driver_seconds": outcome.seconds}, step=point.world_size)
        return outcome

    def _failed(self, point: Point, run_id: str, error: str, start: float, exc: BaseException) -> Outcome:
        status = "diverged" if self.kind == "search" and is_divergence(exc) else "failed"
        self.tracker.fail_point(run_id, error)
        return Outcome(point, status, error=error, run_id=run_id, seconds=time.monotonic() - start)

    def open_point(self, point: Point, tags: Mapping[str, Any]) -> str:
        c = point.cfg
        tags = {"strategy": c.parallel.strategy, "world_size": point.world_size, "series": point.series,
                "accelerator": c.parallel.accelerator_type or ("gpu" if c.parallel.use_gpu else "cpu"), **tags}
        run_id = self.tracker.start_point(point.key, point.key, point.config_hash, c.flatten(), tags)
        self._log_world_size(run_id, point)
        return run_id

    def _log_world_size(self, run_id: str, point: Point) -> None:
        """The point's chips as a number too (tags are text: 16 sorts before 8), from the start, so that a
        pivot over chips sorts and filters numerically, whatever became of the point."""
        self.tracker.log_metrics(run_id, {"world_size": point.world_size}, step=point.world_size)

    def record(self, outcome: Outcome, tags: Mapping[str, Any], figures: Mapping[str, Any] = {},
               params: Mapping[str, Any] = {}) -> None:
        """A child run for an outcome that ran elsewhere (a Tune trial): its params, figures and result."""
        run_id = self.tracker.start_point(f"{outcome.point.key} · {tags.get('setting', '')}".strip(" ·"),
                                          outcome.point.key, outcome.point.config_hash,
                                          {**outcome.point.cfg.flatten(), **params}, tags)
        outcome.run_id = run_id
        self._log_world_size(run_id, outcome.point)
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
    from rayvit.launch.torch_trainer import ensure_ray

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
