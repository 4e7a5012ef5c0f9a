"""The projection's straggler term against 1- and 2-worker CPU measurements.

    python benchmarks/straggler_check.py [--steps 200] [--segment-ms 10]

A synchronous step waits for the slowest rank: its expected time is E[max of N ranks' compute], which the
projection takes as ``mean + sigma x E[max of N standard normals]`` (``performance.expected_max``; on GPUs
sigma is the spread of chips' speed). Here each rank repeats a fixed compute segment (a fixed number of
matmuls, about ``--segment-ms``) followed by a one-element all-reduce, as a DDP step ends:

- 1 worker: the segment's time distribution alone (mean, sigma);
- 2 workers: each rank's own segment times, and the step time between two all-reduces on rank 0.

Predicted waits beyond a rank's own compute at 2 ranks: sigma x E[max of 2] (normal, from the 1-worker
and from the 2-worker per-rank spread) and the mean of the maximum of two independent draws from the
measured samples (no distribution assumed); measured: the step time less the rank's own segment and less a
barrier-aligned all-reduce's own time. gloo, one thread per rank, no Ray.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time


def _segment_and_sync(rank: int, world: int, folder: str, steps: int, seconds: float) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("STRAGGLER_PORT", "29533"))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    a = torch.randn(128, 128)
    for _ in range(20):
        a @ a
    start = time.perf_counter()
    for _ in range(200):
        a @ a
    count = torch.tensor([max(1.0, seconds / ((time.perf_counter() - start) / 200))])
    dist.all_reduce(count, op=dist.ReduceOp.MIN)         # the same work on every rank
    n = int(count.item())
    flag = torch.zeros(1)
    aligned = []
    for _ in range(30):                                  # the all-reduce's own time, ranks aligned
        dist.barrier()
        t = time.perf_counter()
        dist.all_reduce(flag)
        aligned.append(time.perf_counter() - t)
    compute, steps_s = [], []
    dist.barrier()
    last = time.perf_counter()
    for _ in range(steps):
        t = time.perf_counter()
        for _ in range(n):
            a @ a
        compute.append(time.perf_counter() - t)
        dist.all_reduce(flag)
        now = time.perf_counter()
        steps_s.append(now - last)
        last = now
    torch.save({"compute": compute, "steps": steps_s, "aligned": statistics.median(aligned)},
               os.path.join(folder, f"rank{rank}.pt"))
    dist.destroy_process_group()


def measure(world: int, steps: int, seconds: float) -> list[dict]:
    import torch
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as folder:
        mp.start_processes(_segment_and_sync, args=(world, folder, steps, seconds), nprocs=world, join=True,
                           start_method="spawn")
        return [torch.load(os.path.join(folder, f"rank{r}.pt")) for r in range(world)]


def empirical_max_mean(samples: list[list[float]], draws: int = 20000, seed: int = 0) -> float:
    """Mean of the maximum of one independent draw from each sample list."""
    rng = random.Random(seed)
    return statistics.fmean(max(rng.choice(s) for s in samples) for _ in range(draws))


def main(argv=None) -> int:
    from rayvit.projection.performance import expected_max

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--segment-ms", type=float, default=10.0)
    args = parser.parse_args(argv)
    seconds = args.segment_ms / 1e3
    warm = args.steps // 10
    one = measure(1, args.steps, seconds)[0]
    two = measure(2, args.steps, seconds)
    c1 = one["compute"][warm:]
    mu1, sd1 = statistics.fmean(c1), statistics.stdev(c1)
    ranks = [r["compute"][warm:] for r in two]
    mu2 = statistics.fmean(x for r in ranks for x in r)
    sd2 = statistics.fmean(statistics.stdev(r) for r in ranks)
    step = statistics.fmean(two[0]["steps"][warm:])
    transfer = statistics.fmean(r["aligned"] for r in two)
    measured_wait = step - statistics.fmean(ranks[0]) - transfer
    e2 = expected_max(2)
    rows = [("1 worker: normal, mean + sigma x E[max of 2]", sd1 * e2),
            ("1 worker: max of two draws from its samples", empirical_max_mean([c1, c1]) - mu1),
            ("2 workers: normal, each rank's sigma", sd2 * e2),
            ("2 workers: max of draws from the two ranks' samples", empirical_max_mean(ranks) - mu2)]
    print(f"segment: 1 worker {mu1 * 1e3:.2f} ms (sigma {sd1 * 1e3:.3f} ms, cv {sd1 / mu1:.1%}); 2 workers "
          f"{mu2 * 1e3:.2f} ms per rank (sigma {sd2 * 1e3:.3f} ms, cv {sd2 / mu2:.1%})")
    print(f"2-worker step {step * 1e3:.2f} ms = rank 0's segment {statistics.fmean(ranks[0]) * 1e3:.2f} + aligned "
          f"all-reduce {transfer * 1e3:.3f} + wait {measured_wait * 1e3:.3f} ms (measured)")
    for label, predicted in rows:
        print(f"  predicted wait {predicted * 1e3:7.3f} ms ({predicted / measured_wait:5.2f}x measured)  {label}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
