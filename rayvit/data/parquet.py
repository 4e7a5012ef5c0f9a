"""Parquet image datasets: encoded image bytes plus an integer label per row.

Two readers share one decoder and its transforms (:mod:`rayvit.data.images`): :func:`load_split`
(pyarrow in this process, images decoded as batches are drawn: :mod:`rayvit.data.pipeline`) and
:func:`ray_datasets` (Ray Data, decoding in parallel tasks, for distributed runs). Ray is imported only
inside the functions that need it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import torch

from rayvit.config_schema import Config
from rayvit.errors import ConfigError
from rayvit.data.batching import Batch, EpochStart, check_num_classes, seeded_split, split_sizes, uint8_normaliser
from rayvit.data.images import CorruptImageError, ImageTransform, transform_batch
from rayvit.data.pipeline import EncodedSplit, Skipped
from rayvit.data.rows import RowPlaces, corrupt_cause, row_namer

if TYPE_CHECKING:
    import ray.data

CLASS_NAMES_KEY = b"class_names"  # schema metadata written by to_parquet: JSON list of class names


# --------------------------------------------------------------------------------------------------
# Files and metadata


@dataclass(frozen=True)
class ParquetSource:
    """The parquet files behind one data path, and the pyarrow filesystem they are read through."""

    filesystem: pafs.FileSystem
    files: list[str]       # paths inside ``filesystem``, sorted
    where: str             # ``key=path`` as the user gave it, for messages
    sizes: Optional[list[int]] = None   # each file's bytes, as listed


def is_uri(path: str) -> bool:
    """Whether ``path`` names a filesystem by scheme (``s3://``, ``gs://``, ``hdfs://``, ``file://``)."""
    return "://" in path


def _reason(error: BaseException) -> str:
    """pyarrow's message, first line only (a missing HDFS client lists every folder it searched)."""
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


def _hint(reason: str) -> str:
    """What to check for the storage errors pyarrow's S3 and GCS clients report."""
    upper = reason.upper()
    if "NETWORK_CONNECTION" in upper or "COULD NOT RESOLVE" in upper or "COULDN'T CONNECT" in upper:
        return "; the store cannot be reached from this node: check the network, or the endpoint and region"
    if "ACCESS_DENIED" in upper or "CREDENTIALS" in upper or "FORBIDDEN" in upper or "403" in upper:
        return ("; the store refused this node's credentials: check them (AWS_ACCESS_KEY_ID / an instance "
                "role for S3, GOOGLE_APPLICATION_CREDENTIALS for GCS) on the driver and every worker node")
    if "NO_SUCH_BUCKET" in upper or "NOSUCHBUCKET" in upper:
        return "; no such bucket"
    return ""


def parquet_files(path: str, key: str = "data.path",
                  filesystem: Optional[pafs.FileSystem] = None) -> ParquetSource:
    """The parquet file ``path`` or the ``*.parquet`` shards under it (recursively), and their filesystem.

    ``path`` is a local path or any URI ``pyarrow.fs.FileSystem.from_uri`` opens; with ``filesystem``
    (e.g. a ``pyarrow.fs.SubTreeFileSystem``) it is a path inside that filesystem. Every failure is a
    ``ConfigError`` naming ``key``, the path and what went wrong.
    """
    where = f"{key}={path}"
    if filesystem is not None:
        fs, inner = filesystem, path
    elif is_uri(path):
        try:
            fs, inner = pafs.FileSystem.from_uri(path)
        except (ValueError, OSError, pa.ArrowException) as e:   # ArrowInvalid is a ValueError
            reason = _reason(e)
            raise ConfigError(f"{where}: pyarrow cannot open it ({reason}){_hint(reason)}") from e
    else:
        fs, inner = pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(path))
    try:
        info = fs.get_file_info(inner)
        if info.type == pafs.FileType.File:
            return ParquetSource(fs, [inner], where, [info.size or 0])
        if info.type == pafs.FileType.Directory:
            found = fs.get_file_info(pafs.FileSelector(inner, recursive=True))
            files = sorted((f.path, f.size or 0) for f in found if f.type == pafs.FileType.File
                           and f.base_name.endswith(".parquet") and not f.base_name.startswith((".", "_")))
            if files:
                return ParquetSource(fs, [f for f, _ in files], where, [size for _, size in files])
            raise ConfigError(f"{where} is a folder with no .parquet files")
    except (OSError, pa.ArrowException) as e:
        reason = _reason(e)
        raise ConfigError(f"{where}: cannot list it ({reason}){_hint(reason)}") from e
    hint = "" if filesystem is not None or is_uri(path) or os.path.isabs(path) else (
        f" (relative to {os.getcwd()}; Ray Train workers change directory, so give an absolute path)")
    raise ConfigError(f"{where} does not exist{hint}")


