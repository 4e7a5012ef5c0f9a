"""HSDP: FSDP2 (``fully_shard``) on a 2-D (replicate, shard) DeviceMesh, sharding inside a node and
replicating across nodes (torchtitan's ``data_parallel_replicate_degree`` x ``data_parallel_shard_degree``).

From 16 GPUs up, FSDP's gathers and reduce-scatters cross the network once per group and grow in latency
with every rank; HSDP keeps them on NVLink, within shard groups of ``parallel.shard_size`` ranks (0, the
default: the GPUs of one node), and sends only each shard's gradient across nodes, one all-reduce per group
over the replicas. Each rank holds 1/shard of the model state (not 1/N). Everything else (the groups, mixed
precision, compile, checkpoints) is FSDP2's, as :mod:`rayvit.strategies.fsdp` sets it up: the 2-D mesh is the
only difference. With one shard group it is FSDP; with shards of one rank it is DDP over FSDP2's code.

Mesh: ranks ``[r x shard, (r + 1) x shard)`` form replica ``r``'s shard group. Ray Train numbers the workers of
a node consecutively (its worker group sorts them by node), so a shard group never straddles two nodes when
the shard size divides every node's worker count: the default is the greatest common divisor of the ranks'
local world sizes (``LOCAL_WORLD_SIZE``, set by Ray Train and torchrun).

Cost model: FSDP's groups with chunked shards over ``shard`` ranks (padded to ``shard``); per group one
all-gather before forward (and before backward when resharding) and one reduce-scatter after backward over
the shard group, then the reduce-scatter's output (1/shard of the group's gradient, in the reduce dtype)
all-reduced over the ``N / shard`` replicas (FSDP2's ``foreach_reduce``: ``dist.all_reduce(reduce_output,
group=all_reduce_group)``). Over the network: 2 (R-1)/R x P x reduce bytes through each node (the replica
groups of one node share its NICs), about DDP's; FSDP moves (N-1)/N x P x (gather bytes x (1 or 2) +
reduce bytes) through it.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import TYPE_CHECKING, Optional

from rayvit.strategies.base import world_size
from rayvit.strategies.costs import (Layout, Message, StateBytes, chunk_local, sharded_messages, sharded_transient,
                                     tensor_state)
from rayvit.strategies.fsdp import FSDP, FSDPCosts, groups

if TYPE_CHECKING:
    from torch import nn

    from rayvit.config_schema import Config


def shard_size(cfg: Config, n: int, per_node: int = 0) -> int:
    """Ranks per shard group at ``n`` ranks: ``parallel.shard_size`` (at most ``n``), else the chips of a
    node that divide ``n`` (their greatest common divisor: nodes hold consecutive ranks), else all ``n``."""
    if cfg.parallel.shard_size:
        return min(cfg.parallel.shard_size, n)
    return math.gcd(n, per_node) if per_node else n


class HSDPCosts(FSDPCosts):
    """HSDP's cost half: FSDP2's groups sharded over a node's ranks, their gradients all-reduced across nodes."""

    name = "hsdp"
    colour = "#9467bd"

    @classmethod
    def refuses(cls, cfg: Config) -> Optional[str]:
        size, n = cfg.parallel.shard_size, cfg.parallel.num_workers
        if size and n % min(size, n):
            return (f"parallel.shard_size={size} does not divide parallel.num_workers={n}: HSDP's mesh is "
                    f"(replicas, shard size); choose a shard size that divides it (e.g. the GPUs per node), or 0 "
                    "for the GPUs of one node")
        return super().refuses(cfg)

    @classmethod
    def step_messages(cls, layout: Layout) -> list[Message]:
        n = layout.n
        shard = shard_size(layout.cfg, n, layout.per_node)
        replicas = n // shard
        if n <= 1:
            return []
        forward, backward = sharded_messages(groups(layout), layout.dt, shard)
        out = [dataclasses.replace(m, group=shard) for m in forward] if shard > 1 else []
        for m in backward:
            if shard > 1:
                out.append(dataclasses.replace(m, group=shard))
            if m.kind == "reduce_scatter" and replicas > 1:
                out.append(Message("all_reduce", m.bytes // shard, "backward", f"{m.what} across replicas",
                                   m.element_bytes, group=replicas, stride=shard))
        return out

    @classmethod
    def rank_state(cls, layout: Layout, rank: int) -> StateBytes:
        shard = shard_size(layout.cfg, layout.n, layout.per_node)
        return tensor_state(layout, rank, local=lambda t: chunk_local(t, shard, rank % shard))

    @classmethod
    def heaviest_ranks(cls, layout: Layout) -> tuple[int, ...]:
        return (0,)                  # the first rank of a shard group holds the longest chunks

    @classmethod
    def optimizer_elements(cls, layout: Layout) -> tuple[int, int]:
        shard = shard_size(layout.cfg, layout.n, layout.per_node)
        return sum(chunk_local(t, shard, 0) for t in layout.tensors), len(layout.tensors)

    @classmethod
    def transient_bytes(cls, layout: Layout) -> int:
        return sharded_transient(layout)


class HSDP(HSDPCosts, FSDP):
    """HSDP's runtime half: FSDP2's ``fully_shard`` of every block and the root, on a (replicate, shard) mesh."""

    def wrap(self, model: nn.Module, mesh=None) -> nn.Module:
        """Shard ``model`` over ``mesh`` (default: :meth:`mesh`, this run's (replicas, shard size) mesh)."""
        return super().wrap(model, mesh if mesh is not None else self.mesh())

    def mesh(self):
        """The 2-D DeviceMesh ``("replicate", "shard")`` over every rank (a collective: every rank calls it)."""
        from torch.distributed.device_mesh import init_device_mesh

        n = world_size()
        shard = self.runtime_shard_size(n)
        return init_device_mesh(self.device.type, (n // shard, shard), mesh_dim_names=("replicate", "shard"))

    def runtime_shard_size(self, n: int) -> int:
        """``parallel.shard_size``, else the greatest common divisor of every rank's workers on its node (the
        ranks agree on it through one small all-gather), so that no shard group straddles two nodes."""
        if self.cfg.parallel.shard_size or n <= 1:
            shard = shard_size(self.cfg, n)
        else:
            import torch.distributed as dist

            local = [0] * n
            dist.all_gather_object(local, int(os.environ.get("LOCAL_WORLD_SIZE", n)))
            shard = shard_size(self.cfg, n, math.gcd(*local))
        if n % shard:
            from rayvit.errors import ConfigError

            raise ConfigError(f"parallel.shard_size={self.cfg.parallel.shard_size} does not divide the {n} "
                              "workers: set a shard size that does")
        return shard


__all__ = ["HSDP", "HSDPCosts", "shard_size"]
