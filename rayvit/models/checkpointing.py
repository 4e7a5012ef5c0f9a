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
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from rayvit.config import ModelConfig


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


def apply_activation_checkpointing(model, cfg: "ModelConfig", wrap: Callable = torch_checkpoint_wrapper) -> list[int]:
    """Wrap the checkpointed blocks of ``model`` (a ``VisionTransformer``) in place; returns their indices."""
    chosen = checkpointed_blocks(cfg)
    for i in chosen:
        model.blocks[i] = wrap(model.blocks[i])
    return chosen


__all__ = ["checkpointed_blocks", "apply_activation_checkpointing", "torch_checkpoint_wrapper"]
