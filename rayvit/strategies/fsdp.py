"""PyTorch FSDP2 (``fully_shard``): parameters, gradients and optimizer state sharded over ranks.

torchtitan's recipe: shard every encoder block, then the root, so each block's parameters are gathered
just before it runs and freed (``reshard_after_forward``) right after. Parameters become DTensors, each
rank holding its shard. FairScale's FSDP was upstreamed into this; it runs on CPU with gloo too.

``model.compile``: each block is compiled before it is sharded (torchtitan's ``apply_compile`` then
``apply_fsdp``), so ``fully_shard`` puts its all-gather and reduce-scatter hooks on the compiled module,
outside the graph (FSDP2's hooks are ``torch._dynamo.disable``d). LayerNorm kept in fp32 puts the norm
groups' hooks inside each block: dynamo then splits the block's graph at them, and the rest still fuses.

Cost model: each tensor split on dim 0 like ``torch.chunk`` (rank r holds rows [r*c, (r+1)*c) with
c = ceil(d0/N); rank 0 holds the most, and the storage is padded to c rows on every rank). Per parameter
group (each block, and the root: stem, tokens, head; under ``mixed`` with fp32 LayerNorm also each block's
two norms as one group, and the final norm) one all-gather before forward, one more before backward when
``reshard_after_forward`` (the root's too: rayvit sets the flag explicitly, which turns off FSDP2's
keep-the-root heuristic), one reduce-scatter after backward. Moves (N-1)/N x P x (gather bytes x (1 or
2) + reduce bytes).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from rayvit.strategies.base import Strategy, StrategyCosts, rank, world_size
from rayvit.strategies.costs import (Layout, Message, ShardGroup, StateBytes, chunk_local, sharded_messages,
                                     sharded_transient, tensor_state)
from rayvit.strategies.shapes import ROOT_UNIT, fsdp_units

if TYPE_CHECKING:
    import torch
    from torch import nn

    from rayvit.config_schema import Config


def groups(layout: Layout) -> list[ShardGroup]:
    """FSDP2's parameter groups in forward order, as :meth:`FSDP.wrap` makes them."""
    again = layout.cfg.parallel.reshard_after_forward
    out = []
    for name, unit in fsdp_units(list(layout.tensors)).items():
        if layout.dt.layer_norm_fp32:
            out.append(ShardGroup(name, [t for t in unit if not t.norm], False, again))
            norms = [t for t in unit if t.norm]
            if norms:      # both norms of a block, one group; the root's final norm, after the blocks
                out.append(ShardGroup(f"{name} norms", norms, False, again))
        else:
            out.append(ShardGroup(name, unit, False, again))
    root_norm = [g for g in out if g.name == f"{ROOT_UNIT} norms"]
    return [g for g in out if g not in root_norm] + root_norm


class FSDPCosts(StrategyCosts):
    """FSDP2's cost half: chunked shards, one all-gather per group before forward (and before backward when
    it reshards), one reduce-scatter per group after backward."""

    name = "fsdp"
    owns_mixed_precision = True
    dtensor_params = True
    reshards = True
    colour = "#1f77b4"

    @classmethod
    def variants(cls, cfg: Config) -> list[Config]:
        """FSDP as configured, and with the other resharding setting (ZeRO-3-like against ZeRO-2-like)."""
        return [cfg, cfg.replace({"parallel.reshard_after_forward": not cfg.parallel.reshard_after_forward})]

    @classmethod
    def step_messages(cls, layout: Layout) -> list[Message]:
        if layout.n <= 1:
            return []
        forward, backward = sharded_messages(groups(layout), layout.dt, layout.n)
        return forward + backward

    @classmethod
    def rank_state(cls, layout: Layout, rank: int) -> StateBytes:
        return tensor_state(layout, rank, local=lambda t: chunk_local(t, layout.n, rank))

    @classmethod
    def heaviest_ranks(cls, layout: Layout) -> tuple[int, ...]:
        return (0,)                  # rank 0 holds the longest chunk of every tensor

    @classmethod
    def optimizer_elements(cls, layout: Layout) -> tuple[int, int]:
        return sum(chunk_local(t, layout.n, 0) for t in layout.tensors), len(layout.tensors)

    @classmethod
    def transient_bytes(cls, layout: Layout) -> int:
        return sharded_transient(layout)


class FSDP(FSDPCosts, Strategy):
    """FSDP2's runtime half: ``fully_shard`` per block (and per LayerNorm pair under fp32 LayerNorm), then
    the root; torch.distributed.checkpoint for its sharded state."""

    def wrap(self, model: nn.Module, mesh=None) -> nn.Module:
        """Shard ``model`` over ``mesh`` (default: every rank of the process group)."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = mesh if mesh is not None else init_device_mesh(self.device.type, (world_size(),))
        kwargs = dict(mesh=mesh, reshard_after_forward=self.cfg.parallel.reshard_after_forward,
                      mp_policy=self.mixed_precision_policy())
        # LayerNorm kept in fp32: its parameters form groups of their own with no mixed-precision policy
        # (an FSDP2 group has one parameter dtype), one group for both norms of a block so that each block
        # costs one extra all-gather, not two. Bottom-up: norms before the block that holds them.
        norm_kwargs = dict(kwargs, mp_policy=MixedPrecisionPolicy())
        for block in model.blocks:
            if self.precision.layer_norm_fp32:
                fully_shard([block.norm1, block.norm2], **norm_kwargs)
            fully_shard(block, **kwargs)
        if self.precision.layer_norm_fp32:
            fully_shard(model.norm, **norm_kwargs)
        fully_shard(model, **kwargs)
        return model

    def mixed_precision_policy(self):
        """``mixed``: half compute parameters gathered from fp32 shards (the master copy), gradients reduced
        in ``parallel.reduce_dtype``. ``pure``: the parameters are half already; an fp32 reduce dtype
        makes FSDP2 reduce-scatter in fp32 and cast the result back (_fsdp_collectives.py foreach_reduce).
        """
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if self.precision.mode == "mixed":
            return MixedPrecisionPolicy(param_dtype=self.precision.half, reduce_dtype=self.reduce_dtype)
        if self.precision.mode == "pure":
            return MixedPrecisionPolicy(reduce_dtype=self.reduce_dtype)
        return MixedPrecisionPolicy()

    # Sharded state: every rank writes its own shard with torch.distributed.checkpoint into the same
    # folder (Ray merges the ranks' folders into one checkpoint).
    def save(self, directory: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        from rayvit.training.checkpoint_layout import SHARDED_DIR

        model_state, optim_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=os.path.join(directory, SHARDED_DIR))

    def save_model(self, directory: str, model: nn.Module) -> None:
        # Gathered onto rank 0, each parameter offloaded to its CPU as it is gathered: one file written from
        # one node, as a replicated strategy writes it (the other ranks get nothing; fp32 under mixed,
        # where the sharded parameters are the master copy).
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        from rayvit.training.checkpoint_layout import save_full_state

        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank() == 0:
            save_full_state(directory, {"model": state})

    def load(self, directory: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        from rayvit.training.checkpoint_layout import SHARDED_DIR

        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=os.path.join(directory, SHARDED_DIR))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

