"""One worker's side of training, with no Ray: the loop and what it runs. Precision, optimizers, checkpoint
files and the device's properties are :mod:`rayvit.training`'s; the parallel strategies are
:mod:`rayvit.strategies`'.

- ``loop``: :func:`train`, a whole run in this process, read top to bottom;
- ``session``: :class:`Session`, what one worker builds for a config, its training step and evaluation;
- ``step_clock`` (the steps' times and the NVML ``sampler``), ``run_figures`` (the figures gathered across
  ranks, from ``metrics``), ``agree`` (how the ranks agree that a run ended), ``compiling`` (compile caches);
- ``checkpoint_io`` (a session's checkpoints, and any checkpoint read back), ``faults`` (fault injection);
- ``rounds`` (several runs measured in interleaved rounds), ``bench`` and ``bench_data`` (single-process
  benchmarks of training and of the input pipeline).
"""

from rayvit.errors import DivergedError, InjectedFault
from rayvit.worker.loop import train
from rayvit.worker.session import Session

__all__ = ["DivergedError", "InjectedFault", "Session", "train"]
