"""Ray Tune search: the fastest setting whose accuracy stays within a stated drop of the baseline.

:func:`run_search` does, in order:

1. :func:`~rayvit.studies.plan.plan_search` validates the ``search`` section against the run config, so an
   empty space, an unknown key or a constraint without a baseline fails before anything starts;
2. the screen (grid searches, ``search.screen``, :mod:`rayvit.studies.screen`) times every setting's
   training step on one trial device and decides the order trials run in and which are not trained;
3. the baseline (the reference setting) trains as a point of the study; its validation accuracy is what
   the constraint is measured from, its objective's interval what a trial must lie beyond (a rerun of
   the same search reuses it, and every finished trial, from MLflow);
4. every trial is a Tune function trainable that launches a multi-worker Ray Train run and judges itself
   (:mod:`rayvit.studies.trials`): grid settings best screened first, stopping once no remaining
   setting can win, or Optuna TPE; optional ASHA;
5. each trial is recorded in MLflow as a child run; the best feasible setting that beats the baseline
   beyond noise (else the baseline) is written as a config file that ``rayvit sweep --config`` runs.

SIGINT or SIGTERM stops the trials and raises :class:`SearchInterrupted` (no best config).
Every trial gets the same budget (``train.steps`` at ``train.batch_size``); the space may only hold keys
that change how the work is done (:data:`~rayvit.studies.plan.SEARCHABLE_KEYS`), never how much.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import signal
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Optional

from ray import tune

from rayvit.config import Config, Study, rayvit_home
from rayvit.launch import compat
from rayvit.launch.compat import PlacementGroupReleaser
from rayvit.record import plots, tracking
from rayvit.record.tables import Column, cell, fmt, format_table, times, write_parquet
from rayvit.results import RunResult
from rayvit.studies import screen, trials
from rayvit.studies.judge import (BaselineFailed, SearchInterrupted, Verdict, best_outcome, judge, last_line,
                                  speedup, versus_baseline)
from rayvit.studies.plan import Point, SearchPlan, plan_search, setting_label
from rayvit.studies.runner import Outcome, Progress, Report, StudyRun, attach_ray, print_where, with_interval
from rayvit.studies.screen import ScreenReport

# Trial drivers ask for a sliver of the head node's marker resource: they do no training, so they need
# no CPU, and the head node is the one least likely to be preempted (the Ray Train + Tune guide
# recommends keeping Train driver processes off the worker nodes).
HEAD_NODE_RESOURCE = compat.HEAD_NODE_RESOURCE
DEFAULT_EXPERIMENT = "rayvit-search"


@dataclasses.dataclass
class SearchReport(Report):
    """A search's report: the baseline, the best feasible outcome and the config written for it."""

    baseline: Optional[Outcome] = None
    best: Optional[Outcome] = None
    best_config_path: Optional[Path] = None
    objective: str = "tflops_per_chip"
    mode: str = "max"
    released_placement_groups: int = 0
    screen: Optional[ScreenReport] = None
    not_trained: dict[str, str] = dataclasses.field(default_factory=dict)   # label -> why (screen, stop rule)
    saved_seconds: float = 0.0
    saved_device_hours: float = 0.0


def default_search_name() -> str:
    return f"search-{datetime.now().strftime('%Y%m%d-%H%M%S')}"


def _record(run: StudyRun, o: Outcome, role: str) -> None:
    """The outcome's verdict as tags and figures; a child run of its own for trials (kind ``point``, so
    a rerun of the search finds its finished trials)."""
    tags = {"rayvit.role": role, "rayvit.trial": o.point.key, "setting": setting_label(o.point.setting),
            "feasible": str(o.verdict.feasible).lower(), "reason": o.verdict.reason[:500], "status": o.status}
    if o.verdict.beats_baseline is not None:
        tags["beats_baseline"] = str(o.verdict.beats_baseline).lower()
    figures = {"objective": o.verdict.objective, "accuracy_drop": o.verdict.accuracy_drop, "trial_seconds": o.seconds}
    if role == "baseline":
        run.tracker.set_tags(o.run_id, tags)
        run.tracker.log_metrics(o.run_id, figures, step=0)
        return
    tags.update({"strategy": o.point.cfg.parallel.strategy, "world_size": o.point.world_size})
    run.record(o, tags, figures, params={f"trial.{k}": v for k, v in o.point.setting.items()})
    if o.status == "interrupted":
        # Stopped by the user, not broken: MLflow's KILLED, as an interrupted sweep point.
        run.tracker.client.set_terminated(o.run_id, status="KILLED")


