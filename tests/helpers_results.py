"""Results with chosen figures, as the trainer returns them, for the code that records, compares and
projects them (the MLflow record among it)."""

from __future__ import annotations

from rayvit.results import RunResult

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def make_result(strategy: str, world_size: int, tflops: float, images_per_chip: float, gpu: bool = False) -> RunResult:
    """A RunResult as the trainer returns it, with chosen figures (inputs for the code under test).

    Peak memory per rank is 4e7, 5e7, ... bytes (max 5e7 at two ranks); ``gpu`` adds what a CUDA run with
    NVML records (reserved memory, utilisation, power).
    """
    metrics = {"images_per_sec": images_per_chip * world_size, "images_per_sec_per_chip": images_per_chip,
               "tflops_per_chip": tflops, "mfu": tflops / 2.0, "step_time_p50_s": 0.1, "step_time_p90_s": 0.12,
               "model_state_bytes_per_rank": 4e6 / (world_size if strategy != "ddp" else 1),
               "peak_memory_bytes_per_rank": 5e7, "final_loss": 1.5, "val_accuracy": None,
               "epoch_time_imagenet_h": 3.0, "train_flops_per_image": 1e9, "peak_tflops": 2.0,
               "timed_steps": 10, "wall_time_s": 4.0}
    per_rank = {"peak_memory_bytes": [4e7 + 1e7 * r for r in range(world_size)]}
    metrics["peak_memory_bytes_per_rank"] = max(per_rank["peak_memory_bytes"])
    if gpu:
        per_rank.update(peak_memory_reserved_bytes=[6e7 + 1e7 * r for r in range(world_size)],
                        gpu_utilization_pct=[90.0 - 10 * r for r in range(world_size)],
                        gpu_power_w=[400.0 - 50 * r for r in range(world_size)])
        metrics.update(peak_memory_reserved_bytes_per_rank=max(per_rank["peak_memory_reserved_bytes"]),
                       gpu_utilization_pct=sum(per_rank["gpu_utilization_pct"]) / world_size,
                       gpu_utilization_pct_max=90.0, gpu_power_w=sum(per_rank["gpu_power_w"]) / world_size,
                       gpu_power_w_max=400.0, gpu_samples=30.0)
    conditions = {"model": "custom", "image_size": 32, "batch_per_chip": 16, "precision": "fp32",
                  "strategy": strategy, "world_size": world_size, "accelerator": "cpu",
                  "torch_version": "2.13.0", "ray_version": "2.60.0", "fairscale_version": "0.4.13",
                  "rayvit_version": "0.1.0", "data": "synthetic",
                  "memory_measure": "cuda_allocated" if gpu else "process_rss"}
    history = [{"step": s, "loss": 2.0 - 0.1 * s, "lr": 1e-3, "step_time_s": 0.1} for s in range(1, 6)]
    return RunResult(metrics, conditions, history, config={"parallel": {"strategy": strategy}},
                     per_rank=per_rank)
