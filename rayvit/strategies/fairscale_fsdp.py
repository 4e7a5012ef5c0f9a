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

Cost model: flattened per wrapped unit (or per tensor, unflattened), padded to ceil(numel/N) on every rank.
The same collectives per flat unit as FSDP2's groups, except that the root never gathers again for
backward (``disable_reshard_on_root``); under ``mixed`` with fp32 LayerNorm every LayerNorm is a wrapper
of its own with unflattened parameters (one fp32 all-gather per parameter, kept until after backward).
Gradients go through FairScale's shared reduce-scatter bucketer (25 MiB per dtype): a gradient larger
than that goes at once, smaller ones wait in the bucket until it is full or backward ends.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from rayvit.strategies.base import Strategy, StrategyCosts, pure_reduce_refusal, rank, world_size
from rayvit.strategies.costs import (Layout, Message, ShardGroup, StateBytes, optimizer_bytes, sharded_messages,
                                     sharded_transient, tensor_state)
from rayvit.strategies.shapes import ROOT_UNIT, fsdp_units

if TYPE_CHECKING:
    import torch
    from torch import nn

    from rayvit.config_schema import Config

FAIRSCALE_BUCKET = 25 * 2 ** 20    # FullyShardedDataParallel(bucket_cap_mb=25), the root's, shared by all


class MaskedWeightDecay:
    """The optimizer's weight decay applied element-wise over flat parameters, before its step.

    ``adamw`` decays decoupled, ``p *= 1 - lr * wd`` (torch's AdamW does exactly this first in its step);
    ``adam`` and ``sgd`` add ``wd * p`` to the gradient (their L2 term). Masked-out elements are untouched.
    """

    def __init__(self, params: list[torch.Tensor], masks: list[torch.Tensor], weight_decay: float,
                 decoupled: bool) -> None:
        self.params, self.masks = params, masks
        self.weight_decay, self.decoupled = weight_decay, decoupled

    def apply(self, lr: float) -> None:
        import torch

        if self.weight_decay == 0:
            return
        with torch.no_grad():
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
    import torch

    full = torch.cat([torch.full((numel,), float(plan[(id(module), name)]), device=flat.device)
                      for (_, module, name), numel in zip(flat._param_infos, flat._param_numels)])
    if getattr(flat, "_is_sharded", False):
        full, _ = wrapper._get_shard(full)
    return full > 0.5


def groups(layout: Layout) -> list[ShardGroup]:
    """FairScale FSDP's instances in forward order (:meth:`FairScaleFSDP.wrap`): a flat unit per block and
    the root (which never reshards), and under fp32 LayerNorm a wrapper per LayerNorm."""
    again = layout.cfg.parallel.reshard_after_forward
    out = []
    for name, unit in fsdp_units(list(layout.tensors)).items():
        wrapped = [t for t in unit if t.norm] if layout.dt.layer_norm_fp32 else []
        out.append(ShardGroup(name, [t for t in unit if t not in wrapped], True, again and name != ROOT_UNIT))
        for i in range(0, len(wrapped), 2):             # weight and bias of one LayerNorm
            out.append(ShardGroup(f"{wrapped[i].name.rsplit('.', 1)[0]}", wrapped[i:i + 2], False, False,
                                  per_tensor=True))
    root = [g for g in out if g.name == "norm"]     # the final LayerNorm runs after the blocks
    return [g for g in out if g not in root] + root


def bucketer(backward: list[Message], n: int) -> list[Message]:
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