def _read(source: ParquetSource, what: str, read: Callable[[str], Any], file: str) -> Any:
    """``read(file)``, with a failure reported as a ConfigError naming the data path and the file."""
    try:
        return read(file)
    except (OSError, pa.ArrowException) as e:
        reason = _reason(e)
        raise ConfigError(f"{source.where}: cannot read {what} of {file} ({reason}){_hint(reason)}") from e


def read_table(path: str, cfg: Config, key: str, images: bool = True,
               filesystem: Optional[pafs.FileSystem] = None) -> pa.Table:
    """The label (and, with ``images``, image) columns of a parquet dataset, with clear errors."""
    d = cfg.data
    source = parquet_files(path, key, filesystem)
    columns = [d.image_column, d.label_column] if images else [d.label_column]
    schema = _read(source, "the schema", lambda f: pq.read_schema(f, filesystem=source.filesystem),
                   source.files[0])
    missing = [c for c in columns if c not in schema.names]
    if missing:
        raise ConfigError(f"{key}={path} has no column {missing[0]!r} (columns: {', '.join(schema.names)}); "
                          f"set data.image_column / data.label_column")
    return pa.concat_tables([
        _read(source, "the data", lambda f: pq.read_table(f, columns=columns, filesystem=source.filesystem), f)
        for f in source.files])


def class_names(path: str, filesystem: Optional[pafs.FileSystem] = None) -> Optional[list[str]]:
    """Class names that to_parquet stored in the schema metadata, if any."""
    source = parquet_files(path, filesystem=filesystem)
    schema = _read(source, "the schema", lambda f: pq.read_schema(f, filesystem=source.filesystem),
                   source.files[0])
    meta = schema.metadata or {}
    return json.loads(meta[CLASS_NAMES_KEY]) if CLASS_NAMES_KEY in meta else None


def _labels(table: pa.Table, column: str, key: str) -> np.ndarray:
    labels = table.column(column).to_numpy().astype(np.int64)
    if len(labels) and labels.min() < 0:
        raise ConfigError(f"{key} has negative labels in column {column!r}; labels must be 0..C-1")
    return labels


INFO_KEY = "rayvit.data.info"  # DataContext config key carrying ParquetInfo to Ray workers


@dataclass
class ParquetInfo:
    """Sizes and class count of a parquet dataset, from footers and the label column only (sizes None: a
    caller's own dataset, not counted)."""

    num_train: Optional[int]
    num_val: Optional[int]
    num_classes: int


def shard_info(shard: Any, cfg: Config) -> ParquetInfo:
    """Sizes and class count of the dataset behind a Ray shard (from ray_datasets, else from the files; a
    caller's own dataset (``data.name=dataset``): not counted, ``model.num_classes`` classes)."""
    stored = shard.get_context().get_config(INFO_KEY)
    if stored:
        return ParquetInfo(**stored)
    if cfg.data.name == "dataset":
        return ParquetInfo(None, None, cfg.model.num_classes)
    return parquet_info(cfg)


def parquet_info(cfg: Config, filesystem: Optional[pafs.FileSystem] = None) -> ParquetInfo:
    """Split sizes and class count, checked against ``model.num_classes``; reads no image bytes."""
    d = cfg.data
    labels = _labels(read_table(d.path, cfg, "data.path", images=False, filesystem=filesystem),
                     d.label_column, "data.path")
    if d.val_path:
        val = _labels(read_table(d.val_path, cfg, "data.val_path", images=False, filesystem=filesystem),
                      d.label_column, "data.val_path")
        num_train, num_val = len(labels), len(val)
        labels = np.concatenate([labels, val])
    else:
        num_train, num_val = split_sizes(len(labels), d.val_fraction)
    names = class_names(d.path, filesystem) or []
    num_classes = max(len(names), int(labels.max()) + 1 if len(labels) else 0)
    check_num_classes(num_classes, cfg.model.num_classes, f"data.path={d.path}")
    return ParquetInfo(num_train, num_val, num_classes)


