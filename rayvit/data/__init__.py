"""Input data for the training loop: synthetic, scikit-learn digits, or parquet (with or without Ray).

:func:`build_data` is the one entry point. Every batch is ``(images, labels)``: float32
``(B, 3, S, S)`` normalised images and int64 ``(B,)`` labels, already on the requested device. Parquet
images are decoded and cropped as ImageNet training does (:mod:`rayvit.data.images`). Ray is imported
only by the functions that use it (``rayvit.data.parquet.ray_datasets`` and Ray shards); torch only by
the modules that need it (:mod:`rayvit.data.schema` checks a Ray Dataset's columns without it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rayvit.data.build import Data, build_data
    from rayvit.data.parquet import decode_dataset, ray_datasets, with_absolute_paths

__all__ = ["Data", "build_data", "decode_dataset", "ray_datasets", "with_absolute_paths"]

# Loaded when first used, so that the torch-free parts of this package (rayvit.data.schema, .photos)
# import without torch.
_WHERE = {"Data": "build", "build_data": "build", "decode_dataset": "parquet", "ray_datasets": "parquet",
          "with_absolute_paths": "parquet"}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(f"rayvit.data.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'rayvit.data' has no attribute {name!r}")
