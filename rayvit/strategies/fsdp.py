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
from typing import Optional

import torch
from torch import nn

from rayvit.config import Config
from rayvit.strategies.costs import (Layout, Message, ShardGroup, StateBytes, chunk_local, sharded_messages,
                                     sharded_transient, tensor_state)
from rayvit.strategies.shapes import ROOT_UNIT, fsdp_units
from rayvit.training.checkpoint import SHARDED_DIR
from rayvit.strategies.base import Strategy, world_size


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


class FSDP(Strategy):
    name = "fsdp"
    owns_mixed_precision = True
    dtensor_params = True
    reshards = True
    colour = "#1f77b4"
    # FSDP2 allocates its reduce-scatter input in the reduce dtype, at one rank too.
    reduce_call = ("torch.distributed.fsdp._fully_shard._fsdp_collectives", "foreach_reduce_scatter_copy_in", 1)

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
    def optimizer_elements(cls, layout: Layout) -> tuple[int, int]:
        return sum(chunk_local(t, layout.n, 0) for t in layout.tensors), len(layout.tensors)

    @classmethod
    def transient_bytes(cls, layout: Layout) -> int:
        return sharded_transient(layout)

    @classmethod
    def collective_path_s(cls, cfg: Config, device: torch.device, repeats: int = 25) -> Optional[float]:
        """FSDP2's collective path at more than one rank: each group's gather copies its shards into one
        buffer (``all_gather_copy_in``), gathers, and splits the result into per-parameter tensors
        (``split_with_sizes_copy``), with per-parameter Python and dispatch work around each; at one rank it
        only copies each parameter (``FSDPParamGroup.unshard``/``wait_for_unshard``'s world-size-1 branch).

        Measured with the public ``unshard()``/``reshard()`` of every group of the sweep's model, barrier
        aligned, on the world mesh and on a one-rank mesh at the same time, less a bare all-gather of the
        group's bytes: the mean over groups. The reduce-scatter's path (``chunk_cat`` copy-in, per-parameter
        views of the reduced shard) has no public entry point; it is taken to cost the same per message.
        On a 2-core CPU host: ~0.45 ms per message (world path 0.6-0.9 ms, one-rank path 0.1 ms, bare
        all-gather of 131 KB 0.16 ms), which the links and the 1-rank anchor do not show otherwise.
        """
        import torch.distributed as dist
        from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
        from torch.distributed.fsdp import FSDPModule

        from rayvit.models import build_model
        from rayvit.projection.collectives import aligned_all_gather_s, aligned_s
        from rayvit.training.precision import Precision

        n = world_size()
        if n <= 1:
            return None
        own_group = dist.new_group([dist.get_rank()], use_local_synchronization=True)
        meshes = {"world": init_device_mesh(device.type, (n,)), "alone": DeviceMesh.from_group(own_group, device.type)}
        try:
            times: dict[str, list[float]] = {}
            sizes: list[int] = []
            for key, mesh in meshes.items():
                torch.manual_seed(cfg.train.seed)
                precision = Precision(cfg.precision, device, owns_mixed_precision=True)
                strategy = cls(cfg, precision, device)
                model = strategy.wrap(precision.prepare_model(build_model(cfg.model).to(device)), mesh=mesh)
                size = cfg.model.image_size
                images = torch.randn(1, 3, size, size, device=device)
                with torch.no_grad(), precision.autocast():    # FSDP2 initialises lazily, on the first forward
                    model(precision.cast_inputs(images))
                units = [m for m in model.modules() if isinstance(m, FSDPModule)]
                times[key] = [aligned_s(lambda m=m: (m.unshard(), m.reshard()), device, repeats) for m in units]
                if key == "world":
                    gathered = strategy.mixed_precision_policy().param_dtype
                    for m in units:
                        nested = {id(p) for u in m.modules() if u is not m and isinstance(u, FSDPModule)
                                  for p in u.parameters()}
                        own = [p for p in m.parameters() if id(p) not in nested]
                        sizes.append(sum(p.to_local().numel() * (gathered or p.dtype).itemsize for p in own) * n)
                del model
            # A shard's rows differ by rank (rank 0 holds the most); the gather moves the padded largest.
            agreed = torch.tensor(sizes, dtype=torch.float64, device=device)
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
            bare = [aligned_all_gather_s(int(size), device, repeats) for size in agreed.tolist()]
            extra = [w - a - b for w, a, b in zip(times["world"], times["alone"], bare)]
        finally:
            dist.destroy_process_group(own_group)
        return max(0.0, sum(extra) / len(extra)) if extra else None

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

        model_state, optim_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=os.path.join(directory, SHARDED_DIR))

    def load(self, directory: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=os.path.join(directory, SHARDED_DIR))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

