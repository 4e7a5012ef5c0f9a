"""The shape every parallel strategy has, in two halves, and the distributed helpers they share.

A strategy decides how the model, its gradients and its optimizer state are spread over ranks. Each
strategy module holds both halves:

- its cost half, a :class:`StrategyCosts` subclass: what config validation (:meth:`~StrategyCosts.refuses`,
  ``compile_unsupported``), the projection's cost model (the collectives of a step, bytes per rank,
  optimizer elements, transient buffers; in the terms of :mod:`rayvit.strategies.costs`), tables and
  figures (label, variants, colour) ask of it. No torch: ``rayvit project``, a dry run and a config
  check import these modules without it.
- its runtime half, a :class:`Strategy` subclass of its cost half: how it wraps, steps and saves the model
  for the worker's session (:mod:`rayvit.worker.session`), which calls one object through this interface and
  never asks which strategy it holds. torch (and the library's own modules) are imported by the methods
  that run, so that importing the module stays torch-free.

Adding a strategy is one module and one :func:`~rayvit.strategies.registry.register` line.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Optional, Sequence

from rayvit.strategies.costs import Layout, Message, StateBytes, tensor_state
from rayvit.strategies.dtypes import reduces_in_half

if TYPE_CHECKING:
    import torch
    from torch import nn

    from rayvit.config_schema import Config
    from rayvit.training.precision import MasterWeights, Precision


def world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def ensure_process_group(device: "torch.device") -> bool:
    """Start a one-rank process group when none exists, so every strategy runs the same code path.

    Returns True when this call created it (the caller then destroys it).
    """
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return True


def pure_reduce_refusal(cfg: "Config", why: str) -> Optional[str]:
    """The refusal of a library that cannot reduce ``pure``'s half gradients in fp32 (``why`` says why)."""
    if cfg.precision.mode == "pure" and not reduces_in_half(cfg):
        return (f"precision.mode=pure with parallel.strategy={cfg.parallel.strategy} cannot reduce its half "
                f"gradients in fp32 (parallel.reduce_dtype=fp32): {why}; set parallel.reduce_dtype=half, or use "
                "parallel.strategy=ddp or fsdp, which reduce in fp32")
    return None


