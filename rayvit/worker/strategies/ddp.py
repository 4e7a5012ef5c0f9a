"""DDP: every rank holds the whole model and optimizer; gradients are all-reduced. The study's baseline.

DDP all-reduces each gradient bucket in the gradients' own dtype, so under ``mixed`` (half model weights)
it would reduce in half while FSDP2 reduces in fp32: not like for like. A communication hook makes DDP
honour ``parallel.reduce_dtype`` too: half buckets travel in the reduce dtype, fp32 buckets (LayerNorm
kept in fp32) in fp32, as torch's own ``fp16_compress_hook`` does it
(torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py ``_compress_hook``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from rayvit.worker.strategies.base import Strategy


def cast_allreduce_hook(wire_dtype, bucket):
    """All-reduce (mean) one bucket with half gradients sent as ``wire_dtype``; fp32 buckets stay fp32.

    ``wire_dtype`` is the hook's state. (No annotations: DDP compares them with the real classes, and this
    module's postponed annotations would be strings.)

    The sum is taken in the wire dtype and rounded back to the gradients' dtype once, in place.
    """
    buffer = bucket.buffer()
    dtype = torch.float32 if buffer.dtype == torch.float32 else wire_dtype
    group = dist.group.WORLD
    # Like torch's allreduce_hook: divide before the sum (``to`` copies only when the dtype changes).
    wire = buffer.to(dtype).div_(dist.get_world_size(group))
    future = dist.all_reduce(wire, group=group, async_op=True).get_future()

    def copy_back(fut: torch.futures.Future) -> torch.Tensor:
        reduced = fut.value()[0]
        if reduced.dtype != buffer.dtype:
            buffer.copy_(reduced)
            return buffer
        return reduced

    return future.then(copy_back)


class DDP(Strategy):
    name = "ddp"
    # torch.compile of the DDP-wrapped module, as DDP's documentation asks ("apply the DDP model wrapper
    # before compiling"): dynamo's DDPOptimizer (torch._dynamo.config.optimize_ddp, on by default) splits
    # the graph at the bucket boundaries so that each bucket's all-reduce still overlaps backward.
    compile_mode = "wrapped"

    def wrap(self, model: nn.Module) -> nn.Module:
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        ddp = DistributedDataParallel(model, device_ids=device_ids)
        # Half gradients (mixed, pure): reduce in parallel.reduce_dtype. fp32 gradients need no hook.
        if self.precision.mode in ("mixed", "pure"):
            ddp.register_comm_hook(self.reduce_dtype, cast_allreduce_hook)
        return ddp
