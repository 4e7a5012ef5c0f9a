"""Parallel strategies: how the model, its gradients and its optimizer state are spread over ranks.

| strategy          | params     | grads         | optimizer state | runs on  |
| ----------------- | ---------- | ------------- | --------------- | -------- |
| `ddp`             | replicated | all-reduced   | replicated      | CPU, GPU |
| `fsdp`            | sharded    | reduce-scatter| sharded         | CPU, GPU | PyTorch FSDP2 (`fully_shard`)
| `fairscale_oss`   | replicated | reduced to owner | sharded      | CPU, GPU | FairScale OSS + ShardedDDP
| `fairscale_fsdp`  | sharded    | sharded       | sharded         | GPU only | FairScale FSDP, as the study used

FSDP follows torchtitan's recipe: shard every encoder block, then the root, so each block's parameters
are gathered just before it runs and freed (``reshard_after_forward``) right after.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from rayvit.config import Config, ConfigError
from rayvit.optim import build_optimizer, optimizer_spec, param_groups
from rayvit.precision import MasterWeights, Precision


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def ensure_process_group(device: torch.device) -> bool:
    """Start a one-rank process group when none exists, so every strategy runs the same code path.

    Returns True when this call created it (the caller then destroys it).
    """
    if dist.is_initialized():
        return False
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return True


def parallelize(model: nn.Module, cfg: Config, precision: Precision, device: torch.device
                ) -> tuple[nn.Module, torch.optim.Optimizer, Optional[MasterWeights]]:
    """Wrap ``model`` for ``cfg.parallel.strategy`` and build the matching optimizer.

    ``model`` is already on ``device`` and cast by ``precision.prepare_model``.
    """
    strategy = cfg.parallel.strategy
    eps = precision.adam_eps(cfg.optim.eps)
    masters = None

    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    elif strategy == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(device.type, (world_size(),))
        kwargs = dict(mesh=mesh, reshard_after_forward=cfg.parallel.reshard_after_forward,
                      mp_policy=precision.fsdp_policy(cfg.parallel.reduce_dtype) or MixedPrecisionPolicy())
        for block in model.blocks:
            fully_shard(block, **kwargs)
        fully_shard(model, **kwargs)
    elif strategy == "fairscale_oss":
        from fairscale.nn.data_parallel import ShardedDataParallel
        from fairscale.optim.oss import OSS

        groups = param_groups(model, cfg.optim.weight_decay)
        cls, kwargs = optimizer_spec(cfg.optim, [p for g in groups for p in g["params"]], eps=eps)
        optimizer = OSS(groups, optim=cls, **kwargs)
        return ShardedDataParallel(model, optimizer), optimizer, None
    elif strategy == "fairscale_fsdp":
        if device.type != "cuda":
            raise ConfigError("parallel.strategy=fairscale_fsdp needs CUDA; use parallel.strategy=fsdp on CPU")
        from fairscale.nn import FullyShardedDataParallel as FairScaleFSDP

        mixed = precision.mode == "mixed"
        # flatten_parameters=False keeps each parameter an object of its own, so weight-decay grouping
        # by identity still holds after wrapping.
        kwargs = dict(mixed_precision=mixed, compute_dtype=precision.half if mixed else None,
                      flatten_parameters=False, reshard_after_forward=cfg.parallel.reshard_after_forward)
        for i, block in enumerate(model.blocks):
            model.blocks[i] = FairScaleFSDP(block, **kwargs)
        model = FairScaleFSDP(model, **kwargs)
    else:  # pragma: no cover - config validation rejects it first
        raise ConfigError(f"unknown parallel.strategy={strategy}")

    groups = param_groups(model, cfg.optim.weight_decay)
    if precision.uses_master_weights:
        masters = MasterWeights([p for g in groups for p in g["params"]])
        groups = [{**g, "params": [masters.master_of(p) for p in g["params"]]} for g in groups]
    return model, build_optimizer(cfg.optim, groups, eps=eps), masters


def unwrap(model: nn.Module) -> nn.Module:
    """The user's ViT inside DDP / ShardedDDP / FairScale FSDP wrappers (FSDP2 wraps in place)."""
    while hasattr(model, "module"):
        model = model.module
    return model
