"""What one run asks of a Ray cluster: a bundle per worker and the total. Pure arithmetic, no Ray."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rayvit.config_schema import Config


def worker_bundle(cfg: "Config") -> dict[str, float]:
    """The resources of one training worker: its CPUs, and one GPU when it trains on GPUs."""
    bundle = {"CPU": float(cfg.parallel.cpus_per_worker)}
    if cfg.parallel.use_gpu:
        bundle["GPU"] = 1.0
    return bundle


def resources_for(cfg: "Config") -> dict[str, float]:
    """Total resources one run asks for: CPUs and GPUs over all its workers."""
    return {key: value * cfg.parallel.num_workers for key, value in worker_bundle(cfg).items()}
