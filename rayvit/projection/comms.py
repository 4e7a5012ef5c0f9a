"""The collectives each strategy issues in one training step: kind, bytes, when, and whether it can hide.

``bytes`` is the collective's size as nccl-tests counts it (the whole array: an all-gather's output, a
reduce-scatter's input), so its time is ``latency + factor(kind, n) x bytes / busbw`` with the factors of
:data:`BUS_FACTOR`. Per step, with P the parameter elements (FSDP units padded to multiples of N):

- ``ddp``: one all-reduce per gradient bucket, in the reduce dtype, at every world size (one rank too).
  DDP's reducer buckets each gradient dtype apart (fp32 LayerNorm under ``mixed`` has buckets of its
  own), in reverse parameter order, 1 MiB first and then 25 MiB of gradient bytes per dtype. Moves
  2(N-1)/N x P x reduce bytes per rank.
- ``fsdp`` (FSDP2): per parameter group (each block, and the root: stem, tokens, head; under ``mixed``
  with fp32 LayerNorm also each block's two norms as one group, and the final norm) one all-gather
  before forward, one more before backward when ``reshard_after_forward`` (the root's too: rayvit sets
  the flag explicitly, which turns off FSDP2's keep-the-root heuristic), one reduce-scatter after
  backward. Moves (N-1)/N x P x (gather bytes x (1 or 2) + reduce bytes).
- ``fairscale_fsdp``: the same per flat unit, except that the root never gathers again for backward
  (``disable_reshard_on_root``); under ``mixed`` with fp32 LayerNorm every LayerNorm is a wrapper of its
  own with unflattened parameters (one fp32 all-gather per parameter, kept until after backward).
  Gradients go through FairScale's shared reduce-scatter bucketer (25 MiB per dtype): a gradient larger
  than that goes at once, smaller ones wait in the bucket until it is full or backward ends.
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
from rayvit.projection.shapes import ROOT_UNIT, Tensor, fsdp_units, optimizer_order, vit_tensors

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
    element_bytes: int = 0   # of a gradient reduction: the reduce dtype's size


def ddp_buckets(tensors: list[Tensor], width_of) -> list[list[Tensor]]:
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


def _ddp(tensors, dt: Dtypes, n: int) -> list[Message]:
    # Buckets fill by the gradients' own bytes; the hook then sends each in the reduce dtype.
    return [Message("all_reduce", sum(t.numel for t in bucket) * dt.reduced(bucket[0].norm), "backward",
                    f"gradient bucket {i}")
            for i, bucket in enumerate(ddp_buckets(tensors, lambda t: dt.stored(t.norm)))]


def _padded(t: Tensor, n: int) -> int:
    return fsdp2_rows(t.shape[0], n, 0) * n * (t.numel // t.shape[0])


FAIRSCALE_BUCKET = 25 * 2 ** 20    # FullyShardedDataParallel(bucket_cap_mb=25), the root's, shared by all


@dataclass(frozen=True)
class _Group:
    """What one FSDP instance gathers together: a name, its tensors, and how it issues its collectives."""

    name: str
    tensors: list[Tensor]
    flat: bool             # FairScale's flat parameter: one gather of the padded total
    regather: bool         # gathered again before backward
    per_tensor: bool = False   # FairScale's unflattened parameters: one gather per tensor


def _fsdp2_groups(cfg: Config, tensors, dt: Dtypes) -> list[_Group]:
    """FSDP2's parameter groups in forward order (rayvit.worker.strategies.fsdp)."""
    again = cfg.parallel.reshard_after_forward
    groups = []
    for name, unit in fsdp_units(tensors).items():
        if dt.layer_norm_fp32:
            groups.append(_Group(name, [t for t in unit if not t.norm], False, again))
            norms = [t for t in unit if t.norm]
            if norms:      # both norms of a block, one group; the root's final norm, after the blocks
                groups.append(_Group(f"{name} norms", norms, False, again))
        else:
            groups.append(_Group(name, unit, False, again))
    root_norm = [g for g in groups if g.name == f"{ROOT_UNIT} norms"]
    return [g for g in groups if g not in root_norm] + root_norm


def _fairscale_groups(cfg: Config, tensors, dt: Dtypes) -> list[_Group]:
    """FairScale FSDP's instances in forward order (rayvit.worker.strategies.fairscale_fsdp): a flat unit
    per block and the root (which never reshards), and under fp32 LayerNorm a wrapper per LayerNorm."""
    again = cfg.parallel.reshard_after_forward
    groups = []
    for name, unit in fsdp_units(tensors).items():
        wrapped = [t for t in unit if t.norm] if dt.layer_norm_fp32 else []
        groups.append(_Group(name, [t for t in unit if t not in wrapped], True, again and name != ROOT_UNIT))
        for i in range(0, len(wrapped), 2):             # weight and bias of one LayerNorm
            groups.append(_Group(f"{wrapped[i].name.rsplit('.', 1)[0]}", wrapped[i:i + 2], False, False,
                                 per_tensor=True))
    root = [g for g in groups if g.name == "norm"]     # the final LayerNorm runs after the blocks
    return [g for g in groups if g not in root] + root


