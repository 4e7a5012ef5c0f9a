"""Sweep records through a real ``mlflow server`` over HTTP, as on a cluster's head node."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient

from rayvit.record import tracking

from helpers_results import make_result

@pytest.fixture
def store(tmp_path, monkeypatch):
    uri = "sqlite:///" + str(tmp_path / "store" / "mlflow.db")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    return uri


def test_sweep_records_through_a_tracking_server(tmp_path):
    """The cluster setup: an ``mlflow server`` on the head, drivers logging over HTTP."""
    import os
    import signal
    import subprocess
    import sys
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mlflow_bin = Path(sys.executable).parent / "mlflow"
    server = subprocess.Popen(
        [str(mlflow_bin), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{tmp_path}/server.db", "--artifacts-destination", str(tmp_path / "arts")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                urllib.request.urlopen(uri + "/health", timeout=2).read()
                break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, "mlflow server did not start"
                time.sleep(0.5)
        tracking.check_reachable(uri)
        t = tracking.SweepTracker(uri, "over-http", "s1")
        parent = t.start(params={"model.name": "custom"}, tags={}, config_yaml="a: 1\n")
        child = t.start_point("ddp/w2", "ddp/w2", "h", {"parallel.strategy": "ddp"}, {"strategy": "ddp"})
        t.finish_point(child, make_result("ddp", 2, 0.4, 80.0, gpu=True), step=2)
        t.log_metrics(parent, {"tflops_per_chip/ddp": 0.4}, step=2)
        t.end("FINISHED")
        again = tracking.SweepTracker(uri, "over-http", "s1")
        assert again.find_parent() == parent
        (run_id, result, _), = again.completed().values()
        assert run_id == child and result.metrics["tflops_per_chip"] == 0.4
        # A GPU run's memory, utilisation and power: run figures at step = chips, each rank's at step = rank.
        client = MlflowClient(uri)
        logged = client.get_run(child).data.metrics
        assert (logged["gpu_utilization_pct"], logged["gpu_utilization_pct_max"], logged["gpu_power_w"],
                logged["gpu_power_w_max"], logged["peak_memory_reserved_bytes_per_rank"]) == (
            85.0, 90.0, 375.0, 400.0, 7e7)
        for key, values in result.per_rank.items():
            history = client.get_metric_history(child, f"{key}_by_rank")
            assert sorted((m.step, m.value) for m in history) == list(enumerate(values)), key
        assert result.per_rank["gpu_power_w"] == [400.0, 350.0]
        assert (tmp_path / "arts").exists()  # artifacts went through the server, not to this directory
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)
