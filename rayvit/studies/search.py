"""Ray Tune search: the fastest setting whose accuracy stays within a stated drop of the baseline.

:func:`run_search` does, in order:

1. :func:`~rayvit.studies.plan.plan_search` validates the ``search`` section against the run config, so an
   empty space, an unknown key or a constraint without a baseline fails before anything starts;
2. the baseline (the reference setting) trains as a point of the study; its validation accuracy is what
   the constraint is measured from (a rerun of the same search reuses it from MLflow);
3. every trial is a Tune function trainable that launches a multi-worker Ray Train run (grid or Optuna
   TPE, optional ASHA) and judges itself (:func:`~rayvit.studies.judge.judge`); a rerun of an interrupted
   search of the same name resumes its Tune experiment;
4. each trial is recorded in MLflow as a child run; the table comes from Tune's result grid, the best
   feasible setting from its best result (the baseline is a candidate too) and is written as a config
   file that ``rayvit sweep --config`` runs.

Every trial gets the same budget (``train.steps`` at ``train.batch_size``); the space may only hold keys
that change how the work is done (:data:`~rayvit.studies.plan.SEARCHABLE_KEYS`), never how much.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Optional

from ray import tune
from ray.tune.search.optuna import OptunaSearch

from rayvit.config import Config, SearchConfig, Study, from_dict, rayvit_home
from rayvit.launch.compat import PlacementGroupReleaser
from rayvit.record import plots, tracking
from rayvit.record.tables import Column, cell, fmt, format_table, times, write_parquet
from rayvit.results import RunResult
from rayvit.studies.judge import (Verdict, accuracy_excess, best_outcome, is_divergence, judge, last_line,
                                  objective_value, speedup)
from rayvit.studies.plan import SearchPlan, plan_search, setting_label
from rayvit.studies.runner import Outcome, Report, StudyRun, attach_ray, print_where

# What a trial's final tune.report carries besides the figures.
STATUS_KEY = "rayvit_status"      # done | diverged | failed (absent: stopped before its final report)
RESULT_KEY = "rayvit_result"      # the RunResult as JSON
ERROR_KEY = "rayvit_error"
EXCESS_KEY = "accuracy_excess"    # accuracy drop beyond the allowed one; <= 0 is feasible (Optuna's constraint)
FEASIBLE_KEY = "feasible_objective"   # the objective if feasible, else NaN: what the best result is chosen by

# Ray's marker resource on the head node. Trial drivers ask for a sliver of it: they do no training, so
# they need no CPU, and the head node is the one least likely to be preempted (the Ray Train + Tune guide
# recommends keeping Train driver processes off the worker nodes).
HEAD_NODE_RESOURCE = "node:__internal_head__"
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


class BaselineFailed(RuntimeError):
    """The baseline did not produce a validation accuracy, so the constraint cannot be applied."""


def default_search_name() -> str:
    return f"search-{datetime.now().strftime('%Y%m%d-%H%M%S')}"


# --------------------------------------------------------------------------------------------------
# The Tune function trainable


def trial_trainable(config: dict[str, Any], *, base: dict[str, Any], search: dict[str, Any], search_name: str,
                    baseline_accuracy: float) -> None:
    """One trial: a multi-worker Ray Train run of ``base`` with the trial's overrides (``config``).

    Workers' reports reach Tune through ``TuneReportCallback`` (ASHA reads their ``loss`` at ``step``);
    the final figures, the verdict and the whole ``RunResult`` follow in one last report. A failed or
    diverged run is reported, not raised: for the search it is an infeasible setting.
    """
    from ray.train import CheckpointConfig, FailureConfig, RunConfig
    from ray.tune.integration.ray_train import TuneReportCallback

    from rayvit.launch.storage import storage_path
    from rayvit.launch.trainer import TrainingError, fit

    cfg, s = from_dict(base, dict(config)), SearchConfig(**search)
    run_config = RunConfig(
        name=f"{search_name}-{tune.get_context().get_trial_id()}", storage_path=storage_path(cfg),
        failure_config=FailureConfig(max_failures=cfg.train.max_failures, controller_failure_limit=0),
        checkpoint_config=CheckpointConfig(num_to_keep=1), callbacks=[TuneReportCallback()])
    try:
        result = fit(cfg, run_config=run_config)
    except TrainingError as e:
        tune.report({STATUS_KEY: "diverged" if is_divergence(e) else "failed", ERROR_KEY: str(e)[-4000:]})
        return
    verdict = judge("done", result, baseline_accuracy, s)
    report: dict[str, Any] = {k: float(v) for k, v in result.metrics.items()
                              if isinstance(v, (int, float)) and math.isfinite(v)}
    recent = result.history[-cfg.train.report_every:] or [{"loss": result.metrics["final_loss"]}]
    report.update({STATUS_KEY: "done", "step": cfg.train.steps, "loss": result.metrics["final_loss"],
                   "loss_mean": sum(h["loss"] for h in recent) / len(recent),
                   EXCESS_KEY: accuracy_excess(result, baseline_accuracy, s.max_accuracy_drop),
                   FEASIBLE_KEY: verdict.objective if verdict.feasible else math.nan,
                   RESULT_KEY: json.dumps(result.to_dict(), default=str)})
    objective = objective_value(result, s.objective, s.target_accuracy)
    if objective is not None:
        report[s.objective] = objective
    tune.report(report)


class ConstrainedOptunaSearch(OptunaSearch):
    """Ray's ``OptunaSearch`` that hands each trial's accuracy excess to the sampler as a constraint.

    Ray's searcher has no constraint hook: each finished trial's ``accuracy_excess`` is set with Optuna's
    ``Trial.set_constraint`` before ``tell`` (<= 0 feasible); TPE then ranks infeasible trials by how far
    they miss, apart from the objective. A trial without the figure (diverged, stopped) gets none and is
    told as failed or pruned. Module level, because Tune pickles its searcher into the experiment state.
    """

    def on_trial_result(self, trial_id: str, result: dict) -> None:
        # Workers' intermediate reports carry no objective (only loss); Optuna prunes nothing here.
        return

    def on_trial_complete(self, trial_id: str, result: Optional[dict] = None, error: bool = False) -> None:
        ot_trial = self._ot_trials.get(trial_id)
        if ot_trial is not None and result and EXCESS_KEY in result:
            ot_trial.set_constraint(EXCESS_KEY, float(result[EXCESS_KEY]))
        super().on_trial_complete(trial_id, result, error)


def optuna_searcher(s: SearchConfig, seed: int, mode: str) -> ConstrainedOptunaSearch:
    """Optuna TPE whose sampler sees the accuracy constraint as a constraint, not part of the objective."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=max(2, min(5, s.num_samples // 2)))
    return ConstrainedOptunaSearch(metric=s.objective, mode=mode, sampler=sampler)


