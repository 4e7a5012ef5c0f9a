"""The collective microbenchmark a sweep runs on its own workers after training, fitted to
``latency + factor x bytes / busbw`` per collective, and the host properties the step model needs beside
it (the compute slowdown of a full node, the memory copy bandwidth, the wait for the slowest rank, each
strategy's own host path per collective).

Two parts, measured apart because they vary differently: the transfer (barrier-aligned, fitted per kind)
and the host's wait for the slowest rank (a curve against the compute before the collective, read
between a sweep's rounds: :func:`rayvit.measure.timers.wait_curve`). The method, and what it reads on CPU
hosts: docs/projection.md. :func:`rayvit.launch.links_on_ray.measure_links` runs :func:`worker_benchmark` on Ray
Train workers of its own; :func:`rayvit.projection.hardware_profile.with_measured_links` turns its result (a
JSON-able links dict) into a hardware profile.
"""

from __future__ import annotations

import socket
import statistics
import time
from typing import Any, Optional

from rayvit.measure.paths import collective_paths
from rayvit.measure.timers import (CPU_SIZES, GPU_SIZES, aligned_s, time_collectives, timed_plain, wait_curve)
from rayvit.strategies.costs import bus_factor

def mean_curve(curves: list) -> list[list[float]]:
    """The mean wait at each gap over several :func:`wait_curve` readings (same gaps)."""
    return [[gap, statistics.fmean(float(c[i][1]) for c in curves)] for i, (gap, _) in enumerate(curves[0])]


def host_wait(in_step: dict[str, list[list[float]]], aligned: dict[str, list[list[float]]]) -> float:
    """Mean seconds a collective issued inside a step waits beyond its barrier-aligned time, pooled over
    every kind and size (each point is the mean of the same number of repeats)."""
    extra = [s - a for kind in in_step for (_, s), (_, a) in zip(in_step[kind], aligned[kind])]
    return max(0.0, statistics.fmean(extra)) if extra else 0.0


def fit_link(points: list[list[float]], kind: str, n: int) -> dict[str, float]:
    """``t = latency + factor(kind, n) x bytes / busbw`` by least squares on relative error (each size
    counts alike, so the small, latency-bound messages are fitted as well as the large ones)."""
    xs = [bus_factor(kind, n) * b for b, _ in points]
    ts = [t for _, t in points]
    w = [1.0 / t ** 2 for t in ts]
    sw, sx, st = sum(w), sum(wi * x for wi, x in zip(w, xs)), sum(wi * t for wi, t in zip(w, ts))
    sxx = sum(wi * x * x for wi, x in zip(w, xs))
    sxt = sum(wi * x * t for wi, x, t in zip(w, xs, ts))
    det = sw * sxx - sx * sx
    slope = (sw * sxt - sx * st) / det if det else 0.0
    latency = (st - slope * sx) / sw
    if slope <= 0 or latency < 0:
        # Noise swamped the fit: latency from the smallest message, bandwidth from the largest.
        latency = min(ts)
        slope = max(ts[-1] - latency, 1e-12) / max(xs[-1], 1.0)
    return {"latency_s": latency, "busbw": 1.0 / slope}


def _train_probe(model_cfg: Optional[dict], device, batch: int):
    """One forward + backward of the sweep's model (a matmul when no model is given)."""
    import torch

    if model_cfg is None:
        a = torch.randn(512, 512, device=device)
        return lambda: (a @ a).sum().item()
    from rayvit.config import from_dict
    from rayvit.models import build_model

    cfg = from_dict(model_cfg)
    model = build_model(cfg.model).to(device)
    images = torch.randn(batch, 3, cfg.model.image_size, cfg.model.image_size, device=device)

    def step():
        model.zero_grad(set_to_none=True)
        model(images).float().sum().backward()
    return step


