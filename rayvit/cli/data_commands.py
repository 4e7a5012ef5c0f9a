"""``rayvit to-parquet`` and ``rayvit make-photos``: datasets on disk, made by :mod:`rayvit.datasets`'s functions."""

from __future__ import annotations

import argparse
import json
import os
from typing import Sequence

from rayvit.cli.options import described_parser, eprint

TO_PARQUET_DESCRIPTION = (
    "Convert an image-folder tree into parquet shards that rayvit reads with data.name=parquet data.path=DST. "
    "SRC holds one subfolder per class; the class index of an image is the position of its folder among the "
    "sorted folder names. Each row holds the encoded file bytes (column 'image') and the class index (column "
    "'label', int64); the class names are stored in the schema metadata.")


def to_parquet(argv: Sequence[str], prog: str = "rayvit to-parquet") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=TO_PARQUET_DESCRIPTION)
    parser.add_argument("src", metavar="SRC", help="image folder: SRC/<class name>/<image files>")
    parser.add_argument("dst", metavar="DST", help="output folder for part-NNNNN.parquet shards")
    parser.add_argument("--rows-per-shard", type=int, default=10_000, metavar="N",
                        help="images per parquet file (default: 10000)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the row shuffle that mixes classes across shards (default: 0)")
    args = parser.parse_args(argv)
    import pyarrow.parquet as pq

    from rayvit.data.parquet import CLASS_NAMES_KEY
    from rayvit.datasets import to_parquet as convert

    try:
        written = convert(args.src, args.dst, args.rows_per_shard, args.seed)
    except (FileNotFoundError, ValueError) as e:
        eprint(f"error: {e}")
        return 2
    rows = sum(pq.read_metadata(p).num_rows for p in written)
    classes = json.loads(pq.read_schema(written[0]).metadata[CLASS_NAMES_KEY])
    print(f"wrote {rows} images of {len(classes)} classes to {len(written)} shard(s) in "
          f"{os.path.abspath(args.dst)}")
    return 0


def make_photos(argv: Sequence[str], prog: str = "rayvit make-photos") -> int:
    from rayvit.data import photos

    parser = described_parser(prog, photos.__doc__, "")
    parser.add_argument("dst", metavar="DST", help="output image folder (one subfolder per class)")
    parser.add_argument("--per-class", type=int, default=40,
                        help=f"images per class (default 40; {len(photos.SOURCES)} classes)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the crops, sizes and qualities (default 0)")
    args = parser.parse_args(argv)
    from rayvit.datasets import make_photos as make

    try:
        folder = make(args.dst, args.per_class, args.seed)
    except (ImportError, ValueError) as e:
        eprint(f"error: {e}")
        return 2
    print(f"wrote {args.per_class * len(photos.SOURCES)} JPEGs of {len(photos.SOURCES)} classes to "
          f"{folder.resolve()}")
    return 0
