"""Parquet image datasets: encoded image bytes plus an integer label per row.

Two readers share one decoder: :func:`load_split` (pyarrow + PIL in this process, for single-process
runs and benchmarks) and :func:`ray_datasets` (Ray Data, decoding in parallel tasks, for distributed
runs). Ray is imported only inside the functions that need it.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import torch

from rayvit.config import Config, ConfigError
from rayvit.data.batching import (Batch, Transform, check_num_classes, seeded_split, split_sizes,
                                  uint8_normaliser)

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
            return ParquetSource(fs, [inner], where)
        if info.type == pafs.FileType.Directory:
            found = fs.get_file_info(pafs.FileSelector(inner, recursive=True))
            files = sorted(f.path for f in found if f.type == pafs.FileType.File
                           and f.base_name.endswith(".parquet") and not f.base_name.startswith((".", "_")))
            if files:
                return ParquetSource(fs, files, where)
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
    """Sizes and class count of a parquet dataset, from footers and the label column only."""

    num_train: int
    num_val: int
    num_classes: int


def shard_info(shard: Any, cfg: Config) -> ParquetInfo:
    """Sizes and class count of the dataset behind a Ray shard (from ray_datasets, else from the files)."""
    stored = shard.get_context().get_config(INFO_KEY)
    return ParquetInfo(**stored) if stored else parquet_info(cfg)


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
# Decoding


def decode_image(data: bytes, image_size: int) -> np.ndarray:
    """Encoded PNG/JPEG bytes -> uint8 (3, S, S): RGB, resized (bilinear) to a square."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as img:
        # JPEG can decode straight to a smaller scale (DCT scaling), much cheaper than a full decode.
        img.draft("RGB", (image_size, image_size))
        img = img.convert("RGB")
        if img.size != (image_size, image_size):
            img = img.resize((image_size, image_size), Image.Resampling.BILINEAR)
        return np.asarray(img).transpose(2, 0, 1)


def decode_images(encoded: list[bytes], image_size: int, threads: int = 0) -> np.ndarray:
    """Decode many images to uint8 (N, 3, S, S); PIL releases the GIL, so threads run in parallel."""
    out = np.empty((len(encoded), 3, image_size, image_size), dtype=np.uint8)
    threads = threads or min(8, os.cpu_count() or 1)

    def work(i: int) -> None:
        out[i] = decode_image(encoded[i], image_size)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(work, range(len(encoded))))
    return out


# --------------------------------------------------------------------------------------------------
# Without Ray: pyarrow + PIL in this process


def load_split(cfg: Config, device: torch.device, filesystem: Optional[pafs.FileSystem] = None):
    """Decoded train/val splits as uint8 (N, 3, S, S) images and int64 labels on ``device``.

    Every image is decoded once, up front, and held as uint8 (N x 3 x S x S bytes; about 150 kB per
    image at 224 px) so that steps pay only a gather and a normalisation. For datasets that do not fit,
    use the Ray Data path. ``filesystem``: see :func:`parquet_files`. Returns
    ``((train_x, train_y), val_or_None, num_classes)``.
    """
    d, size = cfg.data, cfg.model.image_size

    def load(path: str, key: str) -> tuple[torch.Tensor, torch.Tensor]:
        table = read_table(path, cfg, key, filesystem=filesystem)
        labels = _labels(table, d.label_column, key)
        images = decode_images(table.column(d.image_column).to_pylist(), size)
        return torch.from_numpy(images).to(device), torch.from_numpy(labels).to(device)

    info = parquet_info(cfg, filesystem)
    train = load(d.path, "data.path")
    if d.val_path:
        val = load(d.val_path, "data.val_path")
    else:
        train_idx, val_idx = seeded_split(len(train[1]), d.val_fraction, cfg.train.seed)
        x, y = train
        train_idx, val_idx = train_idx.to(device), val_idx.to(device)
        train, val = (x[train_idx], y[train_idx]), (x[val_idx], y[val_idx])
    return train, val, info.num_classes


# --------------------------------------------------------------------------------------------------
# Through Ray Data


def with_absolute_paths(cfg: Config) -> Config:
    """A copy of ``cfg`` whose local data paths are absolute (resolve on the driver before shipping to
    workers); URIs are left as they are."""
    overrides = {f"data.{key}": os.path.abspath(os.path.expanduser(getattr(cfg.data, key)))
                 for key in ("path", "val_path")
                 if getattr(cfg.data, key) and not is_uri(getattr(cfg.data, key))}
    return cfg.replace(overrides) if overrides else cfg


