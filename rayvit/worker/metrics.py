"""The figures a worker reports, each computed in one place: images/s, step-time percentiles, TFLOPS, MFU."""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional, Sequence

import torch

import rayvit
from rayvit.stats import quantile, step_time_percentiles  # noqa: F401 - the figures of a run, in one place
from rayvit.training import hardware


def images_per_sec(batch_size: int, steps: int, seconds: float) -> float:
    """Images per second of one chip that ran ``steps`` steps of ``batch_size`` images in ``seconds``."""
    return batch_size * steps / seconds if steps and seconds > 0 else math.nan


def epoch_start_figures(epoch_start_waits: Sequence[float], step_times: Sequence[float]) -> dict[str, float]:
    """``epoch_start_wait_fraction`` (the timed steps' time spent waiting for an epoch's first batch) and
    ``epoch_start_wait_s`` (the mean such wait), from each timed step's epoch-start wait (0.0 for steps
    that began no epoch); empty when no timed step began an epoch (the figures are then absent)."""
    starts = [w for w in epoch_start_waits if w > 0]
    if not starts or not step_times:
        return {}
    return {"epoch_start_wait_fraction": sum(starts) / sum(step_times), "epoch_start_wait_s": sum(starts) / len(starts)}


def rate_figures(train_flops_per_image: float, images_per_sec_per_chip: float, device: torch.device,
                 dtype: torch.dtype) -> dict:
    """TFLOPS per chip and MFU for a per-chip image rate: analytic training FLOPs x rate / peak."""
    peak, source = hardware.peak_flops(device, dtype)
    tflops = train_flops_per_image * images_per_sec_per_chip / 1e12
    return {"tflops_per_chip": tflops, "mfu": tflops * 1e12 / peak, "peak_tflops": peak / 1e12,
            "peak_source": source}


# Figures each rank measures for itself (gathered from every rank by the loop's summary), and how the
# run's figures combine them over ranks: (run figure, combine). A run figure exists only when every rank
# has a finite value; the per-rank list (None where a rank has none) whenever any rank has one.
PER_RANK_FIGURES: dict[str, tuple[tuple[str, str], ...]] = {
    "peak_memory_bytes": (("peak_memory_bytes_per_rank", "max"),),
    "peak_memory_reserved_bytes": (("peak_memory_reserved_bytes_per_rank", "max"),),
    "gpu_utilization_pct": (("gpu_utilization_pct", "mean"), ("gpu_utilization_pct_max", "max")),
    "gpu_power_w": (("gpu_power_w", "mean"), ("gpu_power_w_max", "max")),
    "gpu_samples": (("gpu_samples", "min"),),
    # data.skip_corrupt only: corrupt images each rank dropped (distinct per rank), summed over ranks.
    "skipped_images": (("skipped_images", "sum"),),
}
# Of those, the ones whose per-rank lists a run keeps (RunResult.per_rank).
PER_RANK_LISTS = ("peak_memory_bytes", "peak_memory_reserved_bytes", "gpu_utilization_pct", "gpu_power_w")

_COMBINE = {"max": max, "min": min, "mean": lambda v: sum(v) / len(v), "sum": sum}


def across_ranks(per_rank: Mapping[str, Sequence[float]]) -> tuple[dict[str, float], dict[str, list[Optional[float]]]]:
    """``(run figures, per-rank lists)`` from ``{figure: [value of rank 0, rank 1, ...]}`` (NaN: none).

    E.g. ``{"peak_memory_bytes": [3e9, 4e9]}`` gives ``({"peak_memory_bytes_per_rank": 4e9},
    {"peak_memory_bytes": [3e9, 4e9]})``. A figure no rank has is absent from both, never zero.
    """
    figures: dict[str, float] = {}
    lists: dict[str, list[Optional[float]]] = {}
    for name, values in per_rank.items():
        clean = [float(v) if v is not None and math.isfinite(float(v)) else None for v in values]
        if all(v is None for v in clean):
            continue
        if name in PER_RANK_LISTS:
            lists[name] = clean
        if any(v is None for v in clean):
            continue
        for figure, how in PER_RANK_FIGURES.get(name, ()):
            figures[figure] = float(_COMBINE[how](clean))
    return figures, lists


def library_versions() -> dict[str, str]:
    # Plain str: torch.__version__ is a TorchVersion, whose unpickling imports torch. A result travels to
    # the driver through the progress board's process, which would then import torch (seconds of a core)
    # while the next run of a worker group timed its steps.
    versions = {"torch_version": str(torch.__version__), "rayvit_version": rayvit.__version__}
    for name in ("ray", "fairscale"):
        try:
            module = __import__(name)
            versions[f"{name}_version"] = module.__version__
        except ImportError:
            versions[f"{name}_version"] = "absent"
    return versions


def run_conditions(cfg, precision, strategy, world_size: int, device: torch.device,
                   peak_source: str) -> dict[str, Any]:
    """What every figure of a run is stated with: its model, size, batch, precision, strategy, world size,
    device, how memory was read, the dtype gradients were reduced in, and the libraries' versions."""
    m = cfg.model
    conditions = {
        "model": m.name if m.name != "custom" else f"custom-d{m.hidden_dim}x{m.depth}h{m.num_heads}p{m.patch_size}",
        "image_size": m.image_size, "batch_per_chip": cfg.train.batch_size,
        "precision": precision.describe(), "strategy": cfg.parallel.strategy,
        "world_size": world_size, "accelerator": hardware.accelerator_name(device),
        # Picks the projection's hardware profile variant (A100 40 GB or 80 GB): None on CPU.
        "device_memory_bytes": hardware.device_memory_bytes(device),
        "peak_source": peak_source, "data": cfg.data.name,
        "memory_measure": hardware.memory_measure(device),
        # Like for like: the dtype gradients were reduced in, and whether LayerNorm stayed fp32.
        "reduce_dtype": hardware.dtype_name(strategy.reduce_dtype),
        "layer_norm_fp32": precision.layer_norm_fp32 or precision.mode == "fp32",
        **library_versions(),
    }
    if m.compile:
        conditions["compile_cold"] = m.compile_cold
    return conditions
