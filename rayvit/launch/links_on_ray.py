"""The links microbenchmark (:mod:`rayvit.measure.links`) on Ray Train workers of its own, for a cluster a
sweep has not measured yet (``rayvit`` sweeps measure on a point's own workers instead:
``fit(measure_links=...)``)."""

from __future__ import annotations

import time
import uuid
from typing import Any, Optional

from rayvit import process_state
from rayvit.launch.connect import ensure_ray
from rayvit.launch.storage import default_storage_path
from rayvit.launch.torch_trainer import apply_train_environment, train_environment
from rayvit.measure.links import worker_benchmark


def measure_links(num_workers: int, *, use_gpu: bool = False, cpus_per_worker: int = 1,
                  model: Optional[dict] = None, batch: int = 8, address: Optional[str] = None,
                  placement_strategy: str = "PACK", **options) -> dict[str, Any]:
    """Run the microbenchmark on ``num_workers`` Ray Train workers of its own; returns the links dict
    (rank 0's). Sweeps do not call this: they measure on a point's workers (``fit(measure_links=...)``).
    A Ray it had to start is stopped when it returns."""
    with process_state.kept():
        ensure_ray(address)
        # Ray Train's settings for a run that never reports: no preemption watcher starting while the
        # collectives are timed, on a single local machine (rayvit.launch.torch_trainer.train_environment).
        apply_train_environment(train_environment(None, reports=False))
        return _run(num_workers, use_gpu, cpus_per_worker, model, batch, placement_strategy, options)


def _run(num_workers: int, use_gpu: bool, cpus_per_worker: int, model: Optional[dict], batch: int,
         placement_strategy: str, options: dict) -> dict[str, Any]:
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    start = time.perf_counter()
    trainer = TorchTrainer(
        worker_benchmark,
        train_loop_config={"use_gpu": use_gpu, "threads": cpus_per_worker, "model": model, "batch": batch,
                           **options},
        scaling_config=ScalingConfig(num_workers=num_workers, use_gpu=use_gpu,
                                     resources_per_worker={"CPU": float(cpus_per_worker),
                                                           **({"GPU": 1.0} if use_gpu else {})},
                                     placement_strategy=placement_strategy),
        torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo"),
        run_config=RunConfig(name=f"rayvit-links-{uuid.uuid4().hex[:8]}", storage_path=default_storage_path(),
                             failure_config=FailureConfig(max_failures=0, controller_failure_limit=0)))
    links = trainer.fit().return_value
    links["wall_seconds"] = time.perf_counter() - start
    return links
