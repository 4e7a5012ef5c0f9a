"""A search's trials inside Ray Tune: the trainable, the order they run in, and the driver's view of them.

- :func:`trial_trainable`: one trial, a multi-worker Ray Train run that judges itself and reports once;
  its workers' step figures travel to the driver's progress board as they come.
- :class:`ScreenedOrder`: a Tune searcher that hands out a grid's settings best screened first and
  leaves out, before each trial, the settings that can no longer win (:mod:`rayvit.studies.screen`).
- :class:`ConstrainedOptunaSearch`: Optuna TPE that sees the accuracy constraint as a constraint.
- :class:`InterruptStop`: a Tune stopper that ends every trial when the search is interrupted.
- :class:`TrialRecorder`: the driver's callback: a line when a trial starts, its verdict when it ends,
  its MLflow child run.
- :class:`PlacementGroupReleaser`: the driver's callback that frees the placement groups stopped trials
  leave reserved (ray-project/ray#54305, through :mod:`rayvit.launch.compat`).

Tune pickles searchers, stoppers and callbacks into its experiment state; what lives only in this
driver (the output function, the MLflow record, the interrupt flag) is looked up by search name in
:data:`LIVE`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import pickle
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import ray
from ray import tune
from ray.tune.search import Searcher
from ray.tune.search.optuna import OptunaSearch

from rayvit.config import Config, SearchConfig, from_dict
from rayvit.launch import compat
from rayvit.results import RunResult
from rayvit.studies.judge import accuracy_excess, is_divergence, judge, objective_value, speedup
from rayvit.studies.plan import Point, SearchPlan, setting_label
from rayvit.studies.runner import Outcome, Progress
from rayvit.studies.screen import beats_reference

logger = logging.getLogger(__name__)

# What a trial's final tune.report carries besides the figures.
STATUS_KEY = "rayvit_status"      # done | diverged | failed (absent: stopped before its final report)
RESULT_KEY = "rayvit_result"      # the RunResult as JSON
ERROR_KEY = "rayvit_error"
EXCESS_KEY = "accuracy_excess"    # accuracy drop beyond the allowed one; <= 0 is feasible (Optuna's constraint)
FEASIBLE_KEY = "feasible_objective"   # the objective if feasible, else NaN
TRIAL_KEY = "rayvit_trial"        # a grid trial's label (t01, t02, ...) in its Tune config

# Per search name, in this driver: out, plan, baseline, run, started, outcomes, skipped, interrupted.
LIVE: dict[str, dict[str, Any]] = {}


# --------------------------------------------------------------------------------------------------
# The trainable


def trial_trainable(config: dict[str, Any], *, base: dict[str, Any], search: dict[str, Any], search_name: str,
                    baseline_accuracy: float, board=None) -> None:
    """One trial: a multi-worker Ray Train run of ``base`` with the trial's overrides (``config``).

    Workers' reports reach Tune through ``TuneReportCallback`` (ASHA reads their ``loss`` at ``step``);
    the final figures (with their intervals over blocks of timed steps), the verdict and the whole
    ``RunResult`` follow in one last report. A failed or diverged run is reported, not raised: for the
    search it is an infeasible setting. ``board``: the driver's progress board; rank 0's step figures
    go there labelled with the trial.
    """
    from ray.train import CheckpointConfig, FailureConfig, RunConfig

    from rayvit.launch.storage import storage_path
    from rayvit.launch.trainer import TrainingError, fit

    overrides = {k: v for k, v in config.items() if k != TRIAL_KEY}
    label = config.get(TRIAL_KEY) or trial_label(tune.get_context().get_trial_id())
    cfg, s = from_dict(base, overrides), SearchConfig(**search)
    # Tune checks that every result carries the searcher's and the scheduler's metrics: the workers'
    # reports carry loss and the throughput objectives; an objective that exists only once the run is
    # judged (time_to_accuracy) is NaN until then.
    pending = {s.objective: math.nan, "loss": math.nan}
    run_config = RunConfig(
        name=f"{search_name}-{tune.get_context().get_trial_id()}", storage_path=storage_path(cfg),
        failure_config=FailureConfig(max_failures=cfg.train.max_failures, controller_failure_limit=0),
        checkpoint_config=CheckpointConfig(num_to_keep=1), callbacks=[_reports_with(pending)])

    def forward(item: dict) -> None:
        board.post.remote({**item, "trial": label})

    try:
        result = fit(cfg, run_config=run_config, on_progress=forward if board else None)
    except TrainingError as e:
        tune.report({**pending, STATUS_KEY: "diverged" if is_divergence(e) else "failed",
                     ERROR_KEY: str(e)[-4000:]})
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


def _reports_with(defaults: dict[str, Any]):
    """Ray Tune's ``TuneReportCallback``, each forwarded worker report completed with ``defaults`` for the
    keys it lacks."""
    from ray.tune.integration.ray_train import TuneReportCallback

    class ReportsWithDefaults(TuneReportCallback):
        def after_report(self, run_context, metrics, checkpoint):
            super().after_report(run_context, [{**defaults, **metrics[0]}, *metrics[1:]], checkpoint)

    return ReportsWithDefaults()


def trial_label(trial_id: Optional[str]) -> str:
    """Optuna's trials: ``t01``, ``t02``, ... from Tune's ``<prefix>_00000``, ``<prefix>_00001``, ..."""
    suffix = (trial_id or "").rsplit("_", 1)[-1]
    return f"t{int(suffix) + 1:02d}" if suffix.isdigit() else f"t-{trial_id or '?'}"


# --------------------------------------------------------------------------------------------------
# The order trials run in


@dataclass(frozen=True)
class Entry:
    """A grid setting waiting to be trained, with what its screen said (ratio to the baseline)."""

    label: str
    setting: dict[str, Any]
    ratio: Optional[float] = None          # None: not screened (screen off or failed): always trained
    ratio_hi: Optional[float] = None
    ratio_text: str = ""


class ScreenedOrder(Searcher):
    """Hands out ``entries`` in order; before each, leaves out those that can no longer win.

    A setting is left out once the best feasible trial's measured ratio to the baseline exceeds its
    screened ratio (``prune``, :func:`~rayvit.studies.screen.beats_reference`); with nothing left it
    returns ``FINISHED`` and the search ends once the running trials do. Finished trials of an earlier run of the search
    (``finished``: label -> measured ratio if feasible, else None) count from the start.
    """

    def __init__(self, name: str, entries: list[Entry], baseline_objective: Optional[float], mode: str,
                 prune: bool, finished: Optional[dict[str, Optional[float]]] = None):
        super().__init__(metric=None, mode=None)
        self.name, self.queue, self.baseline_objective = name, list(entries), baseline_objective
        self.objective_mode, self.prune = mode, prune
        self.running: dict[str, str] = {}
        self.best: tuple[float, str] = (1.0, "baseline")
        for label, ratio in (finished or {}).items():
            self._count(label, ratio)

    def set_search_properties(self, metric, mode, config, **spec) -> bool:
        return True

    def suggest(self, trial_id: str):
        while self.queue:
            entry = self.queue.pop(0)
            why = self.left_out(entry)
            if why is not None:
                _skipped(self.name, entry, why)
                continue
            self.running[trial_id] = entry.label
            return {**entry.setting, TRIAL_KEY: entry.label}
        return Searcher.FINISHED

    def left_out(self, entry: Entry) -> Optional[str]:
        ratio, label = self.best
        if not self.prune or entry.ratio is None or label == "baseline":
            return None
        return beats_reference(entry.ratio, entry.ratio_hi, entry.ratio_text, ratio, label)

    def on_trial_complete(self, trial_id: str, result: Optional[dict] = None, error: bool = False) -> None:
        label = self.running.pop(trial_id, None)
        value = (result or {}).get(FEASIBLE_KEY)
        if label is None or not isinstance(value, (int, float)) or not math.isfinite(value):
            return
        base = self.baseline_objective
        if base and base > 0 and value > 0:
            self._count(label, value / base if self.objective_mode == "max" else base / value)

    def _count(self, label: str, ratio: Optional[float]) -> None:
        if ratio is not None and ratio > self.best[0]:
            self.best = (ratio, label)

    def save(self, checkpoint_path: str) -> None:
        with open(checkpoint_path, "wb") as f:
            pickle.dump(self.__dict__, f)

    def restore(self, checkpoint_path: str) -> None:
        with open(checkpoint_path, "rb") as f:
            self.__dict__.update(pickle.load(f))


def _skipped(name: str, entry: Entry, why: str) -> None:
    live = LIVE.get(name)
    if live is None:
        return
    live["skipped"][entry.label] = why
    live["out"](f"[{entry.label}/{live['plan'].num_trials}] {setting_label(entry.setting)}: not trained, {why}")


class ConstrainedOptunaSearch(OptunaSearch):
    """Ray's ``OptunaSearch`` that hands each trial's accuracy excess to the sampler as a constraint.

    Ray's searcher has no constraint hook: each finished trial's ``accuracy_excess`` is set with Optuna's
    ``Trial.set_constraint`` before ``tell`` (<= 0 feasible); TPE then ranks infeasible trials by how far
    they miss, apart from the objective. A trial without the figure (diverged, stopped) gets none and is
    told as failed or pruned. Module level, because Tune pickles its searcher into the experiment state.
    """

    def on_trial_result(self, trial_id: str, result: dict) -> None:
        # Workers' intermediate reports carry running figures, not a judged outcome: Optuna prunes nothing.
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


class InterruptStop(tune.Stopper):
    """Ends every trial once the search named ``name`` is interrupted (SIGINT, SIGTERM): Tune stops the
    running trials' Ray Train runs and ``fit()`` returns, so the search can say what happened."""

    def __init__(self, name: str):
        self.name = name

    def __call__(self, trial_id: str, result: dict) -> bool:
        return False

    def stop_all(self) -> bool:
        return bool(LIVE.get(self.name, {}).get("interrupted"))


