"""What a parallel strategy tells the projection about one training step: the words of its cost model.

Each strategy (:mod:`rayvit.strategies`) answers the projection's questions itself, in these
terms: the collectives it issues (:class:`Message`), the bytes each rank holds (:class:`StateBytes`), the
elements its optimizer steps and its transient buffers, all for one :class:`Layout` (a config at a chip
count). The projection (``comms``, ``memory``, ``performance``) asks the strategy; it never matches a name.

Also here: the mechanics several libraries share, so that a strategy built from them stays short: whole
tensors per rank (replicated, or owned by one rank after a greedy partition), torch.chunk-style dim-0
shards, and FSDP-style groups that gather before use and reduce-scatter after backward.

No torch here, and nothing that imports the strategies (they import this module).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Optional

from rayvit.strategies.dtypes import FULL, Dtypes
from rayvit.strategies.shapes import Tensor, fsdp_units, vit_tensors

if TYPE_CHECKING:
    from rayvit.config_schema import Config

STEP_BYTES = 4                 # Adam's per-tensor `step` counter: a 0-d fp32 tensor


def bus_factor(kind: str, n: int) -> float:
    """nccl-tests' bus-bandwidth correction: time = factor x bytes / busbw."""
    if n <= 1:
        return 0.0
    return {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n,
            "broadcast": 1.0, "reduce": 1.0}[kind]


@dataclass(frozen=True)
class Message:
    """One collective of a step. ``bytes`` is its size as nccl-tests counts it (the whole array: an
    all-gather's output, a reduce-scatter's input)."""

    kind: str            # all_reduce, all_gather, reduce_scatter, broadcast, reduce
    bytes: int
    phase: str           # forward, backward, after (after backward, before or after the optimizer)
    what: str = ""
    element_bytes: int = 0   # of a gradient reduction: the reduce dtype's size
    # The ranks it runs over when not every rank of the step: a group of ``group`` ranks whose global ranks
    # lie ``stride`` apart (HSDP: its shard groups, stride 1, and its replica groups, stride = shard size).
    group: int = 0
    stride: int = 1


@dataclass(frozen=True)
class StateBytes:
    params: int
    grads: int
    masters: int          # fp32 master weights and their gradients (replicated strategies under `mixed`)
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.masters + self.optimizer


@dataclass(frozen=True)
class Layout:
    """What a strategy's cost model is asked about: ``cfg`` at ``n`` chips, its dtypes and its tensors.

    ``flatten``: FairScale FSDP's flat parameters (its default) rather than its unflattened ones.
    ``per_node``: chips per node where the hardware is known (0: unknown, one node), for strategies whose
    groups follow the nodes (HSDP).
    """

    cfg: Config
    n: int
    dt: Dtypes
    tensors: tuple[Tensor, ...]
    flatten: bool = True
    per_node: int = 0

    @classmethod
    def of(cls, cfg: Config, n: Optional[int] = None, *, sharded: bool, layer_norm_fp32: Optional[bool] = None,
           flatten: bool = True, per_node: int = 0) -> "Layout":
        """``cfg``'s tensors over ``n`` ranks for a strategy that owns mixed precision (``sharded``) or not;
        the registry's :func:`~rayvit.strategies.registry.layout_of` asks ``cfg``'s strategy which."""
        return cls(cfg, n or cfg.parallel.num_workers, Dtypes.of(cfg, sharded, layer_norm_fp32), _tensors(cfg.model),
                   flatten, per_node)


_TENSORS: dict[str, tuple[Tensor, ...]] = {}


def _tensors(model) -> tuple[Tensor, ...]:
    """``vit_tensors`` of ``model``, built once per architecture (a plan asks for it hundreds of times)."""
    key = repr(model)
    if key not in _TENSORS:
        if len(_TENSORS) > 256:
            _TENSORS.clear()
        _TENSORS[key] = tuple(vit_tensors(model))
    return _TENSORS[key]


def layout_key(cfg: Config, *extra) -> str:
    """A key for what a strategy's cost half reads of ``cfg`` (everything but the training run's budget, data
    and launch, which no model state or message depends on), plus ``extra``: caches of the projection use it,
    so that settings differing only in batch or steps share their costing."""
    import dataclasses

    parallel = dataclasses.replace(cfg.parallel, num_workers=0)
    return repr((cfg.model, cfg.precision, cfg.optim, parallel, *extra))


# ------------------------------------------------------------------------------------------------
# Whole tensors per rank (DDP, OSS, ZeRO-1-like strategies)


def optimizer_bytes(cfg: Config, local: int, state_dtype: int) -> int:
    """Optimizer state for ``local`` elements of one tensor (Adam: two moments and a step counter)."""
    if cfg.optim.name == "sgd":
        return local * state_dtype if cfg.optim.momentum else 0
    return 2 * local * state_dtype + STEP_BYTES


def tensor_state(layout: Layout, rank: int, *, local: Callable[[Tensor], int] = lambda t: t.numel,
                 owned: Callable[[Tensor], bool] = lambda t: True,
                 keeps_grad: Callable[[Tensor], bool] = lambda t: True) -> StateBytes:
    """Bytes ``rank`` holds when each tensor is kept as ``local(t)`` elements, its gradient where
    ``keeps_grad(t)``, and its master copy and optimizer state where it ``owned(t)`` (steps it)."""
    dt, params, grads, masters, optim = layout.dt, 0, 0, 0, 0
    for t in layout.tensors:
        width, n = dt.stored(t.norm), local(t)
        params += n * width
        if keeps_grad(t):
            grads += n * width
        if not owned(t):
            continue
        if dt.has_master(t.norm):
            masters += 2 * n * FULL
        optim += optimizer_bytes(layout.cfg, n, dt.optimizer_state(t.norm))
    return StateBytes(params, grads, masters, optim)


