"""DDP: every rank holds the whole model and optimizer; gradients are all-reduced. The study's baseline."""

from __future__ import annotations

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from rayvit.worker.strategies.base import Strategy


class DDP(Strategy):
    name = "ddp"

    def wrap(self, model: nn.Module) -> nn.Module:
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids)
