"""Ray Tune search: the fastest setting whose accuracy stays within a stated drop of the baseline.

:func:`run_search` does, in order:

1. :func:`plan_search` validates the ``search`` section against the config tree, so an empty space, an
   unknown key or a constraint without a baseline fails before anything starts;
2. the baseline (the reference setting) trains with :func:`rayvit.trainer.fit`; its validation accuracy
   is what the constraint is measured from;
3. every trial is a Tune function trainable that launches a multi-worker Ray Train run
   (:func:`rayvit.trainer.fit` with ``TuneReportCallback``), grid or Optuna TPE, optional ASHA;
4. each trial is judged (:func:`judge`: feasible, or why not), recorded in MLflow as a child run, and the
   best feasible setting (the baseline is a candidate too) is written as a config file that
   ``experiments/scaling.py --config`` runs.

Every trial gets the same budget (``train.steps`` at ``train.batch_size``); the space may only hold keys
that change how the work is done (:data:`SEARCHABLE_KEYS`), never how much.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

from rayvit.config import Config, ConfigError, from_dict
from rayvit.results import RunResult
from rayvit.train import DivergedError

logger = logging.getLogger(__name__)

# Keys a search may vary: how the work is done, never how much (steps, batch and data stay fixed).
SEARCHABLE_KEYS = ("precision.mode", "precision.dtype", "model.image_size", "optim.name", "optim.impl",
                   "model.classifier", "model.layout", "parallel.strategy")
OBJECTIVE_MODES = {"tflops_per_chip": "max", "images_per_sec": "max", "time_to_accuracy": "min"}

# What a trial's final tune.report carries besides the figures.
STATUS_KEY = "rayvit_status"      # done | diverged | failed (absent: stopped before its final report)
RESULT_KEY = "rayvit_result"      # the RunResult as JSON
ERROR_KEY = "rayvit_error"
EXCESS_KEY = "accuracy_excess"    # accuracy drop beyond the allowed one; <= 0 is feasible (Optuna's constraint)

# Ray's marker resource on the head node. Trial drivers ask for a sliver of it: they do no training, so
# they need no CPU, and the head node is the one least likely to be preempted (the Ray Train + Tune guide
# recommends keeping Train driver processes off the worker nodes).
HEAD_NODE_RESOURCE = "node:__internal_head__"
_DEFAULT_EXPERIMENT = "rayvit-search"
_EPS = 1e-9


# --------------------------------------------------------------------------------------------------
# Planning and validation


@dataclass(frozen=True)
class SearchPlan:
    """A validated search: the base config, the baseline's, the space and every setting it spans."""

    base: Config
    baseline: Config
    baseline_overrides: dict[str, Any]
    space: dict[str, list[Any]]
    settings: list[dict[str, Any]]      # every combination of the space, in grid order

    @property
    def mode(self) -> str:
        return OBJECTIVE_MODES[self.base.search.objective]

    @property
    def num_trials(self) -> int:
        s = self.base.search
        return len(self.settings) if s.algorithm == "grid" else s.num_samples


def plan_search(cfg: Config) -> SearchPlan:
    """Check the ``search`` section against the config tree; raise ``ConfigError`` before any trial runs."""
    s = cfg.search
    known = cfg.flatten()
    allowed = ", ".join(SEARCHABLE_KEYS)
    if not s.space:
        raise ConfigError(
            "search.space is empty: give at least one key with candidate values, e.g. "
            "--set 'search.space={precision.mode: [amp, pure], model.image_size: [32, 40]}'; "
            f"searchable keys: {allowed}")
    space: dict[str, list[Any]] = {}
    for key, values in s.space.items():
        if key not in known:
            raise ConfigError(f"search.space has unknown key {key!r}: not a config key "
                              f"(section.key); searchable keys: {allowed}")
        if key not in SEARCHABLE_KEYS:
            raise ConfigError(f"search.space key {key!r} cannot be searched: every trial gets the same "
                              f"training budget and data; searchable keys: {allowed}")
        values = list(dict.fromkeys(values if isinstance(values, list) else [values]))
        if not values:
            raise ConfigError(f"search.space.{key} is an empty list: give at least one candidate value")
        for value in values:
            _derive(cfg, {key: value}, f"search.space.{key}={value!r}")
        space[key] = values

    if not s.baseline:
        raise ConfigError(
            f"search.max_accuracy_drop={s.max_accuracy_drop} needs a baseline to measure the drop from, "
            "but search.baseline is empty: set it to the reference setting's overrides, e.g. "
            "{precision.mode: fp32, optim.impl: loop} (the base config's image size is kept)")
    for key in s.baseline:
        if key not in known:
            raise ConfigError(f"search.baseline has unknown key {key!r}: not a config key (section.key)")
        if key not in SEARCHABLE_KEYS:
            raise ConfigError(f"search.baseline key {key!r} would give the baseline another budget or "
                              f"data than the trials; baseline keys must be among: {allowed}")
    baseline = _derive(cfg, dict(s.baseline), "search.baseline")

    if cfg.data.name == "synthetic":
        raise ConfigError("the accuracy constraint needs a real dataset with a validation split: set "
                          "data.name=digits (bundled, no download) or data.name=parquet with data.path")
    if s.objective == "time_to_accuracy" and not cfg.train.eval_every:
        raise ConfigError("search.objective=time_to_accuracy needs evaluations during training: set "
                          "train.eval_every to a number of steps (e.g. train.eval_every=25)")

    settings = [dict(zip(space, combo)) for combo in itertools.product(*space.values())]
    if len(settings) > 10_000 and s.algorithm == "grid":
        raise ConfigError(f"search.space spans {len(settings)} settings: too many for a grid; use "
                          "search.algorithm=optuna with search.num_samples")
    for setting in settings:
        _derive(cfg, setting, "search.space setting " + setting_label(setting))
    return SearchPlan(cfg, baseline, dict(s.baseline), space, settings)


