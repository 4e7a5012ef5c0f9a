"""This host's own rates, measured where the projection needs them and has no data sheet: the matmul rate
of its CPU cores per dtype (the CPU profile's "peak", :func:`rayvit.projection.profiles.cpu_profile`)."""

from __future__ import annotations

from typing import Iterable

_TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def cpu_peaks(threads: int = 1, keys: Iterable[str] = ("fp32", "bf16")) -> dict[str, float]:
    """FLOP/s of a 1024 x 1024 matmul on ``threads`` CPU threads, best of several, for each dtype key
    asked for (``rayvit.projection.performance.peak_key``: 'fp32', 'bf16', 'fp16'). torch's thread count is
    put back afterwards."""
    import torch

    from rayvit.training.hardware import measured_matmul_flops

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        return {key: measured_matmul_flops("cpu", getattr(torch, _TORCH_DTYPES[key]), threads)
                for key in dict.fromkeys(keys)}
    finally:
        torch.set_num_threads(before)


def cpu_peaks_for(cfgs: Iterable) -> dict[str, float]:
    """The rates a CPU projection of ``cfgs`` asks for: fp32, and each config's half dtype where it computes
    in half, on the threads each worker is given (the most of them)."""
    cfgs = list(cfgs)
    keys = ["fp32", *(c.precision.dtype for c in cfgs if c.precision.mode != "fp32")]
    return cpu_peaks(max((c.parallel.cpus_per_worker for c in cfgs), default=1), keys)
