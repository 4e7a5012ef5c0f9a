"""``rayvit``: one command for every entry point, and the only package that parses command lines.

    rayvit sweep   [--config F] [--set k=v ...]     scaling sweeps and the optimization ladder
    rayvit project [--config F] [--hardware P ...]  projected throughput and memory per chip, nothing runs
    rayvit plan    [--config F] [--hardware P ...]  what to run, on what, at what cost per epoch; nothing runs
    rayvit search  [--config F] [--set k=v ...]     Ray Tune: fastest setting within the accuracy budget
    rayvit bench   [k=v ...] [--compare k=a,b]      single-process A/B timing of the training step
    rayvit gpu-check [--quick] [--list]             what only a GPU can tell, with the ladder's TFLOPS and MFU
    rayvit to-parquet SRC DST                       image folder -> parquet shards for data.name=parquet
    rayvit make-photos DST [--per-class N]          sample photographs as an image folder (a test set)
    rayvit bench-data data.path=P [k=v ...]         the input pipeline's images/s per CPU core on your files

One module per family of commands: ``run_commands`` (sweep, search), ``projection_commands`` (project,
plan), ``bench_commands`` (bench, bench-data), ``gpu_check_command``, ``data_commands`` (to-parquet,
make-photos); ``options`` holds what they share and ``dispatch`` the table of commands. Each parses its options
and calls plain functions of the layer below (rayvit.studies, rayvit.projection, rayvit.worker,
rayvit.gpu_check, rayvit.datasets), importing them only when it runs, so a ``--help`` or a dry run stays light.

``experiments/scaling.py`` and ``experiments/search.py`` are the same commands as files, for
``ray job submit -- python experiments/scaling.py``. Exit status: 0 done, 1 a point or trial failed,
2 nothing could start (bad config, unreachable store or cluster, missing cluster token, cluster too
small, checkpoints without shared storage on a multi-node cluster), 130 interrupted (a search: 143 on
SIGTERM).
"""

from rayvit.cli.bench_commands import bench, bench_data
from rayvit.cli.data_commands import make_photos, to_parquet
from rayvit.cli.gpu_check_command import gpu_check
from rayvit.cli.dispatch import COMMANDS, main
from rayvit.cli.projection_commands import plan, project
from rayvit.cli.run_commands import search, sweep

__all__ = ["COMMANDS", "main", "sweep", "project", "plan", "search", "bench", "bench_data", "gpu_check",
           "to_parquet", "make_photos"]
