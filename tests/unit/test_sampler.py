"""Memory and GPU-utilisation figures per worker, on CPU: the sampler's timing window and averaging with an
injected reading function, NVML's absence without a GPU, how ranks combine, and the loop's wiring.

The real NVML path needs a GPU: experiments/gpu_check.py checks it (``nvml sampler``).
"""

from __future__ import annotations

import math
import threading
import time

import pytest
import torch

from rayvit.config import load_config
from rayvit.results import METRIC_KEYS, PER_RANK_KEYS
from rayvit.worker import Session, run_figures, step_clock, train
from rayvit.worker.metrics import across_ranks
from rayvit.worker.sampler import Sampler, mean_readings, nvml_candidates, nvml_reader, nvml_sampler

GPU_KEYS = ("peak_memory_reserved_bytes_per_rank", "gpu_utilization_pct", "gpu_utilization_pct_max",
            "gpu_power_w", "gpu_power_w_max", "gpu_samples")


def test_mean_readings_averages_each_key_and_counts_readings():
    readings = [{"gpu_utilization_pct": 90.0, "gpu_power_w": 300.0},
                {"gpu_utilization_pct": 100.0, "gpu_power_w": float("nan")},
                {"gpu_utilization_pct": 80.0, "gpu_power_w": 500.0}]
    assert mean_readings(readings) == {"gpu_utilization_pct": 90.0, "gpu_power_w": 400.0, "samples": 3.0}
    assert mean_readings([]) == {}                     # nothing read: no figure, not a zero


def test_sampler_counts_readings_only_while_active_and_stops_once():
    ticks, closed = [], []

    def read():
        ticks.append(time.monotonic())
        return {"gpu_utilization_pct": 50.0 + len(ticks) % 2 * 10, "gpu_power_w": 200.0}

    sampler = Sampler(read, interval_s=0.005, close=lambda: closed.append(True))
    sampler.start()
    time.sleep(0.05)
    assert ticks == []                                 # started but inactive (warm-up, between steps)
    sampler.activate()
    deadline = time.monotonic() + 5
    while len(ticks) < 4 and time.monotonic() < deadline:
        time.sleep(0.005)
    sampler.deactivate()
    time.sleep(0.2)                                    # a tick already under way may still land
    counted = len(sampler.readings)
    time.sleep(0.1)
    assert len(sampler.readings) == counted >= 4      # nothing more while inactive
    result = sampler.stop()
    assert result["samples"] == counted and result["gpu_power_w"] == 200.0
    assert 50.0 <= result["gpu_utilization_pct"] <= 60.0
    assert not any(t.name == "rayvit-sampler" for t in threading.enumerate())
    assert sampler.stop() == result and closed == [True]   # idempotent, NVML shut down once


def test_a_failing_reading_is_skipped_and_a_sampler_that_never_read_reports_nothing():
    calls = iter([RuntimeError("NVML_ERROR_UNKNOWN"), {"gpu_power_w": 100.0}])

    def read():
        value = next(calls)
        if isinstance(value, Exception):
            raise value
        return value

    sampler = Sampler(read, interval_s=60)
    sampler.sample()
    sampler.sample()
    assert sampler.errors == 1 and sampler.stop() == {"gpu_power_w": 100.0, "samples": 1.0}
    assert Sampler(read, interval_s=60).stop() == {}
    with pytest.raises(ValueError):
        Sampler(read, interval_s=0)


def test_nvml_is_absent_without_a_gpu():
    cpu = torch.device("cpu")
    assert nvml_reader(cpu) is None and nvml_sampler(cpu) is None
    if not torch.cuda.is_available():
        assert nvml_reader(torch.device("cuda", 0)) is None


def test_the_torch_device_is_found_in_nvml_by_uuid_then_pci_then_visible_devices():
    uuid = "5ba4c1f5-9d1c-4b52-8c8d-0a1f3c2b7e10"
    assert nvml_candidates(0, uuid, "00000000:1b:00.0", "3,5") == [
        ("uuid", f"GPU-{uuid}"), ("uuid", f"MIG-{uuid}"), ("pci", "00000000:1b:00.0"), ("index", 3)]
    # Ray Train gives each worker one GPU: its torch index 0 is the machine's NVML index 5.
    assert nvml_candidates(0, visible_devices="5") == [("index", 5)]
    assert nvml_candidates(1, visible_devices="GPU-abc, GPU-def") == [("uuid", "GPU-def")]
    assert nvml_candidates(2) == [("index", 2)]            # nothing hidden: same numbering assumed
    assert nvml_candidates(1, visible_devices="4") == []   # not visible: no guess


