"""Live progress of a Ray Train run on the driver: rank 0 posts each step's figures, the driver reads them.

Ray Train's reports cost a health-check tick each, so they are made every ``train.report_every`` steps;
progress wants every step. Rank 0 posts to a small actor without waiting for an answer, after the step's
clock has stopped and at most once a second, so the timed window never sees it.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Optional

import ray

if TYPE_CHECKING:
    from rayvit.worker import Session

Item = dict[str, Any]


class _Board:
    """The actor between rank 0 and the driver: the latest items, taken in order."""

    def __init__(self) -> None:
        self.items: list[Item] = []

    def post(self, item: Item) -> None:
        self.items.append(item)

    def take(self) -> list[Item]:
        items, self.items = self.items, []
        return items


class StepPoster:
    """The worker's side (picklable): called after every step, posts from rank 0 at most every ``interval_s``."""

    def __init__(self, board, interval_s: float = 1.0) -> None:
        self.board = board
        self.interval_s = interval_s
        self._next = 0.0

    def __call__(self, session: "Session", **where: Any) -> None:
        last = session.step >= session.cfg.train.steps
        if session.rank != 0 or (time.monotonic() < self._next and not last):
            return
        self._next = time.monotonic() + self.interval_s
        window = session.clock.step_times[-10:]
        self.board.post.remote({
            "kind": "step", **where,
            "step": session.step, "steps": session.cfg.train.steps, "loss": session.history[-1]["loss"],
            "restarts": session.restarts, "time": time.time(),
            "images_per_sec_per_chip": session.cfg.train.batch_size * len(window) / sum(window) if window else None})

    def step_of_group(self, session: "Session", index: int, round: int) -> None:
        """A step of the group's config ``index`` in ``round`` (:func:`rayvit.worker.rounds.measure_rounds`)."""
        self(session, index=index, round=round)

    def round_of_group(self, index: int, round: int, slot: int, result: Optional[dict], error: Optional[str]) -> None:
        """Config ``index`` finished (or failed in) ``round``: its result travels to the driver now, so a
        group that dies later keeps the rounds that finished."""
        import torch.distributed as dist

        if dist.is_initialized() and dist.get_rank() != 0:
            return
        self.board.post.remote({"kind": "round", "index": index, "round": round, "slot": slot,
                                "result": result, "error": error, "time": time.time()})

    def round_abandoned(self, index: int, round: int, slot: int, error: str) -> None:
        """Config ``index`` failed on this rank (any rank: rank 0 may be the one left waiting) and this
        rank ends the group (:class:`rayvit.worker.agree.GroupAbandoned`): the error reaches the driver
        before the group is torn down, so the driver records that config failed instead of rerunning it."""
        ray.get(self.board.post.remote({"kind": "round", "index": index, "round": round, "slot": slot,
                                        "result": None, "error": error, "time": time.time()}), timeout=30)


class ProgressChannel:
    """The driver's side: a board actor for one run and a thread handing its items to ``on_progress``."""

    def __init__(self, on_progress: Callable[[Item], None], interval_s: float = 0.5) -> None:
        # No CPU: it must never take a CPU from the training workers (nor need one on a 0-CPU head).
        self.board = ray.remote(num_cpus=0)(_Board).remote()
        # Wait until its process is up: started later, its start-up (a Python process importing Ray)
        # would compete with the first timed steps for the CPUs.
        ray.get(self.board.take.remote())
        self.on_progress = on_progress
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def poster(self) -> StepPoster:
        return StepPoster(self.board)

    def _drain(self) -> None:
        for item in ray.get(self.board.take.remote()):
            self.on_progress(item)

    def _watch(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._drain()
            except Exception:  # noqa: BLE001 - progress is a courtesy: never fail a run over it
                return

    def __enter__(self) -> "ProgressChannel":
        self._thread = threading.Thread(target=self._watch, name="rayvit-progress", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> bool:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        try:
            self._drain()
        except Exception:  # noqa: BLE001
            pass
        ray.kill(self.board)
        return False
