"""FairScale's FullyShardedDataParallel (0.4.13), the library the study used. Runs on CUDA only.

Every encoder block is wrapped, then the root, as with FSDP2, with FairScale's flattened parameters (its
default): one flat parameter per wrapper, so each block costs one all-gather and one reduce-scatter. What
FairScale needs, by precision (line numbers in fairscale/nn/data_parallel/fully_sharded_data_parallel.py):

- ``mixed``: ``mixed_precision=True`` with ``compute_dtype`` the half type; fp32 shards are the master
  copy. ``fp32_reduce_scatter`` follows ``parallel.reduce_dtype``, and is always on at world size 1:
  there FairScale never reduces, and only that flag casts the half gradient to the fp32 parameter's
  dtype (:1696-1698); without it the half gradient stays on the fp32 parameter and the step fails.
- ``pure``: ``mixed_precision=False, compute_dtype=float16`` over fp16 parameters, the only combination
  that accepts half parameters (:442-449); FairScale has no pure bf16 and cannot reduce fp16 gradients in
  fp32 without mixed precision (:391), so config validation refuses both.
- LayerNorm in fp32 (``mixed``): each LayerNorm in its own unflattened fp32 wrapper, pycls' own recipe
  (pycls/core/trainer.py ``auto_wrap_ln``: mixed_precision=False, flatten_parameters=False,
  reshard_after_forward=False, bucket_cap_mb=0).

Weight decay over flat parameters: a flat parameter concatenates tensors that decay (matrices) with
tensors that do not (biases, position embedding), and its shard is a 1-D slice of that. The optimizer's
own decay is set to 0 for flat parameters and :class:`MaskedWeightDecay` applies the exact decay of
the configured optimizer element-wise, from the decision made on the unwrapped model, before each step.
(pycls grouped by parameter name, so its flat parameters decayed entirely, biases included.)
"""

from __future__ import annotations

import os

import torch
from torch import nn

from rayvit.worker.optim import build_optimizer, owned_parameters
from rayvit.worker.strategies.base import Strategy, rank, world_size


class MaskedWeightDecay:
    """The optimizer's weight decay applied element-wise over flat parameters, before its step.

    ``adamw`` decays decoupled, ``p *= 1 - lr * wd`` (torch's AdamW does exactly this first in its step);
    ``adam`` and ``sgd`` add ``wd * p`` to the gradient (their L2 term). Masked-out elements are untouched.
    """

    def __init__(self, params: list[torch.Tensor], masks: list[torch.Tensor], weight_decay: float,
                 decoupled: bool) -> None:
        self.params, self.masks = params, masks
        self.weight_decay, self.decoupled = weight_decay, decoupled

    @torch.no_grad()
    def apply(self, lr: float) -> None:
        if self.weight_decay == 0:
            return
        for p, mask in zip(self.params, self.masks):
            if self.decoupled:
                p.mul_(torch.where(mask, 1.0 - lr * self.weight_decay, 1.0).to(p.dtype))
            elif p.grad is not None:
                p.grad.add_(p * mask, alpha=self.weight_decay)


def flat_decay_mask(wrapper: nn.Module, flat: nn.Parameter, plan: dict) -> torch.Tensor:
    """Which elements of this rank's shard of ``flat`` decay, from the tensors it was flattened from.

    FairScale flattens in ``_param_infos`` order with ``_param_numels`` sizes (misc/flatten_params_wrapper.py
    ``_init_flatten_params`` and ``FlatParameter.get_param_views``) and shards the flat tensor with
    ``_get_shard`` (torch.chunk, zero padding; fully_sharded_data_parallel.py:740-754), used here too.
    """
    full = torch.cat([torch.full((numel,), float(plan[(id(module), name)]), device=flat.device)
                      for (_, module, name), numel in zip(flat._param_infos, flat._param_numels)])
    if getattr(flat, "_is_sharded", False):
        full, _ = wrapper._get_shard(full)
    return full > 0.5


