"""What became of a study's points, as every study reports it: outcomes, the report, a trial's verdict.

Shared by the sweep, the ladder and the search (:mod:`rayvit.studies.runner` records them); nothing
here knows how a point was run or judged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from rayvit.results import RunResult
from rayvit.studies.plan import Point


@dataclass(frozen=True)
class Verdict:
    """A search trial judged: feasible or not (the accuracy constraint), why, and its objective."""

    feasible: bool
    reason: str
    objective: Optional[float]
    accuracy_drop: Optional[float]
    # Against the baseline, beyond noise (:func:`rayvit.studies.search.judge.versus_baseline`): True when
    # better, False when within noise or worse, None when not compared (infeasible, or the baseline itself).
    beats_baseline: Optional[bool] = None


@dataclass
class Outcome:
    """What became of one point: ``done`` (ran now), ``reused`` (finished earlier), ``failed``,
    ``killed``; search trials also ``diverged``, ``stopped`` (early, by ASHA) or ``interrupted``."""

    point: Point
    status: str
    result: Optional[RunResult] = None
    error: Optional[str] = None
    run_id: Optional[str] = None
    seconds: float = 0.0
    verdict: Optional[Verdict] = None     # searches: feasible or not, and why

    @property
    def ok(self) -> bool:
        return self.result is not None


@dataclass
class Report:
    """Where a study went and what it found."""

    name: str
    kind: str                             # scaling | ladder | search
    experiment: str
    tracking_uri: str
    parent_run_id: str
    outcomes: list[Outcome]
    rows: list[dict[str, Any]]
    artifacts: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def failed(self) -> list[Outcome]:
        """Points that ended in an error (a diverged or stopped search trial is a result, not an error)."""
        return [o for o in self.outcomes if o.status in ("failed", "killed")]

    @property
    def exit_code(self) -> int:
        return 1 if self.failed else 0


def last_line(text: str) -> str:
    """The last non-empty line of an error text (a traceback's message), at most 300 characters."""
    lines = [line for line in str(text).strip().splitlines() if line.strip()]
    return lines[-1].strip()[:300] if lines else ""


def is_divergence(error: BaseException) -> bool:
    """True when a worker's ``DivergedError`` (NaN/inf loss) is what failed the run.

    The worker's exception reaches the driver wrapped (``TrainingError`` <- Ray's ``WorkerGroupError``
    holding each rank's exception); look through the chain and the per-rank failures.
    """
    # Here, not at the top: the worker's loop imports torch, which checking a config or a dry run
    # (everything that imports this module for an Outcome) never needs.
    from rayvit.worker import DivergedError

    seen: set[int] = set()
    stack: list[Optional[BaseException]] = [error]
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
