"""A search's trials: the Tune trainable, and what became of each trial, read back in the driver.

- :func:`trial_trainable`: one trial, a multi-worker Ray Train run that judges itself and reports once;
  its workers' step figures travel to the driver's progress board as they come.
- :func:`trial_outcome`: a trial's outcome from its last report, the one judgement whether read live
  (:class:`TrialRecorder`, the driver's Tune callback) or from the result grid (:func:`grid_outcomes`).
- :class:`TrialProgress`: the driver's live lines of running trials.

How Tune runs them (the searchers, the stopper, the tuner) is :mod:`rayvit.studies.search.tuner`.
"""

from __future__ import annotations

import json
import math
from typing import Any, Callable, Optional

from ray import tune

from rayvit.config import from_dict
from rayvit.config_schema import SearchConfig
from rayvit.results import RunResult
from rayvit.studies.outcome import Outcome, is_divergence
from rayvit.studies.plan import Point, SearchPlan
from rayvit.studies.runner import Progress
from rayvit.studies.search.judge import accuracy_excess, judge, objective_value
from rayvit.studies.search.search_session import SearchSession, running

# What a trial's final tune.report carries besides the figures.
STATUS_KEY = "rayvit_status"      # done | diverged | failed (absent: stopped before its final report)
RESULT_KEY = "rayvit_result"      # the RunResult as JSON
ERROR_KEY = "rayvit_error"
EXCESS_KEY = "accuracy_excess"    # accuracy drop beyond the allowed one; <= 0 is feasible (Optuna's constraint)
FEASIBLE_KEY = "feasible_objective"   # the objective if feasible, else NaN
TRIAL_KEY = "rayvit_trial"        # a grid trial's label (t01, t02, ...) in its Tune config


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
    from rayvit.launch.torch_trainer import TrainingError, fit

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
    """Tune callback on the driver: a line when a trial starts; when it ends, its outcome, handed to the
    search's session (:meth:`~rayvit.studies.search.search_session.SearchSession.conclude`: judged against the
    baseline, recorded in MLflow, a line)."""

    def __init__(self, name: str):
        self.name = name

    def on_trial_start(self, iteration, trials, trial, **info):
        session = running(self.name)
        session.trial_started(trial.trial_id, self._label(trial), self._setting(session, trial))

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

    @staticmethod
    def _setting(session: SearchSession, trial) -> dict[str, Any]:
        return {k: trial.config[k] for k in session.plan.space if k in trial.config}

    def _finish(self, trial, error: Optional[str]) -> None:
        session = running(self.name)
        label = self._label(trial)
        if label in session.outcomes:
            return
        session.conclude(trial_outcome(session.plan, label, self._setting(session, trial),
                                       dict(trial.last_result or {}), error, session.baseline_accuracy,
                                       session.seconds_since_start(trial.trial_id),
                                       interrupted=bool(session.interrupted)))


def grid_outcomes(session: SearchSession, grid) -> list[Outcome]:
    """Every trial of the Tune experiment, judged from its last report (the recorder's where it had one)."""
    outcomes = []
    for result in grid:
        config = dict(result.config or {})
        label = config.get(TRIAL_KEY) or trial_label((result.metrics or {}).get("trial_id"))
        if label not in session.outcomes:
            error = str(result.error) if result.error else None
            session.conclude(trial_outcome(session.plan, label, config, dict(result.metrics or {}), error,
                                           session.baseline_accuracy, interrupted=bool(session.interrupted)))
        outcomes.append(session.outcomes[label])
    return outcomes


class TrialProgress:
    """The driver's live view of running trials: rank 0's step figures, labelled by trial, as lines."""

    def __init__(self, plan: SearchPlan, out: Callable[[str], None]):
        self.plan, self.progress, self.shown = plan, Progress(plan.num_trials, out), {}

    def __call__(self, item: dict) -> None:
        label = item.get("trial")
        if label is None or item.get("kind", "step") != "step":
            return
        if label not in self.shown:
            self.progress.show_next_step()           # each trial's first step is always shown
            point = Point(0, label, label, self.plan.base.parallel.num_workers, self.plan.base, {})
            self.shown[label] = self.progress.live(point)
        self.shown[label](item)
