"""Ray Data shards feeding the worker's batches (a local Ray instance)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from rayvit.data import build_data, ray_datasets

from shared import CPU, WHOLE_IMAGES, config, sample_key, take

REPO = Path(__file__).resolve().parents[2]


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
