"""What the cross-rank finite-loss check costs a step: two gloo ranks, the same run with and without it.

Every step ends with a one-element-per-rank all-reduce of "is my loss finite" (rayvit.worker.agree,
after the step's clock has stopped), so that a NaN on one rank ends the run on all of them. This times
the run with that check and with the local check it replaced (each rank looking at its own loss only),
in alternating rounds on the same two ranks, and prints per variant the median timed step (what every
figure is made from) and the median wall time per step (the timed step plus everything between steps,
the check included), with their ratio to the local check's.

    python benchmarks/nonfinite_check.py [--rounds 6] [--steps 30] [--set section.key=value ...]

Say which CPU the figures came from (``lscpu``); run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _local_check(value: float, device: torch.device) -> list[int]:
    """The check before rayvit.worker.agree: this rank's own loss, no collective."""
    return [] if math.isfinite(value) else [dist.get_rank()]


def _rank(rank: int, folder: str, args: argparse.Namespace) -> None:
    from rayvit.config import load_config
    from rayvit.worker import agree, loop

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=2)
    cfg = load_config(overrides=["parallel.num_workers=2", f"train.steps={args.steps}", "train.warmup_steps=3",
                                 *args.overrides])
    variants = {"local check": _local_check, "all-reduced check": agree.nonfinite_ranks}
    results: dict[str, dict[str, list[float]]] = {name: {"step": [], "wall": []} for name in variants}
    for r in range(args.rounds):
        order = list(variants) if r % 2 == 0 else list(reversed(variants))
        for name in order:
            agree.nonfinite_ranks = variants[name]   # the session looks it up at every step
            walls: list[float] = []
            last = [0.0]

            def clock(session, _walls=walls, _last=last):
                now = time.perf_counter()
                if session.clock.steps > cfg.train.warmup_steps:
                    _walls.append(now - _last[0])
                _last[0] = now

            result = loop.train(cfg, on_step=clock)
            results[name]["step"].append(statistics.median(result.step_times))
            results[name]["wall"].append(statistics.median(walls))
    agree.nonfinite_ranks = variants["all-reduced check"]
    if rank == 0:
        base = {k: statistics.median(v) for k, v in results["local check"].items()}
        print(f"{args.rounds} rounds of {args.steps - 3} timed steps, 2 gloo ranks, one thread each")
        for name, times in results.items():
            step, wall = statistics.median(times["step"]), statistics.median(times["wall"])
            print(f"  {name:<18} timed step {step * 1e3:7.2f} ms ({step / base['step']:.3f}x)   "
                  f"wall per step {wall * 1e3:7.2f} ms ({wall / base['wall']:.3f}x)")
    dist.destroy_process_group()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as folder:
        mp.start_processes(_rank, args=(folder, args), nprocs=2, join=True, start_method="spawn")
    return 0


if __name__ == "__main__":
    sys.exit(main())