def _derive(cfg: Config, overrides: Mapping[str, Any], what: str) -> Config:
    try:
        return cfg.replace(dict(overrides))
    except ConfigError as e:
        raise ConfigError(f"{what}: {e}") from None


def setting_label(overrides: Mapping[str, Any]) -> str:
    """``mode=pure image_size=40 impl=loop``: short enough for a table column and a run name."""
    return " ".join(f"{key.split('.')[-1]}={value}" for key, value in overrides.items()) or "(base config)"


# --------------------------------------------------------------------------------------------------
# Judging trials: the constraint and the objective


@dataclass(frozen=True)
class Verdict:
    feasible: bool
    reason: str
    objective: Optional[float]
    accuracy_drop: Optional[float]


def time_to_accuracy(result: RunResult, target: float) -> Optional[float]:
    """Seconds of training steps until the first evaluation at or above ``target``; None if never.

    Sums the measured step times (warm-up included: it is real time to accuracy), not evaluation time.
    """
    for entry in sorted(result.evals, key=lambda e: e["step"]):
        if entry.get("val_accuracy", -1.0) + _EPS >= target:
            return float(sum(h["step_time_s"] for h in result.history if h["step"] < entry["step"]))
    return None


def objective_value(result: RunResult, objective: str, target_accuracy: float) -> Optional[float]:
    """The objective's figure for ``result`` (None when it has none, e.g. target never reached)."""
    if objective == "time_to_accuracy":
        return time_to_accuracy(result, target_accuracy)
    value = result.metrics.get(objective)
    if isinstance(value, (int, float)) and math.isfinite(value):
        return float(value)
    return None


def judge(status: str, result: Optional[RunResult], baseline_accuracy: float, cfg: Config, *,
          error: Optional[str] = None, last: Optional[Mapping[str, Any]] = None) -> Verdict:
    """Feasible or not, and why; the objective figure where there is one.

    ``status``: ``done`` (trained the whole budget), ``diverged`` (NaN/inf loss), ``stopped`` (stopped
    early by ASHA), ``failed`` (any other error). Only a finished trial can be feasible: its validation
    accuracy may be at most ``search.max_accuracy_drop`` below the baseline's.
    """
    s = cfg.search
    last = last or {}
    if status == "diverged":
        return Verdict(False, "diverged: " + _last_line(error or "NaN or inf loss"), None, None)
    if status == "stopped":
        where = f" at step {int(last['step'])} (loss {last['loss']:.4g})" if "step" in last and "loss" in last else ""
        return Verdict(False, f"stopped early by ASHA{where}", None, None)
    if status != "done" or result is None:
        return Verdict(False, "failed: " + _last_line(error or "no result"), None, None)
    accuracy = result.metrics.get("val_accuracy")
    if not isinstance(accuracy, (int, float)) or not math.isfinite(accuracy):
        return Verdict(False, "no validation accuracy (the data has no validation split)", None, None)
    drop = baseline_accuracy - accuracy
    objective = objective_value(result, s.objective, s.target_accuracy)
    if drop > s.max_accuracy_drop + _EPS:
        return Verdict(False, f"accuracy {accuracy:.2%} is {drop * 100:.1f} points below the baseline's "
                              f"{baseline_accuracy:.2%} (allowed: {s.max_accuracy_drop * 100:.1f})",
                       objective, drop)
    if objective is None:
        if s.objective == "time_to_accuracy":
            return Verdict(False, f"never reached the target accuracy {s.target_accuracy:.2%} "
                                  "within the budget", None, drop)
        return Verdict(False, f"no {s.objective} figure", None, drop)
    return Verdict(True, "within the accuracy budget", objective, drop)


def accuracy_excess(result: Optional[RunResult], baseline_accuracy: float, max_drop: float) -> float:
    """The drop beyond the allowed one (<= 0 feasible): the constraint value given to Optuna's sampler."""
    accuracy = result.metrics.get("val_accuracy") if result is not None else None
    if not isinstance(accuracy, (int, float)) or not math.isfinite(accuracy):
        return 1.0
    return (baseline_accuracy - accuracy) - max_drop


