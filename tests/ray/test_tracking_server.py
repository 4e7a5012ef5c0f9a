"""Sweep records through a real ``mlflow server`` over HTTP, as on a cluster's head node."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient

from rayvit.record import tracking
from rayvit.results import RunResult

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def make_result(strategy: str, world_size: int, tflops: float, images_per_chip: float, gpu: bool = False) -> RunResult:
    """A RunResult as the trainer returns it, with chosen figures (inputs for the code under test).

    Peak memory per rank is 4e7, 5e7, ... bytes (max 5e7 at two ranks); ``gpu`` adds what a CUDA run with
    NVML records (reserved memory, utilisation, power).
    """
    metrics = {"images_per_sec": images_per_chip * world_size, "images_per_sec_per_chip": images_per_chip,
               "tflops_per_chip": tflops, "mfu": tflops / 2.0, "step_time_p50_s": 0.1, "step_time_p90_s": 0.12,
               "model_state_bytes_per_rank": 4e6 / (world_size if strategy != "ddp" else 1),
               "peak_memory_bytes_per_rank": 5e7, "final_loss": 1.5, "val_accuracy": None,
               "epoch_time_imagenet_h": 3.0, "train_flops_per_image": 1e9, "peak_tflops": 2.0,
               "timed_steps": 10, "wall_time_s": 4.0}
    per_rank = {"peak_memory_bytes": [4e7 + 1e7 * r for r in range(world_size)]}
    metrics["peak_memory_bytes_per_rank"] = max(per_rank["peak_memory_bytes"])
    if gpu:
        per_rank.update(peak_memory_reserved_bytes=[6e7 + 1e7 * r for r in range(world_size)],
                        gpu_utilization_pct=[90.0 - 10 * r for r in range(world_size)],
                        gpu_power_w=[400.0 - 50 * r for r in range(world_size)])
        metrics.update(peak_memory_reserved_bytes_per_rank=max(per_rank["peak_memory_reserved_bytes"]),
                       gpu_utilization_pct=sum(per_rank["gpu_utilization_pct"]) / world_size,
                       gpu_utilization_pct_max=90.0, gpu_power_w=sum(per_rank["gpu_power_w"]) / world_size,
                       gpu_power_w_max=400.0, gpu_samples=30.0)
    conditions = {"model": "custom", "image_size": 32, "batch_per_chip": 16, "precision": "fp32",
                  "strategy": strategy, "world_size": world_size, "accelerator": "cpu",
                  "torch_version": "2.13.0", "ray_version": "2.60.0", "fairscale_version": "0.4.13",
                  "rayvit_version": "0.1.0", "data": "synthetic",
                  "memory_measure": "cuda_allocated" if gpu else "process_rss"}
    history = [{"step": s, "loss": 2.0 - 0.1 * s, "lr": 1e-3, "step_time_s": 0.1} for s in range(1, 6)]
    return RunResult(metrics, conditions, history, config={"parallel": {"strategy": strategy}},
                     per_rank=per_rank)


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
