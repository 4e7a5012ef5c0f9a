"""Without Ray (one process): the default model on parquet photographs, per data.prefetch_batches and
parallel.cpus_per_worker, in alternating rounds; median images/s and data_wait_fraction over 3 rounds.

    rayvit make-photos /tmp/photos && rayvit to-parquet /tmp/photos /tmp/photos.parquet
    python benchmarks/prefetch_local.py /tmp/photos.parquet
"""
import statistics, sys
from rayvit.config import load_config
from rayvit.worker import train
path = sys.argv[1]
rates = {}
for r in range(3):
    for p in ((0, 1, 2) if r % 2 == 0 else (2, 1, 0)):
        for cpus in (1, 2):
            cfg = load_config("experiments/configs/cpu_default.yaml", ["data.name=parquet", f"data.path={path}", "model.num_classes=8",
                              f"data.prefetch_batches={p}", f"parallel.cpus_per_worker={cpus}", "train.steps=35", "train.warmup_steps=5"])
            res = train(cfg)
            rates.setdefault((cpus, p), []).append((res["images_per_sec_per_chip"], res["data_wait_fraction"]))
for (cpus, p), v in sorted(rates.items()):
    print(f"cpus_per_worker={cpus} prefetch_batches={p}: img/s {statistics.median(x for x, _ in v):.0f} "
          f"({min(x for x, _ in v):.0f}-{max(x for x, _ in v):.0f}), data_wait_fraction {statistics.median(w for _, w in v):.1%} "
          f"({min(w for _, w in v):.1%}-{max(w for _, w in v):.1%})")
