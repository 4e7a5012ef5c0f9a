"""The GPU check's cases about a worker group's rounds: model state per rank after an evaluation, free
memory round after round with FairScale FSDP in the group, a NaN loss on one of two ranks, the collective
counts that tell ranks out of step, and every compiled run compiling cold (see :mod:`rayvit.gpu_check`)."""

from __future__ import annotations

import math

from rayvit.errors import NotCheckable
from rayvit.gpu_check.cases import on_two_ranks, small_config


def check_state_after_evaluation(device, strategy: str, mode: str, dtype: str) -> str:
    """``model_state_bytes_per_rank`` under both ``reshard_after_forward`` settings, with and without a
    validation split: the same in all four runs. (An evaluation's forward leaves FairScale's root, and its
    blocks without resharding, gathered and in half precision until the next backward; counted then, the
    state came out smaller.)"""
    from rayvit.projection import memory
    from rayvit.worker import train

    seen = {}
    for reshard in (True, False):
        for data in ("digits", "synthetic"):
            cfg = small_config({"parallel.strategy": strategy, "precision.mode": mode, "precision.dtype": dtype,
                                "parallel.reshard_after_forward": reshard, "data.name": data}, steps=4)
            seen[(reshard, data)] = int(train(cfg, device=device).metrics["model_state_bytes_per_rank"])
    projected = memory.model_state(cfg, 1).total
    facts = (f"{seen[(True, 'digits')]:,} B per rank in every run (reshard on/off, with/without a validation "
             f"split); projected {projected:,} B")
    if len(set(seen.values())) != 1:
        raise RuntimeError("model state differs between runs: " + ", ".join(
            f"reshard={r} {d}: {b:,} B" for (r, d), b in seen.items()))
    return facts


def check_group_memory(device, strategies: tuple[str, ...] = ("ddp", "fairscale_fsdp", "fsdp"),
                       tolerance_mib: float = 16.0) -> str:
    """One worker group's rounds, in a process group of their own (as a Ray Train worker group's): after
    each run (its memory released) the process groups that exist and, on CUDA, the device's free memory
    must be the same in round 2 as in round 1 for every strategy. FairScale FSDP's cached process groups
    (and their NCCL communicators, outside torch's allocator) are made before round 1, not by its first
    run, so a run before it in round 1 does not see more memory than the same run in round 2."""
    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _world

    from rayvit.worker.rounds import measure_rounds
    from rayvit.strategies import strategy_class

    if dist.is_initialized():
        raise RuntimeError("a process group is already initialised in this process")
    cfgs = [small_config({"parallel.strategy": s, "precision.mode": "fp32"}, steps=4) for s in strategies]
    after: dict[tuple[int, int], tuple[int, float]] = {}

    def reading(index, r, slot, result, error) -> None:
        if error is not None:
            raise RuntimeError(f"{strategies[index]} failed in round {r + 1}: {error.strip().splitlines()[-1]}")
        free = torch.cuda.mem_get_info(device)[0] / 2**20 if device.type == "cuda" else math.nan
        after[(index, r)] = (len(_world.pg_map), free)

    if device.type == "cuda":
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=device)
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        measure_rounds(cfgs, 2, device=device, on_round=reading)
    finally:
        for s in strategies:
            strategy_class(s).forget_process_groups()
        dist.destroy_process_group()
    memory = (lambda i: f"{after[(i, 0)][1]:.0f}/{after[(i, 1)][1]:.0f} MiB free, ") if device.type == "cuda" \
        else (lambda i: "")
    facts = "after rounds 1/2: " + "; ".join(f"{s} {memory(i)}{after[(i, 0)][0]} process groups"
                                             for i, s in enumerate(strategies))
    for i, s in enumerate(strategies):
        (groups1, free1), (groups2, free2) = after[(i, 0)], after[(i, 1)]
        if groups1 != groups2 or (device.type == "cuda" and abs(free1 - free2) > tolerance_mib):
            raise RuntimeError(f"{s} saw other process groups or free memory in round 2 than in round 1: {facts}")
    return facts


def _rounds_with_a_nan_on_rank_1(device) -> list:
    from rayvit.worker.rounds import measure_rounds

    ok = small_config({"parallel.num_workers": 2, "precision.mode": "amp", "precision.dtype": "fp16"}, steps=4)
    broken = ok.replace({"train.fail_at_step": 2, "train.fail_rank": 1, "train.fail_mode": "nan"})
    return [o["error"] for o in measure_rounds([ok, broken, ok], 2, device=device)]