class FairScaleFSDPCosts(StrategyCosts):
    """FairScale FSDP's cost half: flat parameters per wrapped unit, its reduce-scatter bucketer, CUDA only."""

    name = "fairscale_fsdp"
    owns_mixed_precision = True
    reshards = True
    colour = "#2ca02c"
    compile_unsupported = (
        "FairScale's FullyShardedDataParallel (0.4.13, unmaintained since it was upstreamed into PyTorch) "
        "does not support torch.compile: it predates it and swaps flattened-parameter views in and out of "
        "the model around every forward and backward; use parallel.strategy=fsdp (PyTorch FSDP2, which "
        "compiles each block), or model.compile=false for the study's FairScale FSDP")

    @classmethod
    def refuses(cls, cfg: Config) -> str | None:
        prec = cfg.precision
        if not cfg.parallel.use_gpu:
            return ("parallel.strategy=fairscale_fsdp needs CUDA GPUs (FairScale's FSDP uses CUDA streams and "
                    "fails on CPU); set parallel.use_gpu=true on a GPU cluster, or use parallel.strategy=fsdp "
                    "(PyTorch FSDP2), which runs on CPU too")
        if prec.mode == "pure" and prec.dtype == "bf16":
            return ("precision.mode=pure precision.dtype=bf16 cannot run with parallel.strategy=fairscale_fsdp: "
                    "FairScale 0.4.13's FSDP accepts half parameters only as fp16 (pure bf16 does not exist in "
                    "that version); use precision.dtype=fp16, or parallel.strategy=fsdp (PyTorch FSDP2) for "
                    "pure bf16")
        return pure_reduce_refusal(cfg, "FairScale FSDP reduces in fp32 only with mixed_precision "
                                        "(fp32_reduce_scatter)")

    @classmethod
    def step_messages(cls, layout: Layout) -> list[Message]:
        if layout.n <= 1:
            return []
        forward, backward = sharded_messages(groups(layout), layout.dt, layout.n)
        return forward + bucketer(backward, layout.n)

    @classmethod
    def heaviest_ranks(cls, layout: Layout) -> tuple[int, ...]:
        return (0,)                  # padded to equal shards on every rank

    @classmethod
    def rank_state(cls, layout: Layout, rank: int) -> StateBytes:
        n = layout.n
        if not layout.flatten:
            return tensor_state(layout, rank, local=lambda t: -(-t.numel // n))
        params = optim = 0
        width = layout.dt.stored(False)
        for unit in fsdp_units(list(layout.tensors)).values():
            local = -(-sum(t.numel for t in unit) // n)
            params += local * width
            optim += optimizer_bytes(layout.cfg, local, layout.dt.optimizer_state(False))
        return StateBytes(params, params, 0, optim)

    @classmethod
    def optimizer_elements(cls, layout: Layout) -> tuple[int, int]:
        units = fsdp_units(list(layout.tensors)).values()
        return sum(-(-sum(t.numel for t in u) // layout.n) for u in units), len(units)

    @classmethod
    def transient_bytes(cls, layout: Layout) -> int:
        return sharded_transient(layout)



class FairScaleFSDP(FairScaleFSDPCosts, Strategy):
    """FairScale FSDP's runtime half: its wrappers (and fp32 LayerNorm wrappers), flat-parameter weight
    decay, its own clipping and sharded checkpoints."""

    @classmethod
    def prepare_process_groups(cls, device: "torch.device") -> None:
        """FairScale's FSDP makes two process groups of all ranks at its first wrap (``process_group`` and
        the overlapping ``reduce_scatter`` group; fairscale/internal/parallel.py ``get_process_group_cached``)
        and caches them for the life of the process, their NCCL communicators outside torch's caching
        allocator. Made here, with a collective on each (NCCL creates a communicator at its group's first
        collective), every run of a worker group has the same free memory, before and after FairScale's."""
        import torch
        import torch.distributed as dist
        from fairscale.internal.parallel import ProcessGroupName, get_process_group_cached

        for name in (ProcessGroupName.default, ProcessGroupName.reduce_scatter):
            dist.all_reduce(torch.zeros(1, device=device), group=get_process_group_cached(name))

    @classmethod
    def forget_process_groups(cls) -> None:
        """Drop FairScale's cache of process groups (they belonged to a destroyed default group; reused,
        they would fail): the next wrap makes them anew."""
        from fairscale.internal.parallel import get_process_group_cached

        if hasattr(get_process_group_cached, "_global_group_cache"):
            del get_process_group_cached._global_group_cache

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.masked_decay: MaskedWeightDecay | None = None

    def checkpoint_wrapper(self, block: nn.Module) -> nn.Module:
        """FairScale's own checkpoint wrapper, the one its FSDP documents ("wrap the module with
        checkpoint_wrapper, then with FSDP"): it patches the block's forward in place (names unchanged) and
        its recomputation runs inside FSDP's backward, with the block's parameters already gathered.

        Its recompute re-enters ``torch.cuda.amp.autocast(True)`` when the forward ran under CUDA autocast
        (fairscale/nn/checkpoint/checkpoint_activations.py, ``autocast`` and ``CheckpointFunction.backward``),
        whose dtype is fp16: under bf16 (amp, mixed with fp32 LayerNorm) every recompute and the gradients
        through it would run in fp16, with no loss scaler. The block re-enters its forward's own autocast
        inside it (:func:`~rayvit.models.activation_checkpointing.recompute_in_forward_autocast`). FairScale's wrapper
        is kept rather than torch's, which FairScale's FSDP advises against and which rayvit cannot run with
        it off CUDA."""
        from fairscale.nn.checkpoint import checkpoint_wrapper
        from fairscale.nn.checkpoint.checkpoint_activations import is_recomputing

        from rayvit.models.activation_checkpointing import recompute_in_forward_autocast

        return checkpoint_wrapper(recompute_in_forward_autocast(block, is_recomputing))

    def wrapper_kwargs(self) -> dict:
        """Settings of the block and root wrappers for this precision (see the module docstring)."""
        mode, half = self.precision.mode, self.precision.half
        # Under autocast, each wrapper drops autocast's cache of down-cast weights when its forward ends;
        # else the cache keeps a half copy of every gathered fp32 weight (FairScale's docstring, :264-269).
        # pycls sets it with mixed precision too (trainer.py setup_model).
        import torch

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
        from torch import nn

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

        from rayvit.training.optim import build_optimizer, owned_parameters

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
        # With the shard's metadata, so that rayvit.worker.checkpoint_io.load_checkpoint can consolidate the
        # shards into one model offline (FairScale's consolidate_shard_weights).
        import torch

        torch.save({"model": model.local_state_dict(), "optim": optimizer.state_dict(),
                    "metadata": model.local_metadata_dict()}, os.path.join(directory, f"rank{rank()}.pt"))

    def save_model(self, directory: str, model: nn.Module) -> None:
        # Its own layout, without the optimizer: each rank's flat shard and its metadata, consolidated offline
        # by load_checkpoint. (FairScale's full state_dict() would gather the whole model onto every rank.)
        import torch

        torch.save({"model": model.local_state_dict(), "metadata": model.local_metadata_dict()},
                   os.path.join(directory, f"rank{rank()}.pt"))

    def load(self, directory: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        import torch

        state = torch.load(os.path.join(directory, f"rank{rank()}.pt"), map_location=self.device)
        model.load_local_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
