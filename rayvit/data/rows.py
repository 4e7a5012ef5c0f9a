"""Where a row of a parquet dataset lives: its file, its row in the file, its row group and its index there.

A bad image is reported by place (``part-00003.parquet row 1207 (row group 1, index 207)``) so that a
user can find it with any parquet reader. Without Ray, rows are read in file order and each row's place
follows from the files' footers (:class:`RowPlaces`); through Ray Data a row carries only its file's
path, and :func:`find_row` looks for its bytes in that file, once, when an image has failed. A row of a
caller's own Dataset with no file column is named by its block and offset, its label, size and digest
(:func:`unplaced_row`), which ``Dataset.filter`` finds again.
"""

from __future__ import annotations

import bisect
import hashlib
from dataclasses import dataclass
from typing import Any, Callable, Optional

import pyarrow.fs as pafs
import pyarrow.parquet as pq

from rayvit.errors import CorruptImageError


def place(path: str, row: Optional[int], group: Optional[int] = None, index: Optional[int] = None) -> str:
    """``path row R (row group G, index I)``; ``path`` alone when the row is unknown."""
    if row is None:
        return path
    return f"{path} row {row}" + (f" (row group {group}, index {index})" if group is not None else "")


@dataclass(frozen=True)
class RowPlaces:
    """The places of the rows of ``files`` read one after another (row ``i`` of the concatenation)."""

    files: tuple[str, ...]
    starts: tuple[int, ...]                 # first concatenated row of each file
    groups: tuple[tuple[int, ...], ...]     # each file's row-group sizes

    @classmethod
    def of(cls, files: list[str], filesystem: pafs.FileSystem) -> "RowPlaces":
        starts, groups, total = [], [], 0
        for f in files:
            meta = pq.read_metadata(f, filesystem=filesystem)
            starts.append(total)
            groups.append(tuple(meta.row_group(g).num_rows for g in range(meta.num_row_groups)))
            total += meta.num_rows
        return cls(tuple(files), tuple(starts), tuple(groups))

    def describe(self, row: int) -> str:
        k = bisect.bisect_right(self.starts, row) - 1
        in_file = row - self.starts[k]
        group, index = _group_of(self.groups[k], in_file)
        return place(self.files[k], in_file, group, index)


def _group_of(sizes: tuple[int, ...], row: int) -> tuple[int, int]:
    for group, size in enumerate(sizes):
        if row < size:
            return group, row
        row -= size
    return len(sizes) - 1, row


def find_row(filesystem: pafs.FileSystem, path: str, column: str, data: bytes) -> str:
    """The place of the row of ``path`` whose ``column`` holds ``data`` (the first such row), read one row
    group at a time; the path alone when the file cannot be read or holds no such row."""
    try:
        with filesystem.open_input_file(path) as handle:
            reader = pq.ParquetFile(handle)
            row = 0
            for group in range(reader.num_row_groups):
                values = reader.read_row_group(group, columns=[column]).column(0).to_pylist()
                for index, value in enumerate(values):
                    if value == data:
                        return place(path, row + index, group, index)
                row += len(values)
    except (OSError, ValueError):
        pass
    return path


def unplaced_row(data: bytes, label: object, block: Optional[int], offset: int) -> str:
    """``block 3 of the map's input, row 17 (label 0, 1024 bytes, md5 0123456789ab)``: a row no file locates
    (``block``: the Ray Data map task's index, None where unknown; ``offset``: the row within its block)."""
    digest = hashlib.md5(bytes(data)).hexdigest()[:12]
    where = f"block {block} of the map's input, row {offset}" if block is not None else f"row {offset} of a block"
    return f"{where} (label {label}, {len(data)} bytes, md5 {digest})"


def row_namer(batch: dict[str, Any], encoded: list, image_column: str, label_column: str,
              filesystem: pafs.FileSystem) -> Callable[[int], str]:
    """How a Ray Data map task names row ``i`` of its batch (the whole block: map_batches without a batch
    size) when its image fails: its file, row and row group where the batch has a ``path`` column
    (``include_paths``), else its block and offset, label, size and digest; its label either way."""
    paths, labels = batch.get("path"), batch[label_column]
    block = task_index()

    def where(i: int) -> str:
        if paths is not None:
            return f"{find_row(filesystem, str(paths[i]), image_column, encoded[i])}, label {labels[i]}"
        return unplaced_row(encoded[i], labels[i], block, i)

    return where


def task_index() -> Optional[int]:
    """The running Ray Data map task's index among its operator's tasks (Ray's TaskContext, private; read
    in Ray 2.60), None where it cannot be read."""
    try:
        from ray.data._internal.execution.interfaces.task_context import TaskContext

        context = TaskContext.get_current()
        return None if context is None else int(context.task_idx)
    except Exception:  # noqa: BLE001 - a private API: without it the row is named without its block
        return None


def corrupt_cause(error: BaseException) -> Optional[str]:
    """The one-line message of a CorruptImageError inside Ray's wrappers of ``error``, if there is one."""
    seen: set[int] = set()
    todo = [error]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        for line in reversed(str(e).splitlines()):
            if CorruptImageError.__name__ + ": " in line:
                return line.split(CorruptImageError.__name__ + ": ", 1)[1].strip()
        if isinstance(e, CorruptImageError):
            return str(e).strip().splitlines()[-1]
        todo += [getattr(e, "cause", None), e.__cause__, e.__context__]
    return None
