"""Ray Data shards feeding the worker's batches (a local Ray instance)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from rayvit.data import build_data, ray_datasets

from helpers_data import CPU, WHOLE_IMAGES, config, export_photos_parquet, sample_key, take
from helpers_sessions import Counted, checkpointed_after, train_steps

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def local_ray(shared_ray):
    # The local instance this module shares with test_data_storage.py and test_trainer.py (conftest.py):
    # its Ray worker processes import rayvit to run the decode function.
    return shared_ray


def test_ray_data_path_feeds_build_data_from_shards(local_ray, digits_parquet):
    cfg = config("data.name=parquet", f"data.path={digits_parquet}", "model.image_size=16", *WHOLE_IMAGES)
    datasets = ray_datasets(cfg)
    assert set(datasets) == {"train", "val"}
    rows = datasets["val"].take_batch(5, batch_format="numpy")
    assert rows["image"].shape == (5, 3, 16, 16) and rows["image"].dtype == np.uint8

    # A worker on another node cannot reach the files: sizes come with the datasets, rows from the shards.
    elsewhere = cfg.replace({"data.path": "/not/on/this/node"})
    data = build_data(elsewhere, CPU, dataset_shards={"train": datasets["train"].iterator(),
                                                      "val": datasets["val"].iterator()})
    assert (data.num_train, data.num_val, data.num_classes) == (1437, 360, 10)
    steps = 1437 // 16
    epochs = [take(data, steps) for _ in range(2)]   # the iterator rolls into a second epoch
    data.train.close()
    for images, labels in epochs[0] + epochs[1]:
        assert images.shape == (16, 3, 16, 16) and images.dtype == torch.float32
        assert labels.shape == (16,) and labels.dtype == torch.int64 and labels.max() < 10
    keys = [[sample_key(x) for b in epoch for x in b[0]] for epoch in epochs]
    assert len(set(keys[0])) == steps * 16 and keys[0] != keys[1]   # one pass, then a new order
    val_keys = [sample_key(x) for images, _ in data.val_batches() for x in images]
    assert len(val_keys) == len(set(val_keys)) == 360
    assert not set(val_keys) & set(keys[0])
    # Same normalisation as the pyarrow path: background pixels map to the same values.
    local = build_data(cfg, CPU)
    assert torch.allclose(epochs[0][0][0].amin(dim=(0, 2, 3)), next(local.train)[0].amin(dim=(0, 2, 3)))


def test_parquet_is_read_in_tasks_sized_to_the_cpus_quietly_leaving_the_callers_settings(local_ray, digits_parquet,
                                                                                      capfd):
    """With Ray running the files are read through Ray Data's file-per-task reader (read tasks sized to the
    cluster's CPUs, rayvit.data.ray_read); its sampling prints nothing unless data.progress_bars, and the
    process's DataContext and Ray Data's loggers are as they were."""
    import logging

    from ray.data import DataContext

    from rayvit.data.ray_read import read_tasks

    sampling_log = logging.getLogger("ray.data._internal.datasource.parquet_datasource")
    context = DataContext.get_current()
    before = (context.use_datasource_v2, context.enable_progress_bars, sampling_log.level)
    capfd.readouterr()
    train = ray_datasets(config("data.name=parquet", f"data.path={digits_parquet}", "model.image_size=16"))["train"]
    out, err = capfd.readouterr()
    assert "parquet encoding ratio" not in out + err and "reader batch size" not in out + err
    assert (context.use_datasource_v2, context.enable_progress_bars, sampling_log.level) == before
    files = sorted(Path(digits_parquet).rglob("*.parquet"))
    size = sum(f.stat().st_size for f in files)
    stats = train.materialize().stats()          # 4 files, 3 CPUs: one read-and-decode task a file
    assert read_tasks(len(files), size, 3) == len(files) and f"{len(files)} tasks executed" in stats, stats


def test_ray_data_split_shards_are_disjoint_across_ranks(local_ray, digits_parquet):
    """Two ranks reading a streaming split (as Ray Train hands them out) see disjoint train rows."""
    from concurrent.futures import ThreadPoolExecutor

    cfg = config("data.name=parquet", f"data.path={digits_parquet}", "model.image_size=8", *WHOLE_IMAGES)
    shards = ray_datasets(cfg)["train"].streaming_split(2, equal=True)
    steps = (1437 // 2) // 16

    def one_epoch(rank: int) -> list[bytes]:
        data = build_data(cfg, CPU, rank=rank, world_size=2, dataset_shards={"train": shards[rank]})
        assert data.val_batches is None
        keys = [sample_key(x) for images, _ in take(data, steps) for x in images]
        data.train.close()
        return keys

    # Split iterators advance together, so both ranks must read at once.
    with ThreadPoolExecutor(2) as pool:
        rank0, rank1 = pool.map(one_epoch, [0, 1])
    assert len(set(rank0)) == len(set(rank1)) == steps * 16
    assert not set(rank0) & set(rank1)


def test_a_corrupt_image_through_ray_data_is_named_in_one_line_or_skipped_and_counted(local_ray, tmp_path):
    """The photographs plus odd images (greyscale, CMYK, PNG, tiny: converted; one truncated JPEG)."""
    from rayvit.data.images import CorruptImageError

    path = export_photos_parquet(tmp_path, per_class=4, bad=True, rows_per_shard=1000)
    base = ("data.name=parquet", f"data.path={path}", "model.image_size=32", "model.num_classes=8",
            "train.batch_size=4", "data.val_fraction=0.1")
    cfg = config(*base)
    datasets = ray_datasets(cfg)
    data = build_data(cfg, CPU, dataset_shards={"train": datasets["train"].iterator()})
    with pytest.raises(CorruptImageError) as e:
        take(data, 2 * data.num_train // 4)
    message = str(e.value)
    assert "\n" not in message and len(message) < 400, message
    assert f"{path / 'part-00000.parquet'} row " in message and "(row group 0, index " in message
    assert "OSError: image file is truncated" in message and "data.skip_corrupt=true" in message

    skipping = config(*base, "data.skip_corrupt=true")
    datasets = ray_datasets(skipping)
    data = build_data(skipping, CPU, dataset_shards={"train": datasets["train"].iterator(),
                                                     "val": datasets["val"].iterator()})
    batches = take(data, 2 * (data.num_train - 1) // 4)
    assert all(images.shape == (4, 3, 32, 32) for images, _ in batches)
    val = sum(len(y) for _, y in data.val_batches())
    assert len(data.skipped) == 1 and val in (data.num_val, data.num_val - 1)   # the corrupt row, wherever it fell
    data.train.close()


def test_dataset_columns_are_checked_on_the_driver(local_ray, digits_parquet):
    """Encoded bytes and rayvit's decoded crops pass (naming which); other columns fail naming them."""
    import ray.data

    from rayvit.errors import ConfigError
    from rayvit.data.schema import check_dataset

    cfg = config("data.name=parquet", f"data.path={digits_parquet}", "model.image_size=16")
    assert check_dataset(ray.data.read_parquet(str(digits_parquet)), cfg) == "encoded"
    assert check_dataset(ray_datasets(cfg)["val"], cfg, "val") == "decoded"
    with pytest.raises(ConfigError, match=r"model.image_size=32"):
        check_dataset(ray_datasets(cfg)["val"], config("model.image_size=32"), "val")
    renamed = ray.data.from_items([{"pixels": np.zeros((3, 16, 16), np.uint8), "y": 1}])
    with pytest.raises(ConfigError, match=r"datasets\['train'\] has no column 'image' \(columns: pixels .*, y "):
        check_dataset(renamed, cfg)
    ok = config("data.image_column=pixels", "data.label_column=y", "model.image_size=16")
    assert check_dataset(renamed, ok) == "decoded"


