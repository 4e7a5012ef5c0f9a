"""rayvit's Ray Train layer, for your own Ray pipelines (the implementation lives in :mod:`rayvit.launch`).

- ``train_loop_per_worker(config)``: the function any ``TorchTrainer`` can run; ``config["rayvit"]`` is
  a run config dict (``Config.to_dict()``).
- ``build_trainer(cfg, datasets=None, run_config=None) -> TorchTrainer``: scaling, backend, failure
  handling, storage and datasets derived from the config, for callers who want to ``fit()`` themselves.
- ``fit(cfg) -> RunResult``: run it and return the typed summary; raises ``TrainingError`` on failure.
"""

from rayvit.launch.capacity import ClusterTooSmall, ScaleUpTimeout
from rayvit.launch.connect import ConnectError, ensure_ray
from rayvit.launch.storage import StorageError, check_storage, default_storage_path, storage_path
from rayvit.launch.trainer import TrainingError, build_trainer, check_cluster_fits, fit, train_loop_per_worker

__all__ = ["ClusterTooSmall", "ConnectError", "ScaleUpTimeout", "StorageError", "TrainingError", "build_trainer", "check_cluster_fits",
           "check_storage", "default_storage_path", "ensure_ray", "fit", "storage_path", "train_loop_per_worker"]
