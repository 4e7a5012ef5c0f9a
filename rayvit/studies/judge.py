"""Judging a search's trials: the accuracy constraint, the objective, divergence, the best setting."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional

from rayvit.config import SearchConfig
from rayvit.results import RunResult
from rayvit.worker import DivergedError

_EPS = 1e-9


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


def judge(status: str, result: Optional[RunResult], baseline_accuracy: float, s: SearchConfig, *,
          error: Optional[str] = None, last: Optional[Mapping[str, Any]] = None) -> Verdict:
    """Feasible or not, and why; the objective figure where there is one.

    ``status``: ``done`` (trained the whole budget), ``diverged`` (NaN/inf loss), ``stopped`` (stopped
    early by ASHA), ``failed`` (any other error). Only a finished trial can be feasible: its validation
    accuracy may be at most ``search.max_accuracy_drop`` below the baseline's.
    """
    last = last or {}
    if status == "diverged":
        return Verdict(False, "diverged: " + last_line(error or "NaN or inf loss"), None, None)
    if status == "stopped":
        where = f" at step {int(last['step'])} (loss {last['loss']:.4g})" if "step" in last and "loss" in last else ""
        return Verdict(False, f"stopped early by ASHA{where}", None, None)
    if status not in ("done", "reused") or result is None:
        return Verdict(False, "failed: " + last_line(error or "no result"), None, None)
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


def speedup(objective: Optional[float], baseline: Optional[float], mode: str) -> Optional[float]:
    """How many times better than the baseline (a time ratio inverted for ``min`` objectives)."""
    if objective is None or baseline is None or objective <= 0 or baseline <= 0:
        return None
    return objective / baseline if mode == "max" else baseline / objective


def best_outcome(outcomes: Iterable[Any], mode: str) -> Optional[Any]:
    """The feasible outcome (anything with a ``verdict``) with the best objective; ties: the earlier one."""
    feasible = [o for o in outcomes if o.verdict is not None and o.verdict.feasible
                and o.verdict.objective is not None]
    if not feasible:
        return None
    pick = max if mode == "max" else min
    return pick(feasible, key=lambda o: o.verdict.objective)


def last_line(text: str) -> str:
    lines = [line for line in str(text).strip().splitlines() if line.strip()]
    return lines[-1].strip()[:300] if lines else ""
