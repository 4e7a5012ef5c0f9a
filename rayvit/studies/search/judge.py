"""Judging a search's trials: the accuracy constraint, the objective, the baseline, the best setting.

Also what a search raises when it cannot go on (:class:`BaselineFailed`, :class:`SearchInterrupted`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable, Mapping, Optional

from rayvit import stats
from rayvit.config_schema import SearchConfig
from rayvit.errors import BaselineFailed, SearchInterrupted  # noqa: F401 - the search raises them
from rayvit.results import RunResult
from rayvit.studies.outcome import Outcome, Verdict, last_line

_EPS = 1e-9


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
    early by ASHA), ``interrupted`` (the search was stopped by SIGINT/SIGTERM), ``failed`` (any other error). Only a finished trial can be feasible: its validation
    accuracy may be at most ``search.max_accuracy_drop`` below the baseline's.
    """
    last = last or {}
    if status == "diverged":
        return Verdict(False, "diverged: " + last_line(error or "NaN or inf loss"), None, None)
    if status == "interrupted":
        return Verdict(False, "interrupted: the search was stopped before this trial finished "
                              "(a resumed search trains it again)", None, None)
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


def versus_baseline(result: Optional[RunResult], baseline: Optional[RunResult], objective: str,
                    mode: str) -> tuple[bool, str]:
    """Whether ``result`` beats ``baseline`` on ``objective`` beyond noise, and how that reads.

    :mod:`rayvit.stats`' one rule: the ratio of the trial's objective to the baseline's, with its 95%
    interval from both runs' timed steps (:func:`rayvit.stats.compare`, unpaired: the two are separate
    runs, not rounds of one), beats the baseline only when the interval lies wholly above 1.0 (for
    ``max``; below it for ``min``). Without step times to resample (``time_to_accuracy``, results
    recorded before step times were kept) the figures themselves are compared.
    """
    if result is None or baseline is None:
        return False, "no figures to compare with the baseline"
    value, base = result.metrics.get(objective), baseline.metrics.get(objective)
    if objective == "time_to_accuracy" or not _finite(value) or not _finite(base):
        return False, "no figures to compare with the baseline"
    gain = speedup(value, base, mode)
    ratio = _ratio(result, baseline, objective)
    if ratio is None:
        beats = value > base if mode == "max" else value < base
        return beats, f"{gain:.2f}x the baseline (no intervals: figures compared as they are)"
    better = stats.ABOVE if mode == "max" else stats.BELOW
    side = ratio.verdict(1.0)
    where = (f"{value:.4g} against the baseline's {base:.4g}, ratio {ratio.median:.3f}x, "
             f"95% interval {ratio.lo:.3f}-{ratio.hi:.3f}")
    if side == better:
        return True, f"{gain:.2f}x the baseline, beyond noise: {where}"
    if side == stats.WITHIN_NOISE:
        return False, f"{gain:.2f}x, within noise of the baseline: {where}"
    return False, f"{gain:.2f}x, below the baseline: {where}"


def _ratio(result: RunResult, baseline: RunResult, objective: str) -> Optional[stats.Estimate]:
    try:
        return stats.compare(result, baseline, objective, paired=False)
    except (KeyError, TypeError, ValueError):   # figures recorded without what their step times need
        return None


def against_baseline(o: Outcome, baseline: Outcome, objective: str, mode: str) -> Outcome:
    """Outcome ``o`` with its verdict's comparison against the baseline's outcome (feasible trials only)."""
    if o.verdict is None or not o.verdict.feasible or o is baseline:
        return o
    beats, text = versus_baseline(o.result, baseline.result, objective, mode)
    o.verdict = dataclasses.replace(o.verdict, beats_baseline=beats, reason=f"{o.verdict.reason}; {text}")
    return o


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def accuracy_excess(result: Optional[RunResult], baseline_accuracy: float, max_drop: float) -> float:
    """The drop beyond the allowed one (<= 0 feasible): the constraint value given to Optuna's sampler."""
    accuracy = result.metrics.get("val_accuracy") if result is not None else None
    if not isinstance(accuracy, (int, float)) or not math.isfinite(accuracy):
        return 1.0
    return (baseline_accuracy - accuracy) - max_drop


def speedup(objective: Optional[float], baseline: Optional[float], mode: str) -> Optional[float]:
    """How many times better than the baseline (a time ratio inverted for ``min`` objectives)."""
    if objective is None or baseline is None or objective <= 0 or baseline <= 0:
        return None
    return objective / baseline if mode == "max" else baseline / objective


def best_outcome(outcomes: Iterable[Any], mode: str, *, beyond_noise: bool = False) -> Optional[Any]:
    """The feasible outcome (anything with a ``verdict``) with the best objective; ties: the earlier one.

    ``beyond_noise``: only outcomes whose verdict says they beat the baseline beyond noise (and the
    baseline itself, whose ``beats_baseline`` is None) are candidates.
    """
    feasible = [o for o in outcomes if o.verdict is not None and o.verdict.feasible
                and o.verdict.objective is not None
                and (not beyond_noise or o.verdict.beats_baseline is not False)]
    if not feasible:
        return None
    pick = max if mode == "max" else min
    return pick(feasible, key=lambda o: o.verdict.objective)