class FairScaleFSDP(Strategy):
    name = "fairscale_fsdp"
    owns_mixed_precision = True
    # model.compile is refused at config time (rayvit.config_rules.COMPILE_UNSUPPORTED): FairScale's FSDP does not
    # support torch.compile.

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.masked_decay: MaskedWeightDecay | None = None

    def wrapper_kwargs(self) -> dict:
        """Settings of the block and root wrappers for this precision (see the module docstring)."""
        mode, half = self.precision.mode, self.precision.half
        # Under autocast, each wrapper drops autocast's cache of down-cast weights when its forward ends;
        # else the cache keeps a half copy of every gathered fp32 weight (FairScale's docstring, :264-269).
        # pycls sets it with mixed precision too (trainer.py setup_model).
        kwargs = dict(reshard_after_forward=self.cfg.parallel.reshard_after_forward, compute_device=self.device,
                      clear_autocast_cache=self.precision.uses_autocast)
        if mode == "mixed":
            kwargs.update(mixed_precision=True, compute_dtype=half,
                          fp32_reduce_scatter=self.reduce_dtype == torch.float32 or world_size() == 1)
        elif mode == "pure":
            kwargs.update(mixed_precision=False, compute_dtype=torch.float16)
        return kwargs

    def wrap(self, model: nn.Module) -> nn.Module:
        # No CUDA check here: config validation refuses fairscale_fsdp without GPUs. Wrapping alone works on
        # CPU (tests build wrappers there); FairScale's forward and clip need CUDA streams.
        from fairscale.nn import FullyShardedDataParallel as Wrapper

        if self.precision.layer_norm_fp32:
            ln_kwargs = dict(mixed_precision=False, flatten_parameters=False, reshard_after_forward=False,
                             bucket_cap_mb=0, compute_device=self.device)
            norms = [(parent, name) for parent in model.modules()
                     for name, child in parent.named_children() if isinstance(child, nn.LayerNorm)]
            for parent, name in norms:
                setattr(parent, name, Wrapper(getattr(parent, name), **ln_kwargs))
        kwargs = self.wrapper_kwargs()
        for i, block in enumerate(model.blocks):
            model.blocks[i] = Wrapper(block, **kwargs)
        return Wrapper(model, **kwargs)

    def build_optimizer(self, model: nn.Module, plan: dict) -> torch.optim.Optimizer:
        """Groups: decayed and undecayed whole tensors (unflattened norms), and flat parameters whose decay
        :class:`MaskedWeightDecay` applies."""
        from fairscale.nn import FullyShardedDataParallel as Wrapper
        from fairscale.nn.misc.flatten_params_wrapper import FlatParameter

        owners = {id(p): w for w in model.modules() if isinstance(w, Wrapper) for p in w.params}
        decay, no_decay, flat, masks = [], [], [], []
        for module, name, p in owned_parameters(model):
            if isinstance(p, FlatParameter):
                flat.append(p)
                masks.append(flat_decay_mask(owners[id(p)], p, plan))
            else:
                (decay if plan[(id(module), name)] else no_decay).append(p)
        wd = self.cfg.optim.weight_decay
        self.masked_decay = MaskedWeightDecay(flat, masks, wd, decoupled=self.cfg.optim.name == "adamw")
        groups = [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0},
                  {"params": flat, "weight_decay": 0.0}]
        return build_optimizer(self.cfg.optim, [g for g in groups if g["params"]],
                               eps=self.precision.adam_eps(self.cfg.optim.eps))

    def optimizer_step(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        if self.masked_decay is not None:
            self.masked_decay.apply(optimizer.param_groups[-1]["lr"])
        optimizer.step()

    def clip_grad_norm_(self, model: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
        # Each rank holds one shard of every gradient: FairScale's clip all-reduces the shards' norms
        # (fully_sharded_data_parallel.py:621-685); torch's clip would give every rank its own norm.
        return model.clip_grad_norm_(max_norm)

    # Sharded state: each rank saves its own shard of the model and optimizer.
    def save(self, directory: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        torch.save({"model": model.local_state_dict(), "optim": optimizer.state_dict()},
                   os.path.join(directory, f"rank{rank()}.pt"))

    def load(self, directory: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        state = torch.load(os.path.join(directory, f"rank{rank()}.pt"), map_location=self.device)
        model.load_local_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