# --------------------------------------------------------------------------------------------------
# Outcomes of trials: one judgement, whether read live by the recorder or from the result grid


def trial_status(last: dict[str, Any], error: Optional[str], *, interrupted: bool, asha: bool) -> str:
    """What became of a trial: its own final report says done/diverged/failed; without one, the search
    was interrupted, ASHA stopped it (only when ASHA is on), or it failed."""
    if STATUS_KEY in last:
        return last[STATUS_KEY]
    if error:
        return "failed"
    if interrupted:
        return "interrupted"
    return "stopped" if asha else "failed"


def trial_outcome(plan: SearchPlan, label: str, setting: dict[str, Any], last: dict[str, Any],
                  error: Optional[str], baseline_accuracy: float, seconds: float = 0.0, *,
                  interrupted: bool = False) -> Outcome:
    """A trial's outcome from its last report."""
    status = trial_status(last, error, interrupted=interrupted, asha=plan.study.search.asha)
    result = RunResult.from_dict(json.loads(last[RESULT_KEY])) if RESULT_KEY in last else None
    if status == "done" and result is None:
        status, error = "failed", "the trial finished without its result"
    if status == "failed" and not (error or last.get(ERROR_KEY)):
        error = "the trial ended without its final report"
    error = error or last.get(ERROR_KEY)
    index = int(label[1:]) if label[1:].isdigit() else 0
    point = plan.trial(index, label, {k: setting[k] for k in plan.space if k in setting})
    verdict = judge(status, result, baseline_accuracy, plan.study.search, error=error, last=last)
    return Outcome(point, status, result, error, seconds=seconds, verdict=verdict)