class StrategyCosts:
    """A strategy's cost half: what it allows, what a step costs, how it is named and drawn. No torch.

    The defaults are those of a replicated strategy (every rank holds the whole model and optimizer).
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
    # Why this strategy cannot run under ``model.compile`` (config validation refuses it), or None.
    compile_unsupported: ClassVar[Optional[str]] = None
    # Why this strategy cannot run ``model.activation_checkpointing`` (config validation refuses it), or None.
    checkpointing_unsupported: ClassVar[Optional[str]] = None
    # Parameters are DTensors once wrapped (FSDP2): fused optimizers need DTensor rules for their ops.
    dtensor_params: ClassVar[bool] = False
    # Its line's colour in every figure (None: matplotlib's next colour).
    colour: ClassVar[Optional[str]] = None
    # It honours ``parallel.reshard_after_forward`` (tables label the other setting "no reshard").
    reshards: ClassVar[bool] = False

    @classmethod
    def cost_key(cls) -> tuple:
        """What the projection's caches of costed layouts key this strategy by: the class, and any module
        setting its costs read beyond the layout (FairScale OSS's bucket size)."""
        return (cls.__module__, cls.__qualname__)

    @classmethod
    def refuses(cls, cfg: "Config") -> Optional[str]:
        """Why this library cannot run ``cfg`` (a precision or device it cannot honour), or None. Config
        validation raises it as is, so it names the keys and the way out."""
        return None

    @classmethod
    def variants(cls, cfg: "Config") -> list["Config"]:
        """The settings of this strategy a projection table shows beside ``cfg`` (``cfg`` first)."""
        return [cfg]

    @classmethod
    def label(cls, cfg: "Config") -> str:
        """How tables and figures name this strategy under ``cfg``."""
        if cls.reshards and not cfg.parallel.reshard_after_forward:
            return f"{cls.name} (no reshard)"
        return cls.name

    @classmethod
    def step_messages(cls, layout: Layout) -> list[Message]:
        """Every collective one rank takes part in during one step, in issue order."""
        raise NotImplementedError(f"strategy {cls.name} does not describe its collectives (step_messages): "
                                  "the projection cannot cost it")

    @classmethod
    def rank_state(cls, layout: Layout, rank: int) -> StateBytes:
        """Bytes of parameters, gradients, masters and optimizer state ``rank`` holds. Replicated: all."""
        return tensor_state(layout, rank)

    @classmethod
    def heaviest_ranks(cls, layout: Layout) -> Sequence[int]:
        """The ranks that may hold the most state (the projection reports the largest rank's), so that it
        need not cost all N: every rank, unless the strategy knows (it holds for its own ``rank_state``
        only: the projection asks every rank of a subclass that overrides ``rank_state`` alone)."""
        return range(layout.n)

    @classmethod
    def optimizer_elements(cls, layout: Layout) -> tuple[int, int]:
        """(elements, tensors) the busiest rank's optimizer steps. Replicated: every one."""
        return sum(t.numel for t in layout.tensors), len(layout.tensors)

    @classmethod
    def transient_bytes(cls, layout: Layout) -> int:
        """Buffers that exist only during the step, beside model state and activations."""
        return 0


class Strategy(StrategyCosts):
    """A strategy's runtime half, for one worker: wrap, optimizer, gradient clearing and clipping,
    checkpoints. The defaults are those of a replicated strategy: subclasses override what their library
    does differently.
    """

    # -- what the library keeps per process, beyond one run ------------------------------------------

    @classmethod
    def prepare_process_groups(cls, device: torch.device) -> None:
        """Once per worker group, on every rank alike, before its first run: make the process groups
        (and their communicators) this library would otherwise make in its first run and keep for the
        rest of the process, so that every run of the group sees them. Most libraries keep none."""

    @classmethod
    def forget_process_groups(cls) -> None:
        """The process group this library's groups were made from is gone (a one-process tool destroyed
        its own): drop any it cached, so that the next run makes them anew."""

    def __init__(self, cfg: "Config", precision: "Precision", device: "torch.device") -> None:
        self.cfg = cfg
        self.precision = precision
        self.device = device
        self.masters: Optional["MasterWeights"] = None

    # -- building ------------------------------------------------------------------------------------

    def parallelize(self, model: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Wrap ``model`` (already on the device, cast by the precision) and build its optimizer.

        Weight decay is decided on the unwrapped model, where every tensor still has its shape and name.
        """
        from rayvit.training.optim import weight_decay_plan

        plan = weight_decay_plan(model)
        self.checkpoint_blocks(model)
        self.compile_blocks(model)
        model = self.wrap(model)
        return model, self.build_optimizer(model, plan)

    def checkpoint_blocks(self, model: nn.Module) -> list[int]:
        """Under ``model.activation_checkpointing``: the chosen encoder blocks wrapped, in place, before
        compiling and wrapping (torchtitan's order: checkpoint, compile, shard), with
        :meth:`checkpoint_wrapper`."""
        from rayvit.models.activation_checkpointing import apply_activation_checkpointing

        return apply_activation_checkpointing(model, self.cfg.model, self.checkpoint_wrapper)

    def checkpoint_wrapper(self, block: nn.Module) -> nn.Module:
        """One checkpointed block: PyTorch's non-reentrant checkpoint wrapper (DDP, FSDP2 and OSS see plain
        autograd; the recomputed forward needs no hooks of theirs)."""
        from rayvit.models.activation_checkpointing import torch_checkpoint_wrapper

        return torch_checkpoint_wrapper(block)

    def compile_blocks(self, model: nn.Module) -> None:
        """Under ``model.compile`` with ``compile_mode = "blocks"``: each encoder block becomes its compiled
        module, in place, before any wrapper sees it. Compiling is lazy: the first step compiles."""
        if self.cfg.model.compile and self.compile_mode == "blocks":
            import torch

            for i, block in enumerate(model.blocks):
                model.blocks[i] = torch.compile(block, backend=self.cfg.model.compile_backend)

    def forward_of(self, model: nn.Module):
        """What the loop calls for a forward pass: the wrapped model, compiled whole under
        ``model.compile`` with ``compile_mode = "wrapped"``."""
        if self.cfg.model.compile and self.compile_mode == "wrapped":
            import torch

            return torch.compile(model, backend=self.cfg.model.compile_backend)
        return model

    def wrap(self, model: nn.Module) -> nn.Module:
        return model

    def build_optimizer(self, model: nn.Module, plan: dict) -> torch.optim.Optimizer:
        """Weight-decay groups from ``plan``, over an fp32 master copy where the precision keeps one."""
        from rayvit.training.optim import build_optimizer, param_groups
        from rayvit.training.precision import MasterWeights

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
        import torch

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
        import torch

        params = [p for g in optimizer.param_groups for p in g["params"]]
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    def optimizer_step(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """One optimizer step on the (unscaled, clipped) gradients."""
        optimizer.step()

    # -- checkpoints ----------------------------------------------------------------------------------

    def save(self, directory: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Replicated state: rank 0 writes one full copy (model, optimizer, master weights)."""
        from rayvit.training import checkpoint_layout

        optim_state = self.optimizer_state_dict(optimizer)
        if rank() == 0:
            checkpoint_layout.save_full_state(directory, {**self._model_state(model), "optim": optim_state})

    def save_model(self, directory: str, model: nn.Module) -> None:
        """The model alone, for ``rayvit.worker.checkpoint_io.load_checkpoint`` (every rank calls it): rank 0
        writes the full copy, as :meth:`save` does without the optimizer. Sharded strategies gather it onto
        rank 0 or write their own layout."""
        from rayvit.training import checkpoint_layout

        if rank() == 0:
            checkpoint_layout.save_full_state(directory, self._model_state(model))

    def _model_state(self, model: nn.Module) -> dict:
        import torch

        state = {"model": self.unwrap(model).state_dict()}
        if self.masters is not None:
            # By parameter name: checkpoint.load_checkpoint puts them in place of the half weights.
            state["masters"] = {name: self.masters.master_of(p).detach()
                                for name, p in self.unwrap(model).named_parameters() if p.dtype != torch.float32}
        return state

    def load(self, directory: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        import torch

        from rayvit.training import checkpoint_layout

        state = checkpoint_layout.load_full_state(directory, self.device)
        self.unwrap(model).load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
        if self.masters is not None:
            with torch.no_grad():
                for name, p in self.unwrap(model).named_parameters():
                    if name in state["masters"]:
                        self.masters.master_of(p).copy_(state["masters"][name])

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> Optional[dict]:
        """The optimizer state rank 0 saves (a collective for strategies that shard it)."""
        return optimizer.state_dict()
