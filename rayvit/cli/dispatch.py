"""``rayvit COMMAND``: the table of commands and the dispatch to each one's module."""

from __future__ import annotations

import sys
from typing import Callable, Optional, Sequence

from rayvit.cli.bench_commands import bench, bench_data
from rayvit.cli.data_commands import make_photos, to_parquet
from rayvit.cli.gpu_check_command import gpu_check
from rayvit.cli.options import eprint
from rayvit.cli.projection_commands import plan, project
from rayvit.cli.run_commands import search, sweep

COMMANDS: dict[str, tuple[Callable[..., int], str]] = {
    "sweep": (sweep, "scaling sweeps and the optimization ladder, recorded in MLflow"),
    "project": (project, "project a sweep's per-chip throughput and memory on 8-64 GPUs, without running it"),
    "plan": (plan, "what to run, on what and how many chips, ranked by hours and cost per epoch, without running"),
    "search": (search, "Ray Tune search for the fastest setting within an accuracy budget"),
    "bench": (bench, "single-process A/B timing of the training step (ratios against the first variant)"),
    "gpu-check": (gpu_check, "on one GPU: every precision level and strategy, FairScale FSDP, the ladder's TFLOPS"),
    "to-parquet": (to_parquet, "convert an image folder into parquet shards for data.name=parquet"),
    "make-photos": (make_photos, "ImageNet-like JPEGs of 8 classes from scikit-image's photographs (a test set)"),
    "bench-data": (bench_data, "the input pipeline's images/s per CPU core on your parquet files (for --data-rate)"),
}


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        width = max(len(name) for name in COMMANDS)
        usage = "usage: rayvit COMMAND [options]   (rayvit COMMAND --help for each)\n\ncommands:\n" + "\n".join(
            f"  {name.ljust(width)}  {about}" for name, (_, about) in COMMANDS.items())
        if argv and argv[0] not in ("-h", "--help"):
            eprint(f"rayvit: unknown command {argv[0]!r}\n\n{usage}")
            return 2
        print(usage)
        return 0 if argv else 2
    command, _ = COMMANDS[argv[0]]
    return command(argv[1:])