class TrialRecorder(tune.Callback):
    """Tune callback on the driver: a line when a trial starts; when it ends, its verdict (through
    ``finish``: the search's judgement, MLflow record and line)."""

    def __init__(self, name: str):
        self.name = name

    @property
    def live(self) -> dict[str, Any]:
        return LIVE[self.name]

    def on_trial_start(self, iteration, trials, trial, **info):
        live = self.live
        label = self._label(trial)
        live["started"][trial.trial_id] = time.monotonic()
        live["out"](f"[{label}/{live['plan'].num_trials}] running {setting_label(self._setting(trial))}"
                    + live.get("screened", {}).get(label, ""))

    def on_trial_complete(self, iteration, trials, trial, **info):
        self._finish(trial, None)

    def on_trial_error(self, iteration, trials, trial, **info):
        try:
            error = str(trial.get_error())
        except Exception:  # noqa: BLE001 - the message is a courtesy
            error = None
        self._finish(trial, error or "the trial actor failed")

    def _label(self, trial) -> str:
        return trial.config.get(TRIAL_KEY) or trial_label(trial.trial_id)

    def _setting(self, trial) -> dict[str, Any]:
        return {k: trial.config[k] for k in self.live["plan"].space if k in trial.config}

    def _finish(self, trial, error: Optional[str]) -> None:
        live = self.live
        label = self._label(trial)
        if label in live["outcomes"]:
            return
        seconds = time.monotonic() - live["started"].get(trial.trial_id, time.monotonic())
        o = trial_outcome(live["plan"], label, self._setting(trial), dict(trial.last_result or {}), error,
                          live["baseline"].result.metrics["val_accuracy"], seconds,
                          interrupted=bool(live.get("interrupted")))
        live["outcomes"][label] = o
        live["finish"](o)