# --------------------------------------------------------------------------------------------------
# Outcomes of trials: one judgement, whether read live by the recorder or from the result grid


def trial_label(trial_id: Optional[str]) -> str:
    """``t01``, ``t02``, ...: Tune numbers a run's trials ``<prefix>_00000``, ``<prefix>_00001``, ..."""
    suffix = (trial_id or "").rsplit("_", 1)[-1]
    return f"t{int(suffix) + 1:02d}" if suffix.isdigit() else f"t-{trial_id or '?'}"


def trial_outcome(plan: SearchPlan, trial_id: Optional[str], setting: dict[str, Any], last: dict[str, Any],
                  error: Optional[str], baseline_accuracy: float, seconds: float = 0.0) -> Outcome:
    """A trial's outcome from its last report; no final report means Tune stopped it early (ASHA)."""
    status = "failed" if error and STATUS_KEY not in last else last.get(STATUS_KEY, "stopped")
    result = RunResult.from_dict(json.loads(last[RESULT_KEY])) if RESULT_KEY in last else None
    if status == "done" and result is None:
        status, error = "failed", "the trial finished without its result"
    error = error or last.get(ERROR_KEY)
    point = plan.trial(0, trial_label(trial_id), {k: setting[k] for k in plan.space if k in setting})
    verdict = judge(status, result, baseline_accuracy, plan.study.search, error=error, last=last)
    return Outcome(point, status, result, error, seconds=seconds, verdict=verdict)


