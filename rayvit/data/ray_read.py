"""How rayvit reads parquet through Ray Data: read tasks sized to the CPUs, each reading and decoding its own
files (the decode fuses into the read), so that the decode spreads over every CPU Ray Data is given.

Ray 2.60's default parquet reader (``DataContext.use_datasource_v2``) packs files into read tasks of up to
128 MiB (``RAY_DATA_PARQUET_BIN_PACKING_BYTES``, read once when ``read_parquet`` is called) whatever
``override_num_blocks`` asks, and lists each execution's files through a pool of 32 footer-reading actors
(new processes every epoch). On a small dataset that is one or two tasks for the whole epoch and seconds
of start per epoch. Its other reader (``use_datasource_v2=False``) reads each file's metadata once, when
the dataset is made, and makes ``override_num_blocks`` read tasks of whole files: rayvit uses it when Ray
is running (it samples files in Ray tasks then), with one task per file or per group of files, as many as
:func:`read_tasks` says. Measured figures and the arithmetic at ImageNet's scale: docs/data.md.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any, Optional, Protocol

if TYPE_CHECKING:
    import pyarrow.fs
    import ray.data


class ParquetFiles(Protocol):
    """What a read needs of a listing (``rayvit.data.parquet.ParquetSource`` is one)."""

    files: list[str]
    filesystem: "pyarrow.fs.FileSystem"
    sizes: Optional[list[int]]

TASKS_PER_CPU = 4                 # read tasks per CPU (waves that even out tasks of unequal length)
MAX_TASK_BYTES = 128 * 1024 ** 2  # Ray Data's own ceiling on a read's bytes (its target_max_block_size)


def read_tasks(files: int, total_bytes: int, cpus: int) -> int:
    """Read tasks for ``files`` parquet files of ``total_bytes`` in all on a cluster of ``cpus`` CPUs:
    ``TASKS_PER_CPU`` per CPU, more where a task would read over ``MAX_TASK_BYTES``, never more than the
    files (a file is not split: more tasks than files would split the read's blocks after it, unfuse the
    decode and make tasks of a few rows each, slower than one task per file)."""
    by_size = math.ceil(total_bytes / MAX_TASK_BYTES)
    return max(1, min(files, max(TASKS_PER_CPU * max(1, cpus), by_size)))


def read_parquet(source: ParquetFiles, columns: list[str], progress_bars: bool,
                 **kwargs: Any) -> "ray.data.Dataset":
    """``ray.data.read_parquet`` of ``source``'s files (with each row's ``path``), in :func:`read_tasks`
    tasks sized to the running cluster's CPUs; without Ray running, Ray Data's default reader (which
    starts nothing until the dataset runs). Its sampling's INFO lines (the estimated encoding ratio and batch
    size) are held back unless ``progress_bars``. The process's DataContext and loggers are left as they were."""
    import ray
    import ray.data
    from ray.data import DataContext

    read = dict(filesystem=source.filesystem, include_paths=True, columns=columns, **kwargs)
    if not ray.is_initialized():
        return ray.data.read_parquet(source.files, **read)
    context = DataContext.get_current()
    before = context.use_datasource_v2, context.enable_progress_bars
    context.use_datasource_v2 = False
    context.enable_progress_bars = progress_bars and context.enable_progress_bars  # its sampling bar
    sampling_log = logging.getLogger("ray.data._internal.datasource.parquet_datasource")
    level = sampling_log.level
    if not progress_bars:
        sampling_log.setLevel(max(level, logging.WARNING))
    try:
        cpus = int(ray.cluster_resources().get("CPU", 1))
        tasks = read_tasks(len(source.files), source_bytes(source), cpus)
        return ray.data.read_parquet(source.files, override_num_blocks=tasks, **read)
    finally:
        context.use_datasource_v2, context.enable_progress_bars = before
        sampling_log.setLevel(level)


def source_bytes(source: ParquetFiles) -> int:
    """The bytes of ``source``'s files (from the listing, else asked of the filesystem)."""
    if source.sizes is not None:
        return sum(source.sizes)
    return sum(info.size or 0 for info in source.filesystem.get_file_info(source.files))

