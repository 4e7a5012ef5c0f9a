"""``rayvit bench`` and ``rayvit bench-data``: side-by-side timings in this one process, of the training step
(:mod:`rayvit.worker.bench`) and of the input pipeline (:mod:`rayvit.worker.bench_data`); each module's
docstring is its command's description."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional, Sequence

from rayvit.cli.options import described_parser, eprint

BENCH_EXAMPLES = """examples:
  rayvit bench model.name=vit_s16 model.image_size=224 train.batch_size=8
  rayvit bench model.name=vit_s16 model.image_size=224 train.batch_size=8 \\
      --compare optim.impl=loop,foreach --compare precision.mode=fp32,amp
  rayvit bench --config experiments/configs/cpu_default.yaml --compare model.layout=batch_first,batch_second
  rayvit bench model.name=vit_s16 model.image_size=224 train.batch_size=8 --compare model.compile=false,true
"""

BENCH_DATA_EXAMPLES = """examples:
  rayvit bench-data data.path=/data/imagenet/train model.image_size=224
  rayvit bench-data --config experiments/configs/study_a100.yaml data.name=parquet data.path=s3://bucket/train \\
      --json data_rate.json && rayvit project --config experiments/configs/study_a100.yaml --data-rate data_rate.json
  rayvit bench-data data.path=/data/train --compare data.cpu_decoder=pil,simplejpeg --compare data.augment=none,randaugment
  rayvit bench-data data.path=/data/train --ray-cpus 1 2 4 --json data_rate.json
"""


def ab_parser(prog: str, description: str, examples: str, config_help: str) -> argparse.ArgumentParser:
    """The options every side-by-side timing command takes: overrides, --config, --compare, --rounds."""
    parser = described_parser(prog, description, examples)
    parser.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides")
    parser.add_argument("--config", help=config_help)
    parser.add_argument("--compare", action="append", default=[], metavar="KEY=V1,V2",
                        help="variants to time side by side; repeat for several groups")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds (default 5)")
    return parser


def bench_parser(prog: str) -> argparse.ArgumentParser:
    from rayvit.worker import bench

    parser = ab_parser(prog, bench.__doc__, BENCH_EXAMPLES, "YAML config file (defaults: a tiny ViT on CPU)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant per round (default 3)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per variant first (default 2)")
    parser.add_argument("--json", help="also write the results to this JSON file")
    return parser


def bench(argv: Sequence[str], prog: str = "rayvit bench") -> int:
    args = bench_parser(prog).parse_args(argv)
    if args.warmup < 0 or args.steps < 1 or args.rounds < 1:
        eprint("error: --warmup must be >= 0, --steps and --rounds >= 1")
        return 2
    import torch

    from rayvit.config import load_config
    from rayvit.errors import CompareFailed, ConfigError
    from rayvit.worker.bench import bench_config, check_bench, format_rows, parse_compare, report, run_group

    try:
        # The benchmark measures the step itself: synthetic data, never a dataset's decode cost.
        cfg = load_config(args.config, ["data.name=synthetic", *args.overrides])
        groups = [parse_compare(c) for c in args.compare] or [None]
        check_bench(cfg, groups, args.warmup)
    except ConfigError as e:
        eprint(f"error: {e}")
        return 2
    m, t = cfg.model, cfg.train
    eprint(f"rayvit bench: {m.name} {m.image_size}px batch {t.batch_size}, {cfg.precision.mode}/"
           f"{cfg.precision.dtype}, {cfg.optim.name}-{cfg.optim.impl}, {cfg.parallel.cpus_per_worker} "
           f"thread(s), torch {torch.__version__}; {args.rounds} rounds x {args.steps} steps after "
           f"{args.warmup} warm-up")
    results = []
    for group in groups:
        try:
            variants = run_group(bench_config(cfg, args.steps, args.warmup), group, args.rounds)
        except CompareFailed as e:
            eprint(f"error: {e}")
            return 1
        rows = report(variants)
        print(format_rows(rows))
        print()
        results.append({"compare": group[0] if group else None, "rows": rows})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": cfg.to_dict(), "groups": results}, f, indent=2)
    return 0


def bench_data_parser(prog: str) -> argparse.ArgumentParser:
    from rayvit.worker import bench_data

    parser = ab_parser(prog, bench_data.__doc__, BENCH_DATA_EXAMPLES,
                       "YAML config file (data.path: your parquet file or folder)")
    parser.add_argument("--images", type=int, default=256, help="rows read and decoded per round (default 256)")
    parser.add_argument("--json", help="write the results here (rayvit project --data-rate reads it)")
    parser.add_argument("--ray-cpus", type=int, nargs="+", metavar="N",
                        help="also time Ray Data's own read and decode of the train split with each N CPUs (a local "
                             "Ray instance; alternating rounds); --json then carries it and rayvit project uses it")
    parser.add_argument("--ray-images", type=int, default=2048,
                        help="rows read per --ray-cpus round (default 2048, or the split's)")
    return parser


def bench_data(argv: Sequence[str], prog: str = "rayvit bench-data") -> int:
    args = bench_data_parser(prog).parse_args(argv)
    if args.images < 1 or args.rounds < 1 or args.ray_images < 2 or min(args.ray_cpus or [1]) < 1:
        eprint("error: --images, --rounds and --ray-cpus must be >= 1, --ray-images >= 2")
        return 2
    import torch

    from rayvit.errors import ConfigError

    threads = torch.get_num_threads()
    try:
        report = _time_input(args, prog, threads)
    except ConfigError as e:
        eprint(f"error: {e}")
        return 2
    finally:
        torch.set_num_threads(threads)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


def _time_input(args: argparse.Namespace, prog: str, threads: int) -> dict:
    """Time the transforms on one core, then (``--ray-cpus``) Ray Data's read and decode; what --json writes."""
    import torch

    from rayvit.config import load_config
    from rayvit.worker.bench import parse_compare
    from rayvit.worker.bench_data import (cpu_description, format_ray_rows, format_rows, measure, ray_data_rates,
                                          read_images)

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
    ray_rows: Optional[list[dict]] = None
    if args.ray_cpus:
        torch.set_num_threads(threads)
        print(f"{prog}: Ray Data's read and decode of the train split, up to {args.ray_images} rows per round, "
              f"with {', '.join(map(str, args.ray_cpus))} CPUs", file=sys.stderr)
        ray_rows = ray_data_rates(cfg, args.ray_cpus, args.rounds, args.ray_images)
        print(format_ray_rows(ray_rows) + "\n")
    first = results[0]["rows"]
    return {"config": cfg.to_dict(), "image_size": cfg.model.image_size, "cpu": cpu_description(),
            "images": len(images), "train": first[0], "val": first[1], "groups": results, "ray_data": ray_rows}