def _record(run: StudyRun, o: Outcome, role: str) -> None:
    """The outcome's verdict as tags and figures; a child run of its own for trials."""
    tags = {tracking.TAG_KIND: "trial" if role == "trial" else "point", "rayvit.role": role,
            "rayvit.trial": o.point.key, "setting": setting_label(o.point.setting),
            "feasible": str(o.verdict.feasible).lower(), "reason": o.verdict.reason, "status": o.status}
    figures = {"objective": o.verdict.objective, "accuracy_drop": o.verdict.accuracy_drop, "trial_seconds": o.seconds}
    if role == "baseline":
        run.tracker.set_tags(o.run_id, tags)
        run.tracker.log_metrics(o.run_id, figures, step=0)
        return
    tags.update({"strategy": o.point.cfg.parallel.strategy, "world_size": o.point.world_size})
    run.record(o, tags, figures, params={f"trial.{k}": v for k, v in o.point.setting.items()})


class TrialRecorder(tune.Callback):
    """Tune callback on the driver: judges each finished trial, records it in MLflow, prints a line.

    Tune pickles its callbacks into the experiment state; the live parts (the MLflow record, the output
    function) stay in this driver and are looked up by search name, so a restored search records too.
    """

    _live: dict[str, dict[str, Any]] = {}

    def __init__(self, name: str, plan: SearchPlan, baseline: Outcome, out: Callable[[str], None]):
        self.name = name
        TrialRecorder._live[name] = {"plan": plan, "baseline": baseline, "out": out, "started": {},
                                     "outcomes": {}}

    @property
    def live(self) -> dict[str, Any]:
        return TrialRecorder._live[self.name]

    def attach(self, run: StudyRun) -> None:
        self.live["run"] = run

    def on_trial_start(self, iteration, trials, trial, **info):
        self.live["started"][trial.trial_id] = time.monotonic()
        self.live["out"](f"[{trial_label(trial.trial_id)}/{self.live['plan'].num_trials}] running "
                         f"{setting_label(self._setting(trial))}")

    def on_trial_complete(self, iteration, trials, trial, **info):
        self._finish(trial, None)

    def on_trial_error(self, iteration, trials, trial, **info):
        try:
            error = str(trial.get_error())
        except Exception:  # noqa: BLE001 - the message is a courtesy
            error = None
        self._finish(trial, error or "the trial actor failed")

    def _setting(self, trial) -> dict[str, Any]:
        return {k: trial.config[k] for k in self.live["plan"].space if k in trial.config}

    def _finish(self, trial, error: Optional[str]) -> None:
        live = self.live
        if trial.trial_id in live["outcomes"]:
            return
        seconds = time.monotonic() - live["started"].get(trial.trial_id, time.monotonic())
        base = live["baseline"]
        o = trial_outcome(live["plan"], trial.trial_id, self._setting(trial), dict(trial.last_result or {}),
                          error, base.result.metrics["val_accuracy"], seconds)
        live["outcomes"][trial.trial_id] = o
        try:
            _record(live["run"], o, role="trial")
        except Exception as e:  # noqa: BLE001 - a tracking hiccup must not lose the search
            live["out"](f"warning: could not record trial {o.point.key} in MLflow: {e}")
        live["out"](progress_line(o, live["plan"], base))


