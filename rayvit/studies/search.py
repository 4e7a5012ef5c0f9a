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

import dataclasses
import json
import math
import os
import signal
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Optional

from ray import tune

from rayvit import process_state
from rayvit.config import Config, Study
from rayvit.launch import compat
from rayvit.record import tracking
from rayvit.record.tables import fmt
from rayvit.studies import screen, trials
from rayvit.studies.judge import BaselineFailed, SearchInterrupted, Verdict, best_outcome, judge, versus_baseline
from rayvit.studies.plan import SearchPlan, plan_search, setting_label
from rayvit.studies.runner import Outcome, Progress, StudyRun, attach_ray, with_interval
from rayvit.studies.search_report import (SearchReport, _best_header, _best_path, _log_parent_results,
                                          print_summary, screen_figure, search_table, sort_rows, trial_rows,
                                          write_best_config)

# What callers import from here: running a search, and what it reports and raises.
__all__ = ["BaselineFailed", "SearchInterrupted", "SearchReport", "Verdict", "print_summary", "run_search",
           "search_table", "write_best_config"]

# Trial drivers ask for a sliver of the head node's marker resource: they do no training, so they need
# no CPU, and the head node is the one least likely to be preempted (the Ray Train + Tune guide
# recommends keeping Train driver processes off the worker nodes).
HEAD_NODE_RESOURCE = compat.HEAD_NODE_RESOURCE
DEFAULT_EXPERIMENT = "rayvit-search"


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


@process_state.keeps_process_state
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
            baseline = _baseline(run, plan, capacity.waiting(fit, out), out)
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
    from rayvit.record.views import TAG_KIND, TAG_SWEEP, quote

    t = run.tracker
    if t.parent_id is not None:
        return
    found = t.client.search_runs([t.experiment_id], f"tags.`{TAG_SWEEP}` = {quote(run.name)} and tags.`{TAG_KIND}` = 'search'",
                                 order_by=["attributes.start_time ASC"], max_results=1)
    if found:
        t.parent_id, t.resumed = found[0].info.run_id, True
        run.done = t.completed()


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
    releaser = trials.PlacementGroupReleaser()
    channel = ProgressChannel(trials.TrialProgress(plan, out))
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
    tuner = trials.new_tuner(plan, trainable, parallel, [releaser, trials.TrialRecorder(run.name)], tune_name,
                       study.run, entries, baseline, reused)
    with channel, trials.tune_environment():
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
    report.rows = sort_rows(trial_rows(outcomes, baseline, plan.mode, screened, not_trained), plan.mode)
    report.best_config_path = write_best_config(
        plan.study.run if best is baseline else best.point.cfg, _best_path(output, run.name),
        _best_header(report, s.max_accuracy_drop))
    _log_parent_results(run, report)
    return report


