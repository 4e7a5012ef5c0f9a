"""rayvit's Ray Train layer, for your own Ray pipelines (the implementation lives in :mod:`rayvit.launch`).

- ``train_loop_per_worker(config)``: the function any ``TorchTrainer`` can run; ``config["rayvit"]`` is
  a run config dict (``Config.to_dict()``).
- ``build_trainer(cfg, datasets=None, run_config=None) -> TorchTrainer``: scaling, backend, failure
  handling, storage and datasets derived from the config, for callers who want to ``fit()`` themselves.
- ``fit(cfg) -> RunResult``: run it and return the typed summary; raises ``TrainingError`` on failure.
- ``fit_group(cfgs, rounds) -> GroupResult``: several configs of one worker count measured on one worker
  group in interleaved rounds, each with medians over rounds and 95% intervals.
"""

from rayvit.launch.capacity import ClusterTooSmall, ScaleUpTimeout
from rayvit.launch.connect import ConnectError, ensure_ray
from rayvit.launch.storage import StorageError, check_storage, default_storage_path, storage_path
from rayvit.launch.trainer import (GroupResult, TrainingError, build_trainer, check_cluster_fits, fit, fit_group,
                                   train_loop_per_worker)

__all__ = ["ClusterTooSmall", "ConnectError", "GroupResult", "ScaleUpTimeout", "StorageError", "TrainingError",
           "build_trainer", "check_cluster_fits", "check_storage", "default_storage_path", "ensure_ray", "fit",
           "fit_group", "storage_path", "train_loop_per_worker"]
