"""Datasets on disk for rayvit to train on: the public functions behind ``rayvit to-parquet`` and
``rayvit make-photos``.

    from rayvit.datasets import make_photos, to_parquet

    make_photos("photos", per_class=40)          # photos/<class>/<nnnn>.jpg: 8 classes of sample photographs
    to_parquet("photos", "photos.parquet")       # photos.parquet/part-NNNNN.parquet: image bytes and labels

``to_parquet(src, dst, rows_per_shard=10_000, seed=0)``
    Convert an image-folder tree (``src/<class name>/<image files>``, any of .png .jpg .jpeg .bmp .gif .webp
    .tif .tiff) into ``dst/part-NNNNN.parquet`` shards with an ``image`` column (the files' bytes, not
    re-encoded) and a ``label`` column (int64: the position of the class's folder among the sorted folder
    names); the class names go into the schema's metadata. Rows are shuffled with ``seed`` so every shard
    mixes classes. Returns the shards' paths. ``data.name=parquet data.path=dst`` trains on them.
    Raises ``FileNotFoundError`` when ``src`` holds no class folders or images, ``ValueError`` for
    ``rows_per_shard`` < 1.

``make_photos(folder, per_class=40, seed=0)``
    Write ``per_class`` ImageNet-like JPEGs of each of 8 classes into ``folder/<class>/<nnnn>.jpg``: random
    crops (rescaled to ImageNet's usual sizes, mirrored, brightness and colour varied) of the colour
    photographs scikit-image ships, so nothing is downloaded; learnable, since the classes differ in content
    and colour. Returns ``folder``. Needs scikit-image (``pip install scikit-image``; rayvit's ``test``
    extra): ``ImportError`` without it, ``ValueError`` for ``per_class`` < 1.
"""

from __future__ import annotations

from rayvit.data.photos import make_photos
from rayvit.data.to_parquet import to_parquet

__all__ = ["make_photos", "to_parquet"]
