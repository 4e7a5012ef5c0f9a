"""The figures a worker reports, each computed in one place: images/s, step-time percentiles, TFLOPS, MFU."""

from __future__ import annotations

import math
from typing import Sequence

import torch

import rayvit
from rayvit.worker import hardware


def images_per_sec(batch_size: int, steps: int, seconds: float) -> float:
    """Images per second of one chip that ran ``steps`` steps of ``batch_size`` images in ``seconds``."""
    return batch_size * steps / seconds if steps and seconds > 0 else math.nan


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile with linear interpolation between order statistics (numpy's default)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def step_time_percentiles(step_times: Sequence[float]) -> dict[str, float]:
    return {"step_time_p50_s": quantile(step_times, 0.5), "step_time_p90_s": quantile(step_times, 0.9)}


def rate_figures(train_flops_per_image: float, images_per_sec_per_chip: float, device: torch.device,
                 dtype: torch.dtype) -> dict:
    """TFLOPS per chip and MFU for a per-chip image rate: analytic training FLOPs x rate / peak."""
    peak, source = hardware.peak_flops(device, dtype)
    tflops = train_flops_per_image * images_per_sec_per_chip / 1e12
    return {"tflops_per_chip": tflops, "mfu": tflops * 1e12 / peak, "peak_tflops": peak / 1e12,
            "peak_source": source}


def library_versions() -> dict[str, str]:
    versions = {"torch_version": torch.__version__, "rayvit_version": rayvit.__version__}
    for name in ("ray", "fairscale"):
        try:
            module = __import__(name)
            versions[f"{name}_version"] = module.__version__
        except ImportError:
            versions[f"{name}_version"] = "absent"
    return versions
