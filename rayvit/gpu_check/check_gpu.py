"""The GPU check from start to end: refuse without CUDA, run every check, then the ladder, print the
verdicts and write the JSON report (:func:`check_gpu`); ``--list`` is :func:`list_plan`. Its command line is
``rayvit gpu-check`` (:mod:`rayvit.cli.gpu_check_command`)."""

from __future__ import annotations

import json
import platform
import sys
import time
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Optional

from rayvit.gpu_check.checklist import plan_checks, run_checks
from rayvit.gpu_check.ladder_runs import GpuCheckOptions, ladder_config, run_ladder

# The study's ViT-H/16 ratios to its DDP baseline (A100s), printed beside ours for orientation.
STUDY_RATIOS = {"batch_second": 1.51, "image_256": 1.86, "full_half": 2.18}


def no_cuda_reason() -> Optional[str]:
    """Why this process cannot use CUDA, or None when it can."""
    import os

    import torch

    if torch.version.cuda is None:
        return (f"this torch ({torch.__version__}) is a CPU-only build. Install a CUDA build of torch on a "
                f"machine with an NVIDIA GPU, e.g. `pip install torch` there.")
    if not torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        hint = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
        return (f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device{hint}. "
                f"Check `nvidia-smi` and the driver.")
    return None


def environment(device) -> dict[str, Any]:
    import torch

    from rayvit.training import hardware
    from rayvit.worker.metrics import library_versions

    env: dict[str, Any] = {"python": platform.python_version(), "host": platform.node(),
                           "time_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                           **library_versions(), "cuda": torch.version.cuda}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(device_name=props.name, accelerator=hardware.accelerator_name(device),
                   capability=f"{props.major}.{props.minor}", memory_gib=round(props.total_memory / 2**30, 1),
                   cudnn=torch.backends.cudnn.version(), tf32_matmul=torch.backends.cuda.matmul.allow_tf32,
                   flash_sdp_enabled=torch.backends.cuda.flash_sdp_enabled(),
                   mem_efficient_sdp_enabled=torch.backends.cuda.mem_efficient_sdp_enabled())
    return env


def list_plan(options: GpuCheckOptions, out: Callable[[str], None] = print) -> None:
    """``--list``: the checks and ladder rungs a run with these options would do."""
    from rayvit.studies.plan import plan_ladder

    out("checks:")
    for name, _ in plan_checks(None, quick=options.quick, compile_=options.compile):
        out(f"  {name}")
    if not options.no_ladder:
        out(f"ladder ({options.model}, batch {options.batch_size}, {options.steps} steps, {options.warmup} warm-up):")
        for point in plan_ladder(ladder_config(options)):
            out(f"  {point.key}")


def check_gpu(options: GpuCheckOptions, out: Callable[[str], None] = print) -> int:
    """Every check, then the ladder, on this process's CUDA device; the report goes to ``options.out``.
    Exit status: 0 all passed, 1 a check or rung failed, 2 no CUDA."""
    reason = no_cuda_reason()
    if reason:
        print(f"gpu_check: no GPU to check: {reason}", file=sys.stderr)
        return 2

    import torch

    device = torch.device("cuda", torch.cuda.current_device())
    start = time.perf_counter()
    env = environment(device)
    out(f"gpu_check on {env['device_name']} ({env['memory_gib']} GiB, sm {env['capability']}), torch "
        f"{env['torch_version']}, CUDA {env['cuda']}")
    out("checks:")
    checks = run_checks(device, compile_=options.compile, out=out, quick=options.quick)
    rows = [] if options.no_ladder else ladder_with_ratios(options, device, out)
    failed = [c["check"] for c in checks if c["ok"] is False] + [r["point"] for r in rows if r["status"] != "done"]
    report = {"environment": env, "args": {**asdict(options), "list": False}, "checks": checks, "ladder": rows,
              "failed": failed, "seconds": round(time.perf_counter() - start, 1)}
    path = Path(options.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=str))
    unchecked = [c["check"] for c in checks if c["ok"] is None]
    note = f" ({len(unchecked)} not checkable on this machine: {', '.join(unchecked)})" if unchecked else ""
    out(f"\n{'all passed' if not failed else 'FAILED: ' + ', '.join(failed)}{note} in {report['seconds']:.0f} s; "
        f"written to {path.resolve()}")
    return 1 if failed else 0


def ladder_with_ratios(options: GpuCheckOptions, device, out: Callable[[str], None]) -> list[dict[str, Any]]:
    """The ladder's rungs on ``device``, then each rung's ratio to the baseline beside the study's."""
    cfg = ladder_config(options)
    out(f"\nladder: {options.model}, batch {options.batch_size}/GPU, {options.steps} steps ({options.warmup} "
        f"warm-up) per rung, baseline {options.baseline_precision}, half type {options.dtype}, 1 GPU")
    rows = run_ladder(cfg, device, out=out)
    out("\nratio to the baseline (the study's ViT-H/16 on A100s in brackets):")
    for row in rows:
        ratio = row.get("relative_throughput")
        study = STUDY_RATIOS.get(row["series"])
        out(f"  {row['series']:<18} " + (f"{ratio:.2f}x" if ratio else "-") + (f"  [{study:.2f}x]" if study else ""))
    return rows
