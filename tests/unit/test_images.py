"""ImageNet's transforms on real photographs, the odd images real datasets hold, and the path without Ray."""

from __future__ import annotations

import io
import random
import threading

import numpy as np
import pytest
import torch

from rayvit.errors import ConfigError
from rayvit.data import build_data
from rayvit.data.images import (CorruptImageError, ImageTransform, center_box, dct_divisor, random_resized_box,
                                transform_image)

from helpers_data import CPU, ODD_IMAGES, config, export_photos_parquet


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    """8 classes x 8 ImageNet-sized JPEGs from scikit-image's photographs, as parquet (3 shards)."""
    return export_photos_parquet(tmp_path_factory.mktemp("photos"), per_class=8, rows_per_shard=25)


@pytest.fixture(scope="module")
def odd(tmp_path_factory):
    """The same photographs plus a greyscale, a CMYK, a PNG, a tiny and a truncated image (one shard)."""
    return export_photos_parquet(tmp_path_factory.mktemp("odd"), per_class=4, bad=True, rows_per_shard=1000)


def _jpeg(width: int, height: int, quality: int = 92) -> bytes:
    from PIL import Image

    from rayvit.data.photos import source_photographs

    out = io.BytesIO()
    Image.fromarray(source_photographs()["coffee"]).resize((width, height)).save(out, "JPEG", quality=quality)
    return out.getvalue()


def test_random_resized_crop_boxes_follow_torchvisions_defaults():
    rng = random.Random(0)
    boxes = [random_resized_box(500, 375, (0.08, 1.0), (3 / 4, 4 / 3), rng) for _ in range(2000)]
    for x, y, w, h in boxes:
        assert 0 <= x and x + w <= 500 and 0 <= y and y + h <= 375
    areas = [w * h / (500 * 375) for _, _, w, h in boxes]
    aspects = [w / h for _, _, w, h in boxes]
    assert 0.07 < min(areas) < 0.12 and max(areas) > 0.95
    assert min(aspects) > 0.74 and max(aspects) < 1.35
    assert sum(a > 1 for a in aspects) > 600 and sum(a < 1 for a in aspects) > 600       # log-uniform aspect
    assert random_resized_box(500, 375, (1, 1), (1, 1), random.Random(1)) == (62, 0, 375, 375)   # the fallback
    # Validation: the shorter side to floor(224 / 0.875) = 256, then 224: a 328-px central square of 375.
    assert center_box(500, 375, 224, 0.875) == (86, 23, 328, 328)
    assert center_box(500, 375, 224, 1.0) == (62, 0, 375, 375)
    assert [dct_divisor((0, 0, w, w), 224) for w in (200, 447, 448, 900, 1800)] == [1, 1, 2, 4, 8]


def test_crops_decode_at_a_dct_scale_when_large_and_match_a_full_decode():
    """A 1600x1200 JPEG's validation crop (1050 px) decodes at 1/4 scale; the result is what a full decode
    and PIL's resize of the same box give, up to the DCT scaling's own filtering."""
    from PIL import Image

    from rayvit.data.images import decode_scaled, scaled_box

    data = _jpeg(1600, 1200)
    spec = ImageTransform(size=224, train=False)
    out = transform_image(data, spec, random.Random(0))
    assert out.shape == (3, 224, 224) and out.dtype == torch.uint8
    assert decode_scaled(data, dct_divisor(center_box(1600, 1200, 224, 0.875), 224)).shape == (300, 400, 3)
    x, y, w, h = scaled_box(center_box(1600, 1200, 224, 0.875), 0.25, 0.25, 400, 300)
    with Image.open(io.BytesIO(data)) as img:
        ref = img.convert("RGB").resize((224, 224), Image.Resampling.BILINEAR, box=(4 * x, 4 * y, 4 * (x + w), 4 * (y + h)))
    ref = np.asarray(ref).transpose(2, 0, 1).astype(np.float32)
    assert np.abs(out.numpy().astype(np.float32) - ref).mean() < 1.5
    # At full scale the resize is PIL's bilinear (antialiased) resize, to rounding.
    small = _jpeg(400, 300)
    out = transform_image(small, spec, random.Random(0)).numpy().astype(np.float32)
    x, y, w, h = center_box(400, 300, 224, 0.875)
    with Image.open(io.BytesIO(small)) as img:
        ref = img.convert("RGB").resize((224, 224), Image.Resampling.BILINEAR, box=(x, y, x + w, y + h))
    assert np.abs(out - np.asarray(ref).transpose(2, 0, 1)).mean() < 0.1
    # Both decoders agree, and a flip is exactly the mirror image of the same crop.
    pil = transform_image(data, ImageTransform(size=224, train=False, decoder="pil"), random.Random(0))
    sj = transform_image(data, spec, random.Random(0))
    assert (pil.float() - sj.float()).abs().mean() < 3.0
    train = ImageTransform(size=224, train=True, hflip=0.0)
    flipped = ImageTransform(size=224, train=True, hflip=1.0)
    assert torch.equal(transform_image(data, flipped, random.Random(5)),
                       transform_image(data, train, random.Random(5)).flip(-1))