# --------------------------------------------------------------------------------------------------
# Without Ray: pyarrow in this process, images decoded as batches are drawn (rayvit.data.pipeline)


def read_split(path: str, cfg: Config, key: str, filesystem: Optional[pafs.FileSystem] = None) -> EncodedSplit:
    """A split's encoded images and labels (on the CPU), each row named by its file, row and row group."""
    d = cfg.data
    source = parquet_files(path, key, filesystem)
    table = read_table(path, cfg, key, filesystem=filesystem)
    places = _read(source, "the footers", lambda f: RowPlaces.of(source.files, source.filesystem), source.files[0])
    labels = torch.from_numpy(_labels(table, d.label_column, key))
    return EncodedSplit(table.column(d.image_column).to_pylist(), labels, places.describe)


def load_split(cfg: Config, device: torch.device, filesystem: Optional[pafs.FileSystem] = None,
               skip: Optional[Skipped] = None) -> tuple[EncodedSplit, tuple[torch.Tensor, torch.Tensor], int]:
    """The train split, encoded (decoded batch by batch as training draws it), the validation split
    decoded once under the validation transform (uint8 (N, 3, S, S) and int64 labels on ``device``:
    about 150 kB per image at 224 px), and the class count.

    Every row is held in memory (the train split as its encoded bytes): for datasets that do not fit,
    use the Ray Data path. ``filesystem``: see :func:`parquet_files`; ``skip``: drop corrupt images
    (``data.skip_corrupt``), else a corrupt validation image raises ``CorruptImageError``.
    """
    d = cfg.data
    info = parquet_info(cfg, filesystem)
    train = read_split(d.path, cfg, "data.path", filesystem)
    if d.val_path:
        val = read_split(d.val_path, cfg, "data.val_path", filesystem)
    else:
        train_idx, val_idx = seeded_split(len(train.labels), d.val_fraction, cfg.train.seed)
        train, val = train.subset(train_idx), train.subset(val_idx)
    x, y = val.decode(ImageTransform.of(cfg, train=False), cfg.parallel.cpus_per_worker, skip)
    return train, (x.to(device), y.to(device)), info.num_classes


# --------------------------------------------------------------------------------------------------
# Through Ray Data


def with_absolute_paths(cfg: Config) -> Config:
    """A copy of ``cfg`` whose local data paths are absolute (resolve on the driver before shipping to
    workers); URIs are left as they are."""
    overrides = {f"data.{key}": os.path.abspath(os.path.expanduser(getattr(cfg.data, key)))
                 for key in ("path", "val_path")
                 if getattr(cfg.data, key) and not is_uri(getattr(cfg.data, key))}
    return cfg.replace(overrides) if overrides else cfg


def _decode_batch(batch: dict[str, np.ndarray], image_column: str, label_column: str, spec: ImageTransform,
                  skip_corrupt: bool, filesystem: pafs.FileSystem) -> dict[str, np.ndarray]:
    """Ray Data map_batches body: encoded bytes -> uint8 (N, 3, S, S) crops + int64 labels.

    Crops come from fresh entropy in every task (a new crop of each image every epoch; not
    reproducible run to run, unlike the path without Ray). A corrupt image raises CorruptImageError
    naming its file and row, or, with ``skip_corrupt``, is marked in a ``corrupt`` column (its reason;
    empty for good rows) for the worker to drop and count.
    """
    encoded = list(batch[image_column])
    where = row_namer(batch, encoded, image_column, label_column, filesystem)

    rng = random.Random()
    images, errors = transform_batch(encoded, spec, [rng] * len(encoded), where)
    out = {image_column: images, label_column: np.asarray(batch[label_column], dtype=np.int64)}
    if skip_corrupt:
        out["corrupt"] = np.array([e or "" for e in errors], dtype=object)
    else:
        Skipped.check(errors, None)
    return out


