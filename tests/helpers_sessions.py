"""A ``rayvit.worker.Session`` trained a few steps, checkpointed, and its train stream counted."""

from __future__ import annotations


def train_steps(session, steps: int) -> None:
    """``steps`` optimizer steps of a ``rayvit.worker.Session``."""
    for _ in range(steps):
        session.clear_grads()
        session.train_step()


def checkpointed_after(cfg, steps: int, folder, **session_kwargs) -> None:
    """A session of ``cfg`` trained ``steps`` steps, its resumable checkpoint written to ``folder``, closed."""
    from rayvit.worker import Session
    from rayvit.worker.checkpoint_io import save_state

    session = Session(cfg, **session_kwargs)
    try:
        train_steps(session, steps)
        save_state(session, str(folder))
    finally:
        session.close()


class Counted:
    """A session's own train stream, counting the batches drawn from it (``drawn``)."""

    def __init__(self, batches):
        self.batches, self.drawn = batches, 0

    def __next__(self):
        self.drawn += 1
        return next(self.batches)

    def close(self):
        self.batches.close()
