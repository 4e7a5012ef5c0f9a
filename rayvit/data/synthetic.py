"""Fixed random batches made once on the device: pure throughput measurement, no input pipeline."""

from __future__ import annotations

import itertools
from typing import Iterator

import torch

from rayvit.config_schema import Config
from rayvit.data.batching import Batch


def synthetic_batches(cfg: Config, device: torch.device, rank: int = 0) -> list[Batch]:
    """``cfg.data.synthetic_batches`` distinct batches of N(0, 1) images (already "normalised") and labels."""
    size, batch = cfg.model.image_size, cfg.train.batch_size
    # Seeded per rank so ranks do not all train on the same images, as with real data.
    gen = torch.Generator(device=device).manual_seed(cfg.train.seed + 1000 * rank)
    out = []
    for _ in range(cfg.data.synthetic_batches):
        images = torch.randn(batch, 3, size, size, generator=gen, device=device)
        labels = torch.randint(0, cfg.model.num_classes, (batch,), generator=gen, device=device)
        out.append((images, labels))
    return out


def synthetic_train(batches: list[Batch], start_step: int = 0) -> Iterator[Batch]:
    """Cycle the fixed batches forever (no per-step work beyond handing out a reference), from the one
    optimizer step ``start_step`` draws."""
    first = start_step % len(batches)
    return itertools.cycle(batches[first:] + batches[:first])