def ray_datasets(cfg: Config, filesystem: Optional[pafs.FileSystem] = None) -> dict[str, "ray.data.Dataset"]:
    """Ray Datasets for ``TorchTrainer(datasets=...)``: ``"train"``, and ``"val"`` when there is one.

    Rows come out as uint8 images (3, S, S) (the training or validation crop of
    :mod:`rayvit.data.images`) and int64 labels, in the columns ``data.image_column`` and
    ``data.label_column`` (:func:`decode_dataset`); normalisation to float32 happens on the worker's
    device in :func:`shard_train_batches` (4x less data through the object store and host-to-device
    copies than float32). Data paths are local paths or URIs that ``pyarrow.fs`` opens (``s3://``,
    ``gs://``, ``hdfs://``, ``file://``), or paths inside ``filesystem``; they are resolved here, on the
    driver, to a filesystem and a list of files that the read tasks use as they are (local paths
    absolute: Train workers run in another directory). Missing files, columns, credentials or too many
    classes are reported here, before any worker starts.
    """
    from ray.data import FileShuffleConfig

    from rayvit.data.ray_read import read_parquet

    d = cfg.data
    info = parquet_info(cfg, filesystem)  # fails fast on missing files, columns or too many classes
    sources = {}

    def read(path: str, key: str, **kwargs: Any) -> "ray.data.Dataset":
        source = sources[key] = parquet_files(path, key, filesystem)
        # Each row's file (its path), so that a corrupt image can be named by file and row.
        return read_parquet(source, [d.image_column, d.label_column], d.progress_bars, **kwargs)

    if d.val_path:
        # File order is reshuffled every epoch (seeded; a new seed per execution).
        train = read(d.path, "data.path", shuffle=FileShuffleConfig(seed=cfg.train.seed))
        val = read(d.val_path, "data.val_path")
    else:
        # A seeded global shuffle then a cut (materialises the encoded rows; fine for the small datasets
        # that have no validation split of their own).
        train, val = read(d.path, "data.path").train_test_split(
            test_size=d.val_fraction, shuffle=True, seed=cfg.train.seed)

    val_key = "data.val_path" if d.val_path else "data.path"
    datasets = {"train": decode_dataset(train, cfg, True, sources["data.path"].filesystem),
                "val": decode_dataset(val, cfg, False, sources[val_key].filesystem)}
    for ds in datasets.values():
        # Workers learn sizes and class count from the shard's DataContext, so they never need to reach
        # the files themselves (which may sit on another node).
        ds.context.set_config(INFO_KEY, dataclasses.asdict(info))
    return datasets


def decode_dataset(dataset: "ray.data.Dataset", cfg: Config, training: bool,
                   filesystem: Optional[pafs.FileSystem] = None) -> "ray.data.Dataset":
    """A Ray Dataset of encoded images (``data.image_column``: bytes, ``data.label_column``: integers) as
    rayvit trains on it: each row's training (``training``) or validation crop, uint8 (3, S, S), in the same
    columns. A ``path`` column (``read_parquet(include_paths=True)``) and the ``filesystem`` it lies in let
    a corrupt image be named by file and row. Under ``data.decode=gpu`` training rows are only planned
    here and decoded on the worker's GPU (:mod:`rayvit.data.gpu_decode`)."""
    d = cfg.data
    from rayvit.data.context import own_context

    dataset = own_context(dataset, cfg)
    if d.decode == "gpu" and training:
        from rayvit.data.gpu_decode import plan_batch

        return dataset.map_batches(plan_batch, batch_format="numpy", fn_kwargs=dict(
            image_column=d.image_column, label_column=d.label_column, spec=ImageTransform.of(cfg, True)))
    kwargs = dict(image_column=d.image_column, label_column=d.label_column, spec=ImageTransform.of(cfg, training),
                  skip_corrupt=d.skip_corrupt, filesystem=filesystem or pafs.LocalFileSystem())
    return dataset.map_batches(_decode_batch, batch_format="numpy", fn_kwargs=kwargs)


