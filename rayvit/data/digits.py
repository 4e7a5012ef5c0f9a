"""scikit-learn's bundled 8x8 handwritten digits: real, labelled, learnable data with no download."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from rayvit.data.batching import Transform, seeded_split

DIGITS_LEVELS = 16  # load_digits() pixels are integers 0..16


def load_digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """All 1797 digits: images uint8 (N, 8, 8) in 0..16 and labels int64 (N,).

    Read from the file scikit-learn ships them in (what ``sklearn.datasets.load_digits`` reads: one row per
    image, 64 pixels then the label), without importing scikit-learn, whose import (SciPy's included) would
    otherwise be part of every training worker's start (benchmarks/results/2026-12-05-xeon-avx512-suite-time.md)."""
    import importlib.util

    spec = importlib.util.find_spec("sklearn")
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError("the digits dataset ships with scikit-learn: pip install scikit-learn")
    rows = np.loadtxt(Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz", delimiter=",")
    return rows[:, :-1].reshape(-1, 8, 8).astype(np.uint8), rows[:, -1].astype(np.int64)


def digits_tensors(val_fraction: float, seed: int, device: torch.device):
    """Normalised 8x8 train/val tensors (N, 1, 8, 8) on ``device``, their labels, and the upsampler.

    Mean and std come from the train split. The images stay 8x8 on the device: bilinear upsampling is
    affine, so normalising before it equals normalising after, and a pre-upsampled 224 px copy would
    take about 1 GB.
    """
    images, labels = load_digits_arrays()
    x = torch.from_numpy(images).float().div_(DIGITS_LEVELS).unsqueeze(1)
    y = torch.from_numpy(labels)
    train_idx, val_idx = seeded_split(len(y), val_fraction, seed)
    mean, std = x[train_idx].mean(), x[train_idx].std()
    x = ((x - mean) / std).to(device)
    y = y.to(device)
    train_idx, val_idx = train_idx.to(device), val_idx.to(device)
    return (x[train_idx], y[train_idx]), (x[val_idx], y[val_idx])


def upsampler(image_size: int) -> Transform:
    """(B, 1, 8, 8) -> (B, 3, S, S): bilinear upsampling, grey replicated to three channels."""

    def transform(images: torch.Tensor) -> torch.Tensor:
        if images.shape[-1] != image_size:
            images = F.interpolate(images, size=(image_size, image_size), mode="bilinear",
                                   align_corners=False)
        return images.expand(-1, 3, -1, -1).contiguous()

    return transform


def export_image_folder(dst: str | os.PathLike, limit: Optional[int] = None) -> Path:
    """Write the digits as 8x8 greyscale PNGs in ``dst/<label>/<index>.png`` (one folder per class).

    Pixels 0..16 are scaled to 0..255 (exactly invertible by rounding). ``limit`` keeps the first N
    digits. Returns ``dst``. This is the image-folder layout ``rayvit to-parquet`` reads.
    """
    from PIL import Image

    images, labels = load_digits_arrays()
    if limit is not None:
        images, labels = images[:limit], labels[:limit]
    dst = Path(dst)
    pixels = np.rint(images.astype(np.float32) * (255.0 / DIGITS_LEVELS)).astype(np.uint8)
    for label in np.unique(labels):
        (dst / str(label)).mkdir(parents=True, exist_ok=True)
    for i, (img, label) in enumerate(zip(pixels, labels)):
        Image.fromarray(img).save(dst / str(label) / f"{i:05d}.png")
    return dst
