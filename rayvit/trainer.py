"""rayvit's Ray Train layer, for your own Ray pipelines (the implementation lives in :mod:`rayvit.launch`).

- ``make_trainer(cfg, *, scaling_config=None, run_config=None, datasets=None) -> TorchTrainer``: a Ray
  Train ``TorchTrainer`` for a config, checked on the driver; every ``ray.train.report`` carries the
  running TFLOPS, images/s and MFU per chip, the last one the run's summary (so ``result.metrics`` and
  Ray Tune see them).
- ``train_loop_per_worker``, ``loop_config(cfg)``, ``scaling_config(cfg)``: the pieces, for a
  ``TorchTrainer(train_loop_per_worker, train_loop_config=loop_config(cfg),
  scaling_config=scaling_config(cfg))`` of your own.
- ``fit(cfg) -> RunResult``: run it and return the typed summary; raises ``TrainingError`` on failure.
- ``fit_group(cfgs, rounds) -> GroupResult``: several configs of one worker count measured on one worker
  group in interleaved rounds, each with medians over rounds and 95% intervals.
- ``compare(a, b) -> Comparison``: an A/B of two configs in interleaved rounds, a paired ratio with its
  interval and verdict (``rayvit bench --compare`` is its command line; ``on_ray=True`` runs it on a Ray
  Train worker group).
- ``load_checkpoint(path) -> Checkpointed``: the model (and optimizer state) a rayvit checkpoint holds.

Each leaves the caller's process as it found it (:mod:`rayvit.process_state`).
"""

from rayvit.launch.capacity import ClusterTooSmall, ScaleUpTimeout
from rayvit.launch.connect import ConnectError, ensure_ray
from rayvit.launch.storage import StorageError, check_storage, default_storage_path, storage_path
from rayvit.launch.torch_trainer import (GroupResult, RayvitTrainer, TrainingError, build_trainer, check_cluster_fits, compare,
                                   fit, fit_group, loop_config, make_trainer, scaling_config, train_loop_per_worker)
from rayvit.results import Comparison, RunResult
from rayvit.worker.checkpoint_io import Checkpointed, load_checkpoint

__all__ = ["Checkpointed", "ClusterTooSmall", "Comparison", "ConnectError", "GroupResult", "RayvitTrainer", "RunResult", "ScaleUpTimeout", "StorageError",
           "TrainingError", "build_trainer", "check_cluster_fits", "check_storage", "compare", "default_storage_path",
           "ensure_ray", "fit", "fit_group", "load_checkpoint", "loop_config", "make_trainer", "scaling_config", "storage_path",
           "train_loop_per_worker"]