def test_a_run_resumed_on_ray_data_starts_its_input_afresh_draws_nothing_to_skip_and_says_so(local_ray, digits_parquet,
                                                                                            tmp_path):
    """Ray Data's order cannot be replayed: a session resumed from a step-4 checkpoint draws none of the
    4 batches it would skip (each a decode through the whole pipeline), starts a new pass over its shard,
    and its summary says the input started afresh once."""
    from rayvit.config import load_config
    from rayvit.worker import Session, run_figures
    from rayvit.worker.checkpoint_io import resume

    cfg = load_config("cpu_default", ["data.name=parquet", f"data.path={digits_parquet}", "train.steps=6",
                                      "train.warmup_steps=1"])
    datasets = ray_datasets(cfg)
    checkpointed_after(cfg, 4, tmp_path, dataset_shards={"train": datasets["train"].iterator()})
    resumed = Session(cfg, dataset_shards={"train": datasets["train"].iterator()})
    try:
        resumed.data.train = counted = Counted(resumed.data.train)
        resume(resumed, str(tmp_path))
        assert counted.drawn == 0, f"resuming drew {counted.drawn} batches to skip"
        train_steps(resumed, 2)
        result = run_figures.summary(resumed, 0.0)
    finally:
        resumed.close()
    assert result.restarts == 1 and [h["step"] for h in result.history] == list(range(6))
    assert result["data_fresh_starts"] == 1 and counted.drawn == 2