def _decode_batch(batch: dict[str, np.ndarray], image_column: str, label_column: str,
                  image_size: int) -> dict[str, np.ndarray]:
    """Ray Data map_batches body: encoded bytes -> fixed-shape uint8 (N, 3, S, S) + int64 labels."""
    return {"image": decode_images(list(batch[image_column]), image_size, threads=1),
            "label": np.asarray(batch[label_column], dtype=np.int64)}


def ray_datasets(cfg: Config, filesystem: Optional[pafs.FileSystem] = None) -> dict[str, "ray.data.Dataset"]:
    """Ray Datasets for ``TorchTrainer(datasets=...)``: ``"train"``, and ``"val"`` when there is one.

    Rows come out decoded and resized as uint8 ``image`` (3, S, S) and int64 ``label``; normalisation
    to float32 happens on the worker's device in :func:`shard_train_batches` (4x less data through the
    object store and host-to-device copies than float32). Data paths are local paths or URIs that
    ``pyarrow.fs`` opens (``s3://``, ``gs://``, ``hdfs://``, ``file://``), or paths inside ``filesystem``;
    they are resolved here, on the driver, to a filesystem and a list of files that the read tasks use
    as they are (local paths absolute: Train workers run in another directory). Missing files, columns,
    credentials or too many classes are reported here, before any worker starts.
    """
    import ray.data
    from ray.data import FileShuffleConfig

    d = cfg.data
    info = parquet_info(cfg, filesystem)  # fails fast on missing files, columns or too many classes
    decode = dict(fn_kwargs=dict(image_column=d.image_column, label_column=d.label_column,
                                 image_size=cfg.model.image_size), batch_format="numpy")

    def read(path: str, key: str, **kwargs: Any) -> "ray.data.Dataset":
        source = parquet_files(path, key, filesystem)
        return ray.data.read_parquet(source.files, filesystem=source.filesystem,
                                     columns=[d.image_column, d.label_column], **kwargs)

    if d.val_path:
        # File order is reshuffled every epoch (seeded; a new seed per execution).
        train = read(d.path, "data.path", shuffle=FileShuffleConfig(seed=cfg.train.seed))
        val = read(d.val_path, "data.val_path")
    else:
        # A seeded global shuffle then a cut (materialises the encoded rows; fine for the small datasets
        # that have no validation split of their own).
        train, val = read(d.path, "data.path").train_test_split(
            test_size=d.val_fraction, shuffle=True, seed=cfg.train.seed)
    datasets = {"train": train.map_batches(_decode_batch, **decode),
                "val": val.map_batches(_decode_batch, **decode)}
    for ds in datasets.values():
        # Workers learn sizes and class count from the shard's DataContext, so they never need to reach
        # the files themselves (which may sit on another node).
        ds.context.set_config(INFO_KEY, dataclasses.asdict(info))
    return datasets


def shard_train_batches(shard: Any, cfg: Config, device: torch.device, rank: int = 0,
                        world_size: int = 1) -> Iterator[Batch]:
    """Endless train batches from a Ray ``DataIterator`` (one pass per epoch; incomplete batches dropped).

    Ray Train splits the dataset disjointly across workers; a local shuffle buffer, seeded per epoch and
    rank, reorders rows differently every epoch.
    """
    normalise = uint8_normaliser(device)
    batch_size = cfg.train.batch_size
    epoch = 0
    while True:
        steps = 0
        for batch in shard.iter_torch_batches(
                batch_size=batch_size, drop_last=True, device="cpu",
                local_shuffle_buffer_size=max(1024, 4 * batch_size),
                local_shuffle_seed=cfg.train.seed + epoch * world_size + rank):
            yield _to_device(batch, normalise, device)
            steps += 1
        if steps == 0:
            raise ConfigError(f"rank {rank}'s train shard holds less than one batch of "
                              f"train.batch_size={batch_size}; lower it or use more data")
        epoch += 1


def shard_val_batches(shard: Any, cfg: Config, device: torch.device):
    """A callable that yields one pass over a Ray validation shard (incomplete last batch kept)."""
    normalise = uint8_normaliser(device)

    def batches() -> Iterator[Batch]:
        for batch in shard.iter_torch_batches(batch_size=cfg.train.batch_size, drop_last=False,
                                              device="cpu"):
            yield _to_device(batch, normalise, device)

    return batches


def _to_device(batch: dict[str, torch.Tensor], normalise: Transform, device: torch.device) -> Batch:
    images = batch["image"].to(device, non_blocking=True)
    return normalise(images), batch["label"].to(device=device, dtype=torch.int64, non_blocking=True)