def progress_line(o: Outcome, plan: SearchPlan, baseline: Outcome) -> str:
    v, s = o.verdict, plan.study.search
    figures = ""
    if o.result is not None:
        figures = (f"; {s.objective} {with_interval(o.result.metrics, s.objective, '.4g')}, val accuracy "
                   f"{fmt(o.result.metrics.get('val_accuracy'), '.2%')}")
    took = "reused" if o.status == "reused" else f"in {o.seconds:.0f} s"
    return (f"[{o.point.key}/{plan.num_trials}] {setting_label(o.point.setting)}: "
            f"{'FEASIBLE' if v.feasible else o.status if o.status in ('interrupted',) else 'infeasible'} "
            f"{took}{figures}; {v.reason}")


def with_noise(o: Outcome, baseline: Outcome, objective: str, mode: str) -> Outcome:
    """``o`` with its verdict's noise-aware comparison against the baseline (feasible trials only)."""
    if o.verdict is None or not o.verdict.feasible or o is baseline:
        return o
    beats, text = versus_baseline(o.result, baseline.result, objective, mode)
    o.verdict = dataclasses.replace(o.verdict, beats_baseline=beats, reason=f"{o.verdict.reason}; {text}")
    return o


# --------------------------------------------------------------------------------------------------
# Running a search


