"""How Tune runs a search's trials: the order they come in, when to stop, the tuner itself.

- :class:`ScreenedOrder`: a Tune searcher that hands out a grid's settings best screened first and
  leaves out, before each trial, the settings that can no longer win (the screen's stop rule,
  :func:`rayvit.studies.search.screen.stop_reason`).
- :class:`ConstrainedOptunaSearch`: Optuna TPE that sees the accuracy constraint as a constraint.
- :class:`InterruptStop`: a Tune stopper that ends every trial when the search is interrupted.
- :class:`PlacementGroupReleaser`: the driver's callback that frees the placement groups stopped trials
  leave reserved (ray-project/ray#54305, through :mod:`rayvit.launch.compat`).

Tune pickles searchers, stoppers and callbacks into its experiment state: they hold the search's name
and find the driver's :class:`~rayvit.studies.search.search_session.SearchSession` by it.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import pickle
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import ray
from ray import tune
from ray.tune.search import Searcher
from ray.tune.search.optuna import OptunaSearch

from rayvit import stats
from rayvit.config_schema import Config, SearchConfig
from rayvit.launch import compat
from rayvit.studies.search.judge import speedup
from rayvit.studies.search.screen import stop_reason
from rayvit.studies.search.search_session import SearchSession, session_named
from rayvit.studies.search.trials import EXCESS_KEY, FEASIBLE_KEY, TRIAL_KEY

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------------
# The order trials run in


@dataclass(frozen=True)
class Entry:
    """A grid setting waiting to be trained, with what its screen said."""

    label: str
    setting: dict[str, Any]
    # Its screened ratio to the baseline; None: not screened (screen off or failed), always trained.
    screened: Optional[stats.Estimate] = None


class ScreenedOrder(Searcher):
    """Hands out ``entries`` in order; before each, leaves out those that can no longer win.

    A setting is left out once the best feasible trial's measured ratio to the baseline is not below
    its screened ratio (``prune``: the stop rule, :func:`~rayvit.studies.search.screen.stop_reason`); with
    nothing left it returns ``FINISHED`` and the search ends once the running trials do. Finished trials
    of an earlier run of the search (``finished``: label -> measured ratio if feasible, else None) count
    from the start.
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
                session = session_named(self.name)
                if session is not None:
                    session.skip(entry.label, entry.setting, why)
                continue
            self.running[trial_id] = entry.label
            return {**entry.setting, TRIAL_KEY: entry.label}
        return Searcher.FINISHED

    def left_out(self, entry: Entry) -> Optional[str]:
        ratio, label = self.best
        if not self.prune or entry.screened is None or label == "baseline":
            return None      # before any feasible trial, the screen itself applied the rule to the baseline
        return stop_reason(entry.screened, ratio, label)

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
        session = session_named(self.name)
        return session is not None and session.interrupted is not None


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


def new_tuner(session: SearchSession, trainable, parallel: int, callbacks: list, name: str,
              entries: list[Entry]) -> tune.Tuner:
    """The Tune experiment ``name`` of the trials still to run: ``entries`` in order (grid) or Optuna's."""
    plan, cfg = session.plan, session.plan.base
    s = plan.study.search
    return tune.Tuner(
        trainable, param_space={} if s.algorithm == "grid" else {k: tune.choice(v) for k, v in plan.space.items()},
        tune_config=tune.TuneConfig(search_alg=_searcher(session, entries),
                                    scheduler=_asha(s, cfg.train.steps) if s.asha else None,
                                    num_samples=len(entries) if s.algorithm == "grid" else s.num_samples,
                                    max_concurrent_trials=parallel, reuse_actors=False),
        run_config=tune.RunConfig(name=name, storage_path=tune_storage(cfg), verbose=0, callbacks=callbacks,
                                  stop=InterruptStop(session.name)))


def _searcher(session: SearchSession, entries: list[Entry]) -> Searcher:
    plan, baseline = session.plan, session.baseline
    s = plan.study.search
    if s.algorithm != "grid":
        return optuna_searcher(s, plan.base.train.seed, plan.mode)
    # Trials an earlier run of the search finished count for the stop rule from the start.
    finished = {k: (speedup(o.verdict.objective, baseline.verdict.objective, plan.mode)
                    if o.verdict.feasible else None) for k, o in session.outcomes.items() if o.status == "reused"}
    return ScreenedOrder(session.name, entries, baseline.verdict.objective, plan.mode,
                         prune=s.screen and s.objective != "time_to_accuracy", finished=finished)


def _asha(s: SearchConfig, steps: int):
    from ray.tune.schedulers import ASHAScheduler

    # max_t above the last step: the budget's end is never a reason to stop a trial (that would cut off
    # its final report); rungs fall at grace x factor^k steps.
    grace = s.asha_grace_steps or max(1, steps // 4)
    return ASHAScheduler(time_attr="step", metric="loss", mode="min", max_t=steps + 1,
                         grace_period=min(grace, steps), reduction_factor=s.asha_reduction_factor)
