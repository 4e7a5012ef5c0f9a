"""RandAugment (Cubuk et al., 2019) on a uint8 crop: ``data.augment=randaugment``.

``ops`` operations drawn uniformly (with replacement) from the paper's fourteen, each at one shared
``magnitude`` on a 0-30 scale (31 bins, as torchvision's and timm's implementations count it; 9 is the
usual setting of the ViT/DeiT recipes), signed ops negated with probability 1/2. Ranges at magnitude 30:
shear 0.3, translation 150/331 of the side, rotation 30 degrees, enhancement factors 1 +- 0.9, posterize
to 4 bits, solarize at threshold 0. Geometric ops use nearest-neighbour sampling and fill with black.
Runs on the crop (after resize), so its cost does not grow with the source image.
"""

from __future__ import annotations

import random
from typing import Callable

import numpy as np
import torch

MAX_MAGNITUDE = 30


def _affine(img, coefficients):
    from PIL import Image

    return img.transform(img.size, Image.Transform.AFFINE, coefficients, resample=Image.Resampling.NEAREST,
                         fillcolor=(0, 0, 0))


def _enhance(name: str) -> Callable:
    def op(img, level: float):
        from PIL import ImageEnhance

        return getattr(ImageEnhance, name)(img).enhance(1.0 + level * 0.9)
    return op


def _ops() -> dict[str, tuple[Callable, bool]]:
    """name -> (op(img, level in [0, 1], signed), whether the level takes a random sign)."""
    from PIL import Image, ImageOps

    return {
        "identity": (lambda img, level: img, False),
        "shear_x": (lambda img, level: _affine(img, (1, 0.3 * level, 0, 0, 1, 0)), True),
        "shear_y": (lambda img, level: _affine(img, (1, 0, 0, 0.3 * level, 1, 0)), True),
        "translate_x": (lambda img, level: _affine(img, (1, 0, 150 / 331 * img.size[0] * level, 0, 1, 0)), True),
        "translate_y": (lambda img, level: _affine(img, (1, 0, 0, 0, 1, 150 / 331 * img.size[1] * level)), True),
        "rotate": (lambda img, level: img.rotate(30 * level, resample=Image.Resampling.NEAREST,
                                                 fillcolor=(0, 0, 0)), True),
        "brightness": (_enhance("Brightness"), True),
        "color": (_enhance("Color"), True),
        "contrast": (_enhance("Contrast"), True),
        "sharpness": (_enhance("Sharpness"), True),
        "posterize": (lambda img, level: ImageOps.posterize(img, 8 - int(round(level * 4))), False),
        "solarize": (lambda img, level: ImageOps.solarize(img, int(round(255 * (1 - level)))), False),
        "autocontrast": (lambda img, level: ImageOps.autocontrast(img), False),
        "equalize": (lambda img, level: ImageOps.equalize(img), False),
    }


OPS = tuple(sorted(_ops()))


def rand_augment(image: torch.Tensor, ops: int, magnitude: int, rng: random.Random) -> torch.Tensor:
    """uint8 (3, S, S) -> uint8 (3, S, S) after ``ops`` random operations at ``magnitude`` (0-30)."""
    from PIL import Image

    if ops <= 0:
        return image
    table = _ops()
    img = Image.fromarray(np.ascontiguousarray(image.permute(1, 2, 0).numpy()))
    level = magnitude / MAX_MAGNITUDE
    for _ in range(ops):
        op, signed = table[OPS[rng.randrange(len(OPS))]]
        img = op(img, -level if signed and rng.random() < 0.5 else level)
    return torch.from_numpy(np.asarray(img).copy()).permute(2, 0, 1)
