"""Activation checkpointing's test runs: a few steps of a four-block ViT (so that "selective", every second
block, differs from "block"), their losses and the bytes autograd saves, and what the projection says it keeps."""

from __future__ import annotations

from rayvit.measure.activation_memory import saved_bytes_slope
from rayvit.projection import memory

# Four blocks, so that "selective" (every second block) differs from "block"; a few steps at a small batch.
SMALL = ["model.depth=4", "train.steps=3", "train.warmup_steps=1", "train.batch_size=4", "train.report_every=3"]


def losses_and_slope(cfg) -> tuple[list[float], float]:
    """Three training steps' losses, then the saved bytes per image of the trained session's forward."""
    from rayvit.worker import Session

    session = Session(cfg)
    try:
        losses = []
        for _ in range(cfg.train.steps):
            session.clear_grads()
            losses.append(session.train_step())
        return losses, saved_bytes_slope(session)
    finally:
        session.close()


def modelled_saved(cfg) -> float:
    """What the projection says autograd keeps per image between forward and backward (the recomputed
    block exists only during backward: not in a forward's saved tensors)."""
    parts = memory.activation_bytes_per_image(cfg, layer_norm_fp32=False)
    return sum(parts.values()) - parts.get("recomputed_block", 0.0)
