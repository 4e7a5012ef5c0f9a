"""Optimizers (AdamW, Adam, SGD) in three implementations, and the learning-rate schedule.

``loop`` runs one set of kernels per tensor, ``foreach`` is the study's multi-tensor-apply (MTA)
optimizer (one kernel over lists of tensors), ``fused`` is a single fused kernel where torch has one.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Iterable, Optional

import torch
from torch import nn
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

from rayvit.errors import ConfigError

if TYPE_CHECKING:
    from rayvit.config_schema import OptimConfig


def weight_decay_plan(model: nn.Module) -> dict[tuple[int, str], bool]:
    """Which parameters decay, decided on the unwrapped model: ``{(id(owner module), name): decays}``.

    Biases, norm weights and the model's ``no_weight_decay()`` parameters (position embedding, class token)
    do not decay. Keyed by owning module and attribute name, not by parameter object or shape: DDP and FSDP2
    keep the modules (FSDP2 swaps their parameters for sharded ones of the same name) and FairScale's flat
    parameters record the module and name of every tensor they hold, whereas shapes do not survive
    sharding (a FairScale shard is 1-D whatever it came from).
    """
    inner = getattr(model, "module", model)
    skip = {id(p) for p in getattr(inner, "no_weight_decay", lambda: [])()}
    return {(id(m), n): not (p.ndim <= 1 or id(p) in skip)
            for m in model.modules() for n, p in m.named_parameters(recurse=False) if p.requires_grad}


def owned_parameters(model: nn.Module):
    """``(module, name, parameter)`` for every trainable parameter, each once, under the module holding it."""
    seen: set[int] = set()
    for m in model.modules():
        for n, p in m.named_parameters(recurse=False):
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                yield m, n, p


def param_groups(model: nn.Module, weight_decay: float,
                 plan: Optional[dict[tuple[int, str], bool]] = None) -> list[dict]:
    """Two groups: decayed weights, and biases / norm weights / position embedding / class token.

    ``plan`` is :func:`weight_decay_plan` of the model before it was wrapped (default: of ``model`` itself).
    A parameter the plan does not know (a wrapper's own) is an error, never silently left undecayed.
    """
    plan = weight_decay_plan(model) if plan is None else plan
    decay, no_decay = [], []
    for m, n, p in owned_parameters(model):
        if (id(m), n) not in plan:
            raise ValueError(f"parameter {n!r} of {type(m).__name__} did not exist before wrapping: "
                             "its weight decay is undecided")
        (decay if plan[(id(m), n)] else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


_FUSED_OPS = {"adamw": "_fused_adamw_", "adam": "_fused_adam_", "sgd": "_fused_sgd_"}


def _dtensor_runs(op_name: str) -> bool:
    """Whether DTensor (FSDP2's parameters) has a sharding rule for ``aten.<op_name>.default``."""
    from torch.distributed.tensor import DTensor

    op = getattr(torch.ops.aten, op_name).default
    propagator = DTensor._op_dispatcher.sharding_propagator
    # torch keeps its rules in several tables, by kind of rule; a table an older torch lacks is empty.
    tables = ("op_single_dim_strategy_funcs", "op_strategy_funcs", "op_to_rules")
    return any(op in getattr(propagator, table, {}) for table in tables)


def fused_unavailable(name: str, dtensor: bool, device_type: str) -> Optional[str]:
    """Why this torch cannot run ``optim.impl=fused`` for optimizer ``name`` on ``device_type`` ('cpu',
    'cuda'), over DTensor parameters when ``dtensor``, or None when it can. Config validation asks, before
    anything is built.

    Fused kernels exist per device (``torch.utils._foreach_utils``); FSDP2's parameters are DTensors,
    which need a sharding rule for the fused op (torch registers Adam's and AdamW's, not SGD's).
    """
    supported = _get_fused_kernels_supported_devices()
    if device_type not in supported:
        return (f"torch {torch.__version__} has no fused {name} kernels for {device_type} "
                f"(it has them for {', '.join(supported)})")
    if dtensor and not _dtensor_runs(_FUSED_OPS[name]):
        return (f"torch {torch.__version__} cannot run fused {name} on FSDP2's sharded (DTensor) parameters "
                f"(no sharding rule for aten.{_FUSED_OPS[name]})")
    return None


def _impl_flags(impl: str, name: str, params: list[torch.Tensor]) -> dict:
    if impl == "loop":
        return {"foreach": False}
    if impl == "foreach":
        return {"foreach": True}
    # Validation refused what torch cannot run; this only guards optimizers built outside a Config.
    dtensor = any(type(p.data).__name__ == "DTensor" for p in params)
    for device_type in sorted({p.device.type for p in params}):
        why = fused_unavailable(name, dtensor, device_type)
        if why:
            raise ConfigError(f"optim.impl=fused: {why}; use optim.impl=foreach")
    return {"fused": True}


def optimizer_spec(cfg: OptimConfig, params: list[torch.Tensor], *, eps: Optional[float] = None
                   ) -> tuple[type[torch.optim.Optimizer], dict]:
    """The optimizer class and keyword arguments named by ``cfg`` (wrappers such as OSS need them apart)."""
    flags = _impl_flags(cfg.impl, cfg.name, params)
    eps = cfg.eps if eps is None else eps
    if cfg.name == "sgd":
        return torch.optim.SGD, dict(lr=cfg.lr, momentum=cfg.momentum, **flags)
    # Adam's weight decay is L2 added to the gradient; AdamW's is decoupled from it.
    cls = torch.optim.AdamW if cfg.name == "adamw" else torch.optim.Adam
    return cls, dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=eps, **flags)


def build_optimizer(cfg: OptimConfig, groups: list[dict], *, eps: Optional[float] = None) -> torch.optim.Optimizer:
    """The optimizer named by ``cfg`` over prepared parameter groups (see :func:`param_groups`)."""
    cls, kwargs = optimizer_spec(cfg, [p for g in groups for p in g["params"]], eps=eps)
    return cls(groups, **kwargs)


def lr_factor(cfg: OptimConfig, step: int, total_steps: int) -> float:
    """Multiplier on ``cfg.lr`` at ``step``: linear warm-up, then cosine (or constant) decay."""
    if cfg.lr_warmup_steps and step < cfg.lr_warmup_steps:
        return (step + 1) / cfg.lr_warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    span = max(1, total_steps - cfg.lr_warmup_steps)
    progress = min(1.0, (step - cfg.lr_warmup_steps) / span)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(cfg: OptimConfig, optimizer: torch.optim.Optimizer, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(cfg, step, total_steps))


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """The part of a tensor this rank holds: a DTensor's (FSDP2) local shard, or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def tensors_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the tensors' local shards."""
    return sum(local_shard(t).numel() * local_shard(t).element_size() for t in tensors)


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state this rank actually holds (local shards only)."""
    # FairScale OSS keeps this rank's partition in an inner optimizer; its own .state is a view for users.
    optimizer = getattr(optimizer, "optim", optimizer)
    return tensors_bytes(v for state in optimizer.state.values() for v in state.values()
                         if isinstance(v, torch.Tensor))
