"""Fault injection (``train.fail_at_step``), a hook the loop calls before each step: tests and the GPU check
use it to prove that a run survives a crashed worker, a lost process or one rank's NaN loss."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Callable, Iterator, Optional

from rayvit.errors import InjectedFault

if TYPE_CHECKING:
    from rayvit.config_schema import TrainConfig
    from rayvit.worker.session import Session


def fault_injector(t: "TrainConfig") -> Optional[Callable[["Session"], None]]:
    """The hook that fails ``t.fail_rank`` once at step ``t.fail_at_step`` (never after a restart), as
    ``t.fail_mode`` says; None when no fault is asked for."""
    if not t.fail_at_step:
        return None

    def before_step(session: "Session") -> None:
        if session.step != t.fail_at_step or session.restarts != 0 or t.fail_rank not in (session.rank, -1):
            return
        if t.fail_mode == "exit":
            os._exit(70)                           # no cleanup, no traceback: as a lost worker
        if t.fail_mode == "nan":
            session.data.train = _poisoned(session.data.train)
            return
        raise InjectedFault(f"injected fault on rank {session.rank} at step {session.step}")

    return before_step


def _poisoned(batches: Iterator) -> Iterator:
    """``train.fail_mode=nan``: the next batch with NaN images (this rank's loss alone is not finite), then
    the rest as they come."""
    images, labels = next(batches)
    yield images * float("nan"), labels
    yield from batches
