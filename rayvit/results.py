"""The typed outcome of one training run, shared by the loop, the Ray layer, sweeps and tracking."""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Optional

from rayvit import stats

# Numeric figures a summary holds (val_accuracy only when the data has a validation split; the reserved
# memory and gpu_* figures only on CUDA, gpu_* only with NVML: absent elsewhere, never zero).
METRIC_KEYS = (
    "images_per_sec",              # global, all chips
    "images_per_sec_per_chip",
    "tflops_per_chip",             # analytic training FLOPs per image x images/s per chip / 1e12
    "mfu",                         # tflops_per_chip / the chip's dense peak for the dtype in use
    "step_time_mean_s",            # mean timed step of the slowest rank (= batch / images_per_sec_per_chip)
    "step_time_p50_s",
    "step_time_p90_s",
    "model_state_bytes_per_rank",  # parameters + gradients + optimizer state actually held (max over ranks)
    # Peak memory of the busiest rank: on CUDA the most bytes tensors held at once
    # (torch.cuda.max_memory_allocated); on CPU the worker process's peak resident set (VmHWM, reset per run), which
    # includes Python and libraries. The condition ``memory_measure`` says which ("cuda_allocated" /
    # "process_rss"); each rank's own figure is in RunResult.per_rank["peak_memory_bytes"].
    "peak_memory_bytes_per_rank",
    "peak_memory_reserved_bytes_per_rank",  # CUDA only: max over ranks of torch.cuda.max_memory_reserved
                                            # (allocated + the caching allocator's cache: what runs out)
    # CUDA with NVML (nvidia-ml-py) only, absent elsewhere. Each GPU is read every 0.1 s during the timed
    # (post-warm-up) steps, between-step work (reports, checkpoints, evaluations) left out; each rank's
    # mean over those readings, then across ranks:
    "gpu_utilization_pct",         # mean over ranks of NVML utilisation: % of time a kernel was running
    "gpu_utilization_pct_max",     # the busiest rank's
    "gpu_power_w",                 # mean over ranks of the board power draw, watts per GPU
    "gpu_power_w_max",             # the hungriest rank's
    "gpu_samples",                 # the fewest readings any rank averaged (a handful: a short window)
    "final_loss",
    "val_accuracy",
    # The share of the timed steps' time spent waiting for the next batch (next() on the data iterator:
    # decoding that fell behind, Ray Data's delivery, the host-to-device copy), each step's longest wait
    # over ranks against its step time, epoch starts left out (below); when its interval lies above
    # rayvit.projection.inputs.INPUT_BOUND_FRACTION the point was input-bound. Synthetic data waits for nothing. data.skip_corrupt only: skipped_images, the corrupt
    # images dropped (each rank's distinct ones, summed).
    "data_wait_fraction",
    # Ray Data input: the timed steps' time spent waiting for an epoch's first batch (each epoch is a new
    # execution: its start and its shuffle buffer filling), booked apart from data_wait_fraction, which
    # is the steady per-step wait; and the mean such wait in seconds. Absent when no timed step began an
    # epoch. Over rounds: the median of the rounds'.
    "epoch_start_wait_fraction",
    "epoch_start_wait_s",
    "skipped_images",
    # A run that resumed from a checkpoint (restarts > 0) only: after how many of its restarts the input
    # started afresh instead of continuing where the checkpoint left it (Ray Data's order cannot be
    # replayed; nor can a parquet stream that dropped corrupt rows). 0: every resume continued the stream.
    "data_fresh_starts",
    "epoch_time_imagenet_h",       # 1,281,167 images at the measured global rate
    "train_flops_per_image",
    "peak_tflops",                 # the MFU denominator used
    "timed_steps",
    # model.compile only, absent otherwise: how much longer the warm-up steps took than a median timed step
    # (the step that compiles, and any that recompile), the slowest rank's; never inside the timed window.
    # Over rounds the largest. From empty caches in every run and round unless model.compile_cold=false
    # (condition compile_cold).
    "compile_time_s",
    # model.compile only: the graphs dynamo compiled during the run (a run reusing another's graphs compiles none).
    "compile_graphs",
    "wall_time_s",                 # the whole loop on rank 0, warm-up and evaluation included (all rounds)
    "rounds",                      # how many rounds the medians and intervals are taken over
)
# The figures of rayvit.stats.INTERVAL_KEYS also carry a 95% interval over rounds and timed blocks as
# ``<key>_lo`` / ``<key>_hi``; each such figure is then the median over rounds.

