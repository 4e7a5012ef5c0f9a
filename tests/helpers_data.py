"""The digits and the sample photographs as images and parquet (through the to_parquet CLI), small configs
to load them with, and ways to tell their samples apart."""

from __future__ import annotations

from pathlib import Path

import torch

from rayvit.config import load_config
from rayvit.data import Data
from rayvit.data.digits import export_image_folder

CPU = torch.device("cpu")

# The whole image as it is, no random crop, flip or border cut: for tests that tell samples apart by their
# pixels (parquet data is otherwise cropped as ImageNet training does: rayvit.data.images).
WHOLE_IMAGES = ("data.crop_scale=[1, 1]", "data.crop_ratio=[1, 1]", "data.hflip=0", "data.crop_pct=1")


def config(*overrides: str):
    return load_config(overrides=["train.batch_size=16", "model.image_size=16", *overrides])


def sample_key(image: torch.Tensor) -> bytes:
    """Identify a digit by its pixels (every load_digits image is distinct)."""
    return image[0].cpu().numpy().tobytes()


def take(data: Data, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [next(data.train) for _ in range(steps)]


def export_digits_parquet(root: Path) -> Path:
    """All 1797 digits exported as PNGs under ``root`` and converted with the to_parquet CLI (4 shards)."""
    import contextlib
    import io

    from rayvit.cli import to_parquet

    export_image_folder(root / "folder")
    # The CLI's own entry point, in this process (a subprocess would spend seconds importing).
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = to_parquet([str(root / "folder"), str(root / "parquet"), "--rows-per-shard", "500"])
    assert code == 0, printed.getvalue()
    assert "wrote 1797 images of 10 classes to 4 shard(s)" in printed.getvalue()
    return root / "parquet"


def export_photos_parquet(root: Path, per_class: int = 8, bad: bool = False, rows_per_shard: int = 100) -> Path:
    """The sample photographs (rayvit.data.photos, 8 classes) as parquet through the to_parquet CLI; with
    ``bad``, the odd images a real dataset holds added to the first class (:func:`write_odd_images`)."""
    import contextlib
    import io

    from rayvit.data.photos import make_photos
    from rayvit.cli import to_parquet

    folder = make_photos(root / "photos", per_class=per_class)
    if bad:
        write_odd_images(folder / "astronaut")
    with contextlib.redirect_stdout(io.StringIO()):
        assert to_parquet([str(folder), str(root / "parquet"), "--rows-per-shard", str(rows_per_shard)]) == 0
    return root / "parquet"


ODD_IMAGES = ("grey.jpg", "cmyk.jpg", "rgba.png", "tiny.jpg", "truncated.jpg")


def write_odd_images(folder: Path) -> None:
    """A greyscale and a CMYK JPEG, an RGBA PNG among the JPEGs, a 20x15 JPEG (smaller than any crop) and a
    JPEG cut off after its first kilobyte (corrupt), each from a photograph."""
    from PIL import Image

    from rayvit.data.photos import source_photographs

    photo = Image.fromarray(source_photographs()["chelsea"]).resize((300, 200))
    photo.convert("L").save(folder / "grey.jpg", quality=90)
    photo.convert("CMYK").save(folder / "cmyk.jpg", quality=90)
    rgba = photo.convert("RGBA")
    rgba.putalpha(128)
    rgba.save(folder / "rgba.png")
    photo.resize((20, 15)).save(folder / "tiny.jpg", quality=90)
    whole = folder / "whole.jpg"
    photo.save(whole, quality=95)
    (folder / "truncated.jpg").write_bytes(whole.read_bytes()[:1024])
    whole.unlink()
