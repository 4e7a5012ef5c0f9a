"""Training points on parquet data read through pyarrow filesystems: URIs, a filesystem object, S3 offline."""

from __future__ import annotations

import os
import time

import pyarrow.fs as pafs
import pytest
import ray

from rayvit.config import ConfigError, load_config
from rayvit.data import ray_datasets
from rayvit.trainer import fit


@pytest.fixture(scope="module", autouse=True)
def local_ray(tmp_path_factory, shared_ray):
    os.environ["RAYVIT_HOME"] = str(tmp_path_factory.mktemp("rayvit_home"))
    # The local instance of conftest.py: one training worker here, and CPUs for Ray Data's read and decode tasks.
    yield


def point(path: str):
    return load_config(overrides=["data.name=parquet", f"data.path={path}", "model.image_size=8",
                                  "model.patch_size=4", "train.steps=6", "train.warmup_steps=2",
                                  "train.report_every=6", "train.eval_every=6"])


def test_a_file_uri_and_a_subtree_filesystem_path_train_a_point_end_to_end(digits_parquet):
    by_uri = fit(point(digits_parquet.as_uri()))
    subtree = pafs.SubTreeFileSystem(str(digits_parquet.parent), pafs.LocalFileSystem())
    cfg = point(digits_parquet.name)    # a path inside the subtree, meaningless on its own
    inside = fit(cfg, datasets=ray_datasets(cfg, filesystem=subtree))
    for result in (by_uri, inside):
        assert [h["step"] for h in result.history] == list(range(6))
        assert result["images_per_sec_per_chip"] > 0 and result["val_accuracy"] is not None
        assert result.history[0]["loss"] == pytest.approx(2.3026, abs=0.05)   # ln 10: ten classes read


def test_an_s3_uri_without_network_fails_on_the_driver_within_30_s_naming_the_uri():
    uri = "s3://rayvit-test-no-such-bucket/imagenet/train"
    start = time.monotonic()
    with pytest.raises(ConfigError) as e:
        fit(point(uri))
    assert time.monotonic() - start < 30
    assert str(e.value).startswith(f"data.path={uri}: ")
    assert "cannot be reached from this node" in str(e.value) or "credentials" in str(e.value)