def greedy_partition(tensors: Iterable[Tensor], world: int) -> dict[str, int]:
    """Each tensor, in the order given, to the rank with the fewest elements so far (OSS, ZeRO)."""
    sizes, owner = [0] * world, {}
    for t in tensors:
        rank = sizes.index(min(sizes))
        owner[t.name] = rank
        sizes[rank] += t.numel
    return owner


def busiest_owner(layout: Layout, owner: dict[str, int]) -> tuple[int, int]:
    """(elements, tensors) of the rank that steps the most elements under the partition ``owner``."""
    per_rank = [[t for t in layout.tensors if owner[t.name] == r] for r in range(layout.n)]
    mine = max(per_rank, key=lambda ts: sum(t.numel for t in ts))
    return sum(t.numel for t in mine), len(mine)


def partition_broadcasts(layout: Layout, owner: dict[str, int], per_tensor: bool = False) -> list[Message]:
    """After the step, each rank broadcasts the weights it updated: one message per rank, or per tensor."""
    out = []
    for r in range(layout.n):
        mine = [t for t in layout.tensors if owner[t.name] == r]
        if per_tensor:
            out += [Message("broadcast", t.numel * layout.dt.stored(t.norm), "after", f"{t.name} from rank {r}")
                    for t in mine]
        elif mine:
            out.append(Message("broadcast", sum(t.numel * layout.dt.stored(t.norm) for t in mine), "after",
                               f"rank {r}'s updated partition"))
    return out


# ------------------------------------------------------------------------------------------------
# Sharded data parallel: groups gathered before use, reduce-scattered after backward (FSDP2, FairScale)


def chunk_rows(d0: int, world: int, rank: int) -> int:
    """Rows of a dim-0 ``torch.chunk`` shard on ``rank``: c = ceil(d0/N) rows each, the last ones short."""
    chunk = -(-d0 // world)
    return max(0, min(chunk, d0 - rank * chunk))


def chunk_local(t: Tensor, world: int, rank: int) -> int:
    return chunk_rows(t.shape[0], world, rank) * (t.numel // t.shape[0])


def chunk_padded(t: Tensor, n: int) -> int:
    """Elements of a dim-0 sharded tensor padded to c rows on every rank (what FSDP2 gathers)."""
    return chunk_rows(t.shape[0], n, 0) * n * (t.numel // t.shape[0])


@dataclass(frozen=True)
class ShardGroup:
    """What one FSDP instance gathers together: a name, its tensors, and how it issues its collectives."""

    name: str
    tensors: list[Tensor]
    flat: bool             # FairScale's flat parameter: one gather of the padded total
    regather: bool         # gathered again before backward
    per_tensor: bool = False   # FairScale's unflattened parameters: one gather per tensor

    def gathers(self, dt: Dtypes, n: int, phase: str) -> list[Message]:
        suffix = " again" if phase == "backward" else ""
        if self.flat:
            elements = -(-sum(t.numel for t in self.tensors) // n) * n
            return [Message("all_gather", elements * dt.gathered(False), phase, f"{self.name} params{suffix}")]
        if self.per_tensor:
            return [Message("all_gather", -(-t.numel // n) * n * dt.gathered(t.norm), phase, f"{t.name}{suffix}")
                    for t in self.tensors]
        return [Message("all_gather", sum(chunk_padded(t, n) * dt.gathered(t.norm) for t in self.tensors), phase,
                        f"{self.name} params{suffix}")]

    def reduce_elements(self, n: int) -> list[int]:
        """The gradients this group reduce-scatters, padded as its library pads them (elements each)."""
        if self.flat:
            return [-(-sum(t.numel for t in self.tensors) // n) * n]
        if self.per_tensor:
            return [-(-t.numel // n) * n for t in self.tensors]
        return [sum(chunk_padded(t, n) for t in self.tensors)]


def sharded_messages(groups: list[ShardGroup], dt: Dtypes, n: int) -> tuple[list[Message], list[Message]]:
    """(forward, backward) collectives of FSDP-style ``groups`` given in forward order, the first the root.

    Backward visits the groups in reverse; the root (it holds the head) regathers first and reduces last.
    """
    forward = [m for g in groups for m in g.gathers(dt, n, "forward")]
    root = groups[0]
    backward = root.gathers(dt, n, "backward") if root.regather else []
    for g in groups[1:][::-1] + [root]:
        if g.regather and g is not root:
            backward += g.gathers(dt, n, "backward")
        width = dt.reduced(all(t.norm for t in g.tensors))
        backward += [Message("reduce_scatter", elements * width, "backward", f"{g.name} grads", width)
                     for elements in g.reduce_elements(n)]
    return forward, backward


def sharded_transient(layout: Layout) -> int:
    """FSDP units (``shapes.fsdp_units``) gathered in the compute dtype (two at a time when resharding after
    forward; all of them from forward to backward when not) plus one unit's unsharded gradient."""
    units = list(fsdp_units(list(layout.tensors)).values())
    dt = layout.dt
    gathered = sorted((sum(t.numel * dt.gathered(t.norm) for t in u) for u in units), reverse=True)
    largest = max(sum(t.numel for t in u) for u in units)
    held = sum(gathered) if not layout.cfg.parallel.reshard_after_forward else sum(gathered[:2])
    return held + largest * dt.reduced()