def is_divergence(error: BaseException) -> bool:
    """True when a worker's ``DivergedError`` (NaN/inf loss) is what failed the run.

    The worker's exception reaches the driver wrapped (``TrainingError`` <- Ray's ``WorkerGroupError``
    holding each rank's exception); look through the chain and the per-rank failures.
    """
    seen: set[int] = set()
    stack: list[BaseException] = [error]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, DivergedError) or type(e).__name__ == "DivergedError":
            return True
        stack += [e.__cause__, e.__context__]
        failures = getattr(e, "worker_failures", None)
        if isinstance(failures, dict):
            stack += list(failures.values())
    # The message text survives every wrapping, even where the exception types do not.
    return "DivergedError" in str(error) or "the run diverged" in str(error)


def _last_line(text: str) -> str:
    lines = [line for line in str(text).strip().splitlines() if line.strip()]
    return lines[-1].strip()[:300] if lines else ""


# --------------------------------------------------------------------------------------------------
# The Tune function trainable


def trial_trainable(config: dict[str, Any], *, base: dict[str, Any], search_name: str,
                    baseline_accuracy: float) -> None:
    """One trial: a multi-worker Ray Train run of ``base`` with the trial's overrides (``config``).

    Workers' reports reach Tune through ``TuneReportCallback`` (ASHA reads their ``loss`` at ``step``);
    the final figures, the verdict's inputs and the whole ``RunResult`` follow in one last report.
    A failed or diverged run is reported, not raised: for the search it is an infeasible setting.
    """
    from ray import tune
    from ray.train import CheckpointConfig, FailureConfig, RunConfig
    from ray.tune.integration.ray_train import TuneReportCallback

    from rayvit.trainer import TrainingError, default_storage_path, fit

    cfg = from_dict(base, dict(config))
    run_config = RunConfig(
        name=f"{search_name}-{tune.get_context().get_trial_id()}",
        storage_path=default_storage_path(),
        failure_config=FailureConfig(max_failures=cfg.train.max_failures, controller_failure_limit=0),
        checkpoint_config=CheckpointConfig(num_to_keep=1),
        callbacks=[TuneReportCallback()])
    try:
        result = fit(cfg, run_config=run_config)
    except TrainingError as e:
        tune.report({STATUS_KEY: "diverged" if is_divergence(e) else "failed", ERROR_KEY: str(e)[-4000:]})
        return
    s = cfg.search
    report: dict[str, Any] = {k: float(v) for k, v in result.metrics.items()
                              if isinstance(v, (int, float)) and math.isfinite(v)}
    recent = result.history[-cfg.train.report_every:] or [{"loss": result.metrics["final_loss"]}]
    report.update({STATUS_KEY: "done", "step": cfg.train.steps, "loss": result.metrics["final_loss"],
                   "loss_mean": sum(h["loss"] for h in recent) / len(recent),
                   EXCESS_KEY: accuracy_excess(result, baseline_accuracy, s.max_accuracy_drop),
                   RESULT_KEY: json.dumps(result.to_dict(), default=str)})
    objective = objective_value(result, s.objective, s.target_accuracy)
    if objective is not None:
        report[s.objective] = objective
    tune.report(report)


# --------------------------------------------------------------------------------------------------
# Placement groups left behind by stopped trials


def _actor_placement_groups(job_id: str) -> Optional[list[tuple[bytes, bool]]]:
    """``(id, creator actor dead)`` of ``job_id``'s live, non-detached groups that an actor created.

    Reads the GCS placement-group table directly: Ray's public table omits the creator. None when this
    Ray no longer exposes it (Train's own cleaner is then the only safeguard).
    """
    try:
        from ray._private.state import state
        from ray.core.generated import gcs_pb2

        table = state._connect_and_get_accessor().get_placement_group_table()
    except Exception as e:  # noqa: BLE001 - a private API: degrade to Ray's own cleaner
        logger.debug("cannot read the placement-group table: %s", e)
        return None
    groups = []
    for blob in table:
        pg = gcs_pb2.PlacementGroupTableData.FromString(blob)
        # Groups the driver made itself (Tune's per-trial groups) have a nil creator actor.
        if (pg.state == gcs_pb2.PlacementGroupTableData.REMOVED or pg.is_detached
                or pg.creator_job_id.hex() != job_id or not pg.creator_actor_id.strip(b"\x00\xff")):
            continue
        groups.append((pg.placement_group_id, bool(pg.creator_actor_dead)))
    return groups