class PlacementGroupReleaser(tune.Callback):
    """Frees placement groups left by stopped trials (:func:`rayvit.launch.compat.release_orphaned_placement_groups`),
    about once a second and at each trial end."""

    def __init__(self, interval_s: float = 1.0):
        self.job_id = ray.get_runtime_context().get_job_id()
        self.interval_s = interval_s
        self.released: list[str] = []
        self._next = 0.0

    def _sweep(self) -> None:
        self._next = time.monotonic() + self.interval_s
        freed = compat.release_orphaned_placement_groups(self.job_id)
        if freed:
            logger.info("released %d placement group(s) left by stopped trials", len(freed))
            self.released += freed

    def on_step_end(self, iteration, trials, **info):
        if time.monotonic() >= self._next:
            self._sweep()

    def on_trial_complete(self, iteration, trials, trial, **info):
        self._next = 0.0     # the stopped trial's controller dies shortly after: look again soon

    def on_trial_error(self, iteration, trials, trial, **info):
        self._next = 0.0

    def drain(self, timeout_s: float = 15.0) -> None:
        """After the last trial: wait until no Train run of this job holds a group, freeing orphans."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._sweep()
            if not compat.job_holds_actor_placement_groups(self.job_id):
                return
            time.sleep(0.5)
        logger.warning("placement groups of this search are still reserved after %.0f s", timeout_s)


def grid_outcomes(plan: SearchPlan, grid, live: dict[str, Any]) -> list[Outcome]:
    """Every trial of the Tune experiment, judged from its last report (the recorder's where it had one)."""
    outcomes = []
    for result in grid:
        config = dict(result.config or {})
        label = config.get(TRIAL_KEY) or trial_label((result.metrics or {}).get("trial_id"))
        known = live["outcomes"].get(label)
        if known is not None:
            outcomes.append(known)
            continue
        error = str(result.error) if result.error else None
        o = trial_outcome(plan, label, config, dict(result.metrics or {}), error,
                          live["baseline"].result.metrics["val_accuracy"], interrupted=bool(live.get("interrupted")))
        live["outcomes"][label] = o
        live["finish"](o)
        outcomes.append(o)
    return outcomes


# --------------------------------------------------------------------------------------------------
# The tuner and its settings


def tune_storage(cfg: Config) -> str:
    """Where Tune keeps its experiments: beside Ray Train's runs (``launch.storage`` on clusters)."""
    from rayvit.launch.storage import storage_path

    base = storage_path(cfg)
    return base.rstrip("/") + "_tune" if "://" in base else str(Path(base).parent / "tune_results")


@contextlib.contextmanager
def tune_environment():
    """Tune's settings for the driver's ``fit()`` only, then restored as they were.

    - Silent: rayvit prints each trial's lines itself. Ray 2.60's new Tune output engine prints its
      "Configuration for experiment" box and a TensorBoard hint even at ``verbose=0`` (``tune.run`` calls
      ``experiment_started`` whatever the verbosity); the legacy engine, chosen by Ray's documented
      ``RAY_AIR_NEW_OUTPUT=0``, honours ``verbose=0``.
    """
    wanted = {"RAY_AIR_NEW_OUTPUT": "0"}
    saved = {k: os.environ.get(k) for k in wanted}
    os.environ.update(wanted)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


class TrialProgress:
    """The driver's live view of running trials: rank 0's step figures, labelled by trial, as lines."""

    def __init__(self, plan: SearchPlan, out: Callable[[str], None]):
        self.plan, self.progress, self.shown = plan, Progress(plan.num_trials, out), {}

    def __call__(self, item: dict) -> None:
        label = item.get("trial")
        if label is None or item.get("kind", "step") != "step":
            return
        if label not in self.shown:
            self.progress._printed = 0.0           # each trial's first step is always shown
            point = Point(0, label, label, self.plan.base.parallel.num_workers, self.plan.base, {})
            self.shown[label] = self.progress.live(point)
        self.shown[label](item)


def new_tuner(plan: SearchPlan, trainable, parallel: int, callbacks: list, name: str, cfg: Config,
               entries: list[Entry], baseline: Outcome, reused: dict[str, Outcome]):
    s = plan.study.search
    if s.algorithm == "grid":
        finished = {k: (speedup(o.verdict.objective, baseline.verdict.objective, plan.mode)
                        if o.verdict.feasible else None) for k, o in reused.items()}
        search_alg = ScreenedOrder(plan.study.search.name, entries, baseline.verdict.objective, plan.mode,
                                          prune=s.screen and s.objective != "time_to_accuracy", finished=finished)
        param_space, samples = {}, len(entries)
    else:
        param_space = {k: tune.choice(v) for k, v in plan.space.items()}
        search_alg, samples = optuna_searcher(s, cfg.train.seed, plan.mode), s.num_samples
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
                                  stop=InterruptStop(plan.study.search.name)))
