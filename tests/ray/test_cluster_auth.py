"""A cluster started with ``ray start --head`` and Ray's defaults: token authentication off.

Ray 2.60 turns token authentication on by default only for local instances (``ray.init()``); a
``ray start`` head runs without it unless ``RAY_AUTH_MODE=token`` is set, or a token file exists in
``~/.ray`` (``ray start`` then enables it). So the head here gets an empty ``HOME``: no token exists
anywhere, as on a fresh cluster. rayvit's drivers must attach in the cluster's mode: a driver that forced
token mode here would fail with "Token authentication is enabled but no authentication token was
found". The token-authentication side is in test_scaling_job.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from mlflow import MlflowClient

from clusters import SweepJob, clean_env, running_head

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).with_name("ray"))


@pytest.fixture(scope="module")
def open_cluster(tmp_path_factory):
    home = tmp_path_factory.mktemp("home")               # empty: no ~/.ray/auth_token
    with running_head(tmp_path_factory.mktemp("auth-off"), clean_env(HOME=str(home)), prefix="rvoff") as cluster:
        mode = json.loads(urllib.request.urlopen(cluster.dashboard_url + "/api/authentication_mode",
                                                 timeout=10).read())
        assert mode == {"authentication_mode": "disabled"}, mode
        yield cluster


@pytest.fixture(scope="module", autouse=True)
def sweep_job(open_cluster, tmp_path_factory):
    """The issue's reproduction, ``ray job submit --working-dir . -- python experiments/scaling.py``, started
    in the background when the head is up; its output (stdout and stderr) goes to a file. If no test
    waited for it, the job is stopped at the module's end: Ray starts a job's driver in a session of its
    own, which stopping the head would not end."""
    tmp = tmp_path_factory.mktemp("job")
    job = SweepJob(open_cluster.dashboard_url, open_cluster.env, tmp / "submit.log", f"sqlite:///{tmp}/mlflow.db",
                   tmp / "rv", ["--set", "sweep.strategies=ddp", "--set", "sweep.worker_counts=1",
                                "--set", "train.steps=6", "--set", "train.warmup_steps=2",
                                "--set", "train.report_every=6"], name="no-auth", limit_s=300)
    try:
        yield job.submit(REPO)
    finally:
        job.stop()


def test_local_instance_keeps_token_authentication_quietly(tmp_path):
    """No address: a local instance, token authentication on (its GCS refuses a call without the
    token), and without Ray's "Token authentication is enabled" warning. The module's head and its job
    run meanwhile, in their own temp dir: this instance never finds them."""
    code = ("import ray\nfrom rayvit.launch.connect import cluster_auth_mode, ensure_ray\n"
            "ensure_ray()\nprint('mode:', cluster_auth_mode(ray.get_runtime_context().gcs_address))\n"
            "ray.shutdown()\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=clean_env(HOME=str(tmp_path)),
                          capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "mode: token" in proc.stdout, out[-3000:]
    assert "Token authentication is enabled" not in out, out[-3000:]


def test_driver_with_token_mode_in_its_environment_takes_the_clusters_mode(open_cluster, tmp_path):
    """A driver whose shell says RAY_AUTH_MODE=token (left from another cluster, or a local habit) and
    has no token still attaches here: the mode is the cluster's, not the environment's."""
    code = ("import sys, ray\nfrom rayvit.launch.connect import ensure_ray\nensure_ray(sys.argv[1])\n"
            "print('attached, CPUs:', ray.cluster_resources().get('CPU'))\n")
    env = clean_env(HOME=str(tmp_path / "home"), RAY_AUTH_MODE="token")
    proc = subprocess.run([sys.executable, "-c", code, open_cluster.address], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0 and "attached, CPUs: 2.0" in proc.stdout, (proc.stdout + proc.stderr)[-3000:]


def test_sweep_as_a_job_on_a_cluster_without_authentication(open_cluster, sweep_job):
    """The issue's reproduction (``sweep_job``, submitted when the head came up): last, it waits for the job."""
    rc, out = sweep_job.result()
    store = sweep_job.store
    assert rc == 0, out[-4000:]
    assert "succeeded" in out and "1 points ran, 0 reused, 0 failed" in out, out[-4000:]
    assert "AuthenticationError" not in out

    client = MlflowClient(store)
    exp = client.get_experiment_by_name("cpu_default")
    (child,) = client.search_runs([exp.experiment_id], "tags.`rayvit.kind` = 'point'")
    assert child.data.tags["rayvit.point"] == "ddp/w1" and child.info.status == "FINISHED"
    # Nothing made up a token on the way: the cluster stays as its operator configured it.
    assert not (Path(open_cluster.env["HOME"]) / ".ray" / "auth_token").exists()
