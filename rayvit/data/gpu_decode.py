"""``data.decode=gpu``: JPEGs decoded on the worker's GPU (nvJPEG through ``torchvision.io.decode_jpeg``).

The CPU work per image shrinks to reading its header and drawing its crop: Ray Data's tasks
(:func:`plan_batch`) pass the encoded bytes on with a crop box and a flip; the worker
(:func:`decode_planned`) decodes the whole batch in one call (torchvision's batched nvJPEG path: a list of
CPU byte tensors in, a list of CUDA images out), crops, resizes (bilinear, antialiased, in float) and
flips on the device. A non-JPEG or CMYK row (nvJPEG reads neither) is re-encoded as a quality-95 JPEG by
the CPU task, once. Training crops only: validation rows are decoded on the CPU as usual.

torchvision is imported here only, on the worker, and only under ``data.decode=gpu``: PyPI's torchvision
does not import beside a CPU-only torch (the CPU path never needs it). ``rayvit gpu-check`` compares this
path with the CPU decoder on the same crops.
"""

from __future__ import annotations

import io
import random
from typing import Any

import numpy as np
import pyarrow.fs as pafs
import torch
import torch.nn.functional as F

from rayvit.errors import ConfigError
from rayvit.data.images import JPEG_MAGIC, UNREADABLE, ImageTransform, decoder_reason, image_size


def _as_plain_jpeg(data: bytes) -> bytes:
    """``data`` if nvJPEG reads it (a YCbCr or greyscale JPEG), else the image re-encoded as one."""
    if data[:2] == JPEG_MAGIC:
        try:
            import simplejpeg

            if simplejpeg.decode_jpeg_header(data)[2].upper() not in ("CMYK", "YCCK"):
                return data
        except ValueError:
            pass
    from rayvit.data.images import decode_scaled

    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(decode_scaled(data, 1, "pil")).save(out, "JPEG", quality=95)
    return out.getvalue()


def plan_batch(batch: dict[str, np.ndarray], image_column: str, label_column: str,
               spec: ImageTransform) -> dict[str, np.ndarray]:
    """Ray Data map_batches body: each row's JPEG bytes, crop box (x, y, w, h) and flip, from its header.

    An unreadable row fails here when its header does; one whose data is cut off after a readable
    header fails on the GPU (:func:`decode_planned` names it by its file).
    """
    from rayvit.data.rows import row_namer, task_index

    block = task_index()
    rng = random.Random()
    datas, boxes, flips = [], [], []
    paths = batch.get("path")
    encoded = list(batch[image_column])
    where = row_namer(batch, encoded, image_column, label_column, pafs.LocalFileSystem())
    for i, data in enumerate(encoded):
        try:
            data = _as_plain_jpeg(bytes(data))
            width, height = image_size(data)
        except UNREADABLE as e:
            from rayvit.data.images import CorruptImageError

            raise CorruptImageError(f"cannot decode the image in {where(i)}: {decoder_reason(e)}") from None
        datas.append(data)
        boxes.append(spec.box(width, height, rng))
        flips.append(spec.hflip > 0 and rng.random() < spec.hflip)
    # Each row's block and offset, to name it should nvJPEG fail on data cut off after a readable header.
    out = {"jpeg": np.array(datas, dtype=object), "box": np.asarray(boxes, dtype=np.int32).reshape(-1, 4),
           "flip": np.asarray(flips, dtype=bool), label_column: np.asarray(batch[label_column], dtype=np.int64),
           "block": np.full(len(datas), -1 if block is None else block, dtype=np.int64),
           "offset": np.arange(len(datas), dtype=np.int64)}
    if paths is not None:
        out["path"] = np.asarray(paths, dtype=object)
    return out


def _planned_row(batch: dict[str, Any], i: int, label_column: str) -> str:
    """Row ``i`` of a planned batch named as the CPU path names it: its file, else its block and offset in
    the map's input, with its label (and size and digest)."""
    from rayvit.data.rows import unplaced_row

    label = int(torch.as_tensor(batch[label_column][i]))
    if "path" in batch:
        return f"{batch['path'][i]} ({len(batch['jpeg'][i])} bytes), label {label}"
    block = int(batch["block"][i]) if "block" in batch else -1
    offset = int(batch["offset"][i]) if "offset" in batch else i
    return unplaced_row(batch["jpeg"][i], label, None if block < 0 else block, offset)


def _decoder():
    try:
        from torchvision.io import ImageReadMode, decode_jpeg
    except ImportError as e:
        raise ConfigError("data.decode=gpu needs torchvision (its torchvision.io.decode_jpeg, nvJPEG) on every GPU "
                          f"worker, built for the worker's torch ({e}); or use data.decode=cpu") from e
    return decode_jpeg, ImageReadMode.RGB


def decode_planned(batch: dict[str, Any], size: int, device: torch.device, image_column: str = "image",
                   label_column: str = "label") -> dict[str, Any]:
    """A planned batch -> ``{image_column: uint8 (N, 3, size, size) on device, label_column: labels}``."""
    decode_jpeg, rgb = _decoder()
    datas = [torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in batch["jpeg"]]
    try:
        images = decode_jpeg(datas, mode=rgb, device=device)
    except RuntimeError:
        images = []
        for i, d in enumerate(datas):      # one at a time, to name the image that failed
            try:
                images.append(decode_jpeg(d, mode=rgb, device=device))
            except RuntimeError as e:
                from rayvit.data.images import CorruptImageError

                raise CorruptImageError(f"cannot decode the image in {_planned_row(batch, i, label_column)} on the "
                                        f"GPU: {decoder_reason(e)}") from None
    boxes = torch.as_tensor(batch["box"]).tolist()
    flips = torch.as_tensor(batch["flip"]).tolist()
    out = torch.empty((len(images), 3, size, size), dtype=torch.uint8, device=device)
    for i, (image, (x, y, w, h), flip) in enumerate(zip(images, boxes, flips)):
        crop = image[None, :, y:y + h, x:x + w].float()
        resized = F.interpolate(crop, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
        resized = resized.round_().clamp_(0, 255).to(torch.uint8)[0]
        out[i] = resized.flip(-1) if flip else resized
    return {image_column: out, label_column: torch.as_tensor(batch[label_column])}
