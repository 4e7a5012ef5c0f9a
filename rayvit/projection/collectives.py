"""Collective microbenchmark: all-reduce, all-gather, reduce-scatter, broadcast and reduce time against
message size on the cluster a sweep is given, fitted to ``latency + factor x bytes / busbw``.

Two parts, measured apart because they vary differently:

- the transfer: each collective timed with the ranks lined up by a barrier (nccl-tests style), the median
  of its repeats, fitted per kind to latency + bytes / busbw;
- the wait for the slowest rank: the same collectives issued the way a training step issues them, right
  after a short compute segment with no barrier, cost the transfer plus a wait for a rank that arrives
  late (on a shared CPU host: a rank descheduled for a scheduler slice while its peer waits; a CUDA
  kernel queue on GPUs). That wait belongs to the host, not to the collective, and it is heavy-tailed
  (on a 2-core host ~60% of collectives wait ~0.1 ms, ~40% 2-4 ms) and it drifts over seconds (its mean
  over 3-second windows of one idle machine ranged 0.45-1.12 ms), so a mean over one kind's 30 repeats
  moved by 2x between two measurements. It is one curve for every kind (``host_wait_curve``: the wait
  after 2 and after 10 ms of compute, since a rank computing alone longer is preempted more often; the
  projection reads it at each step's gap between collectives): read by :func:`wait_curve` after every
  round of a sweep's worker group, so that it covers the minutes the points were measured in, or else
  here. ``host_wait_s`` (the 2-ms reading) stays in each kind's ``latency_s`` for older readers.

``measure_links`` runs :func:`worker_benchmark` on N Ray Train workers (gloo on CPU, NCCL on GPU) and
returns a *links* dict (JSON-able) that :func:`rayvit.projection.profiles.with_measured_links` turns into
a profile. Beside the links it measures two host properties the step model needs: the compute slowdown
when every worker of a node trains at once against one alone (``shared_host_slowdown``: on a CPU host
the workers share caches, memory bandwidth and the cores Ray's own processes run on), and the memory
copy bandwidth that bounds the optimizer step; and, for the strategies it is given, each one's own host
work per collective at this world size (``collective_path_s``: FSDP2's copy-in and copy-out, which its
one-rank point never runs). Ray is imported only inside ``measure_links``.
"""

from __future__ import annotations

import socket
import statistics
import time
from typing import Any, Optional

from rayvit.projection.comms import bus_factor

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce")
CPU_SIZES = (16 * 2 ** 10, 128 * 2 ** 10, 1 * 2 ** 20, 4 * 2 ** 20)
# GPU: 16 and 64 KiB as well, so that small messages (an fp32 LayerNorm group is ~20 KB) take their latency
# from a measurement rather than from an extrapolation of megabyte messages.
GPU_SIZES = (16 * 2 ** 10, 64 * 2 ** 10, 2 ** 20, 16 * 2 ** 20, 128 * 2 ** 20)


def _run(kind: str, buf, shard, dist) -> None:
    if kind == "all_reduce":
        dist.all_reduce(buf)
    elif kind == "all_gather":
        dist.all_gather_into_tensor(buf, shard)
    elif kind == "reduce_scatter":
        dist.reduce_scatter_tensor(shard, buf)
    elif kind == "broadcast":
        dist.broadcast(buf, src=0)
    else:
        dist.reduce(buf, dst=0)


