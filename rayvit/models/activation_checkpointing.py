"""Activation checkpointing (``model.activation_checkpointing``): which encoder blocks keep only their input
for backward and run their forward again there, and how a block is wrapped to do so.

- ``none``: every block keeps what autograd saves (the default).
- ``block``: every block is checkpointed: it saves only its input, and its forward runs twice.
- ``selective``: every ``model.checkpoint_every``-th block (blocks 0, k, 2k, ...), torchtitan's
  selective-layer pattern: memory and recompute in between.

Each strategy wraps the chosen blocks before anything else touches the model (``Strategy.parallelize``:
checkpointing, then ``torch.compile``, then sharding, as torchtitan's ``parallelize`` orders them), with the
wrapper its library works with (``Strategy.checkpoint_wrapper``). Choosing blocks needs no torch (the
projection asks); wrapping imports torch when called.

A recompute must compute in the dtype its forward did. torch's non-reentrant wrapper records the forward's
autocast state and re-enters it. FairScale's re-enters ``torch.cuda.amp.autocast(True)``, whose dtype is
fp16, whatever the forward's was (and on CPU no autocast at all): :func:`recompute_in_forward_autocast`
makes the block itself re-enter its forward's autocast inside that.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from torch import nn

    from rayvit.config_schema import ModelConfig


def checkpointed_blocks(cfg: "ModelConfig") -> list[int]:
    """Indices of the encoder blocks ``cfg.activation_checkpointing`` checkpoints."""
    mode = getattr(cfg, "activation_checkpointing", "none")
    if mode == "block":
        return list(range(cfg.depth))
    if mode == "selective":
        return list(range(0, cfg.depth, max(1, cfg.checkpoint_every)))
    return []


def torch_checkpoint_wrapper(block):
    """PyTorch's non-reentrant checkpoint wrapper (what torchtitan applies before ``fully_shard``): the
    block's state-dict keys stay the same, and DDP, FSDP2 and OSS see ordinary autograd."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    return checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)


class _ForwardAutocast:
    """Mixed in before a block's own class: its forward notes the autocast state it runs under, and its
    recompute (``self._recomputing()`` true) runs under that state again, inside whatever autocast the
    checkpoint wrapper entered around it."""

    _recomputing: Callable[[], bool]
    _forward_autocast: tuple[bool, Any, bool]

    def forward(self, x, *args, **kwargs):
        import torch

        device = x.device.type
        if self._recomputing():
            enabled, dtype, cache = self._forward_autocast
            with torch.autocast(device, dtype=dtype, enabled=enabled, cache_enabled=cache):
                return super().forward(x, *args, **kwargs)
        self._forward_autocast = (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device),
                                  torch.is_autocast_cache_enabled())
        return super().forward(x, *args, **kwargs)


_RECOMPUTED_CLASSES: dict[type, type] = {}


def recompute_in_forward_autocast(block: "nn.Module", recomputing: Callable[[], bool]) -> "nn.Module":
    """``block``, in place, made to recompute under the autocast state (enabled, dtype, cache) of its last
    forward: its class becomes a subclass of its own (same parameters, names and state-dict keys) whose
    forward re-enters that state while ``recomputing()`` says a checkpoint wrapper is recomputing it.
    Apply it before a wrapper that calls the class's forward (FairScale's)."""
    cls = type(block)
    if not issubclass(cls, _ForwardAutocast):
        if cls not in _RECOMPUTED_CLASSES:
            _RECOMPUTED_CLASSES[cls] = type(cls.__name__, (_ForwardAutocast, cls), {"__module__": cls.__module__})
        block.__class__ = _RECOMPUTED_CLASSES[cls]
    block._recomputing = recomputing
    return block


def apply_activation_checkpointing(model, cfg: "ModelConfig", wrap: Callable = torch_checkpoint_wrapper) -> list[int]:
    """Wrap the checkpointed blocks of ``model`` (a ``VisionTransformer``) in place; returns their indices."""
    chosen = checkpointed_blocks(cfg)
    for i in chosen:
        model.blocks[i] = wrap(model.blocks[i])
    return chosen


__all__ = ["checkpointed_blocks", "apply_activation_checkpointing", "recompute_in_forward_autocast",
           "torch_checkpoint_wrapper"]
