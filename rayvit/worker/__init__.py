"""One worker's side of training, with no Ray: the loop, precision, optimizers, metrics, checkpoints and
one object per parallel strategy. ``train(cfg)`` runs a whole run in this process; ``Session`` is one
worker's state and its training step."""

from rayvit.errors import DivergedError, InjectedFault
from rayvit.worker.loop import train
from rayvit.worker.session import Session

__all__ = ["DivergedError", "InjectedFault", "Session", "train"]
