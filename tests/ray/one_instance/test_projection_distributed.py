"""The projection against distributed runs: model-state bytes at world size 2 over gloo, and the collective
microbenchmark on two Ray workers."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from rayvit.config import load_config
from rayvit.projection import memory
from rayvit.strategies.shapes import vit_tensors
from rayvit.strategies import fairscale_oss as oss

from helpers_projection import reduce_dtype

ROOT = Path(__file__).resolve().parents[3]
DEFAULT = ROOT / "experiments/configs/cpu_default.yaml"
STUDY = ROOT / "experiments/configs/study_a100.yaml"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_model_state_equals_the_built_strategies_at_world_size_2():
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "PYTHONWARNINGS": "ignore"}
    worker = [sys.executable, str(ROOT / "tests/ray/one_instance/_projection_state_worker.py")]
    procs = [subprocess.Popen(worker, env={**env, "RANK": str(r)}, stdout=subprocess.PIPE, text=True)
             for r in range(2)]
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs)
    measured = json.loads(next(line for line in outputs[0].splitlines() if line.startswith("RESULT "))[7:])
    for key, value in measured.items():
        strategy, mode = key.split("/")[:2]
        cfg = load_config(DEFAULT, [f"parallel.strategy={strategy}", f"precision.mode={mode}",
                                    reduce_dtype(strategy, mode)])
        if key.endswith("small_bucket"):
            oss.SHARDED_DDP_BUCKET, saved = 5000, oss.SHARDED_DDP_BUCKET
            try:
                assert 0 < len(oss.sharded_ddp_bucketed(vit_tensors(cfg.model), oss.oss_owner(
                    vit_tensors(cfg.model), 2), 2)) < len(vit_tensors(cfg.model))
                assert memory.model_state(cfg, 2).total == value, key
            finally:
                oss.SHARDED_DDP_BUCKET = saved
            continue
        assert memory.model_state(cfg, 2).total == value, key


@pytest.mark.slow
def test_collective_microbenchmark_on_two_ray_workers(tmp_path, monkeypatch, shared_ray):
    """On the local instance conftest.py shares with the trainer's modules (measure_links uses the caller's
    instance; it would start one of its own otherwise)."""
    monkeypatch.setenv("RAYVIT_HOME", str(tmp_path))
    from rayvit.launch.links_on_ray import measure_links
    from rayvit.measure.timers import KINDS

    links = measure_links(2, model=load_config(DEFAULT).to_dict(), batch=4, repeats=3)
    assert links["backend"] == "gloo" and links["world_size"] == 2 and links["nodes"] == 1
    assert set(links["collectives"]) == set(KINDS)
    for c in links["collectives"].values():
        assert c["busbw"] > 0 and c["latency_s"] >= 0 and len(c["points"]) == 4
    assert links["shared_host_slowdown"] > 0 and links["memory_bw"] > 0
    # No wait read between rounds here: the workers read the curve themselves, after 2 and 10 ms of compute.
    assert [g for g, _ in links["host_wait_curve"]] == [2e-3, 10e-3]
    assert all(w >= 0 for _, w in links["host_wait_curve"]) and links["collective_path_s"] == {}
