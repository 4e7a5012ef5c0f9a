"""FairScale's FullyShardedDataParallel, the library the study used. CUDA only.

Every encoder block is wrapped, then the root, as with FSDP2.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from rayvit.config import ConfigError
from rayvit.worker.strategies.base import Strategy, rank


class FairScaleFSDP(Strategy):
    name = "fairscale_fsdp"
    owns_mixed_precision = True

    def wrap(self, model: nn.Module) -> nn.Module:
        if self.device.type != "cuda":
            raise ConfigError("parallel.strategy=fairscale_fsdp needs CUDA; use parallel.strategy=fsdp on CPU")
        from fairscale.nn import FullyShardedDataParallel as FairScaleFSDPWrapper

        mixed = self.precision.mode == "mixed"
        # flatten_parameters=False keeps each parameter an object of its own, so weight-decay grouping
        # by identity still holds after wrapping.
        kwargs = dict(mixed_precision=mixed, compute_dtype=self.precision.half if mixed else None,
                      flatten_parameters=False, reshard_after_forward=self.cfg.parallel.reshard_after_forward)
        for i, block in enumerate(model.blocks):
            model.blocks[i] = FairScaleFSDPWrapper(block, **kwargs)
        return FairScaleFSDPWrapper(model, **kwargs)

    # Sharded state: each rank saves its own shard of the model and optimizer.
    def save(self, directory: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        torch.save({"model": model.local_state_dict(), "optim": optimizer.state_dict()},
                   os.path.join(directory, f"rank{rank()}.pt"))

    def load(self, directory: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        state = torch.load(os.path.join(directory, f"rank{rank()}.pt"), map_location=self.device)
        model.load_local_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
