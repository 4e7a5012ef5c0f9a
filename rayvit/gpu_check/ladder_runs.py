"""The GPU check's ladder: the study's optimization rungs on one GPU, with per-chip TFLOPS, MFU and each
rung's ratio to the baseline (see :mod:`rayvit.gpu_check`)."""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from rayvit.gpu_check.cases import one_line


@dataclass(frozen=True)
class GpuCheckOptions:
    """What a GPU check runs: ``rayvit gpu-check``'s options (its --help explains each)."""

    model: str = "vit_l16"
    compile: bool = False
    batch_size: int = 32
    steps: int = 20
    warmup: int = 5
    dtype: str = "bf16"
    baseline_precision: str = "amp"
    no_ladder: bool = False
    quick: bool = False
    out: str = "results/gpu_check.json"


def ladder_config(options: GpuCheckOptions, *, model: Optional[dict[str, Any]] = None,
                  ladder_image_size: int = 256):
    """The ladder as a study: the chosen ViT at 224 px with an ImageNet head, synthetic batches, one GPU."""
    from rayvit.config import study_from_dict
    from rayvit.config_schema import LADDER_RUNGS

    return study_from_dict({
        "model": model or {"name": options.model, "image_size": 224, "num_classes": 1000},
        "precision": {"mode": options.baseline_precision, "dtype": options.dtype},
        "optim": {"name": "adamw"},
        "parallel": {"use_gpu": True, "num_workers": 1},
        "data": {"name": "synthetic"},
        "train": {"batch_size": options.batch_size, "steps": options.steps, "warmup_steps": options.warmup,
                  "report_every": options.steps},
        # The compile rung (compiling costs a minute or so) with --compile only.
        "sweep": {"mode": "ladder", "ladder_image_size": ladder_image_size,
                  "rungs": [r for r in LADDER_RUNGS if r != "compile" or options.compile]},
    })


def run_ladder(cfg, device, *, out: Callable[[str], None]) -> list[dict[str, Any]]:
    """Train every rung of ``rayvit.studies.plan.plan_ladder(cfg)`` on ``device``; one row per rung."""
    import torch

    from rayvit.studies.plan import plan_ladder
    from rayvit.studies.runner import Outcome
    from rayvit.studies.sweep import rows_of, sweep_table
    from rayvit.worker import train

    outcomes = []
    for point in plan_ladder(cfg):
        start = time.perf_counter()
        try:
            result = train(point.cfg, device=device)
            outcome = Outcome(point, "done", result=result, seconds=time.perf_counter() - start)
            m = result.metrics
            out(f"  {point.key:<22} {outcome.seconds:5.1f} s  {m['tflops_per_chip']:7.1f} TFLOPS  "
                f"MFU {m['mfu']:6.1%}  {m['images_per_sec_per_chip']:7.1f} img/s")
        except Exception as e:
            hint = " (lower --batch-size)" if isinstance(e, torch.cuda.OutOfMemoryError) else ""
            outcome = Outcome(point, "failed", error=one_line(e) + hint,
                              seconds=time.perf_counter() - start)
            out(f"  {point.key:<22} FAILED: {outcome.error}")
        outcomes.append(outcome)
        free_device_memory(device)
    rows = rows_of(outcomes, "ladder")
    out("")
    out(sweep_table(rows, "ladder"))
    return rows


def free_device_memory(device) -> None:
    import torch

    from rayvit.training import hardware

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    # Each rung's peak memory is its own.
    hardware.reset_peak_memory(device)
