"""Each strategy's own host work per collective beyond the collective itself: a strategy's diagnostic,
registered here by name (:data:`PATH_PROBES`), asked by the links microbenchmark
(:mod:`rayvit.measure.links`) and added per message by the projection where measured
(``HardwareProfile.collective_path_s``). A strategy without a probe adds none.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable, Optional

from rayvit.measure.timers import aligned_all_gather_s, aligned_s

if TYPE_CHECKING:
    from rayvit.config_schema import Config

logger = logging.getLogger(__name__)


def fsdp_path_s(cfg: "Config", device, repeats: int = 25) -> Optional[float]:
    """FSDP2's collective path at more than one rank: each group's gather copies its shards into one
    buffer (``all_gather_copy_in``), gathers, and splits the result into per-parameter tensors
    (``split_with_sizes_copy``), with per-parameter Python and dispatch work around each; at one rank it
    only copies each parameter (``FSDPParamGroup.unshard``/``wait_for_unshard``'s world-size-1 branch).

    Measured with the public ``unshard()``/``reshard()`` of every group of the sweep's model, barrier
    aligned, on the world mesh and on a one-rank mesh at the same time, less a bare all-gather of the
    group's bytes: the mean over groups. The reduce-scatter's path (``chunk_cat`` copy-in, per-parameter
    views of the reduced shard) has no public entry point; it is taken to cost the same per message.
    What it measures on CPU hosts: docs/projection.md.
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import FSDPModule

    from rayvit.models import build_model
    from rayvit.strategies import world_size
    from rayvit.strategies.fsdp import FSDP
    from rayvit.training.precision import Precision

    n = world_size()
    if n <= 1:
        return None
    own_group = dist.new_group([dist.get_rank()], use_local_synchronization=True)
    meshes = {"world": init_device_mesh(device.type, (n,)), "alone": DeviceMesh.from_group(own_group, device.type)}
    try:
        times: dict[str, list[float]] = {}
        sizes: list[int] = []
        for key, mesh in meshes.items():
            torch.manual_seed(cfg.train.seed)
            precision = Precision(cfg.precision, device, owns_mixed_precision=True)
            strategy = FSDP(cfg, precision, device)
            model = strategy.wrap(precision.prepare_model(build_model(cfg.model).to(device)), mesh=mesh)
            size = cfg.model.image_size
            images = torch.randn(1, 3, size, size, device=device)
            with torch.no_grad(), precision.autocast():    # FSDP2 initialises lazily, on the first forward
                model(precision.cast_inputs(images))
            units = [m for m in model.modules() if isinstance(m, FSDPModule)]
            times[key] = [aligned_s(lambda m=m: (m.unshard(), m.reshard()), device, repeats) for m in units]
            if key == "world":
                gathered = strategy.mixed_precision_policy().param_dtype
                for m in units:
                    nested = {id(p) for u in m.modules() if u is not m and isinstance(u, FSDPModule)
                              for p in u.parameters()}
                    own = [p for p in m.parameters() if id(p) not in nested]
                    sizes.append(sum(p.to_local().numel() * (gathered or p.dtype).itemsize for p in own) * n)
            del model
        # A shard's rows differ by rank (rank 0 holds the most); the gather moves the padded largest.
        agreed = torch.tensor(sizes, dtype=torch.float64, device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        bare = [aligned_all_gather_s(int(size), device, repeats) for size in agreed.tolist()]
        extra = [w - a - b for w, a, b in zip(times["world"], times["alone"], bare)]
    finally:
        dist.destroy_process_group(own_group)
    return max(0.0, sum(extra) / len(extra)) if extra else None


# Strategy name -> probe(cfg, device) -> seconds per message at this world size, or None where it adds none.
PATH_PROBES: dict[str, Callable[..., Optional[float]]] = {"fsdp": fsdp_path_s}


def collective_paths(cfgs: list, device) -> dict[str, float]:
    """Each strategy's own host work per collective at this world size (its probe in :data:`PATH_PROBES`),
    by strategy name, for the configs given (one per strategy; their model, precision and seed). A
    strategy without a probe adds no such path; one whose probe fails is left out with a warning: the
    projection then costs its messages without it."""
    from rayvit.config import from_dict

    out: dict[str, Optional[float]] = {}
    for raw in cfgs:
        cfg = from_dict(raw)
        name = cfg.parallel.strategy
        if name in out:
            continue
        probe = PATH_PROBES.get(name)
        if probe is None:
            continue
        try:
            out[name] = probe(cfg, device)
        except Exception as e:  # noqa: BLE001 - a probe must not lose the links
            logger.warning("%s's collective path probe failed: %s", name, e)
    return {k: v for k, v in out.items() if v is not None}
