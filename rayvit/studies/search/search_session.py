"""A running search's state in this driver, and how SIGINT/SIGTERM stop it.

Tune pickles its searcher, stopper and callbacks into the experiment's state, so they cannot hold the
driver's own objects (the output function, the outcomes judged so far, the interrupt flag). They hold
the search's name and look its :class:`SearchSession` up by it (:func:`session_named`) while the search
runs (:func:`registered`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Optional

from rayvit.studies.outcome import Outcome
from rayvit.studies.plan import SearchPlan, setting_label
from rayvit.studies.search.screen import ScreenReport


@dataclass
class SearchSession:
    """What this driver knows of one running search."""

    name: str
    plan: SearchPlan
    out: Callable[[str], None]
    screen: Optional[ScreenReport] = None               # grid searches with search.screen, once screened
    baseline: Optional[Outcome] = None                  # once trained (or reused from an earlier run)
    started: dict[str, float] = field(default_factory=dict)        # Tune trial id -> its start (monotonic)
    outcomes: dict[str, Outcome] = field(default_factory=dict)     # trial label -> judged outcome (reused too)
    skipped: dict[str, str] = field(default_factory=dict)          # label -> why not trained
    screen_notes: dict[str, str] = field(default_factory=dict)     # label -> its screen, for its running line
    interrupted: Optional[str] = None                   # the signal's name once SIGINT/SIGTERM stopped the trials
    released_placement_groups: int = 0                  # left reserved by stopped trials, freed by the search
    # What the search does with each trial judged in Tune (against the baseline, MLflow, a line).
    on_outcome: Optional[Callable[[Outcome], None]] = None

    @property
    def baseline_accuracy(self) -> float:
        if self.baseline is None or self.baseline.result is None:
            raise RuntimeError(f"search {self.name!r}: the trials started before the baseline's accuracy was known")
        return self.baseline.result.metrics["val_accuracy"]

    def tag(self, label: str) -> str:
        return f"[{label}/{self.plan.num_trials}]"

    def trial_started(self, trial_id: str, label: str, setting: Mapping[str, Any]) -> None:
        self.started[trial_id] = time.monotonic()
        self.out(f"{self.tag(label)} running {setting_label(setting)}{self.screen_notes.get(label, '')}")

    def seconds_since_start(self, trial_id: str) -> float:
        return time.monotonic() - self.started.get(trial_id, time.monotonic())

    def skip(self, label: str, setting: Mapping[str, Any], why: str) -> None:
        """A setting left untrained (the screen, the stop rule), with why."""
        self.skipped[label] = why
        self.out(f"{self.tag(label)} {setting_label(setting)}: not trained, {why}")

    def conclude(self, o: Outcome) -> None:
        """A trial judged: kept (once per label) and handed to :attr:`on_outcome`."""
        self.outcomes[o.point.key] = o
        if self.on_outcome is not None:
            self.on_outcome(o)

    @property
    def finished(self) -> list[Outcome]:
        """Trials that ran their whole budget, now or in an earlier run of the search."""
        return [o for o in self.outcomes.values() if o.status in ("done", "reused")]


_SESSIONS: dict[str, SearchSession] = {}


@contextlib.contextmanager
def registered(session: SearchSession) -> Iterator[SearchSession]:
    """``session`` found by its name (:func:`session_named`) until the block ends, however it ends."""
    _SESSIONS[session.name] = session
    try:
        yield session
    finally:
        _SESSIONS.pop(session.name, None)


def session_named(name: str) -> Optional[SearchSession]:
    """The running search ``name`` of this driver; None outside it (e.g. a searcher used on its own)."""
    return _SESSIONS.get(name)


def running(name: str) -> SearchSession:
    """The running search ``name`` of this driver (the driver's Tune callbacks run only inside it)."""
    session = _SESSIONS.get(name)
    if session is None:
        raise RuntimeError(f"search {name!r} is not running in this driver")
    return session


class Signals:
    """SIGINT and SIGTERM during a search: stop the trials, then say so (``SearchInterrupted``).

    While Tune runs the trials (:attr:`tune`), the first signal only sets the session's
    :attr:`~SearchSession.interrupted`: the ``InterruptStop`` stopper ends every trial's Ray Train run and
    ``fit()`` returns. Elsewhere (the screen, the baseline), and on a second signal, it raises
    ``KeyboardInterrupt`` at once. Tune's own SIGINT handler (which prints a ``Tuner.restore`` hint and
    lets the search carry on to a "best" config) is kept off for the search.
    """

    def __init__(self, session: SearchSession):
        self.session, self.signum, self.tune = session, None, False
        self.saved: dict[int, Any] = {}

    def __enter__(self) -> "Signals":
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
            self.session.interrupted = signal.Signals(signum).name
            self.session.out(f"{signal.Signals(signum).name}: stopping the running trials ...")
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
