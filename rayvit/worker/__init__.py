"""One worker's side of training, with no Ray: the loop, the figures its ranks gather and agree on, a
group's rounds, checkpoints, compiling, fault injection and the benchmarks a worker runs. Precision and the
optimizers are in ``rayvit.training``, the parallel strategies in ``rayvit.strategies``. ``train(cfg)`` runs
a whole run in this process; ``Session`` is one worker's state and its training step."""

from rayvit.errors import DivergedError, InjectedFault
from rayvit.worker.loop import Session, train

__all__ = ["DivergedError", "InjectedFault", "Session", "train"]
