"""Encoded images -> uint8 training and validation crops: ImageNet's transforms, decoded as cheaply as the
crop allows.

Training: a random resized crop (``data.crop_scale`` of the image's area, ``data.crop_ratio`` aspect:
torchvision's ``RandomResizedCrop`` and timm's defaults, (0.08, 1) and (3/4, 4/3)), resized to
``model.image_size``, flipped left-right with probability ``data.hflip``, then ``data.augment``.
Validation: the central crop that resizing the shorter side to ``image_size / data.crop_pct`` and
cropping ``image_size`` square would keep (torchvision's Resize(256) + CenterCrop(224) at crop_pct 0.875).

How: the crop box is drawn from the header's size alone; a JPEG is decoded at the largest power-of-two
DCT scale (1/2, 1/4, 1/8) that still leaves the crop at least ``image_size`` pixels a side, and with
``data.cpu_decoder=turbojpeg`` only the crop's region of it (:mod:`rayvit.data.turbo`); the crop is then
resized (bilinear, antialiased) on uint8 by torch's vectorised kernel. Everything stays uint8 (3, S, S)
until the device normalises it. The decoder (``data.cpu_decoder``: turbojpeg, simplejpeg, PIL) and the
method were chosen by measurement: docs/data.md.

Any image PIL opens is accepted (PNG, greyscale, CMYK, palette: converted to RGB); one no decoder can
read raises :class:`CorruptImageError` naming where it is and the decoder's reason.
"""

from __future__ import annotations

from rayvit.errors import CorruptImageError
import io
import math
import random
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

# (left, top, width, height) in the original image's pixels.
Box = tuple[int, int, int, int]
JPEG_MAGIC = b"\xff\xd8"
# libjpeg-turbo's power-of-two DCT scalings; its other eighths decode slower than a full decode
# (measured, docs/data.md).
DCT_DIVISORS = (8, 4, 2, 1)


@dataclass(frozen=True)
class ImageTransform:
    """What one image becomes: a training crop (random, flipped, augmented) or a validation crop."""

    size: int
    train: bool
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    hflip: float = 0.5
    crop_pct: float = 0.875
    augment: str = "none"
    augment_ops: int = 2
    augment_magnitude: int = 9
    decoder: str = "turbojpeg"

    @classmethod
    def of(cls, cfg, train: bool) -> "ImageTransform":
        d = cfg.data
        return cls(size=cfg.model.image_size, train=train, scale=tuple(d.crop_scale), ratio=tuple(d.crop_ratio),
                   hflip=d.hflip, crop_pct=d.crop_pct, augment=d.augment, augment_ops=d.randaugment_ops,
                   augment_magnitude=d.randaugment_magnitude, decoder=d.cpu_decoder)

    def box(self, width: int, height: int, rng: random.Random) -> Box:
        if self.train:
            return random_resized_box(width, height, self.scale, self.ratio, rng)
        return center_box(width, height, self.size, self.crop_pct)


# --------------------------------------------------------------------------------------------------
# Crop boxes


