"""Convert an image-folder tree (one subfolder per class) into parquet shards for rayvit: :func:`to_parquet`,
public as :func:`rayvit.datasets.to_parquet`; its command line is ``rayvit to-parquet SRC DST [--rows-per-shard N]
[--seed S]``.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from rayvit.data.parquet import CLASS_NAMES_KEY

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff"}


def list_image_folder(src: Path) -> tuple[list[str], list[tuple[Path, int]]]:
    """Class names (sorted subfolder names) and ``(file, class index)`` for every image under them."""
    if not src.is_dir():
        raise FileNotFoundError(f"{src} is not a folder (expected one subfolder of images per class)")
    classes = sorted(p.name for p in src.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not classes:
        raise FileNotFoundError(f"{src} has no class subfolders (expected SRC/<class>/<image files>)")
    items = [(f, label) for label, name in enumerate(classes) for f in sorted((src / name).rglob("*"))
             if f.is_file() and f.suffix.lower() in IMAGE_SUFFIXES]
    if not items:
        raise FileNotFoundError(f"no image files ({', '.join(sorted(IMAGE_SUFFIXES))}) under {src}/<class>/")
    return classes, items


def to_parquet(src: str | os.PathLike, dst: str | os.PathLike, rows_per_shard: int = 10_000,
            seed: int = 0) -> list[Path]:
    """Write ``dst/part-NNNNN.parquet`` shards with ``image`` (bytes) and ``label`` (int64) columns.

    Files are stored as they are (no re-encoding). Rows are shuffled with ``seed`` so every shard mixes
    classes (readers shuffle only within a window). Class names go into the schema metadata.
    """
    if rows_per_shard < 1:
        raise ValueError(f"--rows-per-shard must be at least 1, got {rows_per_shard}")
    classes, items = list_image_folder(Path(src))
    random.Random(seed).shuffle(items)
    schema = pa.schema([("image", pa.binary()), ("label", pa.int64())],
                       metadata={CLASS_NAMES_KEY: json.dumps(classes).encode()})
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    written = []
    for shard, start in enumerate(range(0, len(items), rows_per_shard)):
        chunk = items[start:start + rows_per_shard]
        table = pa.table({"image": [f.read_bytes() for f, _ in chunk],
                          "label": [label for _, label in chunk]}, schema=schema)
        path = dst / f"part-{shard:05d}.parquet"
        pq.write_table(table, path)
        written.append(path)
    return written
