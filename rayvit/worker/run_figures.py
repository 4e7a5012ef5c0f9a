"""A session's figures: the running ones a progress report shows, and the run's summary gathered across
ranks (the slowest rank sets the pace; memory and GPU readings kept per rank, with their max and mean),
stated with their conditions. Every function takes the :class:`~rayvit.worker.session.Session` whose
steps its :class:`~rayvit.worker.step_clock.StepClock` timed; those that gather are collectives (every
rank calls them).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from rayvit.results import IMAGENET_TRAIN_IMAGES, RunResult
from rayvit.training import hardware
from rayvit.worker import compiling, metrics
from rayvit.worker.sampler import POWER, UTILIZATION

if TYPE_CHECKING:
    from rayvit.worker.session import Session


def running(session: Session) -> dict[str, Any]:
    """This rank's figures so far, for progress reports: step, loss, lr, the mean loss of the last
    ``train.report_every`` steps, and the throughput figures (images/s, TFLOPS, MFU per chip) over the
    timed steps so far (``timed_steps`` of them; over the warm-up steps while none is timed yet)."""
    t, last = session.cfg.train, session.history[-1]
    recent = session.history[-t.report_every:]
    times = session.clock.step_times or session.clock.warmup_step_times
    per_chip = metrics.images_per_sec(t.batch_size, len(times), sum(times))
    rate = rate_figures(session, per_chip)
    figures = {"step": session.step, "loss": last["loss"], "lr": last["lr"], "restarts": session.restarts,
               "loss_mean": sum(h["loss"] for h in recent) / len(recent),
               "images_per_sec_per_chip": per_chip, "images_per_sec": per_chip * session.world_size,
               "tflops_per_chip": rate["tflops_per_chip"], "mfu": rate["mfu"],
               "timed_steps": len(session.clock.step_times)}
    if session.evals:
        figures["val_accuracy"] = session.evals[-1]["val_accuracy"]
    if session.restarts:
        figures["data_fresh_starts"] = session.data_fresh_starts
    return figures


def summary(session: Session, wall_time_s: float) -> RunResult:
    """Figures aggregated over ranks (the slowest rank sets the pace), with their conditions.

    Memory and GPU readings are gathered from every rank: the run keeps each rank's value
    (``RunResult.per_rank``) and their max / mean (:func:`metrics.across_ranks`).
    """
    slowest, waited, started, stats, combined, per_rank = _gathered(session)
    # The slowest rank's total time over the window sets the pace.
    per_chip = metrics.images_per_sec(session.cfg.train.batch_size, len(session.clock.step_times), stats[0])
    global_rate = per_chip * session.world_size
    rate = rate_figures(session, per_chip)
    figures = {
        "images_per_sec": global_rate,
        "images_per_sec_per_chip": per_chip,
        "tflops_per_chip": rate["tflops_per_chip"],
        "mfu": rate["mfu"],
        "step_time_mean_s": session.cfg.train.batch_size / per_chip if per_chip > 0 else math.nan,
        **metrics.step_time_percentiles(slowest),
        "model_state_bytes_per_rank": stats[1],
        "data_wait_fraction": sum(waited) / sum(slowest) if slowest else math.nan,
        **metrics.epoch_start_figures(started, slowest),
        **combined,
        "final_loss": session.history[-1]["loss"] if session.history else float("nan"),
        "epoch_time_imagenet_h": IMAGENET_TRAIN_IMAGES / global_rate / 3600,
        "train_flops_per_image": float(session.complexity.train_flops_per_image),
        "peak_tflops": rate["peak_tflops"],
        "timed_steps": float(len(session.clock.step_times)),
        "wall_time_s": wall_time_s,
    }
    if session.evals and "val_accuracy" in session.evals[-1]:
        figures["val_accuracy"] = session.evals[-1]["val_accuracy"]
    if session.restarts:
        figures["data_fresh_starts"] = float(session.data_fresh_starts)
    if session.cfg.model.compile:
        figures["compile_time_s"] = stats[2]      # the slowest rank's
        figures["compile_graphs"] = float(compiling.graphs_compiled() - session.graphs_before)
    return RunResult(metrics=figures, conditions=conditions(session, rate["peak_source"]),
                     history=list(session.history), evals=list(session.evals), config=session.cfg.to_dict(),
                     restarts=session.restarts, per_rank=per_rank, step_times=slowest,
                     data_wait_times=waited)


def _gathered(session: Session) -> tuple[list[float], list[float], list[float], list[float], dict, dict]:
    """Over every rank: each timed step's slowest time, longest steady data wait and longest epoch-start
    wait; the slowest rank's total step time, model state and compile time; and each rank's own readings
    (peak memory, NVML, skipped images), combined and per rank (:func:`metrics.across_ranks`)."""
    readings = session.clock.readings()
    times = torch.tensor(session.clock.step_times or [float("nan")], dtype=torch.float64)
    waits = torch.tensor(session.clock.data_wait_times or [float("nan")], dtype=torch.float64)
    starts = torch.tensor(session.clock.epoch_start_waits or [float("nan")], dtype=torch.float64)
    stats = torch.tensor([times.sum().item(), float(session.model_state_bytes()), compile_time_s(session)],
                         dtype=torch.float64)
    reserved = hardware.peak_reserved_bytes(session.device)
    mine = {"peak_memory_bytes": float(hardware.peak_memory_bytes(session.device)),
            "peak_memory_reserved_bytes": math.nan if reserved is None else float(reserved),
            "gpu_utilization_pct": readings.get(UTILIZATION, math.nan),
            "gpu_power_w": readings.get(POWER, math.nan),
            "gpu_samples": readings.get("samples", math.nan),
            "skipped_images": float(len(session.data.skipped)) if session.data.skipped is not None else math.nan}
    ranks = torch.tensor([list(mine.values())], dtype=torch.float64)
    if session.world_size > 1:
        # Step times and counts are the same length on every rank; take the slowest per step.
        times, waits, starts, stats = (_max_over_ranks(t, session.device) for t in (times, waits, starts, stats))
        mine_d = ranks[0].to(session.device)
        gathered = [torch.empty_like(mine_d) for _ in range(session.world_size)]
        dist.all_gather(gathered, mine_d)
        ranks = torch.stack(gathered).cpu()
    combined, per_rank = metrics.across_ranks(dict(zip(mine, ranks.t().tolist())))
    timed = bool(session.clock.step_times)
    return (times.tolist() if timed else [], waits.tolist() if timed else [],
            starts.tolist() if timed else [], stats.tolist(), combined, per_rank)


def _max_over_ranks(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    on_device = values.to(device)
    dist.all_reduce(on_device, op=dist.ReduceOp.MAX)
    return on_device.cpu()


def rate_figures(session: Session, images_per_sec_per_chip: float) -> dict:
    """TFLOPS per chip and MFU at a per-chip image rate, for this model and precision."""
    return metrics.rate_figures(session.complexity.train_flops_per_image, images_per_sec_per_chip,
                                session.device, session.precision.compute_dtype)


def compile_time_s(session: Session) -> float:
    """Under ``model.compile``: the warm-up steps' time beyond a median timed step, which is what
    compiling them cost (the step that compiles and any that recompile); 0.0 when not compiled."""
    if not session.cfg.model.compile or not session.clock.step_times:
        return 0.0
    return compiling.compile_overhead_s(session.clock.warmup_step_times, session.clock.step_times)


def conditions(session: Session, peak_source: str) -> dict[str, Any]:
    """What every figure of this run is stated with (:func:`metrics.run_conditions`)."""
    return metrics.run_conditions(session.cfg, session.precision, session.strategy, session.world_size,
                                  session.device, peak_source)
