"""``ray job submit --working-dir . -- python experiments/scaling.py``, against a real head on loopback.

The head runs with its own temp dir and a token of its own (passed by environment, never written to
``~/.ray``), in its own process group, which the test ends by id: ``ray stop`` would stop every Ray
process on the machine, including other people's.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from mlflow import MlflowClient

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def head():
    # Short path: Ray's unix sockets live under the temp dir and must stay under ~107 characters.
    tmp = Path(tempfile.mkdtemp(prefix="rvjob", dir="/tmp"))
    dashboard = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI")}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32), RAY_USAGE_STATS_ENABLED="0")
    cmd = [str(BIN / "ray"), "start", "--head", "--block", f"--port={_free_port()}",
           "--node-ip-address=127.0.0.1", "--num-cpus=2", "--include-dashboard=true",
           "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}", f"--temp-dir={tmp / 'ray'}"]
    log = open(tmp / "head.log", "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{dashboard}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                urllib.request.urlopen(url + "/api/version", timeout=2).read()
                break
            except urllib.error.HTTPError:
                break  # it answers (401 without the token): the dashboard is up
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail("ray head did not start:\n" + (tmp / "head.log").read_text()[-3000:])
                time.sleep(1)
        yield url, env, tmp
    finally:
        # `ray start --block` and its children outlive SIGTERM for a while: TERM, wait, then KILL the group.
        for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                pass
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)


def test_sweep_as_a_ray_job(head):
    url, env, tmp = head
    store = f"sqlite:///{tmp}/mlflow.db"
    runtime_env = {"env_vars": {"MLFLOW_TRACKING_URI": store, "RAYVIT_HOME": str(tmp / "home")}}
    cmd = [str(BIN / "ray"), "job", "submit", "--address", url, "--working-dir", ".",
           "--runtime-env-json", json.dumps(runtime_env), "--",
           sys.executable, "experiments/scaling.py", "--name", "as-job",
           "--set", "sweep.strategies=ddp,fsdp", "--set", "sweep.worker_counts=2",
           "--set", "train.steps=6", "--set", "train.warmup_steps=2", "--set", "train.report_every=6"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
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
    assert len(json.loads(actors.stdout)) == 2
