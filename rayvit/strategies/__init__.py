"""Parallel strategies: how the model, its gradients and its optimizer state are spread over ranks.

| strategy          | params     | grads            | optimizer state | runs on  |
| ----------------- | ---------- | ---------------- | --------------- | -------- |
| `ddp`             | replicated | all-reduced      | replicated      | CPU, GPU |
| `fsdp`            | sharded    | reduce-scatter   | sharded         | CPU, GPU | PyTorch FSDP2 (`fully_shard`)
| `hsdp`            | sharded in a node | reduce-scatter, then all-reduce across nodes | sharded in a node | CPU, GPU | FSDP2 on a 2-D mesh
| `hsdp`            | sharded within a shard group, replicated across | reduce-scatter, then all-reduce | sharded | CPU, GPU | FSDP2 on a 2-D mesh
| `fairscale_oss`   | replicated | reduced to owner | sharded         | CPU, GPU | FairScale OSS + ShardedDDP
| `fairscale_fsdp`  | sharded    | reduce-scatter   | sharded         | GPU only | FairScale FSDP, as the study used

Adding one: a module with a cost half (a :class:`StrategyCosts` subclass: what it allows and costs; the
projection and config validation ask it, without torch) and its runtime half (a :class:`Strategy`
subclass of it: how it wraps and steps), and a :func:`register` line. The strategy every figure is compared
to (the study's DDP) is :data:`rayvit.config_schema.BASELINE`.
"""

from __future__ import annotations

from rayvit.config_schema import BASELINE
from rayvit.strategies.base import Strategy, StrategyCosts, ensure_process_group, rank, world_size
from rayvit.strategies.ddp import DDP
from rayvit.strategies.fairscale_fsdp import FairScaleFSDP
from rayvit.strategies.fairscale_oss import FairScaleOSS
from rayvit.strategies.fsdp import FSDP
from rayvit.strategies.hsdp import HSDP
from rayvit.strategies.registry import register, STRATEGIES, strategy_class

for _cls in (DDP, FSDP, HSDP, FairScaleOSS, FairScaleFSDP):
    register(_cls)
assert BASELINE in STRATEGIES, f"the baseline strategy {BASELINE} is not registered"

__all__ = ["STRATEGIES", "Strategy", "StrategyCosts", "ensure_process_group", "rank", "register",
           "strategy_class", "world_size"]
