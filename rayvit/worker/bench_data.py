"""``rayvit bench-data``: the input pipeline's images/s per CPU core on your own parquet files.

Reads up to ``--images`` rows of ``data.path`` into memory, then times the training transform (decode,
random resized crop, flip, ``data.augment``, into a uint8 batch) and the validation transform on one
thread, in alternating rounds (so drift of a shared machine hits every variant alike); each figure is
the median over rounds with the rounds' range. ``--compare key=a,b`` times variants side by side (e.g.
``data.cpu_decoder=pil,simplejpeg``). ``--json`` writes what ``rayvit project --data-rate`` reads: the
projection then says per point how many cores per chip the input needs and whether a node has them.
"""

from __future__ import annotations

import json
import platform
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from rayvit.config import Config, ConfigError, load_config
from rayvit.data.images import ImageTransform, transform_into
from rayvit.worker.bench import ab_parser, parse_compare

EXAMPLES = """examples:
  rayvit bench-data data.path=/data/imagenet/train model.image_size=224
  rayvit bench-data --config experiments/configs/study_a100.yaml data.name=parquet data.path=s3://bucket/train \\
      --json data_rate.json && rayvit project --config experiments/configs/study_a100.yaml --data-rate data_rate.json
  rayvit bench-data data.path=/data/train --compare data.cpu_decoder=pil,simplejpeg --compare data.augment=none,randaugment
"""


def cpu_description() -> str:
    """This CPU's model name and the vector extensions that matter to decoding and resizing."""
    name, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    name = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass
    shown = [f for f in ("sse4_2", "avx2", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_bf16") if f in flags]
    return f"{name} ({', '.join(shown) or 'flags unknown'})"


@dataclass
class Timing:
    label: str
    spec: ImageTransform
    rates: list[float] = field(default_factory=list)     # images/s of each round

    def row(self) -> dict:
        return {"variant": self.label, "transform": "train" if self.spec.train else "val",
                "images_per_sec_per_core": statistics.median(self.rates), "low": min(self.rates),
                "high": max(self.rates), "rounds": list(self.rates)}


def read_images(cfg: Config, count: int) -> list[bytes]:
    from rayvit.data.parquet import read_split

    split = read_split(cfg.data.path, cfg, "data.path")
    if not split.images:
        raise ConfigError(f"data.path={cfg.data.path} holds no rows")
    return split.images[:count]


def time_round(t: Timing, images: list[bytes], seed: int) -> None:
    out = torch.empty((len(images), 3, t.spec.size, t.spec.size), dtype=torch.uint8)
    rngs = [random.Random(seed * 100_003 + i) for i in range(len(images))]
    start = time.perf_counter()
    errors = transform_into(out, images, t.spec, rngs, lambda i: f"row {i}")
    seconds = time.perf_counter() - start
    bad = [e for e in errors if e]
    if bad:
        raise ConfigError(f"{len(bad)} of the images cannot be decoded, e.g. {bad[0]}")
    t.rates.append(len(images) / seconds)


def variants(cfg: Config, compare: Optional[tuple[str, list[str]]]) -> list[Timing]:
    configs = [("as configured", cfg)] if compare is None else [
        (f"{compare[0]}={v}", cfg.replace([f"{compare[0]}={v}"])) for v in compare[1]]
    return [Timing(f"{label}", ImageTransform.of(c, train)) for label, c in configs for train in (True, False)]


def measure(cfg: Config, images: list[bytes], compare, rounds: int) -> list[dict]:
    timings = variants(cfg, compare)
    time_round(timings[0], images[:8], 0)            # imports and first-call costs, untimed
    timings[0].rates.clear()
    for r in range(rounds):
        for t in timings[r % len(timings):] + timings[:r % len(timings)]:
            time_round(t, images, r)
    return [t.row() for t in timings]


def format_rows(rows: list[dict]) -> str:
    header = f"{'variant':<40} {'transform':<9} {'img/s/core':>10} {'range':>15} {'ms/img':>7}"
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(f"{r['variant']:<40} {r['transform']:<9} {r['images_per_sec_per_core']:>10.1f} "
                     f"{r['low']:>7.1f}-{r['high']:<7.1f} {1e3 / r['images_per_sec_per_core']:>7.3f}")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None, prog: str = "rayvit bench-data") -> int:
    parser = ab_parser(prog, __doc__, EXAMPLES, "YAML config file (data.path: your parquet file or folder)")
    parser.add_argument("--images", type=int, default=256, help="rows read and decoded per round (default 256)")
    parser.add_argument("--json", help="write the results here (rayvit project --data-rate reads it)")
    args = parser.parse_args(argv)
    if args.images < 1 or args.rounds < 1:
        print("error: --images and --rounds must be >= 1", file=sys.stderr)
        return 2
    threads = torch.get_num_threads()
    try:
        cfg = load_config(args.config, ["data.name=parquet", *args.overrides])
        groups = [parse_compare(c) for c in args.compare] or [None]
        images = read_images(cfg, args.images)
        torch.set_num_threads(1)       # one core: the figure is per core
        print(f"{prog}: {len(images)} images of data.path={cfg.data.path} at {cfg.model.image_size} px, "
              f"{args.rounds} rounds, one thread on {cpu_description()}", file=sys.stderr)
        results = []
        for group in groups:
            rows = measure(cfg, images, group, args.rounds)
            print(format_rows(rows) + "\n")
            results.append({"compare": group[0] if group else None, "rows": rows})
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        torch.set_num_threads(threads)
    if args.json:
        first = results[0]["rows"]
        with open(args.json, "w") as f:
            json.dump({"config": cfg.to_dict(), "image_size": cfg.model.image_size, "cpu": cpu_description(),
                       "images": len(images), "train": first[0], "val": first[1], "groups": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