def release_orphaned_placement_groups(job_id: str) -> list[str]:
    """Remove ``job_id``'s placement groups whose creating actor is dead; return their ids.

    Ray keeps a placement group until both the actor that created it and its job are gone. Ray Train V2's
    controller (an actor owned by the trial) creates the workers' group; when Tune stops a trial mid-run
    (ASHA), the trial actor and its controller die but the group stays reserved until the driver exits,
    and the next trial's workers never fit. Train's own cleaner actor frees it only when the dashboard's
    state API answers. Nothing can use such a group any more: the only actors placed in it belonged to
    the dead creator. Driver-made groups, detached groups and other jobs' groups are left alone.
    """
    from ray import PlacementGroupID
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    removed = []
    for pg_id, creator_dead in _actor_placement_groups(job_id) or []:
        if not creator_dead:
            continue
        try:
            remove_placement_group(PlacementGroup(PlacementGroupID(pg_id)))
            removed.append(pg_id.hex())
        except Exception as e:  # noqa: BLE001 - already being removed
            logger.debug("could not remove placement group %s: %s", pg_id.hex(), e)
    return removed


def _tune_callback_base():
    from ray import tune

    return tune.Callback


class _PlacementGroupReleaser(_tune_callback_base()):
    """Tune callback: frees placement groups left by stopped trials, about once a second and at each trial end."""

    def __init__(self, job_id: str, interval_s: float = 1.0):
        self.job_id = job_id
        self.interval_s = interval_s
        self.released: list[str] = []
        self._next = 0.0

    def _sweep(self) -> None:
        self._next = time.monotonic() + self.interval_s
        freed = release_orphaned_placement_groups(self.job_id)
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
            if not _actor_placement_groups(self.job_id):
                return
            time.sleep(0.5)
        logger.warning("placement groups of this search are still reserved after %.0f s", timeout_s)


# --------------------------------------------------------------------------------------------------
# Optuna with the accuracy constraint given to the sampler


from ray.tune.search.optuna import OptunaSearch as _OptunaSearch  # noqa: E402 - heavy: kept near its use


class ConstrainedOptunaSearch(_OptunaSearch):
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


def _optuna_searcher(cfg: Config, metric: str, mode: str) -> ConstrainedOptunaSearch:
    """Optuna TPE whose sampler sees the accuracy constraint as a constraint, not part of the objective."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sampler = optuna.samplers.TPESampler(seed=cfg.train.seed,
                                         n_startup_trials=max(2, min(5, cfg.search.num_samples // 2)))
    return ConstrainedOptunaSearch(metric=metric, mode=mode, sampler=sampler)


# --------------------------------------------------------------------------------------------------
# Outcomes, rows and the table


@dataclass
class TrialOutcome:
    """What one trial (or the baseline) produced and how it was judged."""

    label: str                          # "baseline", "t01", ...
    overrides: dict[str, Any]
    status: str                         # done | diverged | stopped | failed
    verdict: Verdict
    result: Optional[RunResult] = None
    error: Optional[str] = None
    run_id: Optional[str] = None
    seconds: float = 0.0
    trial_id: Optional[str] = None
    cfg: Optional[Config] = field(default=None, repr=False)

    @property
    def feasible(self) -> bool:
        return self.verdict.feasible


def speedup(objective: Optional[float], baseline: Optional[float], mode: str) -> Optional[float]:
    """How many times better than the baseline (a time ratio inverted for ``min`` objectives)."""
    if objective is None or baseline is None or objective <= 0 or baseline <= 0:
        return None
    return objective / baseline if mode == "max" else baseline / objective


def rows_of(outcomes: list[TrialOutcome], baseline: TrialOutcome, mode: str) -> list[dict[str, Any]]:
    """One flat row per trial (baseline first): setting, verdict, objective, speedup, conditions, figures."""
    rows = []
    for o in [baseline] + [o for o in outcomes if o is not baseline]:
        row: dict[str, Any] = {"trial": o.label, "setting": setting_label(o.overrides), "status": o.status,
                               "feasible": o.feasible, "reason": o.verdict.reason,
                               "objective": o.verdict.objective,
                               "speedup_vs_baseline": speedup(o.verdict.objective, baseline.verdict.objective, mode),
                               "accuracy_drop": o.verdict.accuracy_drop, "run_id": o.run_id,
                               "seconds": round(o.seconds, 1), "error": o.error}
        row.update({f"set.{k}": v for k, v in o.overrides.items()})
        if o.result is not None:
            row.update(o.result.row())
        rows.append(row)
    return rows


def sort_rows(rows: list[dict[str, Any]], mode: str) -> list[dict[str, Any]]:
    """Best objective first; trials without an objective last."""
    sign = -1.0 if mode == "max" else 1.0
    return sorted(rows, key=lambda r: (r["objective"] is None, sign * (r["objective"] or 0.0)))


def _fmt(value: Any, spec: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return "-"
    return format(value, spec)


def format_table(rows: list[dict[str, Any]], objective: str, best: Optional[str] = None) -> str:
    """All trials sorted by objective, with feasibility and why; ``*`` marks the best feasible one."""
    header = ["", "trial", "setting", objective, "vs base", "val acc", "drop pts", "img/s/chip", "feasible",
              "reason"]
    spec = ".4g" if objective != "time_to_accuracy" else ".1f"
    lines = [["*" if r["trial"] == best else "", r["trial"], r["setting"], _fmt(r["objective"], spec),
              _fmt(r["speedup_vs_baseline"], ".2f") + ("x" if r["speedup_vs_baseline"] else ""),
              _fmt(r.get("val_accuracy"), ".2%"),
              _fmt(r["accuracy_drop"] * 100 if r["accuracy_drop"] is not None else None, "+.1f"),
              _fmt(r.get("images_per_sec_per_chip"), ".1f"), "yes" if r["feasible"] else "no", r["reason"]]
             for r in rows]
    widths = [max(len(h), *(len(line[i]) for line in lines)) if lines else len(h) for i, h in enumerate(header)]
    out = ["  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip(),
           "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines]
    return "\n".join(out)


def best_outcome(outcomes: list[TrialOutcome], mode: str) -> Optional[TrialOutcome]:
    """The feasible outcome with the best objective (ties: the earlier one)."""
    feasible = [o for o in outcomes if o.feasible and o.verdict.objective is not None]
    if not feasible:
        return None
    pick = max if mode == "max" else min
    return pick(feasible, key=lambda o: o.verdict.objective)


def write_best_config(cfg: Config, path: str | Path, header: list[str]) -> Path:
    """Write ``cfg`` as YAML that ``load_config`` (and ``experiments/scaling.py --config``) reads back."""
    path = Path(path).expanduser().resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    # The search section is spent: a rerun of the written config should not search again by accident.
    clean = cfg.replace({"search.space": {}, "search.name": None, "sweep.name": None})
    text = "".join(f"# {line}\n" for line in header) + clean.to_yaml()
    path.write_text(text)
    from rayvit.config import load_config

    load_config(path)   # what we write must load
    return path


# --------------------------------------------------------------------------------------------------
# Running a search


@dataclass
class SearchReport:
    """Where a search went and what it found."""

    name: str
    experiment: str
    tracking_uri: str
    parent_run_id: str
    objective: str
    mode: str
    baseline: TrialOutcome
    outcomes: list[TrialOutcome]
    rows: list[dict[str, Any]]
    best: TrialOutcome
    best_config_path: Path
    seconds: float
    released_placement_groups: int = 0
    artifacts: list[str] = field(default_factory=list)

    @property
    def errors(self) -> list[TrialOutcome]:
        """Trials that failed for a reason other than the search's own judgement."""
        return [o for o in self.outcomes if o.status == "failed"]

    @property
    def exit_code(self) -> int:
        return 1 if self.errors else 0


