"""ImageNet-like JPEGs made offline from the colour photographs scikit-image ships: a realistic test set.

    rayvit make-photos DST [--per-class 40] [--seed 0]     (rayvit.datasets.make_photos in Python)
    rayvit to-parquet DST DST.parquet

Each class is one source photograph (an astronaut, a cat, coffee, a rocket, a galaxy field, a stained
tissue slide, a retina, a motorcycle); each image a different random crop of it (30-100% of the area,
aspect 0.6-1.7), rescaled so its longer side is ImageNet's usual 500 px (60%) or 300-800 px, mirrored
half the time, its brightness and saturation varied by up to 15%, saved as a baseline 4:2:0 JPEG at
quality 75-95: natural photographs of the sizes and encodings ImageNet holds, not noise, and learnable
(the classes differ in content and colour). Needs scikit-image (``pip install scikit-image``, in
rayvit's ``test`` extra); nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

# scikit-image's colour photographs that ship inside the package (others need a download).
SOURCES = ("astronaut", "chelsea", "coffee", "rocket", "hubble_deep_field", "immunohistochemistry", "retina",
           "stereo_motorcycle")


def source_photographs() -> dict[str, np.ndarray]:
    """name -> RGB uint8 (H, W, 3) of every :data:`SOURCES` photograph."""
    try:
        import skimage.data
    except ImportError as e:
        raise ImportError("the sample photographs need scikit-image: pip install scikit-image") from e
    out = {}
    for name in SOURCES:
        image = getattr(skimage.data, name)()
        out[name] = image[0] if isinstance(image, tuple) else image    # stereo_motorcycle: (left, right, disparity)
    return out


def _long_side(rng: np.random.Generator) -> int:
    return 500 if rng.random() < 0.6 else int(rng.integers(300, 801))


def _variant(photo, rng: np.random.Generator):
    """One random crop of ``photo`` (a PIL image), rescaled, mirrored and jittered as the module says."""
    from PIL import Image, ImageEnhance

    width, height = photo.size
    for _ in range(20):
        area = width * height * rng.uniform(0.3, 1.0)
        aspect = float(np.exp(rng.uniform(np.log(0.6), np.log(1.7))))
        w, h = int(round((area * aspect) ** 0.5)), int(round((area / aspect) ** 0.5))
        if w <= width and h <= height:
            break
    else:
        w, h = width, height
    x, y = int(rng.integers(0, width - w + 1)), int(rng.integers(0, height - h + 1))
    crop = photo.crop((x, y, x + w, y + h))
    scale = _long_side(rng) / max(w, h)
    crop = crop.resize((max(1, round(w * scale)), max(1, round(h * scale))), Image.Resampling.LANCZOS)
    if rng.random() < 0.5:
        crop = crop.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    crop = ImageEnhance.Brightness(crop).enhance(float(rng.uniform(0.85, 1.15)))
    return ImageEnhance.Color(crop).enhance(float(rng.uniform(0.85, 1.15)))


def make_photos(folder: str | Path, per_class: int = 40, seed: int = 0) -> Path:
    """Write ``folder/<source>/<nnnn>.jpg``: ``per_class`` distinct JPEGs of each source photograph."""
    from PIL import Image

    if per_class < 1:
        raise ValueError(f"--per-class must be at least 1, got {per_class}")
    root = Path(folder)
    rng = np.random.default_rng(seed)
    for name, pixels in source_photographs().items():
        class_folder = root / name
        class_folder.mkdir(parents=True, exist_ok=True)
        photo = Image.fromarray(pixels).convert("RGB")
        for i in range(per_class):
            _variant(photo, rng).save(class_folder / f"{i:04d}.jpg", "JPEG", quality=int(rng.integers(75, 96)),
                                      subsampling="4:2:0")
    return root