def progress_line(o: Outcome, plan: SearchPlan, baseline: Outcome) -> str:
    v, s = o.verdict, plan.study.search
    figures = ""
    if o.result is not None:
        gain = speedup(v.objective, baseline.verdict.objective, plan.mode)
        figures = (f"; {s.objective} {fmt(v.objective, '.4g')} ({fmt(gain, '.2f')}x baseline), val accuracy "
                   f"{fmt(o.result.metrics.get('val_accuracy'), '.2%')}")
    return (f"[{o.point.key}/{plan.num_trials}] {setting_label(o.point.setting)}: "
            f"{'FEASIBLE' if v.feasible else 'infeasible'} in {o.seconds:.0f} s{figures}; {v.reason}")


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
    ``ClusterTooSmall`` before anything trains, and
    ``BaselineFailed`` if the baseline cannot give a reference accuracy.
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
    attach_ray(address, name, ray_log, out)
    trial_cfgs = [plan.baseline.cfg] + [plan.trial(0, "", o).cfg for o in plan.settings]
    check_cluster_fits(trial_cfgs)
    check_storage(trial_cfgs)
    parallel = concurrency(trial_cfgs, s.max_concurrent_trials)
    parent = run.start({tracking.TAG_KIND: "search", "objective": s.objective, "algorithm": s.algorithm,
                        "max_accuracy_drop": s.max_accuracy_drop, "asha": s.asha, "space": json.dumps(plan.space),
                        "baseline": json.dumps(plan.baseline.setting), "data": study.run.data.name})
    out(f"search {name!r}: {plan.num_trials} trial(s) by {s.algorithm}{' + ASHA' if s.asha else ''}, "
        f"objective {s.objective} ({plan.mode}), at most {s.max_accuracy_drop * 100:.1f} accuracy points "
        f"below the baseline; up to {parallel} trial(s) at once")
    out(f"tracking: {run.uri}, experiment {experiment!r}, parent run {parent}")
    try:
        baseline = _baseline(run, plan, capacity.waiting(fit, out), out)
        # Trials start on whatever is up: hold the cluster at the largest trial's size while they run.
        with capacity.capacity_for(capacity.largest(trial_cfgs), out):
            grid, released = _trials(run, plan, baseline, parallel, out)
    except KeyboardInterrupt:
        run.interrupted("trials")
        raise
    except (BaselineFailed, capacity.ClusterTooSmall) as e:
        run.tracker.set_parent_tags({"rayvit.error": str(e)[:500]})
        run.tracker.end("FAILED")
        raise
    return _finish(run, plan, baseline, grid, released, output, time.monotonic() - start)


def _baseline(run: StudyRun, plan: SearchPlan, fit, out: Callable[[str], None]) -> Outcome:
    """The reference run: reused from an earlier run of this search when its settings are unchanged."""
    point, s = plan.baseline, plan.study.search
    o = run.reusable(point)
    if o is None:
        out(f"[baseline] training {setting_label(point.setting)} for {point.cfg.train.steps} steps")
        o = run.run_point(point, fit, {"rayvit.trial": "baseline"})
    accuracy = o.result.metrics.get("val_accuracy") if o.result else None
    accuracy_ok = isinstance(accuracy, (int, float)) and math.isfinite(accuracy)
    o.verdict = judge(o.status, o.result, accuracy if accuracy_ok else math.nan, s, error=o.error)
    _record(run, o, role="baseline")
    if not accuracy_ok or not o.verdict.feasible:
        raise BaselineFailed(f"the baseline ({setting_label(point.setting)}) gave no reference accuracy: "
                             f"{o.verdict.reason}")
    run.tracker.log_metrics(run.parent_id, {"baseline_val_accuracy": accuracy,
                                            f"baseline_{s.objective}": o.verdict.objective}, step=0)
    out(f"[baseline] {o.status} in {o.seconds:.0f} s: val accuracy {accuracy:.2%}, "
        f"{s.objective} {fmt(o.verdict.objective, '.4g')}")
    return o


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


