"""The shape every parallel strategy has, and the distributed helpers they share.

A strategy decides how the model, its gradients and its optimizer state are spread over ranks. The
worker loop (:mod:`rayvit.worker.loop`) calls one object through this interface and never asks which
strategy it holds; adding a strategy is one module in this package and one registry line.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Optional

import torch
import torch.distributed as dist
from torch import nn

from rayvit.worker import checkpoint
from rayvit.worker.optim import build_optimizer, param_groups, weight_decay_plan
from rayvit.worker.precision import MasterWeights, Precision

from rayvit.config import reduces_in_half

if TYPE_CHECKING:
    from rayvit.config import Config


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


class Strategy:
    """One parallel strategy for one worker: wrap, optimizer, gradient clearing and clipping, checkpoints.

    The defaults are those of a replicated strategy (every rank holds the whole model and optimizer):
    subclasses override what their library does differently.
    """

    name: ClassVar[str]
    # The strategy applies ``precision.mode=mixed`` itself (FSDP's mixed-precision policies): the model
    # stays fp32 until it is wrapped and no separate fp32 master copy is kept.
    owns_mixed_precision: ClassVar[bool] = False
    # How ``model.compile`` applies (config validation refuses it where a library cannot run compiled):
    # "blocks": each encoder block is compiled before the model is wrapped, torchtitan's recipe for FSDP2 (a
    # block's wrapper hooks stay outside its graph; identical blocks share one compiled graph); "wrapped":
    # the wrapped model is compiled whole, as DDP documents it.
    compile_mode: ClassVar[str] = "blocks"

    def __init__(self, cfg: "Config", precision: Precision, device: torch.device) -> None:
        self.cfg = cfg
        self.precision = precision
        self.device = device
        self.masters: Optional[MasterWeights] = None

    # -- building ------------------------------------------------------------------------------------

    def parallelize(self, model: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Wrap ``model`` (already on the device, cast by the precision) and build its optimizer.

        Weight decay is decided on the unwrapped model, where every tensor still has its shape and name.
        """
        plan = weight_decay_plan(model)
        self.compile_blocks(model)
        model = self.wrap(model)
        return model, self.build_optimizer(model, plan)

    def compile_blocks(self, model: nn.Module) -> None:
        """Under ``model.compile`` with ``compile_mode = "blocks"``: each encoder block becomes its compiled
        module, in place, before any wrapper sees it. Compiling is lazy: the first step compiles."""
        if self.cfg.model.compile and self.compile_mode == "blocks":
            for i, block in enumerate(model.blocks):
                model.blocks[i] = torch.compile(block)

    def forward_of(self, model: nn.Module):
        """What the loop calls for a forward pass: the wrapped model, compiled whole under
        ``model.compile`` with ``compile_mode = "wrapped"``."""
        if self.cfg.model.compile and self.compile_mode == "wrapped":
            return torch.compile(model)
        return model

    def wrap(self, model: nn.Module) -> nn.Module:
        return model

    def build_optimizer(self, model: nn.Module, plan: dict) -> torch.optim.Optimizer:
        """Weight-decay groups from ``plan``, over an fp32 master copy where the precision keeps one."""
        groups = param_groups(model, self.cfg.optim.weight_decay, plan)
        if self.precision.uses_master_weights:
            self.masters = MasterWeights([p for g in groups for p in g["params"]])
            groups = [{**g, "params": [self.masters.master_of(p) for p in g["params"]]} for g in groups]
        return build_optimizer(self.cfg.optim, groups, eps=self.precision.adam_eps(self.cfg.optim.eps))

    @property
    def reduce_dtype(self) -> torch.dtype:
        """The dtype gradients travel in when ranks reduce them (``parallel.reduce_dtype``).

        It governs half-precision gradients (``mixed``, ``pure``); fp32 gradients (``fp32``, ``amp``, and
        LayerNorm kept in fp32) are reduced in fp32 by every strategy.
        """
        if self.precision.mode in ("fp32", "amp") or not reduces_in_half(self.cfg):
            return torch.float32
        return self.precision.half

    @staticmethod
    def unwrap(model: nn.Module) -> nn.Module:
        """The user's ViT inside wrappers that hold it as ``.module`` (FSDP2 wraps in place)."""
        while hasattr(model, "module"):
            model = model.module
        return model

    # -- each step ------------------------------------------------------------------------------------

    def zero_grad(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)

    def clip_grad_norm_(self, model: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
        """Clip by the norm of the whole model's gradient. Replicated (reduced) gradients and FSDP2's DTensor
        gradients give every rank that same norm; sharding libraries override this with their own."""
        params = [p for g in optimizer.param_groups for p in g["params"]]
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    def optimizer_step(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """One optimizer step on the (unscaled, clipped) gradients."""
        optimizer.step()

    # -- checkpoints ----------------------------------------------------------------------------------

    def save(self, directory: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Replicated state: rank 0 writes one full copy (model, optimizer, master weights)."""
        optim_state = self.optimizer_state_dict(optimizer)
        if rank() == 0:
            state = {"model": self.unwrap(model).state_dict(), "optim": optim_state}
            if self.masters is not None:
                state["masters"] = [m.detach() for m in self.masters.masters]
            checkpoint.save_full_state(directory, state)

    def load(self, directory: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        state = checkpoint.load_full_state(directory, self.device)
        self.unwrap(model).load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
        if self.masters is not None:
            with torch.no_grad():
                for master, saved in zip(self.masters.masters, state["masters"]):
                    master.copy_(saved)

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> Optional[dict]:
        """The optimizer state rank 0 saves (a collective for strategies that shard it)."""
        return optimizer.state_dict()
