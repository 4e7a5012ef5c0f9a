"""Parallel strategies: how the model, its gradients and its optimizer state are spread over ranks.

| strategy          | params     | grads            | optimizer state | runs on  |
| ----------------- | ---------- | ---------------- | --------------- | -------- |
| `ddp`             | replicated | all-reduced      | replicated      | CPU, GPU |
| `fsdp`            | sharded    | reduce-scatter   | sharded         | CPU, GPU | PyTorch FSDP2 (`fully_shard`)
| `fairscale_oss`   | replicated | reduced to owner | sharded         | CPU, GPU | FairScale OSS + ShardedDDP
| `fairscale_fsdp`  | sharded    | reduce-scatter   | sharded         | GPU only | FairScale FSDP, as the study used

Adding one: a module with a :class:`Strategy` subclass (how it wraps and steps, and, in the same class,
what it allows and costs: the projection and config validation ask it), and a line in ``STRATEGIES``
below. ``rayvit.config.BASELINE`` names the strategy every figure is compared to (the study's DDP).
"""

from __future__ import annotations

from rayvit.config import BASELINE
from rayvit.strategies.base import Strategy, ensure_process_group, rank, world_size
from rayvit.strategies.ddp import DDP
from rayvit.strategies.fairscale_fsdp import FairScaleFSDP
from rayvit.strategies.fairscale_oss import FairScaleOSS
from rayvit.strategies.fsdp import FSDP

STRATEGIES: dict[str, type[Strategy]] = {cls.name: cls for cls in (DDP, FSDP, FairScaleOSS, FairScaleFSDP)}
assert BASELINE in STRATEGIES, f"the baseline strategy {BASELINE} is not registered"


def strategy_class(name: str) -> type[Strategy]:
    """The strategy registered as ``name`` (``parallel.strategy``)."""
    try:
        return STRATEGIES[name]
    except KeyError:
        raise ValueError(f"parallel.strategy={name!r} is not a registered strategy; choose one of: "
                         f"{', '.join(STRATEGIES)}") from None


__all__ = ["STRATEGIES", "Strategy", "ensure_process_group", "rank", "strategy_class", "world_size"]
