"""Running a search: the checks, the screen, the baseline, the trials through Tune, the report.

The steps are those of :mod:`rayvit.studies.search`; this module keeps their order and what happens
when one fails or a signal arrives. What the search knows while it runs is its
:class:`~rayvit.studies.search.search_session.SearchSession`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import signal
import time
from datetime import datetime
from pathlib import Path
from typing import Callable, Optional

from ray import tune

from rayvit import process_state
from rayvit.config_schema import Config, Study
from rayvit.launch import compat
from rayvit.record import tracking
from rayvit.studies.outcome import Outcome
from rayvit.studies.plan import SearchPlan, plan_search, setting_label
from rayvit.studies.runner import Progress, StudyRun, attach_ray, with_interval
from rayvit.studies.search import screen, trials, tuner
from rayvit.studies.search.judge import BaselineFailed, SearchInterrupted, against_baseline, judge
from rayvit.studies.search.report import SearchReport, finish_report, progress_line, record_outcome
from rayvit.studies.search.search_session import SearchSession, Signals, registered

# Trial drivers ask for a sliver of the head node's marker resource: they do no training, so they need
# no CPU, and the head node is the one least likely to be preempted (the Ray Train + Tune guide
# recommends keeping Train driver processes off the worker nodes).
HEAD_NODE_RESOURCE = compat.HEAD_NODE_RESOURCE
DEFAULT_EXPERIMENT = "rayvit-search"


def default_search_name() -> str:
    return f"search-{datetime.now().strftime('%Y%m%d-%H%M%S')}"


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
    """Run (or resume) the search ``study.search`` describes; see :mod:`rayvit.studies.search` for the steps.

    Raises ``ConfigError`` (``StorageError`` among them), ``TrackingError``, ``ConnectError`` or
    ``ClusterTooSmall`` before anything trains, ``BaselineFailed`` if the baseline cannot give a
    reference accuracy, and :class:`SearchInterrupted` on SIGINT/SIGTERM (trials stopped, no best config).
    """
    from rayvit.launch.capacity import ClusterTooSmall

    start = time.monotonic()
    name = study.search.name or default_search_name()
    study = study.replace({"search.name": name})
    plan = plan_search(study)
    experiment = experiment or study.tracking.experiment or DEFAULT_EXPERIMENT
    run, trial_cfgs, parallel = _start(plan, experiment, address, out, ray_log)
    session = SearchSession(name, plan, out)
    with registered(session), Signals(session) as signals:
        try:
            _screen_baseline_trials(run, session, signals, trial_cfgs, parallel)
        except KeyboardInterrupt:
            _raise_interrupted(run, session, signals.signum)
        except (BaselineFailed, ClusterTooSmall) as e:
            run.tracker.set_parent_tags({"rayvit.error": str(e)[:500]})
            run.tracker.end("FAILED")
            raise
        if session.interrupted:
            _raise_interrupted(run, session, signals.signum)
    return finish_report(run, session, output, time.monotonic() - start)


def _start(plan: SearchPlan, experiment: str, address: Optional[str], out: Callable[[str], None],
           ray_log: Optional[str]) -> tuple[StudyRun, list[Config], int]:
    """Every check before anything trains, the search's parent run and its first lines; returns the run
    record, every trial's config (the baseline's first) and how many trials run at once."""
    from rayvit.launch.connect import check_cluster
    from rayvit.launch.storage import check_storage
    from rayvit.launch.torch_trainer import check_cluster_fits

    study, s, name = plan.study, plan.study.search, plan.study.search.name
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
    return run, trial_cfgs, parallel


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


def _screen_baseline_trials(run: StudyRun, session: SearchSession, signals: Signals, trial_cfgs: list[Config],
                            parallel: int) -> None:
    """The screen (grid searches), the baseline, the trials an earlier run finished, then the rest."""
    from rayvit.launch import capacity
    from rayvit.launch.torch_trainer import fit

    plan, out = session.plan, session.out
    s = plan.study.search
    if s.screen and s.algorithm == "grid":
        session.screen = screen.run_screen(plan, out)
    session.baseline = _baseline(run, plan, capacity.waiting(fit, out), out)
    _reuse_finished_trials(run, session)
    # Trials start on whatever is up: hold the cluster at the largest trial's size while they run.
    with capacity.capacity_for(capacity.largest(trial_cfgs), out):
        signals.tune = True
        _trials(run, session, parallel)
        signals.tune = False


def _raise_interrupted(run: StudyRun, session: SearchSession, signum: Optional[int]) -> None:
    """Record what the interrupt left (running trials KILLED, the parent KILLED) and raise SearchInterrupted."""
    session.interrupted = session.interrupted or "SIGINT"
    try:
        run.interrupted("trials" if session.baseline is not None else "baseline")
    except Exception as e:  # noqa: BLE001 - the message below matters more than the record
        session.out(f"warning: could not mark the search KILLED in MLflow: {e}")
    skipped = len(session.skipped)
    raise SearchInterrupted(
        f"interrupted after {len(session.finished)} of {session.plan.num_trials} trials"
        + (f" ({skipped} not trained by the screen)" if skipped else "")
        + f"; no best config written; resume with --name {run.name}", signum or signal.SIGINT)


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
    record_outcome(run, o, role="baseline")
    if not accuracy_ok or not o.verdict.feasible:
        raise BaselineFailed(f"the baseline ({setting_label(point.setting)}) gave no reference accuracy: "
                             f"{o.verdict.reason}")
    run.tracker.log_metrics(run.parent_id, {"baseline_val_accuracy": accuracy,
                                            f"baseline_{s.objective}": o.verdict.objective}, step=0)
    out(f"[baseline] {o.status}{'' if o.status == 'reused' else f' in {o.seconds:.0f} s'}: val accuracy "
        f"{accuracy:.2%}, {s.objective} {with_interval(o.result.metrics, s.objective, '.4g')}")
    return o


def _reuse_finished_trials(run: StudyRun, session: SearchSession) -> None:
    """Trials an earlier run of this search finished with the same settings (grid searches), judged again."""
    plan = session.plan
    s = plan.study.search
    if s.algorithm != "grid":
        return
    for point in plan.candidates():
        o = run.reusable(point)
        if o is None:
            continue
        o.verdict = judge("reused", o.result, session.baseline_accuracy, s)
        session.outcomes[point.key] = against_baseline(o, session.baseline, s.objective, plan.mode)
        session.out(progress_line(o, plan))


def _trials(run: StudyRun, session: SearchSession, parallel: int) -> None:
    """The trials not reused, through Tune: in screened order with the screen's stop rule (grid), or Optuna."""
    from rayvit.launch.progress import ProgressChannel

    plan = session.plan
    s = plan.study.search
    session.on_outcome = lambda o: _conclude(run, session, o)
    releaser = tuner.PlacementGroupReleaser()
    channel = ProgressChannel(trials.TrialProgress(plan, session.out))
    trainable = tune.with_resources(
        tune.with_parameters(trials.trial_trainable, base=plan.base.to_dict(), search=dataclasses.asdict(s),
                             search_name=session.name, baseline_accuracy=session.baseline_accuracy,
                             board=channel.board),
        {"CPU": 0, HEAD_NODE_RESOURCE: 0.001})
    entries = _entries(session)
    if s.algorithm == "grid" and not entries:
        with channel:
            pass
        return
    # A fresh Tune experiment per attempt: finished trials come back from MLflow, not Tune's state.
    name = f"{session.name}-{datetime.now().strftime('%H%M%S')}"
    search = tuner.new_tuner(session, trainable, parallel, [releaser, trials.TrialRecorder(session.name)], name,
                             entries)
    with channel, tuner.tune_environment():
        grid = search.fit()
    # The last trial's controller may still be dying: leave the cluster as we found it.
    releaser.drain()
    trials.grid_outcomes(session, grid)
    session.released_placement_groups = len(releaser.released)