def aligned_s(fn, device, repeats: int) -> float:
    """Median seconds of ``fn`` over ``repeats`` runs, ranks aligned by a barrier before each."""
    import torch
    import torch.distributed as dist

    times = []
    for _ in range(repeats):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _segment(seconds: float, device):
    """The compute a rank does between two collectives of a step: a fixed number of matmuls, about
    ``seconds`` on the fastest rank unhindered, the same count on every rank.

    Fixed work, not a deadline, as in training: a rank descheduled mid-segment arrives late by all the
    time it lost. A loop that ran until a deadline would end on time anyway and hide most of the wait
    (measured on a 2-core host: a third to a half of it).
    """
    import torch
    import torch.distributed as dist

    a = torch.randn(128, 128, device=device)

    def work(count: int) -> None:
        for _ in range(count):
            a @ a
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    work(5)
    each = min(_timed_plain(lambda: work(20), device) for _ in range(5)) / 20
    count = torch.tensor([max(1.0, seconds / each)], dtype=torch.float64, device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    agreed = int(count.item())
    return lambda: work(agreed)


def _buffers(size: int, device):
    """(whole array of about ``size`` bytes, one rank's shard of it), fp32, divisible by the world size."""
    import torch
    import torch.distributed as dist

    n = dist.get_world_size()
    numel = max(n, size // 4 // n * n)
    return torch.ones(numel, device=device), torch.ones(numel // n, device=device)


def _in_step(op, device, repeats: int, segment) -> float:
    """Mean cost of ``op`` issued right after a compute segment, as inside a training step.

    The mean, not the median: step times add up, and the wait for a descheduled peer is a rare but
    long tail (a scheduler time slice) that the median would drop.

    No barrier aligns the ranks: the collective waits for the slowest rank's segment, as it does in
    training (OS scheduling, shared cores and co-located processes all show up here), which a
    barrier-aligned timing hides. Cost = (segment + op) - segment, both timed on this rank.
    """
    import torch.distributed as dist

    costs = []
    dist.barrier()
    for _ in range(repeats):
        segment()
        mid = time.perf_counter()
        op()
        if device.type == "cuda":
            import torch

            torch.cuda.synchronize(device)
        costs.append(time.perf_counter() - mid)
    return statistics.fmean(costs)


def time_collectives(device, sizes, repeats: int = 15, warmup: int = 2, segment_s: float = 2e-3,
                     in_step_too: bool = True
                     ) -> tuple[dict[str, list[list[float]]], dict[str, list[list[float]]]]:
    """``({kind: [[bytes, seconds], ...]} in a step (means), the same barrier-aligned (medians))``; sizes
    as nccl-tests counts them (whole array), fp32. ``in_step_too=False`` leaves the in-step means empty
    (a sweep reads the wait between its rounds instead)."""
    import torch.distributed as dist

    segment = _segment(segment_s, device) if in_step_too else None
    in_step: dict[str, list[list[float]]] = {k: [] for k in KINDS}
    aligned: dict[str, list[list[float]]] = {k: [] for k in KINDS}
    for size in sizes:
        buf, shard = _buffers(size, device)
        nbytes = float(buf.numel() * 4)
        for kind in KINDS:
            op = lambda: _run(kind, buf, shard, dist)  # noqa: E731
            for _ in range(warmup):
                op()
            aligned[kind].append([nbytes, aligned_s(op, device, repeats)])
            if segment is not None:
                in_step[kind].append([nbytes, _in_step(op, device, 2 * repeats, segment)])
    return in_step, aligned


def aligned_all_gather_s(nbytes: int, device, repeats: int = 15) -> float:
    """Barrier-aligned median seconds of a bare fp32 all-gather of about ``nbytes`` (output size)."""
    import torch.distributed as dist

    buf, shard = _buffers(nbytes, device)
    dist.all_gather_into_tensor(buf, shard)
    return aligned_s(lambda: dist.all_gather_into_tensor(buf, shard), device, repeats)


WAIT_PROBE_BYTES = 16 * 2 ** 10
# The compute gaps the wait is read after: FSDP's per-block collectives (a few ms apart on CPU) and a
# replicated strategy's one all-reduce per step (its whole step apart).
WAIT_GAPS_S = (2e-3, 10e-3)


def wait_probe(device, repeats: int = 150, segment_s: float = 2e-3) -> float:
    """One reading of the host's wait for the slowest rank, for a sweep's worker group to take between
    its rounds: a small all-gather issued after compute segments (mean), less the same all-gather
    barrier-aligned (median). About ``repeats`` x (segment + 1 ms); every rank must call it alike."""
    import torch.distributed as dist

    buf, shard = _buffers(WAIT_PROBE_BYTES, device)
    op = lambda: _run("all_gather", buf, shard, dist)  # noqa: E731
    op()
    aligned = aligned_s(op, device, 15)
    return max(0.0, _in_step(op, device, repeats, _segment(segment_s, device)) - aligned)


def wait_curve(device, gaps_s=WAIT_GAPS_S, seconds_each: float = 0.3) -> list[list[float]]:
    """``[[gap_s, wait_s], ...]``: :func:`wait_probe` after compute segments of each length, back to back
    (the wait drifts over seconds; read together, the lengths compare like for like). About
    ``seconds_each`` per length, at least 30 repeats; every rank must call it alike."""
    return [[gap, wait_probe(device, repeats=max(30, int(seconds_each / (gap + 1e-3))), segment_s=gap)]
            for gap in gaps_s]


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
    sleep and takes a worker's otherwise. Medians of 4 steps read 1.00 on a 2-core host where rayvit's
    own loop slowed by 5% (10.26 -> 10.80 ms a step with both workers training, no communication).
    """
    import torch
    import torch.distributed as dist

    step = _train_probe(model_cfg, device, batch)
    for _ in range(2):
        step()
    rank = dist.get_rank()
    one = torch.tensor([_timed_plain(step, device) if rank == 0 else 0.0], dtype=torch.float64, device=device)
    dist.broadcast(one, src=0)

    def mean_step() -> float:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
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


def _timed_plain(fn, device) -> float:
    import torch

    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


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
    # curves from the rounds, the per-kind in-step means would only repeat them (1.5 s on 2 CPU cores).
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


def collective_paths(cfgs: list, device) -> dict[str, float]:
    """Each strategy's own host work per collective at this world size (``Strategy.collective_path_s``),
    by strategy name, for the configs given (one per strategy; their model, precision and seed). A
    strategy whose probe fails is left out with a warning: the projection then costs its messages
    without it."""
    from rayvit.config import from_dict
    from rayvit.strategies import strategy_class

    out: dict[str, Optional[float]] = {}
    for raw in cfgs:
        cfg = from_dict(raw)
        name = cfg.parallel.strategy
        if name in out:
            continue
        try:
            out[name] = strategy_class(name).collective_path_s(cfg, device)
        except Exception as e:  # noqa: BLE001 - a probe must not lose the links
            import logging

            logging.getLogger(__name__).warning("%s's collective path probe failed: %s", name, e)
    return {k: v for k, v in out.items() if v is not None}


def _with_wait(link: dict[str, float], wait: float) -> dict[str, float]:
    """A link fitted on aligned times, with the host's wait for the slowest rank in its latency."""
    return {**link, "transfer_latency_s": link["latency_s"], "latency_s": link["latency_s"] + wait}


def measure_links(num_workers: int, *, use_gpu: bool = False, cpus_per_worker: int = 1,
                  model: Optional[dict] = None, batch: int = 8, address: Optional[str] = None,
                  placement_strategy: str = "PACK", **options) -> dict[str, Any]:
    """Run the microbenchmark on ``num_workers`` Ray Train workers of its own; returns the links dict
    (rank 0's). Sweeps do not call this: they measure on a point's workers (``fit(measure_links=...)``)."""
    import uuid

    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from rayvit.launch.connect import ensure_ray
    from rayvit.launch.storage import default_storage_path

    ensure_ray(address)
    start = time.perf_counter()
    trainer = TorchTrainer(
        worker_benchmark,
        train_loop_config={"use_gpu": use_gpu, "threads": cpus_per_worker, "model": model, "batch": batch,
                           **options},
        scaling_config=ScalingConfig(num_workers=num_workers, use_gpu=use_gpu,
                                     resources_per_worker={"CPU": float(cpus_per_worker),
                                                           **({"GPU": 1.0} if use_gpu else {})},
                                     placement_strategy=placement_strategy),
        torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo"),
        run_config=RunConfig(name=f"rayvit-links-{uuid.uuid4().hex[:8]}", storage_path=default_storage_path(),
                             failure_config=FailureConfig(max_failures=0, controller_failure_limit=0)))
    links = trainer.fit().return_value
    links["wall_seconds"] = time.perf_counter() - start
    return links


def describe(links: dict[str, Any]) -> str:
    """One line per collective: latency and bus bandwidth, as measured; then the wait for the slowest rank
    and each strategy's own host path per collective, where measured."""
    during = " (read between the rounds)" if links.get("host_waits_during_rounds") else ""
    curve = links.get("host_wait_curve")
    head = (f"collectives over {links['world_size']} {links['backend']} ranks on {links['nodes']} node(s) "
            f"(shared-host slowdown {links.get('shared_host_slowdown', 1):.2f}, memory copy "
            f"{links.get('memory_bw', 0) / 1e9:.1f} GB/s, {links.get('seconds', 0):.1f} s)")
    if not curve:
        head += f"; latency includes {links.get('host_wait_s', 0) * 1e6:.0f} us waiting for the slowest rank{during}"
    lines = [head + ":"]
    latency = "transfer_latency_s" if curve else "latency_s"
    for kind, c in links["collectives"].items():
        lines.append(f"  {kind:<15} latency {c.get(latency, c['latency_s']) * 1e6:8.0f} us  "
                     f"busbw {c['busbw'] / 1e9:7.2f} GB/s")
    if curve:
        lines.append(f"  each message also waits for the slowest rank, more the longer the compute before it{during}: "
                     + ", ".join(f"{w * 1e6:.0f} us after {g * 1e3:g} ms" for g, w in curve))
    for name, seconds in (links.get("collective_path_s") or {}).items():
        lines.append(f"  {name}'s own host path per collective (beyond its one-rank path): {seconds * 1e6:.0f} us")
    return "\n".join(lines)