def _trials(run: StudyRun, plan: SearchPlan, baseline: Outcome, parallel: int, out):
    """Every trial through Tune, or the rest of them when an interrupted search of this name is resumed."""
    s, study = plan.study.search, plan.study
    recorder = TrialRecorder(run.name, plan, baseline, out)
    recorder.attach(run)
    releaser = PlacementGroupReleaser()
    trainable = tune.with_resources(
        tune.with_parameters(trial_trainable, base=study.run.to_dict(), search=dataclasses.asdict(s),
                             search_name=run.name, baseline_accuracy=baseline.result.metrics["val_accuracy"]),
        {"CPU": 0, HEAD_NODE_RESOURCE: 0.001})
    path = os.path.join(tune_storage(study.run), run.name)
    if tune.Tuner.can_restore(path):
        out(f"resuming the interrupted trials of {run.name!r} from {path}")
        tuner = tune.Tuner.restore(path, trainable, resume_errored=True)
    else:
        tuner = _new_tuner(plan, trainable, parallel, [releaser, recorder], run.name, study.run)
    with _tune_output_off():
        grid = tuner.fit()
    # The last trial's controller may still be dying: leave the cluster as we found it.
    releaser.drain()
    return grid, len(releaser.released)


def _new_tuner(plan: SearchPlan, trainable, parallel: int, callbacks: list, name: str, cfg: Config):
    s = plan.study.search
    if s.algorithm == "grid":
        param_space = {k: tune.grid_search(v) for k, v in plan.space.items()}
        search_alg, samples = None, 1
    else:
        param_space = {k: tune.choice(v) for k, v in plan.space.items()}
        search_alg, samples = optuna_searcher(s, cfg.train.seed, plan.mode), s.num_samples
        # The workers' intermediate reports carry loss, not the objective (it exists only once the run
        # is measured); Tune would otherwise reject them. Read at each result, in this process.
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
        run_config=tune.RunConfig(name=name, storage_path=tune_storage(cfg), verbose=0, callbacks=callbacks))


def _finish(run: StudyRun, plan: SearchPlan, baseline: Outcome, grid, released: int,
            output: Optional[str | Path], seconds: float) -> SearchReport:
    """The table from Tune's result grid, the best feasible setting, the records on the parent run."""
    live = TrialRecorder._live.pop(run.name)
    outcomes = sorted(_grid_outcomes(plan, grid, baseline, live), key=lambda o: o.point.key)
    best = _best(grid, outcomes, baseline, plan.mode)
    rows = sort_rows(rows_of(outcomes, baseline, plan.mode), plan.mode)
    s = plan.study.search
    report = SearchReport(run.name, "search", run.experiment, run.uri, run.parent_id, outcomes, rows,
                          seconds=seconds, baseline=baseline, best=best, objective=s.objective, mode=plan.mode,
                          released_placement_groups=released)
    report.best_config_path = write_best_config(
        plan.study.run if best is baseline else best.point.cfg, _best_path(output, run.name),
        _best_header(report, s.max_accuracy_drop))
    _log_parent_results(run, report)
    return report


def _grid_outcomes(plan: SearchPlan, grid, baseline: Outcome, live: dict[str, Any]) -> list[Outcome]:
    """Every trial of the experiment (restored ones too), judged from its last report."""
    outcomes = []
    for result in grid:
        trial_id = (result.metrics or {}).get("trial_id")
        known = live["outcomes"].get(trial_id)
        if known is not None:
            outcomes.append(known)
            continue
        error = str(result.error) if result.error else None
        outcomes.append(trial_outcome(plan, trial_id, dict(result.config or {}), dict(result.metrics or {}),
                                      error, baseline.result.metrics["val_accuracy"]))
    return outcomes


