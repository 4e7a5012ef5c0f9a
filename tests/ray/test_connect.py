"""Reaching a cluster and choosing checkpoint storage, without starting Ray.

Unreachable addresses run the real CLI against ports nothing listens on (started with the tier, see
``clusters.start_unreachable_runs``): it must exit with status 2 within 30 s, naming the address and what to
check (Ray's own connect path retries for minutes). The storage checks run on real pyarrow filesystems
and on ``ray.nodes()``-shaped node lists; the refusal on a real two-node cluster is in
test_multinode.py, the auth modes in test_cluster_auth.py and test_scaling_job.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rayvit.config import from_dict
from rayvit.errors import ConfigError
from rayvit.launch.storage import StorageError, check_storage, default_storage_path, storage_path
from clusters import clean_env, start_unreachable_runs, stop_unreachable_runs

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def unreachable(tmp_path_factory):
    """The runs (already started with the tier, or now when this module runs alone)."""
    runs = start_unreachable_runs(tmp_path_factory)
    yield runs
    stop_unreachable_runs()


def test_unreachable_cluster_is_a_clear_error_within_30s(unreachable):
    """``--address`` naming a port nothing listens on: exit 2 within 30 s, naming the address."""
    run = unreachable["free"].finish(90)
    rc, out, took = run.proc.returncode, run.out, run.took
    assert rc == 2, f"rc {rc}\n{out[-3000:]}"
    assert took < 30, f"took {took:.0f} s:\n{out[-3000:]}"
    error = next(line for line in out.splitlines() if line.startswith("error:"))
    assert run.address in error and "no Ray cluster answered" in error, error
    assert "head node is up" in error and "GCS address" in error and "RAY_ADDRESS" in error, error
    assert "Traceback" not in out, out[-3000:]
    assert not (run.folder / "mlflow.db").exists(), "the address is checked before the tracking store is set up"


def test_dead_ray_address_is_a_clear_error(unreachable):
    """``$RAY_ADDRESS`` left over from a cluster that is gone: the library call fails the same way."""
    run = unreachable["dead"].finish(90)
    stdout, stderr = run.out, run.err
    assert run.proc.returncode == 0 and "|" in stdout, stdout + stderr[-3000:]
    took, error = stdout.strip().split("|", 1)
    assert float(took) < 20 and run.address in error and "RAY_ADDRESS" in error, stdout


def test_dashboard_url_as_address_says_what_to_use(unreachable):
    run = unreachable["dashboard"].finish(90)
    rc, out, took = run.proc.returncode, run.out, run.took
    assert rc == 2, out[-3000:]
    assert "dashboard" in out and "ray job submit --address http://127.0.0.1:8265" in out, out[-3000:]
    assert took < 30


def _cfg(**overrides):
    return from_dict({}, [f"{k}={v}" for k, v in overrides.items()])


def test_storage_default_and_absolute_paths(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYVIT_HOME", str(tmp_path / "home"))
    assert storage_path(_cfg()) == default_storage_path() == str(tmp_path / "home" / "ray_results")
    shared = tmp_path / "shared" / "rayvit"
    assert storage_path(_cfg(**{"launch.storage": str(shared)})) == str(shared)
    assert shared.is_dir(), "the storage folder is created (and so checked) on the driver's node"


def test_storage_relative_path_is_refused():
    with pytest.raises(StorageError, match="relative path.*absolute path on a mount every node shares"):
        storage_path(_cfg(**{"launch.storage": "results/ray"}))


def test_storage_unwritable_path_is_refused(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(StorageError, match="cannot create it on this node"):
        storage_path(_cfg(**{"launch.storage": str(blocker / "under")}))


def test_storage_uris_are_checked_with_pyarrow(tmp_path):
    local = f"file://{tmp_path}/by-uri"
    assert storage_path(_cfg(**{"launch.storage": local})) == local
    assert (tmp_path / "by-uri").is_dir()
    # With the region in the URI pyarrow needs no network to accept it.
    s3 = "s3://some-bucket/rayvit?region=us-east-1"
    assert storage_path(_cfg(**{"launch.storage": s3})) == s3
    with pytest.raises(StorageError, match="pyarrow cannot open it.*s3://bucket/prefix"):
        storage_path(_cfg(**{"launch.storage": "nfs://server/export"}))
    with pytest.raises(StorageError, match="names no bucket"):
        storage_path(_cfg(**{"launch.storage": "s3://"}))
    assert issubclass(StorageError, ConfigError), "the CLIs report ConfigErrors with exit status 2"


def _node(cpus: float, gpus: float = 0.0, alive: bool = True) -> dict:
    return {"Alive": alive, "Resources": {"CPU": cpus, "GPU": gpus} if gpus else {"CPU": cpus}}


CKPT = {"parallel.num_workers": 2, "parallel.cpus_per_worker": 1, "train.checkpoint_every": 5}


def test_checkpointing_run_on_one_node_needs_no_shared_storage():
    check_storage([_cfg(**CKPT)], [_node(4)])
    check_storage([_cfg(**CKPT)], [_node(4), _node(0.5)])          # the second node cannot host a worker
    check_storage([_cfg(**CKPT)], [_node(4), _node(4, alive=False)])


def test_checkpointing_run_that_can_span_nodes_is_refused():
    for nodes, where in (([_node(1), _node(1)], "2 nodes of this cluster"),
                         ([_node(0)], "no node can host its workers yet"),
                         ([_node(1)], "holds 1 of its 2")):
        with pytest.raises(StorageError, match=where) as e:
            check_storage([_cfg(**CKPT)], nodes)
        assert "launch.storage" in str(e.value) and "s3://" in str(e.value)
    with pytest.raises(StorageError, match="train.max_failures=1"):
        check_storage([_cfg(**{**CKPT, "train.checkpoint_every": 0, "train.max_failures": 1})],
                      [_node(1), _node(1)])


def test_shared_storage_or_no_checkpoints_runs_anywhere(tmp_path):
    two = [_node(1), _node(1)]
    check_storage([_cfg(**{**CKPT, "launch.storage": str(tmp_path / "shared")})], two)
    check_storage([_cfg(**{**CKPT, "train.checkpoint_every": 0})], two)
    check_storage([_cfg(**CKPT)], two, storage_given=True)
    # GPU runs count GPU nodes: a CPU-only head is no host for them.
    gpu = {**CKPT, "parallel.use_gpu": True, "parallel.num_workers": 8}
    check_storage([_cfg(**gpu)], [_node(8), _node(96, gpus=8)])
    with pytest.raises(StorageError):
        check_storage([_cfg(**gpu)], [_node(8), _node(96, gpus=8), _node(96, gpus=8)])


def test_library_import_sets_no_auth_mode():
    """Importing rayvit's Ray layer leaves Ray's auth mode alone: it is chosen when Ray is reached."""
    env = clean_env()
    code = "import os, rayvit.trainer, rayvit.studies.sweep, rayvit.studies.search, rayvit.cli; print(os.environ.get('RAY_AUTH_MODE'))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "None"
