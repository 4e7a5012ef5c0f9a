"""Ray's own autoscaler grows a cluster from zero worker nodes for a sweep; a point beyond its maximum is
refused up front.

The cluster is Ray's real autoscaler (v1, what ``ray start --autoscaling-config`` runs) with its fake
multi-node provider: a head with 0 CPUs, worker nodes of 1 CPU, 0 to 2 of them. The provider starts
each "node" as a raylet on this machine. It normally makes them join on port 6379; its
``provider.gcs_address`` setting (fake_multi_node/node_provider.py) points them at our head on a free
port instead, so this test neither needs nor collides with 6379. The head runs in its own process group
with its own ``--temp-dir`` and a token of its own (passed by environment, as tests/ray/test_scaling_job.py
does), and the sweep runs as ``experiments/scaling.py`` attached with ``RAY_ADDRESS``. ``ray stop`` is
never used (it stops every Ray instance on the machine); teardown kills our process group and any
process that still names our temp dir.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from mlflow import MlflowClient

from clusters import free_port, pids_mentioning

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
MAX_WORKER_NODES = 2

# Reads the cluster's state straight from the GCS (no driver, so nothing is scheduled): alive nodes and
# the resource request rayvit leaves with the (v1) autoscaler.
PROBE = r'''
import json, sys
from ray._raylet import GcsClient
from ray.core.generated.gcs_pb2 import GcsNodeInfo
client = GcsClient(address=sys.argv[1])
nodes = client.get_all_node_info()
alive = [n for n in nodes.values() if n.state == GcsNodeInfo.ALIVE]
request = client.internal_kv_get(b"autoscaler_resource_request", namespace=None)
print(json.dumps({"cpu_nodes": sum(1 for n in alive if n.resources_total.get("CPU", 0) >= 1),
                  "nodes": len(alive), "request": request.decode() if request is not None else None}))
'''


def _autoscaling_config(gcs_address: str) -> dict:
    """A head with no CPUs and up to two 1-CPU worker nodes, none at start."""
    return {
        "cluster_name": "rayvit-fake",
        "max_workers": MAX_WORKER_NODES,
        "upscaling_speed": 10.0,
        # Long enough that the node of the 1-worker point is still up for the 2-worker point.
        "idle_timeout_minutes": 5,
        # As Ray's own fake_multi_node/example.yaml (absent from the wheel): with node updaters on, the
        # v1 autoscaler runs launcher set-up over its fake command runner, counts that as a failed
        # launch and terminates each node it just started.
        "provider": {"type": "fake_multinode", "gcs_address": gcs_address, "use_node_id_as_ip": True,
                     "disable_node_updaters": True, "disable_launch_config_check": True},
        "auth": {"ssh_user": "ubuntu"},
        "available_node_types": {
            "ray.head.default": {"resources": {"CPU": 0}, "node_config": {}, "max_workers": 0},
            "cpu1": {"resources": {"CPU": 1, "object_store_memory": 100_000_000}, "node_config": {}, "min_workers": 0,
                     "max_workers": MAX_WORKER_NODES},
        },
        "head_node_type": "ray.head.default",
        # The v1 autoscaler reads these launcher fields even though the fake provider ignores them.
        "file_mounts": {}, "cluster_synced_files": [], "file_mounts_sync_continuously": False,
        "rsync_exclude": [], "rsync_filter": [], "initialization_commands": [], "setup_commands": [],
        "head_setup_commands": [], "worker_setup_commands": [], "head_start_ray_commands": [],
        "worker_start_ray_commands": [],
    }


@pytest.fixture(scope="module")
def cluster():
    # Short path: Ray's unix sockets live under the temp dir and must stay under ~107 characters.
    tmp = Path(tempfile.mkdtemp(prefix="rvas", dir="/tmp"))
    ray_tmp = str(tmp / "ray")
    from ray._private.services import get_node_ip_address

    # `ray start` puts the GCS on the host's routable address; the fake nodes must dial the same one.
    address = f"{get_node_ip_address()}:{free_port()}"
    config = tmp / "autoscaling.json"
    config.write_text(json.dumps(_autoscaling_config(address)))
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI", "RAY_enable_autoscaler_v2")}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32), RAY_USAGE_STATS_ENABLED="0",
               RAY_FAKE_CLUSTER="1", AUTOSCALER_UPDATE_INTERVAL_S="1")
    dashboard = free_port()
    cmd = [str(BIN / "ray"), "start", "--head", "--block", f"--port={address.rsplit(':', 1)[1]}",
           "--num-cpus=0", f"--autoscaling-config={config}", f"--temp-dir={ray_tmp}",
           "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}",
           f"--ray-client-server-port={free_port()}", f"--dashboard-agent-listen-port={free_port()}",
           f"--metrics-export-port={free_port()}", "--object-store-memory=100000000", "--disable-usage-stats"]
    log = open(tmp / "head.log", "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{dashboard}/api/version", timeout=2).read()
                break
            except urllib.error.HTTPError:
                break  # it answers (401 without the token): the head is up
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail("ray head did not start:\n" + (tmp / "head.log").read_text()[-3000:])
                time.sleep(1)
        yield {"address": address, "env": env, "tmp": tmp, "store": f"sqlite:///{tmp}/mlflow.db"}
    finally:
        # SIGKILL at once, as clusters.Cluster stops its nodes: `ray start --block` spent the whole 5 s it
        # was given to exit on SIGTERM, and whatever it would have cleaned up is killed below anyway.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)
        # The fake nodes are raylets the autoscaler spawned; they share our temp dir, whatever their group.
        for pid in pids_mentioning(ray_tmp):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10
        while pids_mentioning(ray_tmp) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = pids_mentioning(ray_tmp)
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)
        assert not left, f"processes of the test cluster outlived it: {left}"


def _state(cluster) -> dict:
    probe = subprocess.run([sys.executable, "-c", PROBE, cluster["address"]], env=cluster["env"],
                           capture_output=True, text=True, timeout=60)
    assert probe.returncode == 0, probe.stderr[-2000:]
    return json.loads(probe.stdout.strip().splitlines()[-1])


def _sweep(cluster, name: str, worker_counts: str, timeout: float) -> subprocess.CompletedProcess:
    env = {**cluster["env"], "RAY_ADDRESS": cluster["address"], "MLFLOW_TRACKING_URI": cluster["store"],
           "RAYVIT_HOME": str(cluster["tmp"] / "home")}
    cmd = [sys.executable, "experiments/scaling.py", "--name", name, "--experiment", "autoscaling",
           "--set", "sweep.strategies=ddp", "--set", f"sweep.worker_counts={worker_counts}",
           "--set", "train.steps=6", "--set", "train.warmup_steps=2", "--set", "train.report_every=6",
           "--set", "launch.scale_up_timeout_s=120"]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def test_a_point_beyond_the_autoscalers_maximum_is_refused_before_anything_starts(cluster):
    assert _state(cluster)["cpu_nodes"] == 0          # the cluster starts with no worker node
    start = time.monotonic()
    # 1 worker would fit after growth; 3 never (2 nodes of 1 CPU): the whole plan is refused up front.
    proc = _sweep(cluster, "beyond", "1,3", timeout=120)
    elapsed = time.monotonic() - start
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-4000:]
    assert elapsed < 60, elapsed
    assert "asked for 3 workers" in out and "at most 2 worker nodes, room for 2 such workers" in out, out[-3000:]
    assert "[1/" not in out                            # no point started
    state = _state(cluster)
    assert state["cpu_nodes"] == 0 and not json.loads(state["request"] or "[]"), state   # nothing asked for
    client = MlflowClient(cluster["store"])
    experiment = client.get_experiment_by_name("autoscaling")
    assert experiment is None or not client.search_runs([experiment.experiment_id])   # nothing recorded


def test_a_sweep_grows_the_cluster_from_zero_worker_nodes_and_completes(cluster):
    assert _state(cluster)["cpu_nodes"] == 0
    proc = _sweep(cluster, "grow", "1,2", timeout=400)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    assert "2 points ran, 0 reused, 0 failed" in out, out[-3000:]
    # Each point asked for its nodes and waited for them: the first from zero, the second for one more.
    assert "ddp x 1 worker: asked the autoscaler for 1 CPU" in out, out[-3000:]
    assert "waiting for 1 more CPU: 0 of 1 node up" in out, out[-3000:]
    assert "waiting for 1 more CPU: 1 of 2 nodes up" in out, out[-3000:]
    assert out.count("the cluster holds it after") == 2, out[-3000:]
    state = _state(cluster)
    assert state["cpu_nodes"] == MAX_WORKER_NODES, state
    assert json.loads(state["request"]) == [], state   # the request was withdrawn after the last point