def _gathers(g: _Group, dt: Dtypes, n: int, phase: str) -> list[Message]:
    suffix = " again" if phase == "backward" else ""
    if g.flat:
        elements = -(-sum(t.numel for t in g.tensors) // n) * n
        return [Message("all_gather", elements * dt.gathered(False), phase, f"{g.name} params{suffix}")]
    if g.per_tensor:
        return [Message("all_gather", -(-t.numel // n) * n * dt.gathered(t.norm), phase, f"{t.name}{suffix}")
                for t in g.tensors]
    return [Message("all_gather", sum(_padded(t, n) * dt.gathered(t.norm) for t in g.tensors), phase,
                    f"{g.name} params{suffix}")]


def _reduce_elements(g: _Group, n: int) -> list[int]:
    """The gradients one group reduce-scatters, padded as its library pads them (elements each)."""
    if g.flat:
        return [-(-sum(t.numel for t in g.tensors) // n) * n]
    if g.per_tensor:
        return [-(-t.numel // n) * n for t in g.tensors]
    return [sum(_padded(t, n) for t in g.tensors)]


def _fsdp(cfg: Config, tensors, dt: Dtypes, n: int, fairscale: bool) -> list[Message]:
    groups = (_fairscale_groups if fairscale else _fsdp2_groups)(cfg, tensors, dt)
    forward = [m for g in groups for m in _gathers(g, dt, n, "forward")]
    # Backward visits the groups in reverse; the root (it holds the head) regathers first and reduces last.
    root = groups[0]
    backward = _gathers(root, dt, n, "backward") if root.regather else []
    for g in groups[1:][::-1] + [root]:
        if g.regather and g is not root:
            backward += _gathers(g, dt, n, "backward")
        width = dt.reduced(all(t.norm for t in g.tensors))
        backward += [Message("reduce_scatter", elements * width, "backward", f"{g.name} grads", width)
                     for elements in _reduce_elements(g, n)]
    return forward + (_fairscale_bucketer(backward, n) if fairscale else backward)


def _fairscale_bucketer(backward: list[Message], n: int) -> list[Message]:
    """FairScale's ReduceScatterBucketer (fairscale/internal/reduce_scatter_bucketer.py): a gradient whose
    shard exceeds the bucket's goes at once; smaller ones queue in their dtype's bucket, which is sent when
    the next one does not fit, and when backward ends (the root's flush)."""
    out: list[Message] = []
    queued: dict[int, list] = {}           # bytes per element -> [shard elements queued, what]
    for m in backward:
        if m.kind != "reduce_scatter":
            out.append(m)
            continue
        width = m.element_bytes
        shard, capacity = m.bytes // width // n, FAIRSCALE_BUCKET // width // n
        if shard > capacity:
            out.append(m)
            continue
        bucket = queued.setdefault(width, [0, []])
        if shard > capacity - bucket[0]:
            out.append(_bucket(bucket, n, width, "backward"))
            bucket[:] = [0, []]
        bucket[0] += shard
        bucket[1].append(m.what)
    return out + [_bucket(bucket, n, width, "after") for width, bucket in queued.items() if bucket[0]]


def _bucket(bucket: list, n: int, width: int, phase: str) -> Message:
    return Message("reduce_scatter", bucket[0] * n * width, phase, "bucket: " + ", ".join(bucket[1]), width)


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


def step_messages(cfg: Config, n: Optional[int] = None, *, layer_norm_fp32: Optional[bool] = None
                  ) -> list[Message]:
    """Every collective one rank takes part in during one step of ``cfg`` at ``n`` chips, in issue order."""
    n = n or cfg.parallel.num_workers
    s = cfg.parallel.strategy
    dt, tensors = Dtypes.of(cfg, layer_norm_fp32), vit_tensors(cfg.model)
    if s == "ddp":                      # DDP's reducer all-reduces its buckets at one rank too
        return _ddp(tensors, dt, n)
    if n <= 1 and s != "fairscale_oss":
        return []
    if s in ("fsdp", "fairscale_fsdp"):
        return _fsdp(cfg, tensors, dt, n, fairscale=s == "fairscale_fsdp")
    return _oss(cfg, tensors, dt, n)


def bytes_moved_per_rank(messages: list[Message], n: int) -> float:
    """Bytes each rank sends (the bus-bandwidth numerator): sum of factor x size."""
    return sum(bus_factor(m.kind, n) * m.bytes for m in messages)
