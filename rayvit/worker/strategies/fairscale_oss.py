"""FairScale OSS + ShardedDDP: optimizer state sharded over ranks, each gradient reduced to its owner.

Parameters stay replicated. OSS wraps the real optimizer and gives each rank a partition of the
parameters; ShardedDDP reduces each gradient only to the rank that owns it.

Reduce dtype: ShardedDDP reduces every gradient in its parameter's dtype (its buckets are allocated with
``dtype=param.dtype``, fairscale/nn/data_parallel/sharded_ddp.py:593; direct reductions send
``param.grad``, :440). Its only option, ``reduce_fp16``, down-casts fp32 gradients to fp16 and is switched
off whenever buckets are used (:117-121). So fp32 gradients (fp32, amp) go in fp32, half gradients
(``pure``) in half, and ``pure`` with ``parallel.reduce_dtype=fp32`` is refused at config load.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from rayvit.worker.optim import optimizer_spec, param_groups, weight_decay_plan
from rayvit.worker.strategies.base import Strategy


class FairScaleOSS(Strategy):
    name = "fairscale_oss"

    def parallelize(self, model: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer]:
        from fairscale.nn.data_parallel import ShardedDataParallel
        from fairscale.optim.oss import OSS

        # ShardedDDP needs the optimizer to know which rank owns which gradient: optimizer first.
        groups = param_groups(model, self.cfg.optim.weight_decay, weight_decay_plan(model))
        # model.compile: blocks compiled before wrapping; ShardedDDP's gradient hooks sit on each
        # parameter's accumulator, outside the compiled graphs, and fire as with the eager model.
        self.compile_blocks(model)
        cls, kwargs = optimizer_spec(self.cfg.optim, [p for g in groups for p in g["params"]],
                                     eps=self.precision.adam_eps(self.cfg.optim.eps))
        optimizer = OSS(groups, optim=cls, **kwargs)
        return ShardedDataParallel(model, optimizer), optimizer

    def zero_grad(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        # ShardedDDP reduces gradients through bucket views of .grad: they must be zeroed, never freed.
        optimizer.zero_grad(set_to_none=False)
        model.zero_grad(set_to_none=False)

    def clip_grad_norm_(self, model: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
        # Each rank holds reduced gradients only for the parameters it owns; the others are its own
        # unreduced (or freed) ones. OSS's clip takes the norm over owned gradients and all-reduces it
        # (fairscale/optim/oss.py:278-300), so every rank clips by the same global norm.
        return optimizer.clip_grad_norm(max_norm)

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> Optional[dict]:
        optimizer.consolidate_state_dict(recipient_rank=0)   # collective: every rank joins
        return optimizer.state_dict() if optimizer.rank == 0 else None