def shard_train_batches(shard: Any, cfg: Config, device: torch.device, rank: int = 0, world_size: int = 1,
                        skip: Optional[Skipped] = None) -> Iterator[Batch]:
    """Endless train batches from a Ray ``DataIterator`` (one pass per epoch; incomplete batches dropped).

    Ray Train splits the dataset disjointly across workers; a local shuffle buffer, seeded per epoch and
    rank, reorders rows differently every epoch; ``data.prefetch_batches`` batches are fetched ahead.
    Rows marked corrupt (``data.skip_corrupt``) are dropped and counted in ``skip``; their places in the
    batch go to the batch's other rows, so every rank keeps the same steps per epoch (Ray Data's equal
    split releases the next epoch to all ranks at once: a rank with one batch fewer would wait there
    while the others wait for it in the step's collective).
    """
    from rayvit.data.pipeline import prefetched

    normalise = uint8_normaliser(device)
    batch_size = cfg.train.batch_size
    decode = _device_decoder(cfg, device)

    def epochs() -> Iterator[tuple[bool, dict[str, Any]]]:
        epoch = 0
        while True:
            steps = 0
            for batch in _batches(shard, cfg, device, drop_last=True,
                                  local_shuffle_buffer_size=max(1024, 4 * batch_size),
                                  local_shuffle_seed=cfg.train.seed + epoch * world_size + rank):
                yield steps == 0, batch
                steps += 1
            if steps == 0:
                raise ConfigError(f"rank {rank}'s train shard holds less than one batch of "
                                  f"train.batch_size={batch_size}; lower it or use more data")
            epoch += 1

    # Drawn by a background thread: when this epoch's last batches are in hand, the next epoch's execution
    # (its start, its shuffle buffer filling) is already under way while the step computes on them.
    source = prefetched(epochs(), max(1, cfg.data.prefetch_batches))
    try:
        for first, batch in source:
            images, labels = _refilled(*_kept(decode(batch), cfg, skip), batch_size)
            pair = (normalise(images.to(device, non_blocking=True)), labels.to(device, non_blocking=True))
            yield EpochStart(pair) if first else pair
    finally:
        source.close()


def shard_val_batches(shard: Any, cfg: Config, device: torch.device, skip: Optional[Skipped] = None):
    """A callable that yields one pass over a Ray validation shard (incomplete last batch kept)."""
    normalise = uint8_normaliser(device)

    def batches() -> Iterator[Batch]:
        for batch in _batches(shard, cfg, device, drop_last=False):
            images, labels = _kept(batch, cfg, skip)
            yield normalise(images.to(device, non_blocking=True)), labels.to(device, non_blocking=True)

    return batches


def _batches(shard: Any, cfg: Config, device: torch.device, **kwargs: Any) -> Iterator[dict[str, Any]]:
    """numpy batches of the shard as torch tensors (pinned on CUDA), with a corrupt image's error as the
    driver should read it: one line naming the file, the row and the reason (Ray Data wraps it)."""
    pin = device.type == "cuda"
    try:
        for batch in shard.iter_batches(batch_size=cfg.train.batch_size, batch_format="numpy",
                                        prefetch_batches=cfg.data.prefetch_batches, **kwargs):
            # Arrow-backed columns arrive read-only, which torch refuses to wrap: those are copied.
            out = {k: v if v.dtype == object else torch.from_numpy(v if v.flags.writeable else v.copy())
                   for k, v in batch.items()}
            if pin:
                out = {k: v.pin_memory() if isinstance(v, torch.Tensor) else v for k, v in out.items()}
            yield out
    except Exception as e:  # noqa: BLE001 - only a corrupt image's error is rewritten; the rest re-raised
        corrupt = corrupt_cause(e)
        if corrupt is None:
            raise
        raise CorruptImageError(corrupt) from None


def _kept(batch: dict[str, Any], cfg: Config, skip: Optional[Skipped]) -> tuple[torch.Tensor, torch.Tensor]:
    """(images, labels) of a batch, less the rows marked corrupt (each counted in ``skip``)."""
    images, labels = batch[cfg.data.image_column], batch[cfg.data.label_column].to(torch.int64)
    corrupt = batch.get("corrupt")
    if corrupt is None or skip is None:
        return images, labels
    keep = Skipped.check([str(c) or None for c in corrupt], skip)
    return (images, labels) if keep is None else (images[keep], labels[keep])


def _refilled(images: torch.Tensor, labels: torch.Tensor, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch that lost rows, back to ``batch_size`` by repeating its own first rows."""
    if len(labels) == batch_size:
        return images, labels
    if len(labels) == 0:
        raise CorruptImageError(f"every image of a batch of {batch_size} was corrupt (each named in a warning); "
                                "the data cannot be trained on")
    repeat = torch.arange(batch_size, device=labels.device) % len(labels)
    return images[repeat], labels[repeat]


def _device_decoder(cfg: Config, device: torch.device) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """``data.decode=gpu``: encoded bytes and crop plans -> uint8 crops on the device; else nothing to do."""
    if cfg.data.decode != "gpu":
        return lambda batch: batch
    from rayvit.data.gpu_decode import decode_planned

    return lambda batch: decode_planned(batch, cfg.model.image_size, device, cfg.data.image_column,
                                        cfg.data.label_column)