class BaselineFailed(RuntimeError):
    """The baseline did not produce a validation accuracy, so the constraint cannot be applied."""


def default_search_name() -> str:
    return f"search-{datetime.now().strftime('%Y%m%d-%H%M%S')}"


def concurrency(cfgs: list[Config], requested: int) -> int:
    """Trials at once: ``requested``, else as many as the cluster's CPUs/GPUs hold side by side."""
    if requested:
        return requested
    import ray

    from rayvit.trainer import resources_for

    cluster = ray.cluster_resources()
    need: dict[str, float] = {}
    for cfg in cfgs:
        for key, value in resources_for(cfg).items():
            need[key] = max(need.get(key, 0.0), value)
    fits = [int(cluster.get(k, 0.0) // v) for k, v in need.items() if v > 0]
    return max(1, min(fits) if fits else 1)


def run_search(cfg: Config, *, experiment: Optional[str] = None, output: Optional[str | Path] = None,
               address: Optional[str] = None, out: Callable[[str], None] = print) -> SearchReport:
    """Run the search ``cfg.search`` describes; see the module docstring for the steps.

    Raises ``ConfigError``, ``TrackingError`` or ``ClusterTooSmall`` before anything trains, and
    ``BaselineFailed`` if the baseline cannot give a reference accuracy.
    """
    import ray
    from ray import tune

    from rayvit import tracking
    from rayvit.launch import capacity
    from rayvit.trainer import TrainingError, check_cluster_fits, ensure_ray, fit

    start = time.monotonic()
    name = cfg.search.name or default_search_name()
    cfg = cfg.replace({"search.name": name})
    plan = plan_search(cfg)
    s = cfg.search
    mode = plan.mode
    experiment = experiment or cfg.tracking.experiment or _DEFAULT_EXPERIMENT

    # Fail fast, cheapest first: tracking store, then the cluster.
    uri = tracking.resolve_tracking_uri(cfg.tracking.uri)
    tracking.check_reachable(uri)
    ensure_ray(address)
    trials = [_derive(cfg, o, "trial") for o in plan.settings]
    check_cluster_fits([plan.baseline] + trials)
    parallel = concurrency([plan.baseline] + [cfg.replace(o) for o in plan.settings], s.max_concurrent_trials)

    tracker = tracking.SweepTracker(uri, experiment, name)
    # Kind "search"/"trial" keeps these runs apart from scaling sweeps (whose resume looks for "sweep").
    parent = tracker.start(params=cfg.flatten(), tags={
        tracking.TAG_KIND: "search", "objective": s.objective, "algorithm": s.algorithm,
        "max_accuracy_drop": s.max_accuracy_drop, "asha": s.asha, "space": json.dumps(plan.space),
        "baseline": json.dumps(plan.baseline_overrides), "data": cfg.data.name}, config_yaml=cfg.to_yaml())
    out(f"search {name!r}: {plan.num_trials} trial(s) by {s.algorithm}{' + ASHA' if s.asha else ''}, "
        f"objective {s.objective} ({mode}), at most {s.max_accuracy_drop * 100:.1f} accuracy points "
        f"below the baseline; up to {parallel} trial(s) at once")
    out(f"tracking: {uri}, experiment {experiment!r}, parent run {parent}")

    try:
        # 1. The baseline: its accuracy must be known before any trial is judged.
        out(f"[baseline] training {setting_label(plan.baseline_overrides)} for {cfg.train.steps} steps")
        t0 = time.monotonic()
        try:
            base_result = capacity.waiting(fit, out)(plan.baseline)
            base_status, base_error = "done", None
        except TrainingError as e:
            base_result, base_error = None, str(e)
            base_status = "diverged" if is_divergence(e) else "failed"
        base_accuracy = (base_result.metrics.get("val_accuracy") if base_result else None)
        base_ok = isinstance(base_accuracy, (int, float)) and math.isfinite(base_accuracy)
        verdict = judge(base_status, base_result, base_accuracy if base_ok else math.nan, plan.baseline,
                        error=base_error)
        baseline = TrialOutcome("baseline", plan.baseline_overrides, base_status, verdict, base_result,
                                base_error, seconds=time.monotonic() - t0, cfg=plan.baseline)
        _record(tracker, baseline, role="baseline")
        if not base_ok or not verdict.feasible:
            raise BaselineFailed(f"the baseline ({setting_label(plan.baseline_overrides)}) gave no reference "
                                 f"accuracy: {verdict.reason}")
        tracker.log_metrics(parent, {"baseline_val_accuracy": base_accuracy,
                                     f"baseline_{s.objective}": verdict.objective}, step=0)
        out(f"[baseline] done in {baseline.seconds:.0f} s: val accuracy {base_accuracy:.2%}, "
            f"{s.objective} {_fmt(verdict.objective, '.4g')}")

        # 2. The trials.
        recorder = _TrialRecorder(cfg, tracker, base_accuracy, baseline.verdict.objective, mode,
                                  plan.num_trials, out)
        releaser = _PlacementGroupReleaser(ray.get_runtime_context().get_job_id())
        trainable = tune.with_resources(
            tune.with_parameters(trial_trainable, base=cfg.to_dict(), search_name=name,
                                 baseline_accuracy=base_accuracy),
            {"CPU": 0, HEAD_NODE_RESOURCE: 0.001})
        if s.algorithm == "grid":
            param_space = {k: tune.grid_search(v) for k, v in plan.space.items()}
            search_alg, samples = None, 1
        else:
            param_space = {k: tune.choice(v) for k, v in plan.space.items()}
            search_alg, samples = _optuna_searcher(cfg, s.objective, mode), s.num_samples
            # The workers' intermediate reports carry loss, not the objective (it exists only once the
            # run is measured); Tune would otherwise reject them. Read at each result, in this process.
            os.environ["TUNE_DISABLE_STRICT_METRIC_CHECKING"] = "1"
        scheduler = None
        if s.asha:
            from ray.tune.schedulers import ASHAScheduler

            # max_t above the last step: the budget's end is never a reason to stop a trial (that would
            # cut off its final report); rungs fall at grace x factor^k steps.
            grace = s.asha_grace_steps or max(1, cfg.train.steps // 4)
            scheduler = ASHAScheduler(time_attr="step", metric="loss", mode="min", max_t=cfg.train.steps + 1,
                                      grace_period=min(grace, cfg.train.steps),
                                      reduction_factor=s.asha_reduction_factor)
        tuner = tune.Tuner(
            trainable, param_space=param_space,
            tune_config=tune.TuneConfig(search_alg=search_alg, scheduler=scheduler, num_samples=samples,
                                        max_concurrent_trials=parallel, reuse_actors=False),
            run_config=tune.RunConfig(name=name, storage_path=_tune_storage(), verbose=0,
                                      callbacks=[releaser, recorder]))
        # Trials start on whatever is up: hold the cluster at the largest trial's size while they run.
        with capacity.capacity_for(capacity.largest(trials or [plan.baseline]), out):
            tuner.fit()
        # The last trial's controller may still be dying: leave the cluster as we found it.
        releaser.drain()
    except KeyboardInterrupt:
        tracker.end("KILLED")
        raise
    except BaselineFailed:
        tracker.set_parent_tags({"rayvit.error": "baseline failed"})
        tracker.end("FAILED")
        raise

    # 3. Results: table, plot, best config.
    outcomes = sorted(recorder.outcomes.values(), key=lambda o: o.label)
    rows = sort_rows(rows_of(outcomes, baseline, mode), mode)
    best = best_outcome([baseline] + outcomes, mode) or baseline
    best_path = Path(output) if output else tracking.rayvit_home() / "searches" / name / "best_config.yaml"
    gain = speedup(best.verdict.objective, baseline.verdict.objective, mode)
    best_path = write_best_config(best.cfg, best_path, [
        f"Best feasible setting of rayvit search {name!r} (MLflow experiment {experiment!r}, parent run {parent}).",
        f"Setting: {setting_label(best.overrides)} ({best.label}); {s.objective} = "
        f"{_fmt(best.verdict.objective, '.4g')}, {_fmt(gain, '.2f')}x the baseline's.",
        f"Validation accuracy {_fmt(best.result.metrics.get('val_accuracy'), '.2%')} against the baseline's "
        f"{base_accuracy:.2%} (allowed drop: {s.max_accuracy_drop * 100:.1f} points).",
        "Run it: python experiments/scaling.py --config <this file>"])
    report = SearchReport(name, experiment, uri, parent, s.objective, mode, baseline, outcomes, rows, best,
                          best_path, time.monotonic() - start, len(releaser.released))
    _log_parent_results(tracker, report, cfg)
    tracker.end("FAILED" if report.errors else "FINISHED")
    return report


def _tune_storage() -> str:
    from rayvit.trainer import default_storage_path

    return str(Path(default_storage_path()).parent / "tune_results")


def _record(tracker, o: TrialOutcome, role: str) -> None:
    """One MLflow child run: the trial's params, figures, verdict (``feasible`` tag) and reason."""
    from rayvit import tracking

    c = o.cfg
    tags = {tracking.TAG_KIND: "trial", "rayvit.role": role, "rayvit.trial": o.label,
            "setting": setting_label(o.overrides), "feasible": str(o.feasible).lower(),
            "reason": o.verdict.reason, "status": o.status, "strategy": c.parallel.strategy,
            "world_size": c.parallel.num_workers}
    run_id = tracker.start_point(f"{o.label} · {setting_label(o.overrides)}", o.label, "",
                                 {**c.flatten(), **{f"trial.{k}": v for k, v in o.overrides.items()}}, tags)
    o.run_id = run_id
    figures = {"objective": o.verdict.objective, "accuracy_drop": o.verdict.accuracy_drop,
               "trial_seconds": o.seconds}
    if o.result is not None:
        tracker.log_metrics(run_id, figures, step=0)
        tracker.finish_point(run_id, o.result, step=0)
    else:
        tracker.log_metrics(run_id, figures, step=0)
        status = "KILLED" if o.status == "stopped" else "FAILED"
        tracker.fail_point(run_id, o.error or o.verdict.reason, status=status)


class _TrialRecorder(_tune_callback_base()):
    """Tune callback on the driver: judges each finished trial, records it in MLflow, prints a line."""

    def __init__(self, cfg: Config, tracker, baseline_accuracy: float, baseline_objective: Optional[float],
                 mode: str, total: int, out: Callable[[str], None]):
        self.cfg = cfg
        self.tracker = tracker
        self.baseline_accuracy = baseline_accuracy
        self.baseline_objective = baseline_objective
        self.mode = mode
        self.total = total
        self.out = out
        self.labels: dict[str, str] = {}
        self.started: dict[str, float] = {}
        self.outcomes: dict[str, TrialOutcome] = {}

    def __getstate__(self) -> dict:
        # Tune pickles its callbacks into the experiment state; the MLflow client and the output
        # function stay with this driver (a restored experiment gets a new recorder).
        return {k: v for k, v in self.__dict__.items() if k not in ("tracker", "out")}

    def on_trial_start(self, iteration, trials, trial, **info):
        label = self.labels.setdefault(trial.trial_id, f"t{len(self.labels) + 1:02d}")
        self.started[trial.trial_id] = time.monotonic()
        self.out(f"[{label}/{self.total}] running {setting_label(self._overrides(trial))}")

    def on_trial_complete(self, iteration, trials, trial, **info):
        last = dict(trial.last_result or {})
        # No final report means Tune stopped the trial before its run ended: ASHA's decision.
        status = last.get(STATUS_KEY, "stopped")
        self._finish(trial, status, last, last.get(ERROR_KEY))

    def on_trial_error(self, iteration, trials, trial, **info):
        error = None
        try:
            error = str(trial.get_error())
        except Exception:  # noqa: BLE001 - the message is a courtesy
            pass
        self._finish(trial, "failed", dict(trial.last_result or {}), error or "the trial actor failed")

    def _overrides(self, trial) -> dict[str, Any]:
        return {k: trial.config[k] for k in self.cfg.search.space if k in trial.config}

    def _finish(self, trial, status: str, last: dict, error: Optional[str]) -> None:
        if trial.trial_id in self.outcomes:
            return
        label = self.labels.setdefault(trial.trial_id, f"t{len(self.labels) + 1:02d}")
        overrides = self._overrides(trial)
        cfg = self.cfg.replace(overrides)
        result = RunResult.from_dict(json.loads(last[RESULT_KEY])) if status == "done" and RESULT_KEY in last else None
        if status == "done" and result is None:
            status, error = "failed", "the trial finished without its result"
        verdict = judge(status, result, self.baseline_accuracy, cfg, error=error, last=last)
        seconds = time.monotonic() - self.started.get(trial.trial_id, time.monotonic())
        o = TrialOutcome(label, overrides, status, verdict, result, error, seconds=seconds,
                         trial_id=trial.trial_id, cfg=cfg)
        self.outcomes[trial.trial_id] = o
        try:
            _record(self.tracker, o, role="trial")
        except Exception:  # noqa: BLE001 - a tracking hiccup must not lose the search
            logger.warning("could not record trial %s in MLflow:\n%s", label, traceback.format_exc())
        gain = speedup(verdict.objective, self.baseline_objective, self.mode)
        acc = result.metrics.get("val_accuracy") if result else None
        figures = ""
        if result is not None:
            figures = (f"; {self.cfg.search.objective} {_fmt(verdict.objective, '.4g')} ({_fmt(gain, '.2f')}x "
                       f"baseline), val accuracy {_fmt(acc, '.2%')}")
        self.out(f"[{label}/{self.total}] {setting_label(overrides)}: {'FEASIBLE' if o.feasible else 'infeasible'}"
                 f" in {seconds:.0f} s{figures}; {verdict.reason}")


def _log_parent_results(tracker, report: SearchReport, cfg: Config) -> None:
    """On the parent run: the trials table (parquet + text), the accuracy-vs-throughput plot, the best config."""
    from rayvit import plots
    from rayvit.sweep import write_parquet

    s = cfg.search
    best, base = report.best, report.baseline
    base_acc = base.result.metrics["val_accuracy"]
    tracker.set_parent_tags({"best_trial": best.label, "best_setting": setting_label(best.overrides),
                             "trials": len(report.outcomes),
                             "feasible_trials": sum(o.feasible for o in report.outcomes),
                             "released_placement_groups": report.released_placement_groups})
    tracker.log_metrics(report.parent_run_id, {
        f"best_{s.objective}": best.verdict.objective,
        "best_speedup_vs_baseline": speedup(best.verdict.objective, base.verdict.objective, report.mode),
        "best_val_accuracy": best.result.metrics.get("val_accuracy"), "search_seconds": report.seconds}, step=0)
    with tempfile.TemporaryDirectory() as tmp:
        table = Path(tmp) / "search_trials.txt"
        table.write_text(format_table(report.rows, s.objective, best.label) + "\n")
        files = [write_parquet(report.rows, Path(tmp) / "search_trials.parquet"), table]
        files.append(plots.search_figure(
            report.rows, Path(tmp) / "accuracy_vs_throughput.png", objective=s.objective,
            baseline_accuracy=base_acc, max_accuracy_drop=s.max_accuracy_drop, best=best.label,
            title=f"{report.name}: accuracy against {s.objective}"))
        best_copy = Path(tmp) / "best_config.yaml"
        best_copy.write_text(report.best_config_path.read_text())
        files.append(best_copy)
        for f in files:
            tracker.log_parent_file(f)
            report.artifacts.append(f.name)


def print_summary(report: SearchReport, out: Callable[[str], None] = print) -> None:
    """The table of all trials, the best setting and its speedup, where everything went."""
    from rayvit.tracking import ui_command

    out("")
    out(format_table(report.rows, report.objective, report.best.label))
    gain = speedup(report.best.verdict.objective, report.baseline.verdict.objective, report.mode)
    feasible = sum(o.feasible for o in report.outcomes)
    out(f"\n{len(report.outcomes)} trials, {feasible} feasible, in {report.seconds:.0f} s. "
        f"Best feasible: {report.best.label} ({setting_label(report.best.overrides)}), "
        f"{_fmt(gain, '.2f')}x the baseline's {report.objective}.")
    if report.best is report.baseline:
        out("No trial beat the baseline within the accuracy budget: the best config is the baseline's.")
    for o in report.errors:
        out(f"ERROR {o.label} ({setting_label(o.overrides)}): {_last_line(o.error or '')}")
    out(f"best config: {report.best_config_path}")
    out(f"  run it:  python experiments/scaling.py --config {report.best_config_path}")
    out(f"search {report.name!r} in experiment {report.experiment!r}, parent run {report.parent_run_id}; "
        f"artifacts: {', '.join(report.artifacts)}")
    out(f"browse:    {ui_command(report.tracking_uri)}")