def concurrency(cfgs: list[Config], requested: int) -> int:
    """Trials at once: ``requested``, else as many as the cluster's CPUs/GPUs hold side by side."""
    if requested:
        return requested
    import ray

    from rayvit.launch.resources import resources_for

    cluster = ray.cluster_resources()
    need: dict[str, float] = {}
    for cfg in cfgs:
        for key, value in resources_for(cfg).items():
            need[key] = max(need.get(key, 0.0), value)
    fits = [int(cluster.get(k, 0.0) // v) for k, v in need.items() if v > 0]
    return max(1, min(fits) if fits else 1)


def run_search(study: Study, *, experiment: Optional[str] = None, output: Optional[str | Path] = None,
               address: Optional[str] = None, out: Callable[[str], None] = print,
               ray_log: Optional[str] = None) -> SearchReport:
    """Run (or resume) the search ``study.search`` describes; see the module docstring for the steps.

    Raises ``ConfigError`` (``StorageError`` among them), ``TrackingError``, ``ConnectError`` or
    ``ClusterTooSmall`` before anything trains, ``BaselineFailed`` if the baseline cannot give a
    reference accuracy, and :class:`SearchInterrupted` on SIGINT/SIGTERM (trials stopped, no best config).
    """
    from rayvit.launch import capacity
    from rayvit.launch.connect import check_cluster
    from rayvit.launch.storage import check_storage
    from rayvit.launch.trainer import check_cluster_fits, fit

    start = time.monotonic()
    name = study.search.name or default_search_name()
    study = study.replace({"search.name": name})
    plan, s = plan_search(study), study.search
    experiment = experiment or study.tracking.experiment or DEFAULT_EXPERIMENT
    check_cluster(address)        # the cluster's address first: a probe, no Ray yet
    run = StudyRun(study, name, experiment, kind="search")
    _adopt_parent(run)
    attach_ray(address, name, ray_log, out)
    trial_cfgs = [plan.baseline.cfg] + [plan.trial(0, "", o).cfg for o in plan.settings]
    check_cluster_fits(trial_cfgs)
    check_storage(trial_cfgs)
    parallel = concurrency(trial_cfgs, s.max_concurrent_trials)
    parent = run.start({tracking.TAG_KIND: "search", "objective": s.objective, "algorithm": s.algorithm,
                        "max_accuracy_drop": s.max_accuracy_drop, "asha": s.asha, "space": json.dumps(plan.space),
                        "baseline": json.dumps(plan.baseline.setting), "data": study.run.data.name,
                        "screen": s.screen})
    screening = s.screen and s.algorithm == "grid"
    out(f"search {name!r}: {plan.num_trials} setting(s) by {s.algorithm}{' + ASHA' if s.asha else ''}"
        f"{', screened first' if screening else ''}, objective {s.objective} ({plan.mode}), at most "
        f"{s.max_accuracy_drop * 100:.1f} accuracy points below the baseline; up to {parallel} trial(s) at once")
    if s.screen and not screening:
        out("screen: off for search.algorithm=optuna (the sampler chooses what to train)")
    out(f"tracking: {run.uri}, experiment {experiment!r}, parent run {parent}")
    out(f"resume with: --name {name}")
    live: dict[str, Any] = {"out": out, "plan": plan, "started": {}, "outcomes": {}, "skipped": {},
                            "screened": {}, "interrupted": None, "run": run}
    trials.LIVE[name] = live
    with _Signals(live) as signals:
        try:
            screened = _screen(plan, out) if screening else None
            baseline = _baseline(run, plan, capacity.waiting(_with_intervals(fit), out), out)
            live["baseline"] = baseline
            reused = _reused(run, plan, baseline, out)
            # Trials start on whatever is up: hold the cluster at the largest trial's size while they run.
            with capacity.capacity_for(capacity.largest(trial_cfgs), out):
                signals.tune = True
                grid, released = _trials(run, plan, baseline, parallel, screened, reused, out)
                signals.tune = False
        except KeyboardInterrupt:
            _interrupted(run, plan, live, signals.signum)
        except (BaselineFailed, capacity.ClusterTooSmall) as e:
            run.tracker.set_parent_tags({"rayvit.error": str(e)[:500]})
            run.tracker.end("FAILED")
            trials.LIVE.pop(name, None)
            raise
        if live["interrupted"]:
            _interrupted(run, plan, live, signals.signum)
    return _finish(run, plan, baseline, grid, reused, screened, released, output, time.monotonic() - start)


def _adopt_parent(run: StudyRun) -> None:
    """An earlier run of this search (its parent run is tagged kind ``search``, which the sweep's lookup
    does not find): reopen it, so its baseline and finished trials are reused."""
    from rayvit.record.tracking import TAG_KIND, TAG_SWEEP

    t = run.tracker
    if t.parent_id is not None:
        return
    found = t.client.search_runs([t.experiment_id], f"tags.`{TAG_SWEEP}` = '{_escaped(run.name)}' and tags.`{TAG_KIND}` = 'search'",
                                 order_by=["attributes.start_time ASC"], max_results=1)
    if found:
        t.parent_id, t.resumed = found[0].info.run_id, True
        run.done = t.completed()


def _escaped(value: str) -> str:
    """``value`` inside single quotes of an MLflow filter string."""
    return value.replace("\\", "\\\\").replace("'", "\\'")


def _with_intervals(fit):
    """``fit`` whose result carries 95% intervals over blocks of its timed steps (one round)."""
    def fit_with_intervals(cfg, **kwargs):
        return RunResult.of_rounds([fit(cfg, **kwargs)])
    return fit_with_intervals


class _Signals:
    """SIGINT and SIGTERM during a search: stop the trials, then say so (:class:`SearchInterrupted`).

    While Tune runs the trials, the first signal only raises the search's interrupt flag: the
    :class:`~rayvit.studies.trials.InterruptStop` stopper ends every trial's Ray Train run and ``fit()``
    returns. Elsewhere (the screen, the baseline), and on a second signal, it raises
    ``KeyboardInterrupt`` at once. Tune's own SIGINT handler (which prints a ``Tuner.restore`` hint and
    lets the search carry on to a "best" config) is kept off for the search.
    """

    def __init__(self, live: dict[str, Any]):
        self.live, self.signum, self.tune, self.saved = live, None, False, {}

    def __enter__(self) -> "_Signals":
        self._env = os.environ.get("TUNE_DISABLE_SIGINT_HANDLER")
        os.environ["TUNE_DISABLE_SIGINT_HANDLER"] = "1"
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self.saved[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        first = self.signum is None
        self.signum = self.signum or signum
        if first and self.tune:
            self.live["interrupted"] = signal.Signals(signum).name
            self.live["out"](f"{signal.Signals(signum).name}: stopping the running trials ...")
            return
        raise KeyboardInterrupt

    def __exit__(self, *exc) -> bool:
        for sig, handler in self.saved.items():
            signal.signal(sig, handler)
        if self._env is None:
            os.environ.pop("TUNE_DISABLE_SIGINT_HANDLER", None)
        else:
            os.environ["TUNE_DISABLE_SIGINT_HANDLER"] = self._env
        return False


def _interrupted(run: StudyRun, plan: SearchPlan, live: dict[str, Any], signum: Optional[int]) -> None:
    """Record what the interrupt left (running trials KILLED, the parent KILLED) and raise SearchInterrupted."""
    live["interrupted"] = live["interrupted"] or "SIGINT"
    out = live["out"]
    done = [o for o in live["outcomes"].values() if o.status in ("done", "reused")]
    try:
        run.interrupted("trials" if "baseline" in live else "baseline")
    except Exception as e:  # noqa: BLE001 - the message below matters more than the record
        out(f"warning: could not mark the search KILLED in MLflow: {e}")
    trials.LIVE.pop(run.name, None)
    skipped = len(live["skipped"])
    raise SearchInterrupted(
        f"interrupted after {len(done)} of {plan.num_trials} trials"
        + (f" ({skipped} not trained by the screen)" if skipped else "")
        + f"; no best config written; resume with --name {run.name}", signum or signal.SIGINT)


def _screen(plan: SearchPlan, out: Callable[[str], None]) -> screen.ScreenReport:
    """Time every setting's step on one trial device and decide what to train (:mod:`rayvit.studies.screen`)."""
    s = plan.study.search
    points = plan.candidates()
    cfgs = [plan.baseline.cfg] + [p.cfg for p in points]
    out(f"screen: timing the baseline and {len(points)} setting(s), a few steps each in one process ...")
    started = time.monotonic()
    measured = screen.measure(cfgs, s.screen_steps, s.screen_seconds)
    entries = screen.from_measurement(["baseline"] + [p.key for p in points],
                                      [plan.baseline.setting] + [p.setting for p in points], cfgs, measured)
    report = screen.screen(entries[0], entries[1:], s.objective, device=measured["device"],
                           native_bf16=measured["native_bf16"],
                           profile=screen.profile_for(measured["device"], plan.base.parallel.use_gpu),
                           seconds=time.monotonic() - started)
    bf16 = {True: ", native bf16", False: ", no native bf16"}.get(report.native_bf16, "")
    out(f"screen: {len(cfgs)} settings in {report.seconds:.0f} s on {report.device}{bf16}; "
        f"baseline {screen_figure(report.baseline, s.objective)}; "
        f"{len(report.order)} to train, best screened first, {len(report.screened_out)} screened out")
    for c in sorted(report.candidates, key=lambda c: -(c.ratio.median if c.ratio else 0.0)):
        out(f"  {c.label} {setting_label(c.setting):<40} {c.decision:<12} "
            f"{c.ratio.text('.2f', 'x') if c.ratio else '-':<20} {c.reason if not c.trained else ''}".rstrip())
    return report


def screen_figure(c: screen.Screened, objective: str) -> str:
    return f"{objective} {c.objective.text('.4g')}" if c.objective else f"not screened ({c.error})"


def _baseline(run: StudyRun, plan: SearchPlan, fit, out: Callable[[str], None]) -> Outcome:
    """The reference run: reused from an earlier run of this search when its settings are unchanged."""
    point, s = plan.baseline, plan.study.search
    o = run.reusable(point)
    if o is None:
        out(f"[baseline] training {setting_label(point.setting)} for {point.cfg.train.steps} steps")
        o = run.run_point(point, fit, {"rayvit.trial": "baseline", "rayvit.role": "baseline"},
                          progress=Progress(1, out))
    accuracy = o.result.metrics.get("val_accuracy") if o.result else None
    accuracy_ok = isinstance(accuracy, (int, float)) and math.isfinite(accuracy)
    o.verdict = judge(o.status, o.result, accuracy if accuracy_ok else math.nan, s, error=o.error)
    _record(run, o, role="baseline")
    if not accuracy_ok or not o.verdict.feasible:
        raise BaselineFailed(f"the baseline ({setting_label(point.setting)}) gave no reference accuracy: "
                             f"{o.verdict.reason}")
    run.tracker.log_metrics(run.parent_id, {"baseline_val_accuracy": accuracy,
                                            f"baseline_{s.objective}": o.verdict.objective}, step=0)
    out(f"[baseline] {o.status}{'' if o.status == 'reused' else f' in {o.seconds:.0f} s'}: val accuracy "
        f"{accuracy:.2%}, {s.objective} {with_interval(o.result.metrics, s.objective, '.4g')}")
    return o


def _reused(run: StudyRun, plan: SearchPlan, baseline: Outcome, out: Callable[[str], None]) -> dict[str, Outcome]:
    """Trials an earlier run of this search finished with the same settings (grid searches)."""
    if plan.study.search.algorithm != "grid":
        return {}
    reused = {}
    for point in plan.candidates():
        o = run.reusable(point)
        if o is None:
            continue
        o.verdict = judge("reused", o.result, baseline.result.metrics["val_accuracy"], plan.study.search)
        o = with_noise(o, baseline, plan.study.search.objective, plan.mode)
        reused[point.key] = o
        out(progress_line(o, plan, baseline))
    return reused


def tune_storage(cfg: Config) -> str:
    """Where Tune keeps its experiments: beside Ray Train's runs (``launch.storage`` on clusters)."""
    from rayvit.launch.storage import storage_path

    base = storage_path(cfg)
    return base.rstrip("/") + "_tune" if "://" in base else str(Path(base).parent / "tune_results")


@contextlib.contextmanager
def _tune_output_off():
    """Tune silent: rayvit prints each trial's lines itself.

    Ray 2.60's new Tune output engine prints its "Configuration for experiment" box and a TensorBoard
    hint even at ``verbose=0`` (``tune.run`` calls ``experiment_started`` whatever the verbosity); the
    legacy engine, chosen by Ray's documented ``RAY_AIR_NEW_OUTPUT=0``, honours ``verbose=0``. Set for
    the driver's ``fit()`` only, then restored.
    """
    saved = os.environ.get("RAY_AIR_NEW_OUTPUT")
    os.environ["RAY_AIR_NEW_OUTPUT"] = "0"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("RAY_AIR_NEW_OUTPUT", None)
        else:
            os.environ["RAY_AIR_NEW_OUTPUT"] = saved


class _TrialProgress:
    """The driver's live view of running trials: rank 0's step figures, labelled by trial, as lines."""

    def __init__(self, plan: SearchPlan, out: Callable[[str], None]):
        self.plan, self.progress, self.shown = plan, Progress(plan.num_trials, out), {}

    def __call__(self, item: dict) -> None:
        label = item.get("trial")
        if label is None or item.get("kind", "step") != "step":
            return
        if label not in self.shown:
            self.progress._printed = 0.0           # each trial's first step is always shown
            index = int(label[1:]) if label[1:].isdigit() else 0
            point = Point(0, label, label, self.plan.base.parallel.num_workers, self.plan.base, {})
            self.shown[label] = self.progress.live(point)
        self.shown[label](item)


def _trials(run: StudyRun, plan: SearchPlan, baseline: Outcome, parallel: int,
            screened: Optional[screen.ScreenReport], reused: dict[str, Outcome], out):
    """The trials not reused, through Tune: in screened order with the screen's stop rule (grid), or Optuna."""
    from rayvit.launch.progress import ProgressChannel

    s, study, live = plan.study.search, plan.study, trials.LIVE[run.name]
    live["outcomes"].update(reused)

    def finish(o: Outcome) -> None:
        o = with_noise(o, baseline, s.objective, plan.mode)
        try:
            _record(run, o, role="trial")
        except Exception as e:  # noqa: BLE001 - a tracking hiccup must not lose the search
            out(f"warning: could not record trial {o.point.key} in MLflow: {e}")
        out(progress_line(o, plan, baseline))
    live["finish"] = finish
    releaser = PlacementGroupReleaser()
    channel = ProgressChannel(_TrialProgress(plan, out))
    trainable = tune.with_resources(
        tune.with_parameters(trials.trial_trainable, base=study.run.to_dict(), search=dataclasses.asdict(s),
                             search_name=run.name, baseline_accuracy=baseline.result.metrics["val_accuracy"],
                             board=channel.board),
        {"CPU": 0, HEAD_NODE_RESOURCE: 0.001})
    entries = _entries(plan, screened, reused, live)
    if s.algorithm == "grid" and not entries:
        with channel:
            pass
        return [], 0
    # A fresh Tune experiment per attempt: finished trials come back from MLflow, not Tune's state.
    tune_name = f"{run.name}-{datetime.now().strftime('%H%M%S')}"
    tuner = _new_tuner(plan, trainable, parallel, [releaser, trials.TrialRecorder(run.name)], tune_name,
                       study.run, entries, baseline, reused)
    with channel, _tune_output_off():
        grid = tuner.fit()
    # The last trial's controller may still be dying: leave the cluster as we found it.
    releaser.drain()
    return trials.grid_outcomes(plan, grid, live), len(releaser.released)


def _entries(plan: SearchPlan, screened: Optional[screen.ScreenReport], reused: dict[str, Outcome],
             live: dict[str, Any]) -> list[trials.Entry]:
    """The grid's settings to hand Tune, in order: screened (best first) or grid order; reused ones left out."""
    if plan.study.search.algorithm != "grid":
        return []
    if screened is None:
        return [trials.Entry(p.key, dict(p.setting)) for p in plan.candidates() if p.key not in reused]
    for c in screened.screened_out:
        live["skipped"][c.label] = c.reason if c.reason.startswith("screened") else "screened out: " + c.reason
    entries = []
    for c in screened.order:
        if c.label in reused:
            continue
        live["screened"][c.label] = f" (screened {c.ratio.text('.2f', 'x')} the baseline)" if c.ratio else ""
        entries.append(trials.Entry(c.label, dict(c.setting), c.ratio.median if c.ratio else None,
                                    c.ratio.hi if c.ratio else None, c.ratio.text(".2f", "x") if c.ratio else ""))
    return entries


def _new_tuner(plan: SearchPlan, trainable, parallel: int, callbacks: list, name: str, cfg: Config,
               entries: list[trials.Entry], baseline: Outcome, reused: dict[str, Outcome]):
    s = plan.study.search
    if s.algorithm == "grid":
        finished = {k: (speedup(o.verdict.objective, baseline.verdict.objective, plan.mode)
                        if o.verdict.feasible else None) for k, o in reused.items()}
        search_alg = trials.ScreenedOrder(plan.study.search.name, entries, baseline.verdict.objective, plan.mode,
                                          prune=s.screen and s.objective != "time_to_accuracy", finished=finished)
        param_space, samples = {}, len(entries)
    else:
        param_space = {k: tune.choice(v) for k, v in plan.space.items()}
        search_alg, samples = trials.optuna_searcher(s, cfg.train.seed, plan.mode), s.num_samples
    # The workers' intermediate reports carry loss, not the objective (it exists only once the run is
    # measured); Tune would otherwise reject them. Read at each result, in this process.
    os.environ["TUNE_DISABLE_STRICT_METRIC_CHECKING"] = "1"
    scheduler = None
    if s.asha:
        from ray.tune.schedulers import ASHAScheduler

        # max_t above the last step: the budget's end is never a reason to stop a trial (that would cut
        # off its final report); rungs fall at grace x factor^k steps.
        grace = s.asha_grace_steps or max(1, cfg.train.steps // 4)
        scheduler = ASHAScheduler(time_attr="step", metric="loss", mode="min", max_t=cfg.train.steps + 1,
                                  grace_period=min(grace, cfg.train.steps), reduction_factor=s.asha_reduction_factor)
    return tune.Tuner(
        trainable, param_space=param_space,
        tune_config=tune.TuneConfig(search_alg=search_alg, scheduler=scheduler, num_samples=samples,
                                    max_concurrent_trials=parallel, reuse_actors=False),
        run_config=tune.RunConfig(name=name, storage_path=tune_storage(cfg), verbose=0, callbacks=callbacks,
                                  stop=trials.InterruptStop(plan.study.search.name)))


def _finish(run: StudyRun, plan: SearchPlan, baseline: Outcome, trained: list[Outcome], reused: dict[str, Outcome],
            screened: Optional[screen.ScreenReport], released: int, output: Optional[str | Path],
            seconds: float) -> SearchReport:
    """The table, the best feasible setting beyond noise, what the screen saved, the parent run's records."""
    live = trials.LIVE.pop(run.name)
    s = plan.study.search
    by_label = {**reused, **{o.point.key: o for o in trained}}
    outcomes = sorted(by_label.values(), key=lambda o: o.point.key)
    best = best_outcome([baseline] + outcomes, plan.mode, beyond_noise=True) or baseline
    not_trained = dict(live["skipped"])
    report = SearchReport(run.name, "search", run.experiment, run.uri, run.parent_id, outcomes, [],
                          seconds=seconds, baseline=baseline, best=best, objective=s.objective, mode=plan.mode,
                          released_placement_groups=released, screen=screened, not_trained=not_trained)
    if screened is not None and not_trained:
        skipped = [c for c in screened.candidates if c.label in not_trained]
        report.saved_seconds, report.saved_device_hours = screen.saved_estimate(
            skipped, screened.baseline, baseline.seconds if baseline.status == "done" else 0.0,
            plan.base.train.steps, plan.base.parallel.num_workers)
    report.rows = sort_rows(rows_of(outcomes, baseline, plan.mode, screened, not_trained), plan.mode)
    report.best_config_path = write_best_config(
        plan.study.run if best is baseline else best.point.cfg, _best_path(output, run.name),
        _best_header(report, s.max_accuracy_drop))
    _log_parent_results(run, report)
    return report


def _best_path(output: Optional[str | Path], name: str) -> Path:
    return Path(output) if output else rayvit_home() / "searches" / name / "best_config.yaml"


def _best_header(report: SearchReport, max_drop: float) -> list[str]:
    best, base = report.best, report.baseline
    gain = speedup(best.verdict.objective, base.verdict.objective, report.mode)
    return [
        f"Best feasible setting of rayvit search {report.name!r} (MLflow experiment {report.experiment!r}, "
        f"parent run {report.parent_run_id}).",
        f"Setting: {setting_label(best.point.setting)} ({best.point.key}); {report.objective} = "
        f"{fmt(best.verdict.objective, '.4g')}, {fmt(gain, '.2f')}x the baseline's.",
        f"Validation accuracy {fmt(best.result.metrics.get('val_accuracy'), '.2%')} against the baseline's "
        f"{base.result.metrics['val_accuracy']:.2%} (allowed drop: {max_drop * 100:.1f} points).",
        "Run it: rayvit sweep --config <this file>"]


# --------------------------------------------------------------------------------------------------
# Rows, the table, the best config


def rows_of(outcomes: list[Outcome], baseline: Outcome, mode: str, screened: Optional[screen.ScreenReport] = None,
            not_trained: Optional[dict[str, str]] = None) -> list[dict[str, Any]]:
    """One flat row per setting (baseline first): setting, status, verdict, objective, speedup, screen,
    conditions, figures; settings the screen kept from training are rows too, with why."""
    rows = []
    screens = {c.label: c for c in screened.candidates} if screened is not None else {}
    for o in [baseline] + [o for o in outcomes if o is not baseline]:
        v = o.verdict
        row: dict[str, Any] = {"trial": o.point.key, "setting": setting_label(o.point.setting), "status": o.status,
                               "feasible": v.feasible, "beats_baseline": v.beats_baseline, "reason": v.reason,
                               "objective": v.objective,
                               "speedup_vs_baseline": speedup(v.objective, baseline.verdict.objective, mode),
                               "accuracy_drop": v.accuracy_drop, "run_id": o.run_id,
                               "seconds": round(o.seconds, 1), "error": o.error}
        row.update(_screen_cells(screens.get(o.point.key)))
        row.update({f"set.{k}": val for k, val in o.point.setting.items()})
        if o.result is not None:
            row.update(o.result.row())
        rows.append(row)
    for label, why in (not_trained or {}).items():
        c = screens.get(label)
        if c is None:
            continue
        row = {"trial": label, "setting": setting_label(c.setting), "status": "not trained", "feasible": False,
               "beats_baseline": None, "reason": why, "objective": None, "speedup_vs_baseline": None,
               "accuracy_drop": None, "run_id": None, "seconds": 0.0, "error": None, **_screen_cells(c)}
        row.update({f"set.{k}": val for k, val in c.setting.items()})
        rows.append(row)
    return rows


def _screen_cells(c: Optional[screen.Screened]) -> dict[str, Any]:
    if c is None or c.ratio is None:
        return {"screened_ratio": None, "screened_ratio_lo": None, "screened_ratio_hi": None}
    return {"screened_ratio": c.ratio.median, "screened_ratio_lo": c.ratio.lo, "screened_ratio_hi": c.ratio.hi}


def sort_rows(rows: list[dict[str, Any]], mode: str) -> list[dict[str, Any]]:
    """Baseline first, then the best objective first; settings without one by their screened ratio."""
    sign = -1.0 if mode == "max" else 1.0
    return sorted(rows, key=lambda r: (r["trial"] != "baseline", r["objective"] is None,
                                       sign * (r["objective"] or 0.0), -(r.get("screened_ratio") or 0.0)))


def search_columns(objective: str, best: Optional[str]) -> list[Column]:
    spec = ".4g" if objective != "time_to_accuracy" else ".1f"

    def verdict(r: dict[str, Any]) -> str:
        if r["status"] == "not trained":
            return "not trained"
        if r["trial"] == "baseline":
            return "baseline"
        if not r["feasible"]:
            return "interrupted" if r["status"] == "interrupted" else "infeasible"
        if r.get("beats_baseline"):
            return "beats baseline"
        return "below baseline" if "below the baseline" in (r["reason"] or "") else "within noise"

    return [
        ("", lambda r: "*" if r["trial"] == best else ""), ("trial", cell("trial")), ("setting", cell("setting")),
        ("screened", lambda r: times(r.get("screened_ratio"))),
        (objective, cell("objective", spec)), ("vs base", lambda r: times(r["speedup_vs_baseline"])),
        ("val acc", cell("val_accuracy", ".2%")), ("drop pts", cell("accuracy_drop", "+.1f", scale=0.01)),
        ("verdict", verdict), ("reason", lambda r: _short_reason(r["reason"])),
    ]


def _short_reason(reason: str) -> str:
    """The table's reason: up to the interval detail (the trial's line and MLflow keep the whole text)."""
    reason = reason or ""
    return reason.split(": ", 1)[0] if "95% intervals" in reason else reason


def search_table(rows: list[dict[str, Any]], objective: str, best: Optional[str] = None) -> str:
    """Every setting, baseline first then by objective, with its screen, verdict and why; ``*`` marks the best."""
    return format_table(rows, search_columns(objective, best))


def write_best_config(cfg: Config, path: str | Path, header: list[str]) -> Path:
    """Write ``cfg`` as YAML that ``load_config`` (and ``rayvit sweep --config``) reads back."""
    from rayvit.config import load_config

    path = Path(path).expanduser().resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"# {line}\n" for line in header) + cfg.to_yaml())
    load_config(path)   # what we write must load
    return path


def _log_parent_results(run: StudyRun, report: SearchReport) -> None:
    """On the parent run: the trials table (parquet + text), the accuracy-vs-throughput plot, the best config."""
    best, base = report.best, report.baseline
    s = run.study.search
    run.tracker.log_metrics(report.parent_run_id, {
        f"best_{s.objective}": best.verdict.objective,
        "best_speedup_vs_baseline": speedup(best.verdict.objective, base.verdict.objective, report.mode),
        "best_val_accuracy": best.result.metrics.get("val_accuracy"), "search_seconds": report.seconds}, step=0)
    with tempfile.TemporaryDirectory() as tmp:
        table = Path(tmp) / "search_trials.txt"
        table.write_text(search_table(report.rows, s.objective, best.point.key) + "\n")
        files = [write_parquet(report.rows, Path(tmp) / "search_trials.parquet"), table]
        files.append(plots.search_figure(
            report.rows, Path(tmp) / "accuracy_vs_throughput.png", objective=s.objective,
            baseline_accuracy=base.result.metrics["val_accuracy"], max_accuracy_drop=s.max_accuracy_drop,
            best=best.point.key, title=f"{report.name}: accuracy against {s.objective}"))
        best_copy = Path(tmp) / "best_config.yaml"
        best_copy.write_text(report.best_config_path.read_text())
        files.append(best_copy)
        report.artifacts = run.finish(files, {
            "best_trial": best.point.key, "best_setting": setting_label(best.point.setting),
            "trials": len(report.outcomes), "feasible_trials": sum(o.verdict.feasible for o in report.outcomes),
            "released_placement_groups": report.released_placement_groups}, failed=bool(report.failed))


def print_summary(report: SearchReport, out: Callable[[str], None] = print) -> None:
    """The table of every setting, the best one and its speedup, what the screen saved, where it all went."""
    best, base = report.best, report.baseline
    out("")
    out(search_table(report.rows, report.objective, best.point.key))
    gain = speedup(best.verdict.objective, base.verdict.objective, report.mode)
    feasible = sum(o.verdict.feasible for o in report.outcomes)
    trained = sum(o.status != "reused" for o in report.outcomes)
    out(f"\n{len(report.outcomes)} trial(s) ({trained} trained now), {feasible} feasible, "
        f"{len(report.not_trained)} not trained, in {report.seconds:.0f} s.")
    if report.screen is not None:
        sc = report.screen
        out(f"The screen ({sc.seconds:.0f} s on {sc.device}) kept {len(report.not_trained)} of "
            f"{len(sc.candidates)} settings from training: about {report.saved_seconds / 60:.1f} min of trials, "
            f"{report.saved_device_hours:.3g} device-hours at {base.point.world_size} "
            f"{'GPU' if base.point.cfg.parallel.use_gpu else 'worker'}(s) per trial.")
    if best is base:
        noisy = [o for o in report.outcomes if o.verdict.feasible and o.verdict.beats_baseline is False
                 and (speedup(o.verdict.objective, base.verdict.objective, report.mode) or 0) > 1]
        out("No trial beat the baseline beyond noise within the accuracy budget: the best config is the baseline's"
            + (f" ({', '.join(f'{o.point.key} {speedup(o.verdict.objective, base.verdict.objective, report.mode):.2f}x' for o in noisy)}"
               " within noise of it)." if noisy else "."))
    else:
        out(f"Best: {best.point.key} ({setting_label(best.point.setting)}), {fmt(gain, '.2f')}x the baseline's "
            f"{report.objective}, beyond noise; {best.verdict.reason.split('; ', 1)[-1]}")
    for o in report.failed:
        out(f"ERROR {o.point.key} ({setting_label(o.point.setting)}): {last_line(o.error or '')}")
    out(f"best config: {report.best_config_path}")
    out(f"  run it:  rayvit sweep --config {report.best_config_path}")
    print_where(report, out)


__all__ = ["BaselineFailed", "SearchInterrupted", "SearchReport", "Verdict", "run_search", "print_summary",
           "search_table", "write_best_config"]
