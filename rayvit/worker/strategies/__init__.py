"""Parallel strategies: how the model, its gradients and its optimizer state are spread over ranks.

| strategy          | params     | grads            | optimizer state | runs on  |
| ----------------- | ---------- | ---------------- | --------------- | -------- |
| `ddp`             | replicated | all-reduced      | replicated      | CPU, GPU |
| `fsdp`            | sharded    | reduce-scatter   | sharded         | CPU, GPU | PyTorch FSDP2 (`fully_shard`)
| `fairscale_oss`   | replicated | reduced to owner | sharded         | CPU, GPU | FairScale OSS + ShardedDDP
| `fairscale_fsdp`  | sharded    | reduce-scatter   | sharded         | GPU only | FairScale FSDP, as the study used

Adding one: a module with a :class:`Strategy` subclass, and a line in ``STRATEGIES`` below.
"""

from __future__ import annotations

from rayvit.worker.strategies.base import Strategy, ensure_process_group, rank, world_size
from rayvit.worker.strategies.ddp import DDP
from rayvit.worker.strategies.fairscale_fsdp import FairScaleFSDP
from rayvit.worker.strategies.fairscale_oss import FairScaleOSS
from rayvit.worker.strategies.fsdp import FSDP

STRATEGIES: dict[str, type[Strategy]] = {cls.name: cls for cls in (DDP, FSDP, FairScaleOSS, FairScaleFSDP)}


def strategy_class(name: str) -> type[Strategy]:
    """The strategy registered as ``name`` (``parallel.strategy``)."""
    return STRATEGIES[name]


__all__ = ["STRATEGIES", "Strategy", "ensure_process_group", "rank", "strategy_class", "world_size"]
