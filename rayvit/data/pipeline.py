"""Decoding training batches as they are needed: the parquet path without Ray, and what the Ray path shares.

Without Ray, a rank holds its split's encoded images (bytes, as stored) and decodes each batch when it
is drawn: ``parallel.cpus_per_worker`` threads (the decoders release the GIL), ``data.prefetch_batches``
batches ahead in a background thread, so the step waits only when decoding falls behind (that wait is
``data_wait_s``). Crops are drawn from a generator seeded by (seed, epoch, row): the same run gives the
same crops.

A corrupt image stops the run with :class:`~rayvit.errors.CorruptImageError` naming the file, the
row and the decoder's reason, or, with ``data.skip_corrupt=true``, is dropped: :class:`Skipped` warns
once per image on stderr and counts it, and :class:`Rebatcher` refills the batch from the next rows.
"""

from __future__ import annotations

import queue
import random
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

import torch

from rayvit.config_schema import Config
from rayvit.errors import ConfigError
from rayvit.data.batching import Batch, Transform
from rayvit.data.images import CorruptImageError, ImageTransform, transform_into


@dataclass
class EncodedSplit:
    """A split's encoded images and labels, and how to name row ``i`` in a message."""

    images: list[bytes]
    labels: torch.Tensor            # int64, CPU
    where: Callable[[int], str]

    def subset(self, rows: torch.Tensor) -> "EncodedSplit":
        rows = rows.tolist()
        return EncodedSplit([self.images[i] for i in rows], self.labels[rows],
                            lambda i, where=self.where: where(rows[i]))

    def decode(self, spec: ImageTransform, threads: int, skip: Optional["Skipped"] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Every image under ``spec`` (validation: deterministic), uint8 (N, 3, S, S), and the labels of the
        rows kept (all, unless ``skip`` drops corrupt ones)."""
        out = torch.empty((len(self.images), 3, spec.size, spec.size), dtype=torch.uint8)
        rngs = [random.Random(i) for i in range(len(self.images))]
        with ThreadPoolExecutor(max(1, threads), thread_name_prefix="rayvit-decode") as pool:
            errors = transform_into(out, self.images, spec, rngs, self.where, pool.map)
        keep = Skipped.check(errors, skip)
        return (out, self.labels) if keep is None else (out[keep], self.labels[keep])


@dataclass
class Skipped:
    """Corrupt images dropped under ``data.skip_corrupt=true``: each warned about once, all counted."""

    messages: set[str] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, message: str) -> None:
        with self.lock:
            if message in self.messages:
                return
            self.messages.add(message)
        print(f"WARNING: rayvit skipped a corrupt image (data.skip_corrupt=true): {message}", file=sys.stderr,
              flush=True)

    def __len__(self) -> int:
        return len(self.messages)

    @staticmethod
    def check(errors: list[Optional[str]], skip: Optional["Skipped"]) -> Optional[torch.Tensor]:
        """None when every image was read; else the rows to keep (``skip``), or CorruptImageError."""
        bad = [e for e in errors if e]
        if not bad:
            return None
        if skip is None:
            raise CorruptImageError(f"{bad[0]} (set data.skip_corrupt=true to drop such rows, counted)")
        for message in bad:
            skip.add(message)
        return torch.tensor([e is None for e in errors], dtype=torch.bool)


class Rebatcher:
    """Full batches of ``batch_size`` from batches that lost rows: the rows left over wait for the next."""

    def __init__(self, batch_size: int):
        self.batch_size = batch_size
        self.images: list[torch.Tensor] = []
        self.labels: list[torch.Tensor] = []
        self.count = 0

    def push(self, images: torch.Tensor, labels: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if not self.images and len(labels) == self.batch_size:
            yield images, labels                   # the common case: nothing was dropped
            return
        self.images.append(images)
        self.labels.append(labels)
        self.count += len(labels)
        while self.count >= self.batch_size:
            x, y = torch.cat(self.images), torch.cat(self.labels)
            yield x[:self.batch_size], y[:self.batch_size]
            self.images, self.labels = [x[self.batch_size:]], [y[self.batch_size:]]
            self.count -= self.batch_size

    def clear(self) -> None:
        self.images, self.labels, self.count = [], [], 0


def decoded_train_batches(split: EncodedSplit, cfg: Config, device: torch.device, normalise: Transform,
                          rank: int, world_size: int, skip: Optional[Skipped], start_step: int = 0) -> Iterator[Batch]:
    """Endless train batches of this rank's share, decoded when drawn (see the module's docstring).

    Shares are cut as ``batching.train_batches`` cuts them: the same permutation on every rank (seed +
    epoch), every ``world_size``-th row from ``rank``, the same number of steps per rank. ``start_step``:
    begin with the batch that optimizer step draws, nothing before it decoded (exact while no corrupt row
    is dropped: ``skip`` refills batches from later rows).
    """
    batch_size = cfg.train.batch_size
    n = len(split.labels)
    per_rank = n // world_size
    if per_rank // batch_size == 0:
        raise ConfigError(
            f"the train split has {n} samples, {per_rank} per rank for {world_size} worker(s): fewer than "
            f"one batch of train.batch_size={batch_size}; lower train.batch_size or use more data")
    return _decoded_batches(split, cfg, device, normalise, rank, world_size, skip, start_step)


def _decoded_batches(split: EncodedSplit, cfg: Config, device: torch.device, normalise: Transform,
                     rank: int, world_size: int, skip: Optional[Skipped], start_step: int) -> Iterator[Batch]:
    batch_size, seed = cfg.train.batch_size, cfg.train.seed
    n = len(split.labels)
    per_rank = n // world_size
    spec = ImageTransform.of(cfg, train=True)
    threads = cfg.parallel.cpus_per_worker
    pin = device.type == "cuda"

    def decoded() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        rebatch = Rebatcher(batch_size)
        with ThreadPoolExecutor(threads, thread_name_prefix="rayvit-decode") as pool:
            epoch, first = divmod(start_step, per_rank // batch_size)
            while True:
                perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))
                share = perm[: per_rank * world_size][rank::world_size].tolist()
                full = 0
                for start in range(first * batch_size, len(share) - batch_size + 1, batch_size):
                    rows = share[start:start + batch_size]
                    images = torch.empty((len(rows), 3, spec.size, spec.size), dtype=torch.uint8)
                    rngs = [random.Random((seed * 1_000_003 + epoch) * 10_000_019 + r) for r in rows]
                    errors = transform_into(images, [split.images[r] for r in rows], spec, rngs,
                                            lambda i: split.where(rows[i]), pool.map)
                    labels = split.labels[rows]
                    keep = Skipped.check(errors, skip)
                    if keep is not None:
                        images, labels = images[keep], labels[keep]
                    for x, y in rebatch.push(images, labels):
                        full += 1
                        # Pinned host memory: the copy to a GPU below overlaps the step (non_blocking).
                        yield (x.pin_memory(), y.pin_memory()) if pin else (x, y)
                rebatch.clear()          # an epoch's last partial batch is dropped, as without corrupt rows
                if full == 0 and first == 0:
                    raise CorruptImageError(f"rank {rank}'s train share has no full batch of readable images "
                                            f"({len(skip or ())} corrupt images skipped)")
                epoch, first = epoch + 1, 0

    source = decoded() if cfg.data.prefetch_batches == 0 else prefetched(decoded(), cfg.data.prefetch_batches)
    for images, labels in source:
        yield normalise(images.to(device, non_blocking=True)), labels.to(device, non_blocking=True)


def prefetched(batches: Iterator, depth: int) -> Iterator:
    """``batches`` produced by a background thread up to ``depth`` ahead; its errors are raised here, in
    order. Closing (or dropping) this generator stops the thread."""
    slots: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    done = object()

    def produce() -> None:
        try:
            for item in batches:
                while not stop.is_set():
                    try:
                        slots.put((item, None), timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            slots.put((done, None))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, raised there
            slots.put((done, e))
        finally:
            batches.close()

    thread = threading.Thread(target=produce, name="rayvit-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            item, error = slots.get()
            if error is not None:
                raise error
            if item is done:
                return
            yield item
    finally:
        stop.set()
        while thread.is_alive():
            try:
                slots.get(timeout=0.1)
            except queue.Empty:
                pass
        thread.join()