def random_resized_box(width: int, height: int, scale: Sequence[float], ratio: Sequence[float],
                       rng: random.Random) -> Box:
    """A box of ``scale`` x the area and aspect in ``ratio`` (log-uniform), placed uniformly.

    The published RandomResizedCrop procedure: ten draws; if none fits the image, the whole image cut
    to the nearest allowed aspect, centred.
    """
    area = width * height
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    for _ in range(10):
        target = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(log_lo, log_hi))
        w = int(round(math.sqrt(target * aspect)))
        h = int(round(math.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            return rng.randint(0, width - w), rng.randint(0, height - h), w, h
    aspect = width / height
    if aspect < ratio[0]:
        w, h = width, int(round(width / ratio[0]))
    elif aspect > ratio[1]:
        w, h = int(round(height * ratio[1])), height
    else:
        w, h = width, height
    return (width - w) // 2, (height - h) // 2, max(w, 1), max(h, 1)


def center_box(width: int, height: int, size: int, crop_pct: float) -> Box:
    """The central square that resizing the shorter side to ``floor(size / crop_pct)`` and then cropping
    ``size`` keeps, in original pixels (crop_pct 1.0: the largest central square)."""
    short = min(width, height)
    side = max(1, min(short, int(round(short * size / math.floor(size / crop_pct)))))
    return (width - side) // 2, (height - side) // 2, side, side


def dct_divisor(box: Box, size: int) -> int:
    """The largest of 8, 4, 2, 1 that still leaves the crop at least ``size`` pixels a side."""
    return next(d for d in DCT_DIVISORS if d == 1 or min(box[2], box[3]) >= size * d)


# --------------------------------------------------------------------------------------------------
# Decoding


def image_size(data: bytes, decoder: str = "simplejpeg") -> tuple[int, int]:
    """(width, height) from the header alone."""
    if decoder == "turbojpeg" and data[:2] == JPEG_MAGIC:
        from rayvit.data import turbo

        try:
            return turbo.header(data)[:2]
        except ValueError:
            pass                                   # PIL says what is wrong, or reads what TurboJPEG cannot
    if decoder in ("simplejpeg", "turbojpeg") and data[:2] == JPEG_MAGIC:
        try:
            import simplejpeg

            height, width, colorspace, _ = simplejpeg.decode_jpeg_header(data)
            return width, height
        except (ImportError, ValueError):
            pass                                   # PIL says what is wrong, or reads what simplejpeg cannot
    from PIL import Image

    with Image.open(io.BytesIO(data)) as img:
        return img.size


def decode_scaled(data: bytes, divisor: int, decoder: str = "simplejpeg") -> np.ndarray:
    """RGB uint8 (H, W, 3) at 1/``divisor`` of the full size (JPEG: DCT-scaled; other formats: full size
    and the caller scales the box by the size it got)."""
    if decoder == "simplejpeg" and data[:2] == JPEG_MAGIC:
        try:
            return _simplejpeg(data, divisor)
        except (ImportError, ValueError):
            pass      # CMYK/YCCK, or a file libjpeg warns about: PIL decides (it reads what is readable)
    return _pil(data, divisor)


def _simplejpeg(data: bytes, divisor: int) -> np.ndarray:
    import simplejpeg

    height, width, colorspace, _ = simplejpeg.decode_jpeg_header(data)
    if colorspace.upper() in ("CMYK", "YCCK"):
        raise ValueError("CMYK JPEG")
    # simplejpeg picks the smallest libjpeg-turbo scaling that keeps at least these sizes.
    return simplejpeg.decode_jpeg(data, colorspace="RGB", min_width=-(-width // divisor),
                                  min_height=-(-height // divisor), min_factor=divisor)


def _pil(data: bytes, divisor: int) -> np.ndarray:
    from PIL import Image

    with Image.open(io.BytesIO(data)) as img:
        if divisor > 1 and img.format == "JPEG":
            img.draft("RGB", (-(-img.size[0] // divisor), -(-img.size[1] // divisor)))
        if img.mode in ("RGBA", "LA") or (img.mode == "P" and "transparency" in img.info):
            # Transparent pixels over white, as a viewer shows them (their colour values are arbitrary).
            rgba = img.convert("RGBA")
            img = Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba)
        return np.array(img.convert("RGB"))     # a writable copy (torch refuses read-only buffers)


def scaled_box(box: Box, sx: float, sy: float, width: int, height: int) -> Box:
    """``box`` on an image scaled by (sx, sy) to ``width`` x ``height``: the nearest whole-pixel box there (a
    crop moved by under half a scaled pixel, which is still a crop of the same distribution)."""
    x, y = min(round(box[0] * sx), width - 1), min(round(box[1] * sy), height - 1)
    return x, y, max(1, min(width - x, round(box[2] * sx))), max(1, min(height - y, round(box[3] * sy)))


def resize_box(pixels: np.ndarray, box: Box, size: int) -> torch.Tensor:
    """uint8 (1, 3, size, size), channels-last: the box of ``pixels`` resized (bilinear, antialiased)."""
    x, y, w, h = box
    crop = torch.from_numpy(pixels).permute(2, 0, 1)[None, :, y:y + h, x:x + w]
    # torch's uint8 antialiased kernel is vectorised for channels-last input (docs/data.md).
    crop = crop.contiguous(memory_format=torch.channels_last)
    if (h, w) == (size, size):
        return crop
    return F.interpolate(crop, size=(size, size), mode="bilinear", antialias=True, align_corners=False)


def decode_box(data: bytes, box: Box, width: int, height: int, size: int, decoder: str) -> tuple[np.ndarray, Box]:
    """Pixels that hold ``box`` of the ``width`` x ``height`` image, decoded at the largest DCT scale that
    leaves it ``size`` pixels a side, and the box in those pixels: the box's region alone
    (``turbojpeg``), else the whole image."""
    divisor = dct_divisor(box, size)
    if decoder == "turbojpeg" and data[:2] == JPEG_MAGIC:
        from rayvit.data import turbo

        scaled_w, scaled_h = -(-width // divisor), -(-height // divisor)
        region = box if divisor == 1 else scaled_box(box, scaled_w / width, scaled_h / height, scaled_w, scaled_h)
        try:
            pixels = turbo.decode_region(data if isinstance(data, bytes) else bytes(data), region, divisor)
            return pixels, (0, 0, pixels.shape[1], pixels.shape[0])
        except ValueError:
            decoder = "pil"        # CMYK/YCCK, or a file libjpeg warns about: PIL decides (it reads what is readable)
    pixels = decode_scaled(data, divisor, decoder)
    got_h, got_w = pixels.shape[:2]
    if (got_w, got_h) != (width, height):
        box = scaled_box(box, got_w / width, got_h / height, got_w, got_h)
    return pixels, box


def transform_image(data: bytes, spec: ImageTransform, rng: random.Random) -> torch.Tensor:
    """One encoded image -> uint8 (3, S, S) (channels-last view) under ``spec``."""
    width, height = image_size(data, spec.decoder)
    box = spec.box(width, height, rng)
    pixels, box = decode_box(data, box, width, height, spec.size, spec.decoder)
    out = resize_box(pixels, box, spec.size)[0]
    if spec.train and spec.hflip > 0 and rng.random() < spec.hflip:
        out = out.flip(-1)
    if spec.train and spec.augment == "randaugment":
        from rayvit.data.randaugment import rand_augment

        out = rand_augment(out, spec.augment_ops, spec.augment_magnitude, rng)
    return out


# Exceptions by which decoders say an image is unreadable (PIL: OSError, UnidentifiedImageError,
# SyntaxError from some plugins, DecompressionBombError (a ValueError... in recent Pillow an Exception)).
UNREADABLE = (OSError, ValueError, SyntaxError, EOFError)


def decoder_reason(error: BaseException) -> str:
    """The decoder's own message, on one line (PIL's "cannot identify" names a buffer's address: dropped)."""
    text = " ".join(str(error).split())
    if text.startswith("cannot identify image file"):
        text = "cannot identify image file (not a format PIL reads)"
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def transform_into(out: torch.Tensor, encoded: Sequence[bytes], spec: ImageTransform,
                   rngs: Sequence[random.Random], where: Callable[[int], str],
                   map_fn: Callable = map) -> list[Optional[str]]:
    """Decode ``encoded[i]`` into ``out[i]`` (uint8 (N, 3, S, S)); returns, per image, None or the one-line
    reason it could not be read (``where(i)`` names it). ``map_fn``: e.g. a thread pool's map (decoders
    release the GIL)."""
    from PIL import Image

    def one(i: int) -> Optional[str]:
        try:
            out[i].copy_(transform_image(encoded[i], spec, rngs[i]))
            return None
        except (*UNREADABLE, Image.DecompressionBombError) as e:
            return f"cannot decode the image in {where(i)}: {decoder_reason(e)}"

    return list(map_fn(one, range(len(encoded))))


def transform_batch(encoded: Sequence[bytes], spec: ImageTransform, rngs: Sequence[random.Random],
                    where: Callable[[int], str], map_fn: Callable = map) -> tuple[np.ndarray, list[Optional[str]]]:
    """``transform_into`` a new uint8 (N, 3, S, S) array: (images, per-image error or None)."""
    out = torch.empty((len(encoded), 3, spec.size, spec.size), dtype=torch.uint8)
    errors = transform_into(out, encoded, spec, rngs, where, map_fn)
    return out.numpy(), errors
