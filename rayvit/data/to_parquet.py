"""Convert an image-folder tree (one subfolder per class) into parquet shards for rayvit.

    rayvit to-parquet SRC DST [--rows-per-shard N] [--seed S]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path
from typing import Optional, Sequence

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


def convert(src: str | os.PathLike, dst: str | os.PathLike, rows_per_shard: int = 10_000,
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


def main(argv: Optional[Sequence[str]] = None, prog: str = "rayvit to-parquet") -> int:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Convert an image-folder tree into parquet shards that rayvit reads with "
                    "data.name=parquet data.path=DST. SRC holds one subfolder per class; the class "
                    "index of an image is the position of its folder among the sorted folder names. "
                    "Each row holds the encoded file bytes (column 'image') and the class index "
                    "(column 'label', int64); the class names are stored in the schema metadata.")
    parser.add_argument("src", metavar="SRC", help="image folder: SRC/<class name>/<image files>")
    parser.add_argument("dst", metavar="DST", help="output folder for part-NNNNN.parquet shards")
    parser.add_argument("--rows-per-shard", type=int, default=10_000, metavar="N",
                        help="images per parquet file (default: 10000)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the row shuffle that mixes classes across shards (default: 0)")
    args = parser.parse_args(argv)
    try:
        written = convert(args.src, args.dst, args.rows_per_shard, args.seed)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rows = sum(pq.read_metadata(p).num_rows for p in written)
    classes = json.loads(pq.read_schema(written[0]).metadata[CLASS_NAMES_KEY])
    print(f"wrote {rows} images of {len(classes)} classes to {len(written)} shard(s) in "
          f"{os.path.abspath(args.dst)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
