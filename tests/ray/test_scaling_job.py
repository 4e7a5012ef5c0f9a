"""``ray job submit --working-dir . -- python experiments/scaling.py``, against a real head on loopback
with token authentication on; and what a driver or a submission without the cluster's token gets.

The head runs with its own temp dir, an empty ``HOME`` and a token of its own (passed by environment,
never written to ``~/.ray``), in its own process group, which the test ends by id: ``ray stop`` would
stop every Ray process on the machine, including other people's. A job inherits the head's environment,
token included; ``ray job submit`` itself needs the token too (``RAY_AUTH_MODE=token`` and
``RAY_AUTH_TOKEN`` in the submitting shell). The same sweep on a cluster without authentication is in
test_cluster_auth.py.

The job is submitted as soon as the head is up (``sweep_job``, for every test of the module) and runs
while the token tests run against the same head; its test comes last and waits for it. ``ray job
submit`` spends seconds on one core packaging and uploading the working dir, and the job's driver and
workers starting, which the short tests' processes fill. Those tests start no actor (the job test
counts the head's Train controllers) and check the cluster's total CPUs, not what is free.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient

from clusters import SweepJob, clean_env, running_head

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def token_cluster(tmp_path_factory):
    logs = tmp_path_factory.mktemp("job")
    home = tmp_path_factory.mktemp("head-home")        # empty: no ~/.ray/auth_token to fall back on
    env = clean_env(HOME=str(home), RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))
    with running_head(logs, env, prefix="rvjob") as cluster:
        yield cluster


@pytest.fixture(scope="module")
def head(token_cluster, tmp_path_factory):
    return token_cluster.dashboard_url, token_cluster.env, tmp_path_factory.mktemp("job-records")


@pytest.fixture(scope="module", autouse=True)
def sweep_job(head):
    """``ray job submit`` of a 2-point sweep, started in the background when the head is up; its output
    (stdout and stderr) goes to a file. If no test waited for it, the job is stopped at the module's end:
    Ray starts a job's driver in a session of its own, which stopping the head would not end."""
    url, env, tmp = head
    job = SweepJob(url, env, tmp / "submit.log", f"sqlite:///{tmp}/mlflow.db", tmp / "home",
                   ["--set", "sweep.strategies=ddp,fsdp", "--set", "sweep.worker_counts=2",
                    "--set", "train.steps=6", "--set", "train.warmup_steps=2", "--set", "train.report_every=6"],
                   name="as-job", limit_s=400)
    try:
        yield job.submit(REPO)
    finally:
        job.stop()


_ATTACH = ("import sys, ray\n"
           "from rayvit.launch.connect import ConnectError, ensure_ray\n"
           "try:\n    ensure_ray(sys.argv[1])\n"
           "except ConnectError as e:\n    print('refused:', e); sys.exit(2)\n"
           "print('attached, CPUs:', ray.cluster_resources().get('CPU'))\n")


def test_drivers_need_the_clusters_token(token_cluster, tmp_path):
    """A driver attaching without the token, or with another one, is refused at once with what to do;
    with the token (and no RAY_AUTH_MODE: the mode is the cluster's) it attaches."""
    token = token_cluster.env["RAY_AUTH_TOKEN"]
    no_home = str(tmp_path / "home")                   # no ~/.ray/auth_token either
    envs = {"none": clean_env(HOME=no_home), "wrong": clean_env(HOME=no_home, RAY_AUTH_TOKEN="0" * 64),
            "right": clean_env(HOME=no_home, RAY_AUTH_TOKEN=token)}
    procs = {k: subprocess.Popen([sys.executable, "-c", _ATTACH, token_cluster.address], cwd=REPO, env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for k, env in envs.items()}
    out = {k: (p.communicate(timeout=90)[0], p.returncode) for k, p in procs.items()}
    text, rc = out["none"]
    assert rc == 2 and "token authentication on, and no token was found here" in text, text[-3000:]
    assert "ray get-auth-token" in text and "RAY_AUTH_TOKEN" in text, text[-3000:]
    text, rc = out["wrong"]
    assert rc == 2 and "rejected this process's token (from $RAY_AUTH_TOKEN)" in text, text[-3000:]
    text, rc = out["right"]
    assert rc == 0 and "attached, CPUs: 2.0" in text, text[-3000:]


def test_sweep_without_the_token_exits_2(token_cluster, tmp_path):
    """The CLI reports the missing token as a start-up error (status 2), before any MLflow record."""
    env = clean_env(HOME=str(tmp_path / "home"), RAYVIT_HOME=str(tmp_path / "rv"),
                    MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path}/mlflow.db")
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "experiments/scaling.py", "--address", token_cluster.address,
                           "--set", "sweep.strategies=ddp", "--set", "sweep.worker_counts=1"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=90)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert "error: the Ray cluster at" in out and "no token was found" in out and "Traceback" not in out
    assert time.monotonic() - start < 30
    assert not (tmp_path / "mlflow.db").exists()


def test_job_submission_without_the_token_is_refused(token_cluster, tmp_path):
    """``ray job submit`` with no token is refused by the head's dashboard (Ray's own check)."""
    proc = subprocess.run([str(BIN / "ray"), "job", "submit", "--address", token_cluster.dashboard_url,
                           "--", "python", "-c", "print('ran')"], cwd=tmp_path,
                          env=clean_env(HOME=str(tmp_path / "home")), capture_output=True, text=True,
                          timeout=90)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "ran" not in proc.stdout, out[-3000:]
    assert "Authentication required" in out, out[-3000:]


def test_sweep_as_a_ray_job(head, sweep_job):
    """Last: the job was submitted when the head came up (``sweep_job``) and ran while the tests above did."""
    url, env, tmp = head
    rc, out = sweep_job.result()
    store = sweep_job.store
    assert rc == 0, out[-4000:]
    assert "succeeded" in out and "2 points ran, 0 reused, 0 failed" in out

    # The job ran in a temporary copy of the repo; its records must still be in the store we named.
    client = MlflowClient(store)
    exp = client.get_experiment_by_name("cpu_default")
    (parent,) = client.search_runs([exp.experiment_id], "tags.`rayvit.kind` = 'sweep'")
    assert parent.data.tags["rayvit.sweep"] == "as-job" and parent.info.status == "FINISHED"
    children = client.search_runs([exp.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}' "
                                                       "and tags.`rayvit.kind` = 'point'")
    assert sorted(c.data.tags["rayvit.point"] for c in children) == ["ddp/w2", "fsdp/w2"]
    assert all(c.info.status == "FINISHED" for c in children)
    assert {"results.parquet", "scaling.png"} <= {f.path for f in client.list_artifacts(parent.info.run_id)}
    # The job's driver attached to this head (its Train controllers ran here) instead of starting its own.
    actors = subprocess.run([str(BIN / "ray"), "list", "actors", "--address", url, "--filter",
                             "class_name=TrainController", "--format", "json"], env=env, capture_output=True,
                            text=True, timeout=60)
    assert actors.returncode == 0, actors.stderr[-2000:]
    # One controller for both points: they shared one worker group (interleaved rounds), and the links
    # were measured on its workers, with no run of their own.
    assert len(json.loads(actors.stdout)) == 1
