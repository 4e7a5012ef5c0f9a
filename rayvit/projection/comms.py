"""The collectives each strategy issues in one training step: kind, bytes, when, and whether it can hide.

``bytes`` is the collective's size as nccl-tests counts it (the whole array: an all-gather's output, a
reduce-scatter's input), so its time is ``latency + factor(kind, n) x bytes / busbw`` with the factors of
:data:`BUS_FACTOR`. Per step, with P the parameter elements (FSDP units padded to multiples of N):

- ``ddp``: one all-reduce per gradient bucket (1 MiB first, then 25 MiB, as DDP's reducer builds them, in
  reverse parameter order), in the reduce dtype. Moves 2(N-1)/N x P x reduce bytes per rank.
- ``fsdp`` (FSDP2) / ``fairscale_fsdp``: per unit (each block, and the root: stem, tokens, final norm,
  head) one all-gather before forward, one more before backward when ``reshard_after_forward``, one
  reduce-scatter after backward. Moves (N-1)/N x P x (gather bytes x (1 or 2) + reduce bytes).
- ``fairscale_oss``: ShardedDDP reduces each destination rank's bucket (per tensor beyond the bucket, and
  for every tensor at N = 1), then OSS broadcasts each rank's updated partition. Moves about
  P x (reduce bytes + weight bytes) through the busiest rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from rayvit.config import Config
from rayvit.projection.dtypes import Dtypes
from rayvit.projection.memory import fsdp2_rows, oss_owner, sharded_ddp_bucketed
from rayvit.projection.shapes import Tensor, fsdp_units, optimizer_order, vit_tensors

DDP_FIRST_BUCKET = 2 ** 20          # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES
DDP_BUCKET = 25 * 2 ** 20           # DistributedDataParallel(bucket_cap_mb=25)


def bus_factor(kind: str, n: int) -> float:
    """nccl-tests' bus-bandwidth correction: time = factor x bytes / busbw."""
    if n <= 1:
        return 0.0
    return {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n,
            "broadcast": 1.0, "reduce": 1.0}[kind]


@dataclass(frozen=True)
class Message:
    kind: str            # all_reduce, all_gather, reduce_scatter, broadcast, reduce
    bytes: int
    phase: str           # forward, backward, after (after backward, before or after the optimizer)
    what: str = ""


def ddp_buckets(tensors: list[Tensor], width_of) -> list[int]:
    """Bucket sizes in bytes in the order the reducer fills them (reverse parameter order)."""
    buckets, current, limit = [], 0, DDP_FIRST_BUCKET
    for t in reversed(tensors):
        current += t.numel * width_of(t)
        if current >= limit:
            buckets.append(current)
            current, limit = 0, DDP_BUCKET
    return buckets + ([current] if current else [])


def _ddp(tensors, dt: Dtypes, n: int) -> list[Message]:
    width = dt.reduced()
    return [Message("all_reduce", b, "backward", f"gradient bucket {i}")
            for i, b in enumerate(ddp_buckets(tensors, lambda t: width))]


def _padded(t: Tensor, n: int) -> int:
    return fsdp2_rows(t.shape[0], n, 0) * n * (t.numel // t.shape[0])


def _fsdp(cfg: Config, tensors, dt: Dtypes, n: int, flat: bool) -> list[Message]:
    units = fsdp_units(tensors)
    out = []
    for name, unit in units.items():
        if flat:
            elements = -(-sum(t.numel for t in unit) // n) * n
            gather = elements * dt.gathered(False)
        else:
            elements = sum(_padded(t, n) for t in unit)
            gather = sum(_padded(t, n) * dt.gathered(t.norm) for t in unit)
        out.append(Message("all_gather", gather, "forward", f"{name} params"))
        if cfg.parallel.reshard_after_forward:
            out.append(Message("all_gather", gather, "backward", f"{name} params again"))
        out.append(Message("reduce_scatter", elements * dt.reduced(), "backward", f"{name} grads"))
    # Backward runs the units in reverse; the root's reduce-scatter is the last message of the step.
    fwd = [m for m in out if m.phase == "forward"]
    bwd = [m for m in out if m.phase == "backward"]
    return fwd + bwd[::-1] if not cfg.parallel.reshard_after_forward else fwd + _interleave_backward(bwd)


def _interleave_backward(bwd: list[Message]) -> list[Message]:
    # bwd holds (gather, reduce) pairs per unit in forward order; backward visits blocks last-to-first
    # and the root (which holds the head) both first (gather) and last (its reduce-scatter).
    pairs = [bwd[i:i + 2] for i in range(0, len(bwd), 2)]
    root, blocks = pairs[0], pairs[1:]
    order = [root[0]]
    for gather, reduce in blocks[::-1]:
        order += [gather, reduce]
    return order + [root[1]]


def _oss(cfg: Config, tensors, dt: Dtypes, n: int) -> list[Message]:
    owner = oss_owner(tensors, n)
    bucketed = sharded_ddp_bucketed(tensors, owner, n)
    width = dt.reduced()
    out = []
    for r in range(n):
        mine = [t for t in optimizer_order(tensors) if owner[t.name] == r]
        inside = sum(t.numel for t in mine if t.name in bucketed)
        if inside:
            out.append(Message("reduce", inside * width, "backward", f"bucket to rank {r}"))
        out += [Message("reduce", t.numel * width, "backward", f"{t.name} to rank {r}")
                for t in mine if t.name not in bucketed]
    for r in range(n):
        size = sum(t.numel * dt.stored(t.norm) for t in tensors if owner[t.name] == r)
        if size:
            out.append(Message("broadcast", size, "after", f"rank {r}'s updated partition"))
    return out


def step_messages(cfg: Config, n: Optional[int] = None, *, layer_norm_fp32: Optional[bool] = None,
                  flatten: bool = True) -> list[Message]:
    """Every collective one rank takes part in during one step of ``cfg`` at ``n`` chips, in issue order."""
    n = n or cfg.parallel.num_workers
    s = cfg.parallel.strategy
    if n <= 1 and s != "fairscale_oss":
        return []
    dt, tensors = Dtypes.of(cfg, layer_norm_fp32), vit_tensors(cfg.model)
    if s == "ddp":
        return _ddp(tensors, dt, n)
    if s in ("fsdp", "fairscale_fsdp"):
        return _fsdp(cfg, tensors, dt, n, flat=(s == "fairscale_fsdp" and flatten))
    return _oss(cfg, tensors, dt, n)


def bytes_moved_per_rank(messages: list[Message], n: int) -> float:
    """Bytes each rank sends (the bus-bandwidth numerator): sum of factor x size."""
    return sum(bus_factor(m.kind, n) * m.bytes for m in messages)