def check_nan_on_one_rank(device) -> str:
    """A loss that is not finite on one rank only (``train.fail_mode=nan``, as one rank's fp16 overflow):
    over NCCL both ranks end that run with the same error, and go on with the others' rounds."""
    import torch

    if not (device.type == "cuda" and torch.cuda.device_count() >= 2):
        raise NotCheckable("not checkable on one GPU: needs two ranks over NCCL (two GPUs); the gloo "
                           "version runs in tests/system/test_rank_failures.py")
    errors = on_two_ranks(_rounds_with_a_nan_on_rank_1, backend="nccl", devices=(0, 1))
    first, second = errors
    if first != second or first[0] is not None or first[2] is not None or "on rank 1" not in (first[1] or ""):
        raise RuntimeError(f"the ranks did not agree on the failing run alone: {errors}")
    return "2 ranks (NCCL): " + first[1].strip().splitlines()[-1]


def check_collective_counts(device) -> str:
    """What :func:`rayvit.worker.agree.collective_counts` reads on this backend (NCCL on CUDA): a one-rank
    group's count grows by one per collective when the host issues it, before the device has run it, so a
    rank that issued a collective its peers never join is seen to be ahead of them."""
    import torch
    import torch.distributed as dist

    from rayvit.worker.agree import collective_counts

    if dist.is_initialized():
        raise RuntimeError("a process group is already initialised in this process")
    backend = "nccl" if device.type == "cuda" else "gloo"
    extra = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **extra)
    try:
        tensor = torch.ones(1 << 20, device=device)
        before = collective_counts()
        works = [dist.all_reduce(tensor, async_op=True) for _ in range(3)]
        issued = collective_counts()
        for work in works:
            work.wait()
        after = collective_counts()
    finally:
        dist.destroy_process_group()
    facts = f"{backend}: {before} before, {issued} with 3 all-reduces issued, {after} once they completed"
    if not before or any(issued[name] != before[name] + 3 or after[name] != issued[name] for name in before):
        raise RuntimeError(f"the collective count does not grow by one per issued collective: {facts}")
    return facts


def _rounds_with_rank_1_ahead(device) -> str:
    """Three configs in one round; in the first rank 1 issues one all-reduce rank 0 never joins and both raise."""
    import torch
    import torch.distributed as dist

    from rayvit.worker.agree import GroupOutOfStep
    from rayvit.worker.rounds import measure_rounds

    def fail_first(session, index, r) -> None:
        if index == 0 and session.step == 2:
            if dist.get_rank() == 1:
                dist.all_reduce(torch.zeros(1, device=device), async_op=True)
            raise RuntimeError(f"the first config fails on rank {dist.get_rank()}")

    ok = small_config({"parallel.num_workers": 2, "precision.mode": "amp", "precision.dtype": "bf16",
                       "train.failure_timeout_s": 10}, steps=4)
    try:
        measure_rounds([ok, ok, ok.replace({"parallel.strategy": "fsdp"})], 1, device=device, on_step=fail_first)
    except GroupOutOfStep as e:
        return str(e).splitlines()[0]
    return "measured every config"


def check_out_of_step(device) -> str:
    """Both ranks fail a run, rank 1 one collective ahead (as a host that ran ahead under NCCL): over NCCL
    both see it from their collective counts and end the group at once, instead of the next run meeting
    the stale all-reduce."""
    import torch

    if not (device.type == "cuda" and torch.cuda.device_count() >= 2):
        raise NotCheckable("not checkable on one GPU: needs two ranks over NCCL (two GPUs); the gloo "
                           "version runs in tests/system/test_rank_failures.py")
    lines = on_two_ranks(_rounds_with_rank_1_ahead, backend="nccl", devices=(0, 1))
    if not all("out of step" in line for line in lines):
        raise RuntimeError(f"the ranks did not end the group as out of step: {lines}")
    return "2 ranks (NCCL): " + lines[0]


def check_cold_compile(device) -> str:
    """Two compiled runs of the same config in one process (as two rounds of a worker group): each
    compiles from empty caches, the same graphs, in a like time."""
    from rayvit.worker import train

    cfg = small_config({"model.compile": True, "precision.mode": "amp", "precision.dtype": "bf16"}, steps=8)
    runs = [train(cfg, device=device) for _ in range(2)]
    times = [r.metrics["compile_time_s"] for r in runs]
    graphs = [r.metrics["compile_graphs"] for r in runs]
    facts = f"compiled {graphs[0]:.0f} and {graphs[1]:.0f} graphs in {times[0]:.1f} and {times[1]:.1f} s"
    if not all(r.conditions["compile_cold"] for r in runs) or graphs[0] != graphs[1] or not graphs[0] > 0:
        raise RuntimeError(f"the second run did not compile what the first did: {facts}")
    if not times[1] > 0.5 * times[0]:
        raise RuntimeError(f"the second compile took under half the first's (warm caches?): {facts}")
    return facts