def shared_host_slowdown(device, model_cfg: Optional[dict], batch: int, rounds: int = 5,
                         steps: int = 10) -> float:
    """Median over rounds of (rank 0's mean step time while every rank computes) / (while the others sleep).

    Sleeping ranks use no CPU, so 'alone' really is alone; alternating rounds cancel drift. Means over
    ``steps``, not medians: throughput is a mean, and what a busy host costs is mostly the rare step a
    background process (Ray's own, the OS's) lands on, which has a spare core to run on while the others
    sleep and takes a worker's otherwise; medians of a few steps drop exactly those (docs/projection.md).
    """
    import torch
    import torch.distributed as dist

    from rayvit.training.hardware import synchronize

    step = _train_probe(model_cfg, device, batch)
    for _ in range(2):
        step()
    rank = dist.get_rank()
    one = torch.tensor([timed_plain(step, device) if rank == 0 else 0.0], dtype=torch.float64, device=device)
    dist.broadcast(one, src=0)

    def mean_step() -> float:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        synchronize(device)
        return (time.perf_counter() - start) / steps

    ratios = []
    for _ in range(rounds):
        dist.barrier()
        if rank == 0:
            alone = mean_step()
        else:
            time.sleep(steps * one.item() * 1.5)
        dist.barrier()
        together = mean_step()
        if rank == 0:
            ratios.append(together / alone)
    mine = torch.tensor([statistics.median(ratios) if rank == 0 else 0.0], dtype=torch.float64, device=device)
    dist.broadcast(mine, src=0)
    return mine.item()


def copy_bandwidth(device, megabytes: int) -> float:
    """Bytes/s of a large device-memory copy (read + write), the optimizer step's bound."""
    import torch

    src = torch.ones(megabytes * 2 ** 18, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    seconds = min(aligned_s(lambda: dst.copy_(src), device, 1) for _ in range(5))
    return 2 * src.numel() * 4 / seconds


def worker_benchmark(config: dict[str, Any]) -> dict[str, Any]:
    """The per-worker function (Ray Train, or any initialised process group). Rank 0 returns the links."""
    import torch
    import torch.distributed as dist

    device = torch.device("cpu")
    if config.get("use_gpu"):
        import ray.train.torch

        device = ray.train.torch.get_device()
    torch.set_num_threads(int(config.get("threads", 1)))
    n = dist.get_world_size()
    hosts = [None] * n
    dist.all_gather_object(hosts, socket.gethostname())
    start = time.perf_counter()
    sizes = config.get("sizes") or (GPU_SIZES if device.type == "cuda" else CPU_SIZES)
    # The wait read between a worker group's rounds (``host_waits``: wait curves, or single 2-ms readings
    # from older callers) covers the minutes the points were measured in; else it is read here. With
    # curves from the rounds, the per-kind in-step means would only repeat them (and take seconds).
    during = list(config.get("host_waits") or [])
    curves = [c for c in during if isinstance(c, (list, tuple))]
    flat = [float(w) for w in during if not isinstance(w, (list, tuple))]
    points, aligned = time_collectives(device, sizes, repeats=int(config.get("repeats", 15)), in_step_too=not curves)
    pooled = None if curves else host_wait(points, aligned)
    if curves:
        curve: Optional[list[list[float]]] = mean_curve(curves)
    elif flat:
        curve = None            # older callers' single readings: one flat wait, as before
    else:
        curve = wait_curve(device)
    wait = curve[0][1] if curve else statistics.fmean(flat)
    slowdown = shared_host_slowdown(device, config.get("model"), int(config.get("batch", 8)))
    bandwidth = copy_bandwidth(device, 1024 if device.type == "cuda" else 64)
    links = {"backend": dist.get_backend(), "world_size": n, "nodes": len(set(hosts)),
             "device": device.type, "shared_host_slowdown": slowdown, "memory_bw": bandwidth,
             "host_wait_s": wait, "host_wait_microbenchmark_s": pooled, "host_waits_during_rounds": during,
             "collectives": {k: {**_with_wait(fit_link(aligned[k], k, n), wait), "points": p,
                                 "aligned_points": aligned[k]} for k, p in points.items()},
             "collective_path_s": collective_paths(config.get("strategy_configs") or [], device)}
    if curve:
        links["host_wait_curve"] = curve
    links["seconds"] = time.perf_counter() - start
    if device.type == "cuda":
        # What picks the hardware profile: the chip (rayvit.training.hardware's name) and its memory size.
        from rayvit.training.hardware import accelerator_name

        links.update(device_name=accelerator_name(device),
                     device_memory_bytes=int(torch.cuda.get_device_properties(device).total_memory))
    return links if dist.get_rank() == 0 else {}


def _with_wait(link: dict[str, float], wait: float) -> dict[str, float]:
    """A link fitted on aligned times, with the host's wait for the slowest rank in its latency."""
    return {**link, "transfer_latency_s": link["latency_s"], "latency_s": link["latency_s"] + wait}
