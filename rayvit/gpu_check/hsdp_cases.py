"""The GPU check's HSDP case: FSDP2 on a 2-D (replicate, shard) mesh over NCCL, which CPU runs (gloo) cannot
show: the shards' all-reduce across replicas runs on FSDP2's own all-reduce stream, after the reduce-scatter's
stream, and a wrong wait between them corrupts gradients only on a GPU (see :mod:`rayvit.gpu_check`)."""

from __future__ import annotations

import math

from rayvit.gpu_check.cases import on_two_ranks, small_config


def _losses(device, overrides: dict, steps: int) -> dict:
    """Per run (FSDP, and HSDP as the mesh ``overrides`` give it): the losses, the mesh, and the dtypes sent by
    all-reduces over the mesh's replica group (FSDP2's shard gradients across replicas), on this rank."""
    import torch.distributed as dist

    from rayvit.worker import Session

    out = {}
    for name, strategy in (("fsdp", {"parallel.strategy": "fsdp"}), ("hsdp", {"parallel.strategy": "hsdp"})):
        calls: list = []
        real = dist.all_reduce

        def spy(tensor, *args, _calls=calls, **kwargs):
            _calls.append((kwargs.get("group"), tensor.dtype))
            return real(tensor, *args, **kwargs)

        dist.all_reduce = spy
        session = Session(small_config({**overrides, **strategy}, steps=steps), device)
        try:
            losses = []
            for _ in range(steps):
                session.clear_grads()
                losses.append(session.train_step())
            mesh = next(session.model.parameters()).device_mesh
        finally:
            dist.all_reduce = real
            session.close()
        replicas = mesh.get_group("replicate") if mesh.ndim == 2 and mesh.size(0) > 1 else None
        sent = sorted({str(dtype) for group, dtype in calls if replicas is not None and group is replicas})
        out[name] = {"losses": losses, "sent": sent, "mesh": tuple(mesh.shape)}
    return out


def check_hsdp(device, steps: int = 6) -> str:
    """HSDP in mixed bf16 against FSDP2 with the same data: on two GPUs as one replica of two shards (1x2:
    FSDP's collectives) and as two replicas of one shard (2x1: FSDP2's all-reduce across replicas, in the
    reduce dtype, on its own stream); on one GPU as a 1x1 mesh (FSDP2 still runs its all-reduce path, over a
    one-rank replica group).
    The losses must be finite, and equal to FSDP's where the mesh is FSDP's."""
    import torch

    mixed = {"precision.mode": "mixed", "precision.dtype": "bf16"}
    if device.type == "cuda" and torch.cuda.device_count() >= 2:
        runs = {}
        for shard in (2, 1):
            ranks = on_two_ranks(_losses, {**mixed, "parallel.num_workers": 2, "parallel.shard_size": shard}, steps,
                                 backend="nccl", devices=(0, 1))
            runs[shard] = ranks[0]
        one, two = runs[2], runs[1]
        facts = (f"2 GPUs (NCCL): 1x2 mesh {one['hsdp']['mesh']} losses {_span(one['hsdp']['losses'])}, 2x1 mesh "
                 f"{two['hsdp']['mesh']} losses {_span(two['hsdp']['losses'])}, replica all-reduce in "
                 f"{', '.join(two['hsdp']['sent']) or 'nothing'}")
        _finite(one["hsdp"]["losses"] + two["hsdp"]["losses"], facts)
        if not _close(one["hsdp"]["losses"], one["fsdp"]["losses"]):
            raise RuntimeError(f"1x2 HSDP differs from FSDP ({_span(one['fsdp']['losses'])}): {facts}")
        if "torch.float32" not in two["hsdp"]["sent"]:
            raise RuntimeError(f"the 2x1 mesh all-reduced no fp32 shard gradients (mixed reduces in fp32): {facts}")
        return facts
    run = _losses(device, mixed, steps)
    facts = (f"1 GPU: mesh {run['hsdp']['mesh']}, losses {_span(run['hsdp']['losses'])} against FSDP's "
             f"{_span(run['fsdp']['losses'])} (2x1 and 1x2, the all-reduce across replicas, need two GPUs)")
    _finite(run["hsdp"]["losses"], facts)
    if not _close(run["hsdp"]["losses"], run["fsdp"]["losses"]):
        raise RuntimeError(f"HSDP on one GPU differs from FSDP: {facts}")
    return facts


def _span(losses: list) -> str:
    return f"{losses[0]:.4f} -> {losses[-1]:.4f}"


def _finite(losses: list, facts: str) -> None:
    if not all(math.isfinite(x) for x in losses):
        raise RuntimeError(f"non-finite loss: {facts}")


def _close(a: list, b: list, rel: float = 2e-3) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= rel * max(abs(y), 1e-6) for x, y in zip(a, b))


__all__ = ["check_hsdp"]