def test_the_crops_region_alone_decodes_to_a_full_decodes_pixels(photos):
    """data.cpu_decoder=turbojpeg decodes only the crop's rows and columns (libjpeg-turbo 3's cropping
    region, at each DCT scale): the same pixels as the box of a full decode, so the same crops as simplejpeg."""
    import pyarrow.parquet as pq

    from rayvit.data import turbo
    from rayvit.data.images import decode_scaled

    images = pq.read_table(photos, columns=["image"]).column("image").to_pylist()[:24]
    rng = random.Random(0)
    for data in images:
        width, height, _ = turbo.header(data)
        for divisor in (1, 2, 4):
            full = decode_scaled(data, divisor, "simplejpeg")
            assert full.shape[:2] == (-(-height // divisor), -(-width // divisor))
            for _ in range(4):
                x, y, w, h = random_resized_box(full.shape[1], full.shape[0], (0.08, 1.0), (3 / 4, 4 / 3), rng)
                assert np.array_equal(turbo.decode_region(data, (x, y, w, h), divisor), full[y:y + h, x:x + w])
        for train in (True, False):
            region, whole = (transform_image(data, ImageTransform(size=96, train=train, decoder=decoder), random.Random(7))
                             for decoder in ("turbojpeg", "simplejpeg"))
            assert torch.equal(region, whole)


def test_without_libjpeg_turbo_3_the_region_decoder_says_what_to_install(monkeypatch):
    from rayvit.data import turbo

    monkeypatch.setattr(turbo, "_library", lambda: (None, "no libturbojpeg found"))
    monkeypatch.setattr(turbo._Handle._local, "handle", None, raising=False)
    with pytest.raises(ImportError, match=r"turbojpeg>=0.0.2.*data.cpu_decoder=simplejpeg"):
        transform_image(_jpeg(64, 48), ImageTransform(size=32, train=True), random.Random(0))
    # The other decoders do not need it.
    assert transform_image(_jpeg(64, 48), ImageTransform(size=32, train=True, decoder="simplejpeg"),
                           random.Random(0)).shape == (3, 32, 32)


def test_randaugment_changes_the_crop_and_keeps_its_shape():
    data = _jpeg(500, 375)
    plain = ImageTransform(size=64, train=True)
    strong = ImageTransform(size=64, train=True, augment="randaugment", augment_ops=2, augment_magnitude=9)
    a, b = transform_image(data, plain, random.Random(3)), transform_image(data, strong, random.Random(3))
    assert b.shape == (3, 64, 64) and b.dtype == torch.uint8 and not torch.equal(a, b)
    changed = sum(not torch.equal(transform_image(data, plain, random.Random(s)),
                                  transform_image(data, strong, random.Random(s))) for s in range(20))
    assert changed >= 15            # identity is one of fourteen ops, drawn twice


def test_parquet_photos_train_on_random_crops_and_validate_on_centre_crops(photos):
    cfg = config("data.name=parquet", f"data.path={photos}", "model.image_size=64", "model.num_classes=8",
                 "train.batch_size=8", "data.prefetch_batches=2")
    data = build_data(cfg, CPU)
    assert (data.num_train, data.num_val, data.num_classes) == (51, 13, 8)
    first = [next(data.train) for _ in range(6)]          # six batches: the first epoch, then the second's
    for images, labels in first:
        assert images.shape == (8, 3, 64, 64) and images.dtype == torch.float32 and labels.max() < 8
    # Seeded crops: the same config gives the same batches; epochs crop anew.
    again = build_data(cfg, CPU)
    assert torch.equal(next(again.train)[0], first[0][0])
    assert not torch.equal(first[0][0], first[3][0])
    val = [x for x, _ in data.val_batches()]
    assert sum(len(x) for x in val) == 13 and torch.equal(val[0], next(iter(again.val_batches()))[0])
    # The prefetch thread stops when the data is closed.
    for d in (data, again):
        d.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("rayvit-")]


def test_greyscale_cmyk_png_and_tiny_images_are_converted_and_a_corrupt_one_named(odd, capsys):
    from rayvit.data.parquet import read_split

    cfg = config("data.name=parquet", f"data.path={odd}", "model.image_size=32", "model.num_classes=8")
    split = read_split(str(odd), cfg, "data.path")
    names = {len(b): n for n in ODD_IMAGES for b in [(odd.parent / "photos" / "astronaut" / n).read_bytes()]}
    rows = {names[len(b)]: i for i, b in enumerate(split.images) if len(b) in names}
    spec = ImageTransform.of(cfg, train=True)
    for name in ("grey.jpg", "cmyk.jpg", "rgba.png", "tiny.jpg"):
        out = transform_image(split.images[rows[name]], spec, random.Random(0))
        assert out.shape == (3, 32, 32) and out.dtype == torch.uint8, name
    grey = transform_image(split.images[rows["grey.jpg"]], spec, random.Random(0))
    assert torch.equal(grey[0], grey[1]) and torch.equal(grey[1], grey[2])
    # The corrupt image, by file, row and row group, with the decoder's reason, on one line.
    with pytest.raises(CorruptImageError) as e:
        split.subset(torch.tensor([rows["truncated.jpg"]])).decode(spec, threads=1)
    message = str(e.value)
    row = rows["truncated.jpg"]
    assert "\n" not in message
    assert f"part-00000.parquet row {row} (row group 0, index {row})" in message
    assert "image file is truncated" in message and "data.skip_corrupt=true" in message


def test_a_corrupt_image_stops_training_or_is_skipped_and_counted(odd, capsys):
    base = ("data.name=parquet", f"data.path={odd}", "model.image_size=32", "model.num_classes=8",
            "train.batch_size=4", "data.val_fraction=0.1")
    data = build_data(config(*base), CPU)
    with pytest.raises(CorruptImageError, match=r"part-00000\.parquet row \d+ \(row group 0, index \d+\): "
                                                r"OSError: image file is truncated"):
        for _ in range(2 * data.num_train // 4):
            next(data.train)
    data.close()
    data = build_data(config(*base, "data.skip_corrupt=true"), CPU)
    batches = [next(data.train) for _ in range(2 * data.num_train // 4)]       # two epochs
    assert all(len(y) == 4 for _, y in batches)
    assert len(data.skipped) == 1
    err = capsys.readouterr().err
    assert err.count("WARNING: rayvit skipped a corrupt image") == 1 and "image file is truncated" in err
    data.close()


def test_transform_settings_are_checked():
    for bad, match in [("data.crop_scale=[0.5, 0.1]", "crop_scale"), ("data.crop_scale=[0.5, 1.5]", "whole image"),
                       ("data.hflip=2", "probability"), ("data.crop_pct=0", "crop_pct"),
                       ("data.randaugment_magnitude=31", "randaugment_magnitude"),
                       ("data.decode=gpu", "parallel.use_gpu=true")]:
        with pytest.raises(ConfigError, match=match):
            config("data.name=parquet", "data.path=x", bad)


def test_the_gpu_decode_path_names_a_row_as_the_cpu_path_does_and_refuses_skip_corrupt():
    """data.decode=gpu: a planned row carries its block and offset, so that a JPEG nvJPEG fails on (cut off
    after a readable header) is named with its label, size and digest; data.skip_corrupt=true is refused
    up front (the batch decodes in one call on the device)."""
    import hashlib

    from rayvit.data.gpu_decode import _planned_row, plan_batch

    whole = _jpeg(300, 200)
    cut = whole[:1024]
    batch = {"image": np.array([whole, cut], dtype=object), "label": np.array([3, 5])}
    planned = plan_batch(batch, "image", "label", ImageTransform(size=32, train=True))
    assert list(planned["offset"]) == [0, 1] and list(planned["label"]) == [3, 5]
    digest = hashlib.md5(cut).hexdigest()[:12]
    assert _planned_row(planned, 1, "label") == f"row 1 of a block (label 5, 1024 bytes, md5 {digest})"
    planned["path"] = np.array(["/data/a.parquet", "/data/b.parquet"], dtype=object)
    assert _planned_row(planned, 1, "label") == "/data/b.parquet (1024 bytes), label 5"
    with pytest.raises(ConfigError, match="data.skip_corrupt=true is not available with data.decode=gpu"):
        config("data.name=parquet", "data.path=/x", "parallel.use_gpu=true", "data.decode=gpu", "data.skip_corrupt=true")
