"""The typed outcome of one training run, shared by the loop, the Ray layer, sweeps and tracking."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

# Numeric figures every summary holds (val_accuracy only when the data has a validation split).
METRIC_KEYS = (
    "images_per_sec",              # global, all chips
    "images_per_sec_per_chip",
    "tflops_per_chip",             # analytic training FLOPs per image x images/s per chip / 1e12
    "mfu",                         # tflops_per_chip / the chip's dense peak for the dtype in use
    "step_time_p50_s",
    "step_time_p90_s",
    "model_state_bytes_per_rank",  # parameters + gradients + optimizer state actually held (max over ranks)
    "peak_memory_bytes_per_rank",  # max over ranks
    "final_loss",
    "val_accuracy",
    "epoch_time_imagenet_h",       # 1,281,167 images at the measured global rate
    "train_flops_per_image",
    "peak_tflops",                 # the MFU denominator used
    "timed_steps",
    "wall_time_s",                 # the whole loop on rank 0, warm-up and evaluation included
)

# Conditions every figure is stated with.
CONDITION_KEYS = (
    "model", "image_size", "batch_per_chip", "precision", "strategy", "world_size", "accelerator",
    "torch_version", "ray_version", "fairscale_version", "rayvit_version", "data",
    "reduce_dtype", "layer_norm_fp32",
)


@dataclass
class RunResult:
    """What one run produced: summary figures, their conditions, per-step history and the config."""

    metrics: dict[str, float]
    conditions: dict[str, Any]
    history: list[dict[str, float]] = field(default_factory=list)   # {"step", "loss", "lr", "step_time_s"}
    evals: list[dict[str, float]] = field(default_factory=list)     # {"step", "val_accuracy", "val_loss"}
    config: dict[str, Any] = field(default_factory=dict)
    restarts: int = 0

    def __getitem__(self, key: str) -> Any:
        if key in self.metrics:
            return self.metrics[key]
        return self.conditions[key]

    def get(self, key: str, default: Optional[Any] = None) -> Any:
        try:
            return self[key]
        except KeyError:
            return default

    def row(self) -> dict[str, Any]:
        """One flat row (conditions + metrics) for result tables."""
        return {**self.conditions, **self.metrics}

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RunResult":
        return cls(**data)
