"""The data package on real data: synthetic, scikit-learn digits, parquet (pyarrow and Ray Data)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from rayvit.errors import ConfigError
from rayvit.data import build_data, with_absolute_paths
from rayvit.data.digits import load_digits_arrays
from rayvit.data.images import ImageTransform
from rayvit.data.parquet import class_names, load_split

from helpers_data import CPU, config, sample_key, take

REPO = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------------------------------
# synthetic


def test_synthetic_batches_are_fixed_on_device_and_cycled():
    cfg = config("data.synthetic_batches=3", "model.num_classes=7")
    data = build_data(cfg, CPU, world_size=2)
    batches = take(data, 7)
    for images, labels in batches:
        assert images.shape == (16, 3, 16, 16) and images.dtype == torch.float32
        assert labels.shape == (16,) and labels.dtype == torch.int64
        assert images.device == CPU and labels.device == CPU
        assert 0 <= labels.min() and labels.max() < 7
    # Three distinct batches, then the very same tensors again: nothing is generated per step.
    assert not torch.equal(batches[0][0], batches[1][0])
    assert batches[3][0] is batches[0][0] and batches[6][1] is batches[0][1]
    assert abs(batches[0][0].mean().item()) < 0.05 and abs(batches[0][0].std().item() - 1) < 0.05
    assert data.val_batches is None
    assert (data.num_train, data.num_val, data.num_classes) == (3 * 16 * 2, 0, 7)
    # Seeded: rebuilding gives the same data.
    assert torch.equal(next(build_data(cfg, CPU, world_size=2).train)[0], batches[0][0])


# --------------------------------------------------------------------------------------------------
# digits


def test_digits_batches_are_upsampled_normalised_rgb():
    data = build_data(config("data.name=digits", "model.image_size=24"), CPU)
    assert (data.num_train, data.num_val, data.num_classes) == (1437, 360, 10)
    images, labels = next(data.train)
    assert images.shape == (16, 3, 24, 24) and images.dtype == torch.float32 and images.device == CPU
    assert labels.dtype == torch.int64 and labels.shape == (16,)
    assert torch.equal(images[:, 0], images[:, 1]) and torch.equal(images[:, 0], images[:, 2])

    # At native 8x8 one epoch of train pixels has mean 0 and std 1 (stats come from the train split).
    data = build_data(config("data.name=digits", "model.image_size=8"), CPU)
    pixels = torch.cat([x for x, _ in take(data, 1437 // 16)])
    assert abs(pixels.mean().item()) < 0.02 and abs(pixels.std().item() - 1) < 0.02


def test_digits_ranks_share_train_disjointly_and_reshuffle_every_epoch():
    world, batch, n_train = 3, 16, 1437
    steps = (n_train // world) // batch           # batches per rank per epoch
    cfg = config("data.name=digits", "model.image_size=8")
    all_train = {sample_key(x) for x, _ in
                 build_data(config("data.name=digits", "model.image_size=8", "train.batch_size=1"),
                            CPU).val_batches() or []}
    epochs = []  # epochs[e][rank] = ordered sample keys
    ranks = [build_data(cfg, CPU, rank=r, world_size=world) for r in range(world)]
    for _ in range(2):
        epochs.append([[sample_key(x) for batch_ in take(d, steps) for x in batch_[0]] for d in ranks])
    for epoch in epochs:
        seen = [k for share in epoch for k in share]
        assert len(seen) == len(set(seen)) == world * steps * batch   # disjoint, equal shares
        assert not set(seen) & all_train                              # never a validation sample
    for r in range(world):
        assert epochs[0][r] != epochs[1][r]                           # new order
        assert set(epochs[0][r]) != set(epochs[1][r])                 # new share
    # Same permutation on every rank: rebuilding rank 1 repeats its first epoch exactly.
    again = build_data(cfg, CPU, rank=1, world_size=world)
    assert [sample_key(x) for b in take(again, steps) for x in b[0]] == epochs[0][1]


@pytest.mark.parametrize("name", ["synthetic", "digits", "parquet"])
def test_the_train_stream_resumes_at_any_step_without_drawing_the_batches_before_it(name, digits_parquet):
    """A resumed run continues its input where its checkpoint left it: ``train_from(step)`` is the
    stream an unbroken run draws from that step on, across epoch boundaries, reached by arithmetic on the
    step (no batch before it is made or decoded)."""
    extra = {"synthetic": ["data.synthetic_batches=3"], "digits": [],
             "parquet": [f"data.path={digits_parquet}", "data.prefetch_batches=0"]}[name]
    cfg = config(f"data.name={name}", "model.image_size=8", "train.batch_size=128", *extra)
    unbroken = take(build_data(cfg, CPU, rank=1, world_size=2), 14)     # digits: 5 steps per epoch and rank
    for step in (0, 4, 5, 11):
        resumed = build_data(cfg, CPU, rank=1, world_size=2).train_from(step)
        for (x, y), (ux, uy) in zip([next(resumed) for _ in range(3)], unbroken[step:step + 3]):
            assert torch.equal(x, ux) and torch.equal(y, uy), (name, step)


def test_an_input_whose_order_cannot_be_replayed_says_so(digits_parquet):
    """Corrupt rows dropped (``data.skip_corrupt``) shift every later batch by rows nobody counted: that
    stream cannot be re-entered by arithmetic, and a resumed run starts it afresh (the loop records it)."""
    cfg = config("data.name=parquet", f"data.path={digits_parquet}", "data.skip_corrupt=true")
    assert build_data(cfg, CPU).train_from is None


@pytest.mark.parametrize("world", [1, 2, 3, 7])
def test_validation_covers_every_sample_once_with_equal_batch_counts(world):
    cfg = config("data.name=digits", "model.image_size=8", "train.batch_size=32")
    shares = [list(build_data(cfg, CPU, rank=r, world_size=world).val_batches()) for r in range(world)]
    assert len({len(s) for s in shares}) == 1          # same number of forwards on every rank
    keys = [sample_key(x) for s in shares for images, _ in s for x in images]
    labels = torch.cat([y for s in shares for _, y in s])
    assert len(keys) == len(set(keys)) == 360 == len(labels)
    assert all(len(y) <= 32 for s in shares for _, y in s)


def test_too_many_classes_is_a_config_error(digits_parquet):
    with pytest.raises(ConfigError, match=r"10 classes but model.num_classes=4; set model.num_classes=10"):
        build_data(config("data.name=digits", "model.num_classes=4"), CPU)
    with pytest.raises(ConfigError, match="set model.num_classes=10"):
        build_data(config("data.name=parquet", f"data.path={digits_parquet}", "model.num_classes=9"), CPU)


def test_too_little_data_for_one_batch_is_a_config_error():
    with pytest.raises(ConfigError, match="train.batch_size=1024"):
        build_data(config("data.name=digits", "train.batch_size=1024"), CPU, world_size=2)


def test_digits_are_scikit_learns_read_without_importing_it():
    """The file read directly holds what ``sklearn.datasets.load_digits`` returns, and reading it leaves
    scikit-learn unimported (a fresh interpreter: this one may have imported it already)."""
    from sklearn.datasets import load_digits

    images, labels = load_digits_arrays()
    bunch = load_digits()
    assert images.dtype == np.uint8 and images.shape == (1797, 8, 8) and labels.dtype == np.int64
    assert np.array_equal(images, bunch.images) and np.array_equal(labels, bunch.target)
    code = ("import sys; from rayvit.data.digits import load_digits_arrays; load_digits_arrays(); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('sklearn', 'scipy')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr


# --------------------------------------------------------------------------------------------------
# parquet without Ray


def test_to_parquet_round_trip_keeps_images_and_labels(digits_parquet):
    assert len(list(digits_parquet.glob("part-*.parquet"))) == 4
    assert class_names(str(digits_parquet)) == [str(i) for i in range(10)]
    images, labels = load_digits_arrays()
    label_of = {img.tobytes(): int(y) for img, y in zip(images, labels)}

    # Read back through the pyarrow path at native size, under the validation transform that keeps the
    # whole square (crop_pct 1): pixels invert exactly to 0..16.
    cfg = config("data.name=parquet", f"data.path={digits_parquet}", "model.image_size=8", "data.crop_pct=1")
    train, (val_x, val_y), num_classes = load_split(cfg, CPU)
    train_x, train_y = train.decode(ImageTransform.of(cfg, train=False), threads=2)
    assert num_classes == 10 and len(train_y) == 1437 and len(val_y) == 360
    x = torch.cat([train_x, val_x])
    assert x.dtype == torch.uint8 and x.shape == (1797, 3, 8, 8)
    assert torch.equal(x[:, 0], x[:, 1])
    levels = np.rint(x[:, 0].numpy().astype(np.float32) * 16 / 255).astype(np.uint8)
    assert [label_of[img.tobytes()] for img in levels] == torch.cat([train_y, val_y]).tolist()


def test_parquet_batches_are_normalised_and_resized(digits_parquet, tmp_path):
    cfg = config("data.name=parquet", f"data.path={digits_parquet}", "model.image_size=32")
    data = build_data(cfg, CPU, rank=1, world_size=2)
    assert (data.num_train, data.num_val, data.num_classes) == (1437, 360, 10)
    images, labels = next(data.train)
    assert images.shape == (16, 3, 32, 32) and images.dtype == torch.float32
    assert labels.dtype == torch.int64 and labels.max() < 10
    # Background pixels (0) are (0 - mean) / std per channel (ImageNet statistics).
    expected = torch.tensor([-0.485 / 0.229, -0.456 / 0.224, -0.406 / 0.225])
    assert torch.allclose(images.amin(dim=(0, 2, 3)), expected, atol=1e-5)

    # Relative paths are resolved for Ray workers, which run in another directory.
    rel = config("data.name=parquet", f"data.path={os.path.relpath(digits_parquet)}")
    assert with_absolute_paths(rel).data.path == str(digits_parquet)

    # An explicit validation file: no hold-out is cut from the train data.
    table = pq.read_table(digits_parquet)
    pq.write_table(table.slice(0, 1500), tmp_path / "train.parquet")
    pq.write_table(table.slice(1500), tmp_path / "val.parquet")
    data = build_data(config("data.name=parquet", f"data.path={tmp_path / 'train.parquet'}",
                             f"data.val_path={tmp_path / 'val.parquet'}"), CPU)
    assert (data.num_train, data.num_val) == (1500, 297)
    assert sum(len(y) for _, y in data.val_batches()) == 297


def test_parquet_reads_through_pyarrow_filesystems(digits_parquet):
    """A file:// URI, and a path inside a pyarrow SubTreeFileSystem, read the same rows as the plain path."""
    import pyarrow.fs as pafs

    first = next(build_data(config("data.name=parquet", f"data.path={digits_parquet}"), CPU).train)[0]
    uri = build_data(config("data.name=parquet", f"data.path={digits_parquet.as_uri()}"), CPU)
    subtree = pafs.SubTreeFileSystem(str(digits_parquet.parent), pafs.LocalFileSystem())
    inside = build_data(config("data.name=parquet", f"data.path={digits_parquet.name}"), CPU,
                        filesystem=subtree)
    for data in (uri, inside):
        assert (data.num_train, data.num_val, data.num_classes) == (1437, 360, 10)
        assert torch.equal(next(data.train)[0], first)
    # A URI stays a URI for the workers; only local paths are made absolute.
    assert with_absolute_paths(config("data.name=parquet", f"data.path={digits_parquet.as_uri()}")
                               ).data.path == digits_parquet.as_uri()