def test_ranks_combine_into_max_mean_and_per_rank_lists():
    figures, lists = across_ranks({
        "peak_memory_bytes": [3e9, 4e9], "peak_memory_reserved_bytes": [5e9, 6e9],
        "gpu_utilization_pct": [90.0, 70.0], "gpu_power_w": [400.0, 300.0], "gpu_samples": [40.0, 38.0]})
    assert figures == {"peak_memory_bytes_per_rank": 4e9, "peak_memory_reserved_bytes_per_rank": 6e9,
                       "gpu_utilization_pct": 80.0, "gpu_utilization_pct_max": 90.0,
                       "gpu_power_w": 350.0, "gpu_power_w_max": 400.0, "gpu_samples": 38.0}
    assert lists == {"peak_memory_bytes": [3e9, 4e9], "peak_memory_reserved_bytes": [5e9, 6e9],
                     "gpu_utilization_pct": [90.0, 70.0], "gpu_power_w": [400.0, 300.0]}
    assert set(figures) <= set(METRIC_KEYS) and set(lists) <= set(PER_RANK_KEYS)
    # CPU: memory only. A rank without readings: its list entry is None and no run figure is made up.
    nan = math.nan
    figures, lists = across_ranks({"peak_memory_bytes": [1e8, 2e8], "peak_memory_reserved_bytes": [nan, nan],
                                   "gpu_utilization_pct": [80.0, nan], "gpu_power_w": [nan, nan],
                                   "gpu_samples": [12.0, nan]})
    assert figures == {"peak_memory_bytes_per_rank": 2e8}
    assert lists == {"peak_memory_bytes": [1e8, 2e8], "gpu_utilization_pct": [80.0, None]}


def _tiny(*overrides):
    return load_config(None, ["model.name=custom", "model.hidden_dim=32", "model.depth=1", "model.num_heads=2",
                        "model.mlp_dim=64", "model.patch_size=8", "model.image_size=16", "train.batch_size=4",
                        "parallel.num_workers=1", *overrides])


def test_cpu_run_records_its_resident_set_per_rank_and_no_gpu_figures():
    result = train(_tiny("train.steps=3", "train.warmup_steps=1"))
    m = result.metrics
    assert m["peak_memory_bytes_per_rank"] > 50 * 2**20          # a process with torch loaded
    assert result.per_rank == {"peak_memory_bytes": [m["peak_memory_bytes_per_rank"]]}
    assert not set(GPU_KEYS) & set(m)
    assert result.conditions["memory_measure"] == "process_rss"
    assert result.row()["peak_memory_bytes_by_rank"] == [m["peak_memory_bytes_per_rank"]]


def test_the_loop_samples_from_the_first_timed_step_and_only_during_steps(monkeypatch):
    made = []

    def fake_sampler(device):
        sampler = Sampler(lambda: {"gpu_utilization_pct": 75.0, "gpu_power_w": 250.0}, interval_s=60)
        made.append(sampler)
        return sampler

    monkeypatch.setattr(step_clock, "nvml_sampler", fake_sampler)
    session = Session(_tiny("train.steps=6", "train.warmup_steps=2"))
    during = []                                                 # inside each step: do readings count?
    forward = session.forward
    session.forward = lambda x: (during.append(session.clock.sampler is not None and session.clock.sampler._active.is_set()),
                                 forward(x))[1]
    try:
        for _ in range(5):
            session.clear_grads()
            session.train_step()
            if session.clock.sampler is not None:
                assert not session.clock.sampler._active.is_set()    # between steps: they do not
                session.clock.sampler.sample()                        # what a tick during the step would read
        assert during == [False, False, True, True, True]      # warm-up: no sampler at all
        assert len(made) == 1 and session.clock.sampler.started
        result = run_figures.summary(session, 1.0)
    finally:
        session.close()
    m = result.metrics
    assert (m["gpu_utilization_pct"], m["gpu_power_w"], m["gpu_samples"]) == (75.0, 250.0, 3.0)
    assert (m["gpu_utilization_pct_max"], m["gpu_power_w_max"]) == (75.0, 250.0)
    assert result.per_rank["gpu_utilization_pct"] == [75.0] and result.per_rank["gpu_power_w"] == [250.0]
    assert "peak_memory_reserved_bytes_per_rank" not in m                # CPU: no reserved figure
