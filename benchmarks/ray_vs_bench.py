"""In-loop throughput of a 1-worker Ray Train run against the single-process benchmark, same config.

    python benchmarks/ray_vs_bench.py [section.key=value ...] [--repeats 2]

Alternates (bench, Ray) pairs so machine drift hits both, and prints each pair's ratio
Ray images/s per chip / bench images/s. Ray start-up and reports are outside both timings by design, so
the ratio shows what the Ray worker costs the training step itself (goal: at least 0.95).
"""

from __future__ import annotations

import argparse
import statistics

from rayvit.worker.bench import bench_config, compare_configs
from rayvit.config import load_config
from rayvit.launch.connect import ensure_ray
from rayvit.trainer import fit

DEFAULTS = ["model.name=vit_ti16", "model.image_size=64", "model.patch_size=16", "train.batch_size=16",
            "parallel.cpus_per_worker=2", "data.name=synthetic", "train.steps=40", "train.warmup_steps=5",
            "train.report_every=20"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", metavar="section.key=value")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    cfg = load_config(overrides=DEFAULTS + args.overrides)
    ensure_ray()
    ratios = []
    for i in range(args.repeats):
        steps = cfg.train.steps - cfg.train.warmup_steps
        bench = compare_configs([bench_config(cfg, steps, cfg.train.warmup_steps)], rounds=1)[0]["images_per_sec_per_chip"]
        ray_run = fit(cfg)
        ratio = ray_run["images_per_sec_per_chip"] / bench
        ratios.append(ratio)
        print(f"pair {i + 1}: bench {bench:.1f} img/s, Ray 1 worker "
              f"{ray_run['images_per_sec_per_chip']:.1f} img/s per chip, ratio {ratio:.3f}")
    m = cfg.model
    print(f"{m.name} {m.image_size}px batch {cfg.train.batch_size}, {cfg.parallel.cpus_per_worker} CPU(s), "
          f"{cfg.precision.mode}: median ratio Ray/bench = {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