def test_each_epochs_start_is_booked_apart_from_the_steady_wait_for_data(local_ray, tmp_path):
    """200 photographs (12 steps an epoch at batch 16: every epoch a new Ray Data execution, whose first
    batch may wait for it to start and fill its shuffle buffer) against the same images repeated 15 times
    (3,000 rows: no epoch starts inside the timed steps): the epoch starts are recorded apart
    (epoch_start_wait_fraction, each such step marked in the history), and the steady per-step
    data_wait_fraction of the short epochs is within a few points of the long one's."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from rayvit.worker import train

    photos = export_photos_parquet(tmp_path, per_class=25, rows_per_shard=1000)
    table = pa.concat_tables([pq.read_table(f) for f in sorted(photos.glob("*.parquet"))])
    assert len(table) == 200
    for name, copies in (("short", 1), ("long", 15)):
        (tmp_path / name).mkdir()
        pq.write_table(pa.concat_tables([table] * copies), tmp_path / name / "part-00000.parquet")
    pq.write_table(table.slice(0, 32), tmp_path / "val.parquet")
    # A step slower than two cores' decoding of its batch: the steady wait is small, the epoch start is not.
    base = ("data.name=parquet", f"data.val_path={tmp_path / 'val.parquet'}", "model.num_classes=8",
            "model.image_size=64", "model.name=custom", "model.hidden_dim=192", "model.depth=4", "model.num_heads=3",
            "model.mlp_dim=768", "model.patch_size=8", "train.batch_size=16", "train.steps=40", "train.warmup_steps=4",
            "train.eval_every=0")
    results = {}
    for name in ("short", "long"):
        cfg = config(*base, f"data.path={tmp_path / name}")
        datasets = ray_datasets(cfg)
        results[name] = train(cfg, dataset_shards={"train": datasets["train"].iterator()})
    short, long = results["short"], results["long"]
    print(f"200 rows: steady wait {short['data_wait_fraction']:.1%}, epoch starts {short['epoch_start_wait_fraction']:.1%} "
          f"({short['epoch_start_wait_s']:.2f} s each); 3,000 rows: steady wait {long['data_wait_fraction']:.1%}")
    starts = [h["step"] for h in short.history if h["epoch_start"]]
    assert starts == [0, 12, 24, 36]
    assert short["epoch_start_wait_fraction"] > 0 and short["epoch_start_wait_s"] > 0
    assert "epoch_start_wait_fraction" not in long.metrics           # its one epoch start was a warm-up step
    # Each timed epoch start's wait is booked in the epoch-start figures, not in the steady wait: whatever it
    # costs (starting the next epoch's execution early and reading a file a task, it can be as short as a
    # steady step's; with Ray's default reader it was 0.3 s).
    timed = [h for h in short.history if h["step"] >= 4]
    waits_at_starts = [h["data_wait_s"] for h in timed if h["epoch_start"]]
    assert len(waits_at_starts) == 3 and all(w > 0 for w in waits_at_starts)
    assert short["epoch_start_wait_s"] == pytest.approx(sum(waits_at_starts) / 3, rel=1e-6)
    assert abs(short["data_wait_fraction"] - long["data_wait_fraction"]) < 0.05, (
        short["data_wait_fraction"], long["data_wait_fraction"], short["epoch_start_wait_fraction"])