def _best(grid, outcomes: list[Outcome], baseline: Outcome, mode: str) -> Outcome:
    """Tune's best result by the feasible objective; the baseline when it is better or nothing is feasible."""
    try:
        best_result = grid.get_best_result(metric=FEASIBLE_KEY, mode=mode, filter_nan_and_inf=True)
        trial = trial_label(best_result.metrics.get("trial_id"))
        best = next((o for o in outcomes if o.point.key == trial and o.verdict.feasible), None)
    except RuntimeError:   # no trial has a finite feasible objective
        best = None
    return best_outcome([baseline] + ([best] if best else []), mode) or baseline


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


def rows_of(outcomes: list[Outcome], baseline: Outcome, mode: str) -> list[dict[str, Any]]:
    """One flat row per trial (baseline first): setting, verdict, objective, speedup, conditions, figures."""
    rows = []
    for o in [baseline] + [o for o in outcomes if o is not baseline]:
        v = o.verdict
        row: dict[str, Any] = {"trial": o.point.key, "setting": setting_label(o.point.setting), "status": o.status,
                               "feasible": v.feasible, "reason": v.reason, "objective": v.objective,
                               "speedup_vs_baseline": speedup(v.objective, baseline.verdict.objective, mode),
                               "accuracy_drop": v.accuracy_drop, "run_id": o.run_id,
                               "seconds": round(o.seconds, 1), "error": o.error}
        row.update({f"set.{k}": val for k, val in o.point.setting.items()})
        if o.result is not None:
            row.update(o.result.row())
        rows.append(row)
    return rows


def sort_rows(rows: list[dict[str, Any]], mode: str) -> list[dict[str, Any]]:
    """Best objective first; trials without an objective last."""
    sign = -1.0 if mode == "max" else 1.0
    return sorted(rows, key=lambda r: (r["objective"] is None, sign * (r["objective"] or 0.0)))


def search_columns(objective: str, best: Optional[str]) -> list[Column]:
    spec = ".4g" if objective != "time_to_accuracy" else ".1f"
    return [
        ("", lambda r: "*" if r["trial"] == best else ""), ("trial", cell("trial")), ("setting", cell("setting")),
        (objective, cell("objective", spec)), ("vs base", lambda r: times(r["speedup_vs_baseline"])),
        ("val acc", cell("val_accuracy", ".2%")), ("drop pts", cell("accuracy_drop", "+.1f", scale=0.01)),
        ("img/s/chip", cell("images_per_sec_per_chip", ".1f")),
        ("feasible", lambda r: "yes" if r["feasible"] else "no"), ("reason", cell("reason")),
    ]


def search_table(rows: list[dict[str, Any]], objective: str, best: Optional[str] = None) -> str:
    """All trials sorted by objective, with feasibility and why; ``*`` marks the best feasible one."""
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
    """The table of all trials, the best setting and its speedup, where everything went."""
    best, base = report.best, report.baseline
    out("")
    out(search_table(report.rows, report.objective, best.point.key))
    gain = speedup(best.verdict.objective, base.verdict.objective, report.mode)
    feasible = sum(o.verdict.feasible for o in report.outcomes)
    out(f"\n{len(report.outcomes)} trials, {feasible} feasible, in {report.seconds:.0f} s. "
        f"Best feasible: {best.point.key} ({setting_label(best.point.setting)}), "
        f"{fmt(gain, '.2f')}x the baseline's {report.objective}.")
    if best is base:
        out("No trial beat the baseline within the accuracy budget: the best config is the baseline's.")
    for o in report.failed:
        out(f"ERROR {o.point.key} ({setting_label(o.point.setting)}): {last_line(o.error or '')}")
    out(f"best config: {report.best_config_path}")
    out(f"  run it:  rayvit sweep --config {report.best_config_path}")
    print_where(report, out)


__all__ = ["BaselineFailed", "ConstrainedOptunaSearch", "SearchReport", "Verdict", "run_search", "print_summary",
           "trial_trainable", "search_table", "write_best_config"]
