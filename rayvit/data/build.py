"""Build a rank's data for a config: :func:`build_data` and what it returns, :class:`Data`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Optional

import torch

from rayvit.config_schema import Config
from rayvit.errors import ConfigError
from rayvit.data import batching, digits, parquet, synthetic
from rayvit.data.pipeline import Skipped, decoded_train_batches

if TYPE_CHECKING:
    import pyarrow.fs

@dataclass
class Data:
    """What the training loop consumes."""

    train: Iterator[tuple[torch.Tensor, torch.Tensor]]  # infinite; cycles epochs
    # This rank's share of the validation split (one pass per call); None when there is none.
    val_batches: Optional[Callable[[], Iterable[tuple[torch.Tensor, torch.Tensor]]]]
    num_train: Optional[int]      # size of the whole train split (all ranks); None: a caller's dataset
    num_val: Optional[int]
    num_classes: int    # classes present in the data
    # Corrupt images dropped under data.skip_corrupt=true (each named once on stderr), else None.
    skipped: Optional[Skipped] = None
    # The train stream from optimizer step N on, as an unbroken run draws it, reached by arithmetic on N
    # (no batch before it is made or decoded): what a resumed run continues from. None where the order
    # cannot be replayed (Ray Data's shards; rows dropped as corrupt): a resumed run starts afresh.
    train_from: Optional[Callable[[int], Iterator[tuple[torch.Tensor, torch.Tensor]]]] = None

    def close(self) -> None:
        """Stop what feeds ``train`` (a prefetch thread, Ray Data's iterator)."""
        close = getattr(self.train, "close", None)
        if close is not None:
            close()


def build_data(cfg: Config, device: torch.device, *, rank: int = 0, world_size: int = 1,
               dataset_shards: Optional[dict] = None,
               filesystem: Optional["pyarrow.fs.FileSystem"] = None) -> Data:
    """Build this rank's data for ``cfg.data``.

    With ``dataset_shards`` (``{"train": DataIterator, "val": DataIterator or None}`` from
    ``ray.train.get_dataset_shard`` over :func:`ray_datasets`), batches come from the Ray shards, and
    sizes and class count from the datasets' DataContext (the files are read only for datasets built
    elsewhere; then ``cfg.data.path`` must be absolute or a URI, see :func:`with_absolute_paths`).
    ``filesystem``: a ``pyarrow.fs.FileSystem`` that parquet data paths lie in (default: the local
    filesystem, or the one a URI names).
    """
    device = torch.device(device)
    d, t = cfg.data, cfg.train
    if dataset_shards and dataset_shards.get("train") is not None:
        if d.name not in ("parquet", "dataset"):
            raise ConfigError(f"dataset_shards were given but data.name={d.name}; Ray Data input needs "
                              "data.name=parquet (or dataset: your own, through rayvit.trainer.make_trainer)")
        info = parquet.shard_info(dataset_shards["train"], cfg)
        val_shard = dataset_shards.get("val")
        skipped = Skipped() if d.skip_corrupt else None
        return Data(
            train=parquet.shard_train_batches(dataset_shards["train"], cfg, device, rank, world_size, skipped),
            val_batches=(parquet.shard_val_batches(val_shard, cfg, device, skipped)
                         if val_shard is not None else None),
            num_train=info.num_train, num_val=info.num_val, num_classes=info.num_classes, skipped=skipped)

    if d.name == "dataset":
        raise ConfigError("data.name=dataset trains on the Ray Datasets handed to rayvit.trainer.make_trainer("
                          "datasets=...); without Ray use data.name=parquet with data.path")
    if d.name == "synthetic":
        batches = synthetic.synthetic_batches(cfg, device, rank)
        return Data(train=synthetic.synthetic_train(batches), val_batches=None,
                    num_train=len(batches) * t.batch_size * world_size, num_val=0,
                    num_classes=cfg.model.num_classes,
                    train_from=lambda step: synthetic.synthetic_train(batches, step))

    if d.name == "parquet":
        return _parquet_data(cfg, device, rank, world_size, filesystem)
    return _digits_data(cfg, device, rank, world_size)


def _parquet_data(cfg: Config, device: torch.device, rank: int, world_size: int,
                  filesystem: Optional["pyarrow.fs.FileSystem"]) -> Data:
    """Parquet read by pyarrow in this process, each batch decoded when drawn (:mod:`rayvit.data.pipeline`)."""
    d, t = cfg.data, cfg.train
    if d.decode == "gpu":
        raise ConfigError("data.decode=gpu decodes in Ray Data's pipeline (rayvit.trainer.fit, sweeps); "
                          "without Ray use data.decode=cpu")
    skipped = Skipped() if d.skip_corrupt else None
    encoded, val, num_classes = parquet.load_split(cfg, device, filesystem, skipped)
    normalise = batching.uint8_normaliser(device)

    def decoded_from(step: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return decoded_train_batches(encoded, cfg, device, normalise, rank, world_size, skipped, step)

    return Data(
        train=decoded_from(0),
        val_batches=(batching.val_batches(*val, normalise, t.batch_size, rank, world_size)
                     if len(val[1]) else None),
        num_train=len(encoded.labels), num_val=len(val[1]), num_classes=num_classes, skipped=skipped,
        # Dropped corrupt rows shift every later batch by rows no step counted.
        train_from=None if d.skip_corrupt else decoded_from)


def _digits_data(cfg: Config, device: torch.device, rank: int, world_size: int) -> Data:
    t = cfg.train
    train, val = digits.digits_tensors(cfg.data.val_fraction, t.seed, device)
    num_classes = int(torch.cat([train[1], val[1]]).max()) + 1
    batching.check_num_classes(num_classes, cfg.model.num_classes, "data.name=digits")
    transform = digits.upsampler(cfg.model.image_size)

    def train_from(step: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return batching.train_batches(*train, transform, t.batch_size, t.seed, rank, world_size, start_step=step)

    return Data(
        train=train_from(0), train_from=train_from,
        val_batches=(batching.val_batches(*val, transform, t.batch_size, rank, world_size)
                     if len(val[1]) else None),
        num_train=len(train[1]), num_val=len(val[1]), num_classes=num_classes)
