"""Training points on parquet data read through pyarrow filesystems: URIs, a filesystem object, S3 offline.

The S3 attempt fails only after the AWS SDK's retries (about 6 s of waiting, a tenth of a second of
CPU): it starts in a thread of its own at the module's start (``s3_attempt``) and waits while the first
test trains, and its test checks how, and how fast, it failed.
"""

from __future__ import annotations

import os
import threading
import time

import pyarrow.fs as pafs
import pytest
import ray

from rayvit.config import load_config
from rayvit.errors import ConfigError
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


S3_URI = "s3://rayvit-test-no-such-bucket/imagenet/train"


@pytest.fixture(scope="module", autouse=True)
def s3_attempt(local_ray):
    """``fit()`` on an S3 URI this machine cannot reach, in a thread started at the module's start: the
    error it raised (None if none) and its seconds."""
    outcome: dict = {}

    def attempt() -> None:
        start = time.monotonic()
        try:
            fit(point(S3_URI))
            outcome["error"] = None
        except BaseException as e:  # noqa: BLE001 -- the test says what it should have been
            outcome["error"] = e
        outcome["seconds"] = time.monotonic() - start

    thread = threading.Thread(target=attempt, name="s3-attempt", daemon=True)
    thread.start()
    yield thread, outcome
    thread.join()


def test_a_file_uri_and_a_subtree_filesystem_path_train_a_point_end_to_end(digits_parquet):
    by_uri = fit(point(digits_parquet.as_uri()))
    subtree = pafs.SubTreeFileSystem(str(digits_parquet.parent), pafs.LocalFileSystem())
    cfg = point(digits_parquet.name)    # a path inside the subtree, meaningless on its own
    inside = fit(cfg, datasets=ray_datasets(cfg, filesystem=subtree))
    for result in (by_uri, inside):
        assert [h["step"] for h in result.history] == list(range(6))
        assert result["images_per_sec_per_chip"] > 0 and result["val_accuracy"] is not None
        assert result.history[0]["loss"] == pytest.approx(2.3026, abs=0.05)   # ln 10: ten classes read


def test_an_s3_uri_without_network_fails_on_the_driver_within_30_s_naming_the_uri(s3_attempt):
    thread, outcome = s3_attempt      # started with the module (``s3_attempt``)
    thread.join(timeout=60)
    assert not thread.is_alive(), "fit() on the S3 URI still runs after 60 s"
    error = outcome["error"]
    assert isinstance(error, ConfigError), repr(error)
    assert outcome["seconds"] < 30
    assert str(error).startswith(f"data.path={S3_URI}: ")
    assert "cannot be reached from this node" in str(error) or "credentials" in str(error)