def test_parquet_path_errors_name_the_path_and_what_failed(digits_parquet, tmp_path):
    def error(path, **kwargs):
        with pytest.raises(ConfigError) as e:
            build_data(config("data.name=parquet", f"data.path={path}"), CPU, **kwargs)
        return str(e.value)

    missing = (tmp_path / "nope").as_uri()
    assert error(missing) == f"data.path={missing} does not exist"
    assert error("nope/train").startswith("data.path=nope/train does not exist (relative to ")
    assert "pyarrow cannot open it (Unrecognized filesystem type in URI" in error("foo://bucket/train")
    (tmp_path / "empty").mkdir()
    assert error((tmp_path / "empty").as_uri()) == f"data.path={(tmp_path / 'empty').as_uri()} is a folder " \
                                                   "with no .parquet files"
    (tmp_path / "broken.parquet").write_bytes(b"not parquet")
    text = error(tmp_path / "broken.parquet")
    assert text.startswith(f"data.path={tmp_path / 'broken.parquet'}: cannot read the schema of ")


def test_to_parquet_cli_errors_and_help(tmp_path, capsys):
    from rayvit.cli import main

    # The installed command, once, as a user types it; the error cases in this process (each a process
    # of its own would spend seconds importing torch).
    help_text = subprocess.run([sys.executable, "-m", "rayvit", "to-parquet", "--help"], capture_output=True,
                               text=True, cwd=REPO).stdout
    assert "one subfolder per class" in help_text

    def cli(*args):
        code = main(["to-parquet", *args])
        return code, capsys.readouterr().err

    code, err = cli(str(tmp_path / "nope"), str(tmp_path / "out"))
    assert code == 2 and "is not a folder" in err
    (tmp_path / "empty").mkdir()
    code, err = cli(str(tmp_path / "empty"), str(tmp_path / "out"))
    assert code == 2 and "no class subfolders" in err
    (tmp_path / "empty" / "cat").mkdir()
    code, err = cli(str(tmp_path / "empty"), str(tmp_path / "out"))
    assert code == 2 and "no image files" in err


