"""rayvit's Ray Train layer, for your own Ray pipelines (the implementation lives in :mod:`rayvit.launch`).

- ``make_trainer(cfg, *, scaling_config=None, run_config=None, datasets=None, final_model=True) ->
  TorchTrainer``: a Ray Train ``TorchTrainer`` for a config, checked on the driver; every
  ``ray.train.report`` carries the running TFLOPS, images/s and MFU per chip, the last one the run's
  summary (so ``result.metrics`` and Ray Tune see them) with a checkpoint holding the trained model.
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
- Errors raised before any worker starts, besides ``TrainingError``: ``ClusterTooSmall`` (the cluster, or the
  autoscaler's maximum, can never hold the run), ``ScaleUpTimeout`` (the autoscaler did not add them in
  ``launch.scale_up_timeout_s``), ``StorageError`` (checkpoints without storage every node reaches),
  ``ConnectError`` (``RAY_ADDRESS`` names a cluster that cannot be reached).

Each leaves the caller's process as it found it (:mod:`rayvit.process_state`).
"""

from rayvit.errors import ClusterTooSmall, ConnectError, ScaleUpTimeout, StorageError, TrainingError
from rayvit.launch.entry import loop_config, train_loop_per_worker
from rayvit.launch.torch_trainer import GroupResult, compare, fit, fit_group, make_trainer, scaling_config
from rayvit.results import Comparison, RunResult
from rayvit.worker.checkpoint_io import Checkpointed, load_checkpoint

__all__ = ["Checkpointed", "ClusterTooSmall", "Comparison", "ConnectError", "GroupResult", "RunResult",
           "ScaleUpTimeout", "StorageError", "TrainingError", "compare", "fit", "fit_group", "load_checkpoint",
           "loop_config", "make_trainer", "scaling_config", "train_loop_per_worker"]
