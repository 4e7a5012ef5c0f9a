"""A throwaway strategy, as a user would add one: DDP with ZeRO stage 1 (torch's ZeroRedundancyOptimizer).

One module, and a registry line (``STRATEGIES["ddp_zero1"] = DDPZero1``; the tests set it for their own
duration): its config check and its cost model come with the class. Not part of rayvit.

Cost model: DDP's gradient buckets, all-reduced as DDP does; ZeroRedundancyOptimizer gives whole tensors
to ranks (largest first within each parameter group, each to the rank with the fewest elements so far;
``_partition_parameters``), keeps optimizer state for its own only, and after its step broadcasts each
updated parameter from its owner (``_sync_params`` with ``parameters_as_bucket_view=False``), at every
world size.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from rayvit.config_schema import Config
from rayvit.strategies.costs import (Layout, Message, StateBytes, busiest_owner, greedy_partition,
                                     partition_broadcasts, tensor_state)
from rayvit.strategies.shapes import Tensor
from rayvit.training.optim import optimizer_spec, param_groups
from rayvit.strategies.base import rank
from rayvit.strategies.ddp import DDP

# A short run of it: six steps of a two-block ViT at batch 4.
SHORT = ["train.steps=6", "train.warmup_steps=1", "train.batch_size=4", "model.depth=2"]


def zero_owner(tensors: list[Tensor], world: int) -> dict[str, int]:
    """ZeroRedundancyOptimizer's partition of rayvit's two parameter groups (decayed first)."""
    by_size = []
    for group in ([t for t in tensors if not t.no_decay], [t for t in tensors if t.no_decay]):
        by_size += sorted(group, key=lambda t: t.numel, reverse=True)
    return greedy_partition(by_size, world)


class DDPZero1(DDP):
    name = "ddp_zero1"
    colour = "#9467bd"

    @classmethod
    def refuses(cls, cfg: Config) -> Optional[str]:
        if cfg.precision.mode == "mixed":
            return ("precision.mode=mixed cannot combine with parallel.strategy=ddp_zero1: ZeroRedundancyOptimizer "
                    "partitions the model's own (half) parameters, leaving no place for an fp32 master copy; "
                    "use precision.mode=amp or pure")
        return None

    def build_optimizer(self, model: nn.Module, plan: dict) -> torch.optim.Optimizer:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        groups = [g for g in param_groups(model, self.cfg.optim.weight_decay, plan) if g["params"]]
        cls, kwargs = optimizer_spec(self.cfg.optim, [p for g in groups for p in g["params"]],
                                     eps=self.precision.adam_eps(self.cfg.optim.eps))
        return ZeroRedundancyOptimizer(groups, optimizer_class=cls, **kwargs)

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> Optional[dict]:
        optimizer.consolidate_state_dict(to=0)      # collective: every rank joins
        return optimizer.state_dict() if rank() == 0 else None

    @classmethod
    def step_messages(cls, layout: Layout) -> list[Message]:
        owner = zero_owner(list(layout.tensors), layout.n)
        return super().step_messages(layout) + partition_broadcasts(layout, owner, per_tensor=True)

    @classmethod
    def rank_state(cls, layout: Layout, rank: int) -> StateBytes:
        owner = zero_owner(list(layout.tensors), layout.n)
        return tensor_state(layout, rank, owned=lambda t: owner[t.name] == rank)

    @classmethod
    def optimizer_elements(cls, layout: Layout) -> tuple[int, int]:
        return busiest_owner(layout, zero_owner(list(layout.tensors), layout.n))
