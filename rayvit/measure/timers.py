"""Timing primitives for collectives on an initialised process group (gloo or NCCL): barrier-aligned
medians (nccl-tests style), the same collective issued right after a compute segment as a training step
issues it (the wait for the slowest rank included), and the buffers they move. Every rank calls them
alike. The method: docs/projection.md (measured links)."""

from __future__ import annotations

import statistics
import time

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce")
CPU_SIZES = (16 * 2 ** 10, 128 * 2 ** 10, 1 * 2 ** 20, 4 * 2 ** 20)
# GPU: 16 and 64 KiB as well, so that small messages (an fp32 LayerNorm group is ~20 KB) take their latency
# from a measurement rather than from an extrapolation of megabyte messages.
GPU_SIZES = (16 * 2 ** 10, 64 * 2 ** 10, 2 ** 20, 16 * 2 ** 20, 128 * 2 ** 20)


def run_collective(kind: str, buf, shard, dist) -> None:
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
    import torch.distributed as dist

    from rayvit.training.hardware import synchronize

    times = []
    for _ in range(repeats):
        dist.barrier()
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def compute_segment(seconds: float, device):
    """The compute a rank does between two collectives of a step: a fixed number of matmuls, about
    ``seconds`` on the fastest rank unhindered, the same count on every rank.

    Fixed work, not a deadline, as in training: a rank descheduled mid-segment arrives late by all the
    time it lost. A loop that ran until a deadline would end on time anyway and hide most of the wait
    (docs/projection.md).
    """
    import torch
    import torch.distributed as dist

    from rayvit.training.hardware import synchronize

    a = torch.randn(128, 128, device=device)

    def work(count: int) -> None:
        for _ in range(count):
            a @ a
        synchronize(device)

    work(5)
    each = min(timed_plain(lambda: work(20), device) for _ in range(5)) / 20
    count = torch.tensor([max(1.0, seconds / each)], dtype=torch.float64, device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    agreed = int(count.item())
    return lambda: work(agreed)


def buffers(size: int, device):
    """(whole array of about ``size`` bytes, one rank's shard of it), fp32, divisible by the world size."""
    import torch
    import torch.distributed as dist

    n = dist.get_world_size()
    numel = max(n, size // 4 // n * n)
    return torch.ones(numel, device=device), torch.ones(numel // n, device=device)


def in_step_cost(op, device, repeats: int, segment) -> float:
    """Mean cost of ``op`` issued right after a compute segment, as inside a training step.

    The mean, not the median: step times add up, and the wait for a descheduled peer is a rare but
    long tail (a scheduler time slice) that the median would drop.

    No barrier aligns the ranks: the collective waits for the slowest rank's segment, as it does in
    training (OS scheduling, shared cores and co-located processes all show up here), which a
    barrier-aligned timing hides. Cost = (segment + op) - segment, both timed on this rank.
    """
    import torch.distributed as dist

    from rayvit.training.hardware import synchronize

    costs = []
    dist.barrier()
    for _ in range(repeats):
        segment()
        mid = time.perf_counter()
        op()
        synchronize(device)
        costs.append(time.perf_counter() - mid)
    return statistics.fmean(costs)


def time_collectives(device, sizes, repeats: int = 15, warmup: int = 2, segment_s: float = 2e-3,
                     in_step_too: bool = True
                     ) -> tuple[dict[str, list[list[float]]], dict[str, list[list[float]]]]:
    """``({kind: [[bytes, seconds], ...]} in a step (means), the same barrier-aligned (medians))``; sizes
    as nccl-tests counts them (whole array), fp32. ``in_step_too=False`` leaves the in-step means empty
    (a sweep reads the wait between its rounds instead)."""
    import torch.distributed as dist

    segment = compute_segment(segment_s, device) if in_step_too else None
    in_step: dict[str, list[list[float]]] = {k: [] for k in KINDS}
    aligned: dict[str, list[list[float]]] = {k: [] for k in KINDS}
    for size in sizes:
        buf, shard = buffers(size, device)
        nbytes = float(buf.numel() * 4)
        for kind in KINDS:
            op = lambda: run_collective(kind, buf, shard, dist)  # noqa: E731
            for _ in range(warmup):
                op()
            aligned[kind].append([nbytes, aligned_s(op, device, repeats)])
            if segment is not None:
                in_step[kind].append([nbytes, in_step_cost(op, device, 2 * repeats, segment)])
    return in_step, aligned


def aligned_all_gather_s(nbytes: int, device, repeats: int = 15) -> float:
    """Barrier-aligned median seconds of a bare fp32 all-gather of about ``nbytes`` (output size)."""
    import torch.distributed as dist

    buf, shard = buffers(nbytes, device)
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

    buf, shard = buffers(WAIT_PROBE_BYTES, device)
    op = lambda: run_collective("all_gather", buf, shard, dist)  # noqa: E731
    op()
    aligned = aligned_s(op, device, 15)
    return max(0.0, in_step_cost(op, device, repeats, compute_segment(segment_s, device)) - aligned)


def wait_curve(device, gaps_s=WAIT_GAPS_S, seconds_each: float = 0.3) -> list[list[float]]:
    """``[[gap_s, wait_s], ...]``: :func:`wait_probe` after compute segments of each length, back to back
    (the wait drifts over seconds; read together, the lengths compare like for like). About
    ``seconds_each`` per length, at least 30 repeats; every rank must call it alike."""
    return [[gap, wait_probe(device, repeats=max(30, int(seconds_each / (gap + 1e-3))), segment_s=gap)]
            for gap in gaps_s]


def timed_plain(fn, device) -> float:
    from rayvit.training.hardware import synchronize

    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start