def _conclude(run: StudyRun, session: SearchSession, o: Outcome) -> None:
    """A trial judged in Tune: against the baseline, recorded as a child run, said in a line."""
    s = session.plan.study.search
    against_baseline(o, session.baseline, s.objective, session.plan.mode)
    try:
        record_outcome(run, o, role="trial")
    except Exception as e:  # noqa: BLE001 - a tracking hiccup must not lose the search
        session.out(f"warning: could not record trial {o.point.key} in MLflow: {e}")
    session.out(progress_line(o, session.plan))


def _entries(session: SearchSession) -> list[tuner.Entry]:
    """The grid's settings to hand Tune, in order: screened (best first) or grid order; reused ones left out."""
    plan, screened, reused = session.plan, session.screen, session.outcomes
    if plan.study.search.algorithm != "grid":
        return []
    if screened is None:
        return [tuner.Entry(p.key, dict(p.setting)) for p in plan.candidates() if p.key not in reused]
    for c in screened.screened_out:
        session.skipped[c.label] = c.reason if c.reason.startswith("screened") else "screened out: " + c.reason
    entries = []
    for c in screened.order:
        if c.label in reused:
            continue
        session.screen_notes[c.label] = f" (screened {c.ratio.text('.2f', 'x')} the baseline)" if c.ratio else ""
        entries.append(tuner.Entry(c.label, dict(c.setting), c.ratio))
    return entries