IMAGENET_TRAIN_IMAGES = 1_281_167   # ImageNet-1K's training split, for epoch_time_imagenet_h

# Figures kept per rank (RunResult.per_rank: one value per rank, rank 0 first, None where a rank has
# none), absent when no rank has the figure. As a table column or MLflow metric: ``<name>_by_rank``
# (MLflow: one metric logged with step = rank; the run's figures above are the ones to filter on).
PER_RANK_KEYS = (
    "peak_memory_bytes",           # as peak_memory_bytes_per_rank, this rank's
    "peak_memory_reserved_bytes",  # CUDA only
    "gpu_utilization_pct",         # CUDA + NVML only
    "gpu_power_w",                 # CUDA + NVML only
)

# Conditions every figure is stated with.
CONDITION_KEYS = (
    "model", "image_size", "batch_per_chip", "precision", "strategy", "world_size", "accelerator",
    "device_memory_bytes",
    "torch_version", "ray_version", "fairscale_version", "rayvit_version", "data", "memory_measure",
    "reduce_dtype", "layer_norm_fp32",
    # model.compile only: True when the run compiled from empty caches (dynamo reset, a fresh Inductor cache
    # directory, remote caches off; rayvit.worker.compiling); False when Inductor's caches on disk were reused.
    "compile_cold",
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
    per_rank: dict[str, list[Optional[float]]] = field(default_factory=dict)  # PER_RANK_KEYS -> by rank
    # The collective microbenchmark, measured on this run's own workers after training when the caller
    # asked for it (``fit(..., measure_links=...)``; rayvit.measure.links); else None.
    links: Optional[dict[str, Any]] = None
    # The slowest rank's time of each timed step of this run (one round).
    step_times: list[float] = field(default_factory=list)
    # The longest wait for its batch over ranks, of each of those steps.
    data_wait_times: list[float] = field(default_factory=list)
    # A point measured in several rounds (:meth:`of_rounds`): each round's ``round`` (0-based), ``slot``
    # (its position in the round's order), ``step_times``, ``images_per_sec_per_chip``, ``final_loss``,
    # ``wall_time_s``, ``compile_time_s`` (None when not compiled).
    rounds: list[dict[str, Any]] = field(default_factory=list)

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
        """One flat row (conditions + metrics + ``<key>_by_rank`` lists) for result tables."""
        return {**self.conditions, **self.metrics, **{f"{k}_by_rank": list(v) for k, v in self.per_rank.items()}}

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def report_metrics(self) -> dict[str, Any]:
        """The run as one flat report (``ray.train.report``, a Tune result): its conditions, every finite
        figure with its ``_lo``/``_hi``, and ``restarts``. A figure without a value (NaN) is left out, as in
        :data:`METRIC_KEYS`: absent, never zero."""
        figures = {k: v for k, v in self.metrics.items()
                   if isinstance(v, (int, float)) and math.isfinite(v)}
        return {**self.conditions, **figures, "restarts": self.restarts}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RunResult":
        return cls(**data)

    @classmethod
    def of_rounds(cls, results: list["RunResult"], places: Optional[list[tuple[int, int]]] = None) -> "RunResult":
        """One point's result from its rounds' results (``places``: each round's (round, slot)).

        Throughput figures become the median over rounds with their 95% interval (``<key>_lo``,
        ``<key>_hi``; :mod:`rayvit.stats`); step-time percentiles are over every round's timed steps;
        memory (and each rank's) and compile time are the worst round's; everything else (loss,
        accuracy, history, the other per-rank lists) is the last round's, each round being the same
        training run from the same seed.
        """
        if not results:
            raise ValueError("a point needs at least one round")
        places = places or [(i, 0) for i in range(len(results))]
        last = results[-1]
        rounds = [{"round": r, "slot": slot, "step_times": list(res.step_times),
                   "data_wait_times": list(res.data_wait_times),
                   "images_per_sec_per_chip": res.metrics.get("images_per_sec_per_chip"),
                   "final_loss": res.metrics.get("final_loss"), "wall_time_s": res.metrics.get("wall_time_s"),
                   "compile_time_s": res.metrics.get("compile_time_s")}
                  for res, (r, slot) in zip(results, places)]
        metrics = dict(last.metrics)
        for key in ("model_state_bytes_per_rank", "peak_memory_bytes_per_rank", "peak_memory_reserved_bytes_per_rank"):
            values = [res.metrics[key] for res in results if res.metrics.get(key) is not None]
            if values:
                metrics[key] = max(values)
        for key in ("epoch_start_wait_fraction", "epoch_start_wait_s"):
            values = [res.metrics[key] for res in results if res.metrics.get(key) is not None]
            if values:
                metrics[key] = statistics.median(values)
        compile_times = [res.metrics["compile_time_s"] for res in results if "compile_time_s" in res.metrics]
        if compile_times:
            metrics["compile_time_s"] = max(compile_times)
        per_rank = dict(last.per_rank)
        for key in ("peak_memory_bytes", "peak_memory_reserved_bytes"):
            lists = [res.per_rank[key] for res in results if res.per_rank.get(key)]
            if lists:   # each rank's worst round, so that the run's figure stays the max over ranks
                per_rank[key] = [max((v for v in values if v is not None), default=None) for values in zip(*lists)]
        every_step = [t for res in results for t in res.step_times]
        metrics.update(stats.step_time_percentiles(every_step))
        metrics["timed_steps"] = float(len(every_step))
        metrics["wall_time_s"] = sum(res.metrics.get("wall_time_s", 0.0) for res in results)
        metrics.update(stats.intervals(rounds, metrics, last.conditions))
        if metrics.get("images_per_sec"):
            metrics["epoch_time_imagenet_h"] = IMAGENET_TRAIN_IMAGES / metrics["images_per_sec"] / 3600
        return cls(metrics=metrics, conditions=dict(last.conditions), history=list(last.history),
                   evals=list(last.evals), config=dict(last.config), restarts=last.restarts,
                   per_rank=per_rank, links=last.links, step_times=list(last.step_times),
                   data_wait_times=list(last.data_wait_times), rounds=rounds)


@dataclass
class Comparison:
    """Config ``b`` against config ``a``: both runs' results, and ``b``'s ``key`` over ``a``'s with its
    95% interval (paired by round when they ran in the same rounds: :func:`rayvit.stats.compare`)."""

    a: RunResult
    b: RunResult
    key: str = "images_per_sec_per_chip"

    @property
    def ratio(self) -> Any:
        """The :class:`rayvit.stats.Estimate` of ``b[key] / a[key]`` (median, lo, hi, rounds), or None."""
        from rayvit import stats

        return stats.compare(self.b, self.a, self.key)

    @property
    def verdict(self) -> str:
        """``higher``, ``lower`` (``b``'s figure against ``a``'s, beyond noise) or ``within noise``."""
        ratio = self.ratio
        if ratio is None:
            return "not measured"
        return {"above": "higher", "below": "lower", "within noise": "within noise"}[ratio.verdict(1.0)]

    def text(self, a: str = "A", b: str = "B") -> str:
        """``B: 1.23x (1.10-1.31) A's images_per_sec_per_chip, higher beyond noise (3 rounds)``."""
        ratio = self.ratio
        if ratio is None:
            return f"{b}: no timed steps to compare with {a}"
        how = "within noise" if self.verdict == "within noise" else f"{self.verdict} beyond noise"
        return f"{b}: {ratio.text('.3f', 'x')} {a}'s {self.key}, {how} ({ratio.rounds} round(s))"
