"""``rayvit bench-data``: the input pipeline's images/s per CPU core on your own parquet files.

Reads up to ``--images`` rows of ``data.path`` into memory, then times the training transform (decode,
random resized crop, flip, ``data.augment``, into a uint8 batch) and the validation transform on one
thread, in alternating rounds (so drift of a shared machine hits every variant alike); each figure is
the median over rounds with the rounds' range. ``--compare key=a,b`` times variants side by side (e.g.
``data.cpu_decoder=pil,simplejpeg``). ``--ray-cpus N ...`` also times the same split through Ray Data's own
read and decode tasks with N CPUs each (a local Ray instance): what the pipeline's tasks reach, reads,
task starts and serialisation included. ``--json`` writes what ``rayvit project --data-rate`` reads
(the Ray Data rate per CPU where measured): the projection then says per point how many cores per chip
the input needs and whether a node has them.
"""

from __future__ import annotations

import platform
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from rayvit.config_schema import Config
from rayvit.errors import ConfigError
from rayvit.data.images import ImageTransform, transform_into


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


def ray_data_rates(cfg: Config, cpus: list[int], rounds: int, images: int) -> list[dict]:
    """Images/s through Ray Data's own read and decode (``rayvit.data.ray_datasets``' train split) with each
    N of ``cpus`` CPUs for Ray Data (its ``resource_limits``), in alternating rounds on one local Ray
    instance of max(cpus) CPUs. Each round reads up to ``images`` rows in batches of ``train.batch_size``
    and the rate is rows over the whole time, the execution's start included (as every epoch pays it:
    Ray Data hands out a read task's blocks as it finishes them, so a rate counted from the first batch
    would miss the decoding done before it); the first batch's wait is reported beside it."""
    import ray
    from ray.data import Dataset

    from rayvit.data import ray_datasets

    ray.init(address="local", num_cpus=max(cpus), include_dashboard=False, log_to_driver=False)
    try:
        train = ray_datasets(cfg)["train"]
        rates: dict[int, list[float]] = {n: [] for n in cpus}
        firsts: dict[int, list[float]] = {n: [] for n in cpus}
        for r in range(rounds + 1):                    # round 0 starts Ray's workers: untimed
            for n in cpus[r % len(cpus):] + cpus[:r % len(cpus)]:
                ds = Dataset.copy(train, _deep_copy=True)
                limits = ds.context.execution_options.resource_limits
                ds.context.execution_options.resource_limits = limits.copy(cpu=n)
                first, rate = _time_epoch(ds, cfg.train.batch_size, images)
                if r:
                    rates[n].append(rate)
                    firsts[n].append(first)
    finally:
        ray.shutdown()
    base = rates[cpus[0]]
    return [{"cpus": n, "images_per_sec": statistics.median(v), "low": min(v), "high": max(v), "rounds": v,
             "images_per_sec_per_cpu": statistics.median(v) / n, "first_batch_s": statistics.median(firsts[n]),
             f"vs_{cpus[0]}_cpus": statistics.median(a / b for a, b in zip(v, base))} for n, v in rates.items()]


def _time_epoch(ds, batch_size: int, images: int) -> tuple[float, float]:
    """(seconds to the first batch, images/s over the whole time) over up to ``images`` rows of ``ds``."""
    start = time.perf_counter()
    first, rows = None, 0
    for batch in ds.iter_batches(batch_size=batch_size, batch_format="numpy"):
        first = first or time.perf_counter()
        rows += len(next(iter(batch.values())))
        if rows >= images:
            break
    end = time.perf_counter()
    if first is None:
        raise ConfigError(f"data.path holds less than a batch of train.batch_size={batch_size} for Ray Data")
    return first - start, rows / (end - start)


def format_ray_rows(rows: list[dict]) -> str:
    base = rows[0]["cpus"]
    header = f"{'Ray Data CPUs':<14} {'img/s':>8} {'range':>15} {'img/s/CPU':>10} {f'vs {base} CPUs':>10} {'1st batch s':>11}"
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(f"{r['cpus']:<14} {r['images_per_sec']:>8.1f} {r['low']:>7.1f}-{r['high']:<7.1f} "
                     f"{r['images_per_sec_per_cpu']:>10.1f} {r[f'vs_{base}_cpus']:>9.2f}x {r['first_batch_s']:>11.2f}")
    return "\n".join(lines)


def format_rows(rows: list[dict]) -> str:
    header = f"{'variant':<40} {'transform':<9} {'img/s/core':>10} {'range':>15} {'ms/img':>7}"
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(f"{r['variant']:<40} {r['transform']:<9} {r['images_per_sec_per_core']:>10.1f} "
                     f"{r['low']:>7.1f}-{r['high']:<7.1f} {1e3 / r['images_per_sec_per_core']:>7.3f}")
    return "\n".join(lines)