def test_importing_rayvit_data_does_not_import_ray():
    code = "import sys, rayvit.data; assert 'ray' not in sys.modules, 'ray was imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)
    # The dataset check the driver runs, the sample photographs and the input projection: no torch either.
    code = ("import sys, rayvit.data.schema, rayvit.data.photos, rayvit.projection.inputs; "
            "assert 'torch' not in sys.modules and 'ray' not in sys.modules, 'torch or ray was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


# --------------------------------------------------------------------------------------------------
# parquet through Ray Data




def test_dataset_columns_are_named_when_they_are_not_images_and_labels():
    """rayvit.data.schema, as the driver runs it on a user's Ray Dataset (its schema's names and types)."""
    import pyarrow as pa

    from rayvit.data.schema import check_columns

    cfg = config("model.image_size=16")
    assert check_columns(["image", "label", "path"], [pa.binary(), pa.int64(), pa.string()], cfg) == "encoded"
    with pytest.raises(ConfigError, match=r"labels 'label' are string, not integers 0..C-1 \(columns: image "
                                          r"\(binary\), label \(string\)\)"):
        check_columns(["image", "label"], [pa.binary(), pa.string()], cfg)
    with pytest.raises(ConfigError, match=r"image column 'image' is float .*uint8 images of shape \(3, 16, 16\)"):
        check_columns(["image", "label"], [pa.float32(), pa.int64()], cfg)
    with pytest.raises(ConfigError, match=r"has no column 'image' \(columns: img \(binary\), y \(int64\)\); .*"
                                          r"data.image_column='image'"):
        check_columns(["img", "y"], [pa.binary(), pa.int64()], cfg)


def test_ray_data_read_tasks_spread_small_data_over_the_cpus_and_keep_large_files_whole(digits_parquet):
    from rayvit.data.parquet import parquet_files
    from rayvit.data.ray_read import read_tasks, source_bytes

    mb = 10 ** 6
    assert read_tasks(10, 140 * mb, cpus=2) == 8          # 4 per CPU, not Ray 2.60's 2 bins of 128 MiB
    assert read_tasks(10, 140 * mb, cpus=96) == 10        # never more than the files: a file is not split
    assert read_tasks(1, 140 * mb, cpus=8) == 1
    assert read_tasks(1024, 1024 * 140 * mb, cpus=2) == 1024      # ImageNet's scale: one file a task
    assert read_tasks(4096, 4096 * 10 * mb, cpus=2) == 306         # small files grouped to at most 128 MiB
    source = parquet_files(str(digits_parquet))
    assert source.sizes == [os.path.getsize(f) for f in source.files] and source_bytes(source) == sum(source.sizes)
