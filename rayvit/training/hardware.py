"""Accelerator detection and the peak FLOP/s that MFU divides by."""

from __future__ import annotations

import functools
import time
from typing import Optional

import torch

# The data-sheet peaks and CUDA-name matching live in the torch-free ``rayvit.accelerators`` (the projection
# and config validation read them without torch); re-exported here for the runtime.
from rayvit.accelerators import PEAK_TFLOPS, accelerator_for_name  # noqa: F401

_DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def accelerator_name(device: torch.device) -> str:
    """A short name for the chip: 'A100', 'H100 PCIe', ... the CUDA device name otherwise, or 'cpu'."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return accelerator_for_name(name) or name
    return "cpu"


def device_memory_bytes(device: torch.device) -> Optional[int]:
    """The device's total memory (CUDA's ``total_memory``: it tells an A100 40 GB from an 80 GB), or None
    off CUDA, where no device memory bounds a run."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return None


def dtype_name(dtype: torch.dtype) -> str:
    """'fp32', 'fp16' or 'bf16': how results name a dtype."""
    return _DTYPE_NAMES[dtype]


def _table_key(dtype: torch.dtype) -> str:
    key = _DTYPE_NAMES[dtype]
    # fp32 matmuls use TF32 tensor cores only when torch is told to (off by default for matmul).
    if key == "fp32" and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return key


def peak_flops(device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    """Peak FLOP/s for ``dtype`` on ``device`` and where the figure came from ('table' or 'measured').

    Known GPUs use the data-sheet table. Elsewhere (CPUs, unknown GPUs) there is no trustworthy table, so
    a large matmul is timed once per process: MFU then reads as a fraction of the achievable matmul rate.
    """
    name = accelerator_name(device)
    if name in PEAK_TFLOPS:
        return PEAK_TFLOPS[name][_table_key(dtype)] * 1e12, "table"
    return measured_matmul_flops(device.type, dtype, torch.get_num_threads()), "measured"


@functools.lru_cache(maxsize=None)
def measured_matmul_flops(device_type: str, dtype: torch.dtype, threads: int, n: Optional[int] = None) -> float:
    """Best-of-several rate of an n x n matmul in ``dtype``, with the threads the worker was given."""
    device = torch.device(device_type)
    n = n or (1024 if device_type == "cpu" else 8192)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    best = float("inf")
    for _ in range(4):
        synchronize(device)
        start = time.perf_counter()
        a @ b
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2.0 * n ** 3 / best


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated device memory (CUDA), or the process's peak resident set size on CPU.

    CUDA: ``torch.cuda.max_memory_allocated``, the most bytes tensors held at once since the process
    started or since :func:`reset_peak_memory`. CPU: the whole process's peak resident set (Python,
    libraries and data included), the only figure a CPU run has: Linux's ``VmHWM``, which
    :func:`reset_peak_memory` restarts, elsewhere ``ru_maxrss`` (never reset).
    """
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    hwm = _vm_hwm_bytes()
    if hwm is not None:
        return hwm
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def _vm_hwm_bytes() -> Optional[int]:
    """This process's resident-set high-water mark from /proc (Linux), or None where there is none."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def peak_reserved_bytes(device: torch.device) -> Optional[int]:
    """Peak memory the CUDA caching allocator reserved from the device, or None off CUDA.

    Reserved (``torch.cuda.max_memory_reserved``) is at least the allocated peak: it adds the allocator's
    cached, fragmented blocks, and it is what runs out first.
    """
    if device.type == "cuda":
        return int(torch.cuda.max_memory_reserved(device))
    return None


def memory_measure(device: torch.device) -> str:
    """What :func:`peak_memory_bytes` measures on ``device``: 'cuda_allocated' or 'process_rss'."""
    return "cuda_allocated" if device.type == "cuda" else "process_rss"


def reset_peak_memory(device: torch.device) -> None:
    """Restart the peaks, so that several runs in one process (a sweep's worker group, ``rayvit bench``)
    each measure their own: CUDA's allocated and reserved peaks; on Linux CPUs the resident-set
    high-water mark (writing 5 to ``/proc/self/clear_refs``, see proc(5)), elsewhere nothing can."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def default_device(cfg) -> torch.device:
    """The device a run of ``cfg`` trains on in this process: the current CUDA device, or the CPU."""
    if cfg.parallel.use_gpu:
        if not torch.cuda.is_available():
            raise RuntimeError("parallel.use_gpu=true but this worker sees no CUDA device")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
