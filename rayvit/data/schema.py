"""Whether a Ray Dataset holds what rayvit trains on, checked on the driver before any worker starts.

Torch-free and Ray-free (a dataset is read through its ``schema()``). A dataset may hold, in the columns
``data.image_column`` and ``data.label_column``:

- ``encoded``: image files' bytes (binary), as ``rayvit to-parquet`` writes them; rayvit decodes and crops
  them (``rayvit.data.decode_dataset``);
- ``decoded``: uint8 images of shape (3, S, S) with S = ``model.image_size`` (Ray's tensor columns), as
  ``rayvit.data.ray_datasets`` makes them;

and integer class labels. Anything else is a :class:`~rayvit.config.ConfigError` naming the columns found.
"""

from __future__ import annotations

from typing import Any, Literal, Sequence

from rayvit.config_schema import Config
from rayvit.errors import ConfigError

Kind = Literal["encoded", "decoded"]


def _type_text(t: Any) -> str:
    return str(t).replace("\n", " ")


def _columns_text(names: Sequence[str], types: Sequence[Any]) -> str:
    return ", ".join(f"{n} ({_type_text(t)})" for n, t in zip(names, types))


def check_columns(names: Sequence[str], types: Sequence[Any], cfg: Config, where: str = "the dataset") -> Kind:
    """``encoded`` or ``decoded``: what the image column of a dataset with these column names and types
    holds; ConfigError (naming the columns found and the keys to set) when it is neither, or the labels
    are missing or not integers. ``types``: pyarrow types (Ray's ``Schema.types``)."""
    d, size = cfg.data, cfg.model.image_size
    found = _columns_text(names, types)
    missing = [c for c in (d.image_column, d.label_column) if c not in names]
    if missing:
        raise ConfigError(f"{where} has no column {missing[0]!r} (columns: {found}); rayvit reads images from "
                          f"data.image_column={d.image_column!r} and labels from data.label_column={d.label_column!r}: "
                          "set them to your columns' names")
    image, label = (types[list(names).index(c)] for c in (d.image_column, d.label_column))
    if not _is_integer(label):
        raise ConfigError(f"{where}'s labels {d.label_column!r} are {_type_text(label)}, not integers 0..C-1 "
                          f"(columns: {found})")
    if _is_binary(image):
        return "encoded"
    shape, dtype = _tensor_shape(image)
    if shape is not None and tuple(shape) == (3, size, size) and dtype == "uint8":
        return "decoded"
    raise ConfigError(
        f"{where}'s image column {d.image_column!r} is {_type_text(image)} (columns: {found}): rayvit takes "
        f"encoded image files (binary) or decoded uint8 images of shape (3, {size}, {size}) "
        f"(model.image_size={size})")


def check_dataset(dataset: Any, cfg: Config, name: str = "train") -> Kind:
    """:func:`check_columns` of a Ray Dataset's schema (``dataset.schema()``: for a dataset with map steps
    that runs its first block)."""
    schema = dataset.schema()
    if schema is None:
        raise ConfigError(f"datasets[{name!r}] is empty: it has no rows, so no columns to train on")
    return check_columns(list(schema.names), list(schema.types), cfg, f"datasets[{name!r}]")


def _is_binary(t: Any) -> bool:
    import pyarrow as pa

    return isinstance(t, pa.DataType) and (pa.types.is_binary(t) or pa.types.is_large_binary(t))


def _is_integer(t: Any) -> bool:
    import numpy as np
    import pyarrow as pa

    if isinstance(t, pa.DataType):
        return pa.types.is_integer(t)
    try:
        return np.issubdtype(np.dtype(t), np.integer)
    except TypeError:
        return False


def _tensor_shape(t: Any) -> tuple[Any, str]:
    """(shape, element dtype name) of a Ray tensor column type (ArrowTensorType, its V2, or a variable-shape
    one: shape None), else (None, "")."""
    shape = getattr(t, "shape", None)
    element = getattr(t, "scalar_type", None) or getattr(t, "value_type", None)
    return (tuple(shape) if shape is not None else None), str(element) if element is not None else ""
