"""FairScale OSS + ShardedDDP: optimizer state sharded over ranks, each gradient reduced to its owner.

Parameters stay replicated. OSS wraps the real optimizer and gives each rank a partition of the
parameters; ShardedDDP reduces each gradient only to the rank that owns it.

Reduce dtype: ShardedDDP reduces every gradient in its parameter's dtype (its buckets are allocated with
``dtype=param.dtype``, fairscale/nn/data_parallel/sharded_ddp.py:593; direct reductions send
``param.grad``, :440). Its only option, ``reduce_fp16``, down-casts fp32 gradients to fp16 and is switched
off whenever buckets are used (:117-121). So fp32 gradients (fp32, amp) go in fp32, half gradients
(``pure``) in half, and ``pure`` with ``parallel.reduce_dtype=fp32`` is refused at config load.

Cost model: parameters replicated; OSS gives whole tensors to the rank with the least so far (decayed
group first, in parameter order); optimizer state only for owned tensors. ShardedDDP's gradients: at
N > 1 each destination rank's smallest tensors share a bucket of min(2**23, model) elements whose gradient
views every rank keeps; the other gradients are freed on ranks that do not own them (at N = 1 every
gradient stays). Per step, ShardedDDP reduces each destination rank's bucket (and each tensor beyond it;
every tensor at N = 1), then OSS broadcasts each rank's updated partition: about P x (reduce bytes +
weight bytes) through the busiest rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from rayvit.strategies.base import Strategy, StrategyCosts, pure_reduce_refusal
from rayvit.strategies.costs import (Layout, Message, StateBytes, busiest_owner, greedy_partition,
                                     partition_broadcasts, tensor_state)
from rayvit.strategies.shapes import Tensor, optimizer_order

if TYPE_CHECKING:
    import torch
    from torch import nn

    from rayvit.config_schema import Config

SHARDED_DDP_BUCKET = 2 ** 23   # FairScale ShardedDDP reduce_buffer_size default (elements)


def oss_owner(tensors: list[Tensor], world: int) -> dict[str, int]:
    """FairScale ``OSS.partition_parameters``: each tensor, in the optimizer's order, to the rank with the
    fewest elements so far."""
    return greedy_partition(optimizer_order(tensors), world)


def sharded_ddp_bucketed(tensors: list[Tensor], owner: dict[str, int], world: int) -> set[str]:
    """Tensors whose gradients live in ShardedDDP's per-destination buckets (kept on every rank)."""
    if world == 1:
        return set()
    cap = min(SHARDED_DDP_BUCKET, sum(t.numel for t in tensors))
    by_rank = [sorted((t for t in optimizer_order(tensors) if owner[t.name] == r), key=lambda t: t.numel)
               for r in range(world)]
    bucketed, fill = set(), [0] * world
    for r, mine in enumerate(by_rank):
        for t in mine:
            if fill[r] + t.numel < cap:
                fill[r] += t.numel
                bucketed.add(t.name)
    return bucketed


class FairScaleOSSCosts(StrategyCosts):
    """FairScale OSS's cost half: optimizer state partitioned by owner, gradients reduced to their owner,
    parameters broadcast back from it."""

    name = "fairscale_oss"
    colour = "#ff7f0e"

    @classmethod
    def cost_key(cls) -> tuple:
        return (*super().cost_key(), SHARDED_DDP_BUCKET)    # the bucket decides which gradients stay whole

    @classmethod
    def refuses(cls, cfg: Config) -> str | None:
        if cfg.precision.mode == "mixed":
            return ("precision.mode=mixed cannot combine with parallel.strategy=fairscale_oss: OSS shards the "
                    "optimizer over the model's own (half) parameters, leaving no place for an fp32 master copy; "
                    "use precision.mode=amp or pure with fairscale_oss, or parallel.strategy=fsdp with mixed")
        return pure_reduce_refusal(cfg, "ShardedDDP reduces every gradient in its parameter's dtype")

    @classmethod
    def step_messages(cls, layout: Layout) -> list[Message]:
        tensors, n = list(layout.tensors), layout.n
        owner = oss_owner(tensors, n)
        bucketed = sharded_ddp_bucketed(tensors, owner, n)
        width = layout.dt.reduced()
        out = []
        for r in range(n):
            mine = [t for t in optimizer_order(tensors) if owner[t.name] == r]
            inside = sum(t.numel for t in mine if t.name in bucketed)
            if inside:
                out.append(Message("reduce", inside * width, "backward", f"bucket to rank {r}"))
            out += [Message("reduce", t.numel * width, "backward", f"{t.name} to rank {r}")
                    for t in mine if t.name not in bucketed]
        return out + partition_broadcasts(layout, owner)

    @classmethod
    def rank_state(cls, layout: Layout, rank: int) -> StateBytes:
        tensors = list(layout.tensors)
        owner = oss_owner(tensors, layout.n)
        bucketed = sharded_ddp_bucketed(tensors, owner, layout.n)
        return tensor_state(layout, rank, owned=lambda t: owner[t.name] == rank,
                            keeps_grad=lambda t: owner[t.name] == rank or t.name in bucketed)

    @classmethod
    def optimizer_elements(cls, layout: Layout) -> tuple[int, int]:
        return busiest_owner(layout, oss_owner(list(layout.tensors), layout.n))



class FairScaleOSS(FairScaleOSSCosts, Strategy):
    """FairScale OSS's runtime half: its sharded optimizer and ShardedDataParallel around the model."""

    def parallelize(self, model: "nn.Module") -> tuple["nn.Module", "torch.optim.Optimizer"]:
        from fairscale.nn.data_parallel import ShardedDataParallel
        from fairscale.optim.oss import OSS

        from rayvit.training.optim import optimizer_spec, param_groups, weight_decay_plan

        # ShardedDDP needs the optimizer to know which rank owns which gradient: optimizer first.
        groups = param_groups(model, self.cfg.optim.weight_decay, weight_decay_plan(model))
        # model.activation_checkpointing and model.compile: blocks wrapped before ShardedDDP; its gradient
        # hooks sit on each parameter's accumulator, outside the checkpointed and compiled regions, and fire
        # once per parameter as with the eager model (the recomputed forward uses the same parameters).
        self.checkpoint_blocks(model)
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
