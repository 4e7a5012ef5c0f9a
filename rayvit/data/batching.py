"""Rank-sharded batching over a split held in device memory (digits, and parquet read without Ray)."""

from __future__ import annotations

import math
from typing import Callable, Iterable, Iterator

import torch

from rayvit.errors import ConfigError

Batch = tuple[torch.Tensor, torch.Tensor]


class EpochStart(tuple):
    """An ``(images, labels)`` batch that begins an epoch of an input whose epochs start with a stall (a new
    Ray Data execution filling its shuffle buffer): the loop books its wait apart from the steady per-step
    wait (``epoch_start_wait_fraction``). Unpacks as the plain pair."""

    epoch_start = True


def epoch_start(batch: tuple) -> bool:
    """Whether ``batch`` begins an epoch (:class:`EpochStart`)."""
    return getattr(batch, "epoch_start", False)
# Raw stored images (any dtype/size) -> float32 (B, 3, H, W), normalised.
Transform = Callable[[torch.Tensor], torch.Tensor]

# ImageNet statistics: the usual normalisation for natural RGB images (parquet data).
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def uint8_normaliser(device: torch.device, mean=IMAGENET_MEAN, std=IMAGENET_STD) -> Transform:
    """uint8 (B, 3, H, W) in 0..255 -> float32 ``(x / 255 - mean) / std``, as one multiply-add."""
    mean_t = torch.tensor(mean, dtype=torch.float32, device=device).view(1, 3, 1, 1)
    std_t = torch.tensor(std, dtype=torch.float32, device=device).view(1, 3, 1, 1)
    scale, shift = 1.0 / (255.0 * std_t), -mean_t / std_t

    def normalise(images: torch.Tensor) -> torch.Tensor:
        # uint8 x float32 promotes to float32 in the multiply itself: one float buffer, two passes (a
        # separate conversion first made two buffers, several times slower on a CPU: docs/data.md).
        return images.to(device=device).mul(scale).add_(shift)

    return normalise


def split_sizes(n: int, val_fraction: float) -> tuple[int, int]:
    """(num_train, num_val) of a fractional hold-out; the same rule as Ray's ``train_test_split``."""
    num_train = int(n * (1.0 - val_fraction))
    return num_train, n - num_train


def seeded_split(n: int, val_fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Train and validation row indices of a fixed, seeded hold-out split."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    num_train, _ = split_sizes(n, val_fraction)
    return perm[:num_train].sort().values, perm[num_train:].sort().values


def train_batches(images: torch.Tensor, labels: torch.Tensor, transform: Transform, batch_size: int,
                  seed: int, rank: int = 0, world_size: int = 1, start_step: int = 0) -> Iterator[Batch]:
    """Endless batches of this rank's share of the split, reshuffled every epoch.

    Every rank draws the same permutation (``seed + epoch``) and takes every ``world_size``-th entry from
    ``rank``, so shares are disjoint. The permutation is first cut to a multiple of ``world_size`` and
    each share to whole batches, so all ranks take the same number of steps per epoch. ``start_step``:
    begin with the batch that optimizer step draws (its epoch and place in it follow from the step).
    """
    n = len(labels)
    per_rank = n // world_size
    steps = per_rank // batch_size
    if steps == 0:
        raise ConfigError(
            f"the train split has {n} samples, {per_rank} per rank for {world_size} worker(s): fewer than "
            f"one batch of train.batch_size={batch_size}; lower train.batch_size or use more data")
    return _epochs(images, labels, transform, batch_size, seed, rank, world_size, per_rank, steps, start_step)


def _epochs(images, labels, transform, batch_size, seed, rank, world_size, per_rank, steps, start_step):
    n = len(labels)
    epoch, first = divmod(start_step, steps)
    while True:
        # The permutation is drawn on the CPU so every device type sees the same order; one small
        # index copy per epoch is the only host work.
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))
        share = perm[: per_rank * world_size][rank::world_size][: steps * batch_size]
        for idx in share.to(labels.device).view(steps, batch_size)[first:]:
            yield transform(images[idx]), labels[idx]
        epoch, first = epoch + 1, 0


def val_batches(images: torch.Tensor, labels: torch.Tensor, transform: Transform, batch_size: int,
                rank: int = 0, world_size: int = 1) -> Callable[[], Iterable[Batch]]:
    """This rank's share of the validation split, in order; all ranks together see every sample once.

    Every rank gets the same number of batches (none larger than ``batch_size``; sizes may differ by one
    sample), so collective forwards such as FSDP's stay in step across ranks. A rank with fewer samples
    than batches (only when the split is tiny) gets empty batches to keep that count.
    """
    share = torch.arange(rank, len(labels), world_size, device=labels.device)
    num_batches = math.ceil(math.ceil(len(labels) / world_size) / batch_size)

    def batches() -> Iterator[Batch]:
        for idx in torch.tensor_split(share, num_batches):
            yield transform(images[idx]), labels[idx]

    return batches


def check_num_classes(num_classes: int, cfg_num_classes: int, where: str) -> None:
    """Refuse data whose labels do not fit the model's classifier head."""
    if num_classes > cfg_num_classes:
        raise ConfigError(
            f"{where} has {num_classes} classes but model.num_classes={cfg_num_classes}; "
            f"set model.num_classes={num_classes} (or more)")
