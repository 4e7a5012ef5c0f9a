"""DDP: every rank holds the whole model and optimizer; gradients are all-reduced. The study's baseline.

DDP all-reduces each gradient bucket in the gradients' own dtype, so under ``mixed`` (half model weights)
it would reduce in half while FSDP2 reduces in fp32: not like for like. A communication hook makes DDP
honour ``parallel.reduce_dtype`` too: half buckets travel in the reduce dtype, fp32 buckets (LayerNorm
kept in fp32) in fp32, as torch's own ``fp16_compress_hook`` does it
(torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py ``_compress_hook``).

Cost model: one all-reduce per gradient bucket, in the reduce dtype, at every world size (one rank too).
DDP's reducer buckets each gradient dtype apart (fp32 LayerNorm under ``mixed`` has buckets of its own),
in reverse parameter order, 1 MiB first and then 25 MiB of gradient bytes per dtype; it moves
2(N-1)/N x P x reduce bytes per rank. The buckets are a second copy of every gradient (transient).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rayvit.strategies.base import Strategy, StrategyCosts
from rayvit.strategies.costs import Layout, Message
from rayvit.strategies.shapes import Tensor

if TYPE_CHECKING:
    from torch import nn

DDP_FIRST_BUCKET = 2 ** 20          # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES
DDP_BUCKET = 25 * 2 ** 20           # DistributedDataParallel(bucket_cap_mb=25)


def cast_allreduce_hook(wire_dtype, bucket):
    """All-reduce (mean) one bucket with half gradients sent as ``wire_dtype``; fp32 buckets stay fp32.

    ``wire_dtype`` is the hook's state. (No annotations: DDP compares them with the real classes, and this
    module's postponed annotations would be strings.)

    The sum is taken in the wire dtype and rounded back to the gradients' dtype once, in place.
    """
    import torch
    import torch.distributed as dist

    buffer = bucket.buffer()
    dtype = torch.float32 if buffer.dtype == torch.float32 else wire_dtype
    group = dist.group.WORLD
    # Like torch's allreduce_hook: divide before the sum (``to`` copies only when the dtype changes).
    wire = buffer.to(dtype).div_(dist.get_world_size(group))
    future = dist.all_reduce(wire, group=group, async_op=True).get_future()

    def copy_back(fut):
        reduced = fut.value()[0]
        if reduced.dtype != buffer.dtype:
            buffer.copy_(reduced)
            return buffer
        return reduced

    return future.then(copy_back)


def ddp_buckets(tensors, width_of) -> list[list[Tensor]]:
    """DDP's gradient buckets in the order the reducer fills them (reverse parameter order).

    As torch's ``compute_bucket_assignment_by_size`` does it: one running bucket per gradient dtype
    (``width_of``: the gradient's bytes per element), each closing at 1 MiB the first time and at 25 MiB
    after that; what remains of each dtype's bucket goes last.
    """
    open_: dict[int, tuple[list[Tensor], list[int]]] = {}      # width -> (tensors, [bytes, limit])
    buckets = []
    for t in reversed(tensors):
        width = width_of(t)
        members, fill = open_.setdefault(width, ([], [0, DDP_FIRST_BUCKET]))
        members.append(t)
        fill[0] += t.numel * width
        if fill[0] >= fill[1]:
            buckets.append(members)
            open_[width] = ([], [0, DDP_BUCKET])
    return buckets + [members for members, _ in open_.values() if members]


class DDPCosts(StrategyCosts):
    """DDP's cost half: the baseline's colour, its compile mode, its gradient buckets."""

    name = "ddp"
    colour = "#333333"          # the baseline: grey-black in every figure
    # torch.compile of the DDP-wrapped module, as DDP's documentation asks ("apply the DDP model wrapper
    # before compiling"): dynamo's DDPOptimizer (torch._dynamo.config.optimize_ddp, on by default) splits
    # the graph at the bucket boundaries so that each bucket's all-reduce still overlaps backward.
    compile_mode = "wrapped"

    @classmethod
    def step_messages(cls, layout: Layout) -> list[Message]:
        # Buckets fill by the gradients' own bytes; the hook then sends each in the reduce dtype.
        dt = layout.dt
        return [Message("all_reduce", sum(t.numel for t in bucket) * dt.reduced(bucket[0].norm), "backward",
                        f"gradient bucket {i}")
                for i, bucket in enumerate(ddp_buckets(layout.tensors, lambda t: dt.stored(t.norm)))]

    @classmethod
    def heaviest_ranks(cls, layout: Layout) -> tuple[int, ...]:
        return (0,)                  # every rank holds the same

    @classmethod
    def transient_bytes(cls, layout: Layout) -> int:
        """Its gradient buckets, in the gradient dtype (at one rank too, where the reducer still builds and
        all-reduces them)."""
        return sum(t.numel * layout.dt.stored(t.norm) for t in layout.tensors)


class DDP(DDPCosts, Strategy):
    """DDP's runtime half: the model wrapped by torch's DistributedDataParallel."""

    def wrap(self, model: "nn.Module") -> "nn.Module":
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [self.device.index] if self.device.type == "cuda" else None
        ddp = DistributedDataParallel(model, device_ids=device_ids)
        # Half gradients (mixed, pure): reduce in parallel.reduce_dtype. fp32 gradients need no hook.
        if self.precision.mode in ("mixed", "pure"):
            ddp.register_comm_hook(self.reduce_dtype, cast_allreduce_hook)
        return ddp
