"""The rules a config must satisfy beyond its types: derived values resolved (model presets, the conv
stem), then cross-field checks, one function per section. Checks only: nothing here changes a config.
"""

from __future__ import annotations

import dataclasses
import math

from rayvit.config import (LADDER_RUNGS, STRATEGIES, Config, ConfigError, _half_reduce, DataConfig, LaunchConfig, ModelConfig,
                           OptimConfig, ParallelConfig, PrecisionConfig, SearchConfig, SweepConfig, TrainConfig)
from rayvit.models.presets import ARCH_KEYS, MODEL_PRESETS


def _resolved_model(m: ModelConfig) -> ModelConfig:
    """The model with its preset's architecture and the conv stem's default layers filled in."""
    if m.name != "custom":
        preset = MODEL_PRESETS[m.name]
        for key in ARCH_KEYS:
            given = getattr(m, key)
            if given not in (None, getattr(ModelConfig, key), preset[key]):
                raise ConfigError(
                    f"model.{key}={given} conflicts with model.name={m.name} ({key}={preset[key]}); "
                    f"use model.name=custom to set the architecture yourself")
        m = dataclasses.replace(m, **preset)
    if m.stem == "conv" and not m.conv_stem_strides and not m.conv_stem_dims and m.patch_size:
        n = int(math.log2(m.patch_size))
        _check(2 ** n == m.patch_size,
               f"model.patch_size={m.patch_size} is not a power of two: set model.conv_stem_strides "
               "and model.conv_stem_dims for the conv stem")
        m = dataclasses.replace(m, conv_stem_strides=[2] * n,
                                conv_stem_dims=[max(8, (m.hidden_dim or 8) >> (n - i)) for i in range(n)])
    return m


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def _validate_strategy_precision(p: ParallelConfig, prec: PrecisionConfig) -> None:
    """Strategy and precision combinations a library cannot run or cannot honour, refused up front."""
    if p.strategy == "fairscale_oss" and prec.mode == "mixed":
        raise ConfigError(
            "precision.mode=mixed cannot combine with parallel.strategy=fairscale_oss: OSS shards the "
            "optimizer over the model's own (half) parameters, leaving no place for an fp32 master copy; "
            "use precision.mode=amp or pure with fairscale_oss, or parallel.strategy=fsdp with mixed")
    if p.strategy == "fairscale_fsdp" and prec.mode == "pure" and prec.dtype == "bf16":
        raise ConfigError(
            "precision.mode=pure precision.dtype=bf16 cannot run with parallel.strategy=fairscale_fsdp: "
            "FairScale 0.4.13's FSDP accepts half parameters only as fp16 (pure bf16 does not exist in that "
            "version); use precision.dtype=fp16, or parallel.strategy=fsdp (PyTorch FSDP2) for pure bf16")
    if prec.mode == "pure" and not _half_reduce(p, prec) and p.strategy in ("fairscale_fsdp", "fairscale_oss"):
        why = ("FairScale FSDP reduces in fp32 only with mixed_precision (fp32_reduce_scatter)"
               if p.strategy == "fairscale_fsdp" else
               "ShardedDDP reduces every gradient in its parameter's dtype")
        raise ConfigError(
            f"precision.mode=pure with parallel.strategy={p.strategy} cannot reduce its half gradients in "
            f"fp32 (parallel.reduce_dtype=fp32): {why}; set parallel.reduce_dtype=half, or use "
            "parallel.strategy=ddp or fsdp, which reduce in fp32")


# Strategies whose library cannot run under torch.compile, and why (decided here, before any wrapping).
COMPILE_UNSUPPORTED = {
    "fairscale_fsdp": (
        "FairScale's FullyShardedDataParallel (0.4.13, unmaintained since it was upstreamed into PyTorch) "
        "does not support torch.compile: it predates it and swaps flattened-parameter views in and out of "
        "the model around every forward and backward; use parallel.strategy=fsdp (PyTorch FSDP2, which "
        "compiles each block), or model.compile=false for the study's FairScale FSDP"),
}


def validate(cfg: Config) -> None:
    """Cross-field checks of a run config; raises ConfigError naming the key, the value and the fix."""
    _validate_model(cfg.model)
    _validate_optim(cfg.optim)
    _validate_parallel(cfg)
    _validate_data(cfg.data)
    _validate_train(cfg.train, cfg.parallel)
    _validate_launch(cfg.launch)


def _validate_model(m: ModelConfig) -> None:
    for key in ARCH_KEYS:
        _check(getattr(m, key) is not None and getattr(m, key) > 0,
               f"model.{key} must be a positive integer for model.name=custom")
    _check(m.image_size > 0, f"model.image_size={m.image_size} must be positive")
    _check(m.image_size % m.patch_size == 0,
           f"model.image_size={m.image_size} must be divisible by model.patch_size={m.patch_size}")
    _check(m.hidden_dim % m.num_heads == 0,
           f"model.num_heads={m.num_heads} must divide model.hidden_dim={m.hidden_dim}")
    _check(m.num_classes >= 2, f"model.num_classes={m.num_classes} must be at least 2")
    _check(0.0 <= m.dropout < 1.0, f"model.dropout={m.dropout} must be in [0, 1)")
    if m.stem == "conv":
        _check(len(m.conv_stem_dims) == len(m.conv_stem_strides) and m.conv_stem_dims,
               f"model.conv_stem_dims {m.conv_stem_dims} and model.conv_stem_strides "
               f"{m.conv_stem_strides} must be non-empty lists of equal length")
        _check(math.prod(m.conv_stem_strides) == m.patch_size,
               f"model.conv_stem_strides {m.conv_stem_strides} multiply to "
               f"{math.prod(m.conv_stem_strides)}, but must multiply to model.patch_size={m.patch_size}")
        _check(all(d > 0 for d in m.conv_stem_dims), "model.conv_stem_dims must be positive")


def _validate_optim(o: OptimConfig) -> None:
    _check(o.lr > 0, f"optim.lr={o.lr} must be positive")
    _check(o.weight_decay >= 0, f"optim.weight_decay={o.weight_decay} must be >= 0")
    _check(0 <= o.min_lr_ratio <= 1, f"optim.min_lr_ratio={o.min_lr_ratio} must be in [0, 1]")
    _check(o.lr_warmup_steps >= 0, "optim.lr_warmup_steps must be >= 0")


def _validate_parallel(cfg: Config) -> None:
    p = cfg.parallel
    _check(p.num_workers >= 1, f"parallel.num_workers={p.num_workers} must be at least 1")
    _check(p.cpus_per_worker >= 1, f"parallel.cpus_per_worker={p.cpus_per_worker} must be at least 1")
    if p.strategy == "fairscale_fsdp" and not p.use_gpu:
        raise ConfigError(
            "parallel.strategy=fairscale_fsdp needs CUDA GPUs (FairScale's FSDP uses CUDA streams and "
            "fails on CPU); set parallel.use_gpu=true on a GPU cluster, or use parallel.strategy=fsdp "
            "(PyTorch FSDP2), which runs on CPU too")
    _validate_strategy_precision(p, cfg.precision)
    if cfg.optim.impl == "fused":
        # Decided here, before any model is built or wrapped: torch's fused kernels per device, and under
        # FSDP2 whether DTensor has a rule for the fused op.
        from rayvit.worker.optim import fused_unavailable

        why = fused_unavailable(cfg.optim.name, p.strategy, "cuda" if p.use_gpu else "cpu")
        _check(why is None, f"optim.impl=fused with optim.name={cfg.optim.name} and parallel.strategy="
                            f"{p.strategy}: {why}; use optim.impl=foreach")
    if cfg.model.compile:
        why = COMPILE_UNSUPPORTED.get(p.strategy)
        _check(why is None, f"model.compile=true cannot run with parallel.strategy={p.strategy}: {why}")
        _check(cfg.train.warmup_steps >= 1,
               f"model.compile=true needs train.warmup_steps >= 1 (got {cfg.train.warmup_steps}): the first "
               "step compiles, and it must stay outside the timed window")


def _validate_data(d: DataConfig) -> None:
    if d.name == "parquet":
        _check(bool(d.path), "data.name=parquet needs data.path (a parquet file or folder of shards)")
    _check(0 < d.val_fraction < 1, f"data.val_fraction={d.val_fraction} must be in (0, 1)")
    _check(d.synthetic_batches >= 1, "data.synthetic_batches must be at least 1")


def _validate_train(t: TrainConfig, p: ParallelConfig) -> None:
    _check(t.batch_size > 0, f"train.batch_size={t.batch_size} must be positive")
    _check(t.steps > 0, f"train.steps={t.steps} must be positive")
    _check(0 <= t.warmup_steps < t.steps,
           f"train.warmup_steps={t.warmup_steps} must be >= 0 and below train.steps={t.steps} "
           "so that at least one step is timed")
    _check(t.report_every >= 1, "train.report_every must be at least 1")
    for key in ("eval_every", "checkpoint_every", "max_failures", "fail_at_step"):
        _check(getattr(t, key) >= 0, f"train.{key} must be >= 0")
    _check(-1 <= t.fail_rank < p.num_workers,
           f"train.fail_rank={t.fail_rank} must name a worker in [0, {p.num_workers}), or be -1 (every worker)")


def _validate_launch(launch: LaunchConfig) -> None:
    _check(launch.scale_up_timeout_s >= 0, f"launch.scale_up_timeout_s={launch.scale_up_timeout_s} must be >= 0")
    _check(launch.worker_start_timeout_s is None or launch.worker_start_timeout_s > 0,
           f"launch.worker_start_timeout_s={launch.worker_start_timeout_s} must be positive")


def validate_sweep(s: SweepConfig) -> None:
    unknown = sorted(set(s.strategies) - set(STRATEGIES))
    _check(not unknown, f"sweep.strategies has unknown {unknown}; allowed: {', '.join(STRATEGIES)}")
    _check("ddp" in s.strategies, "sweep.strategies must include ddp, the baseline every point is compared to")
    _check(bool(s.worker_counts) and all(n >= 1 for n in s.worker_counts),
           f"sweep.worker_counts={s.worker_counts} must be a non-empty list of positive integers")
    unknown = sorted(set(s.rungs) - set(LADDER_RUNGS))
    _check(not unknown, f"sweep.rungs has unknown {unknown}; allowed: {', '.join(LADDER_RUNGS)}")
    _check(s.ladder_image_size > 0, "sweep.ladder_image_size must be positive")
    _check(1 <= s.rounds <= 100, f"sweep.rounds={s.rounds} must be between 1 and 100 (3 or more give an "
           "interval that includes run-to-run spread)")


def validate_search(q: SearchConfig) -> None:
    _check(q.max_accuracy_drop >= 0, f"search.max_accuracy_drop={q.max_accuracy_drop} must be >= 0")
    _check(q.num_samples >= 1, "search.num_samples must be at least 1")
    _check(q.max_concurrent_trials >= 0, "search.max_concurrent_trials must be >= 0")
    _check(q.asha_grace_steps >= 0, "search.asha_grace_steps must be >= 0")
    _check(q.asha_reduction_factor > 1, f"search.asha_reduction_factor={q.asha_reduction_factor} must be > 1")
    _check(0 < q.target_accuracy <= 1, f"search.target_accuracy={q.target_accuracy} must be in (0, 1]")
    _check(q.screen_steps >= 1, f"search.screen_steps={q.screen_steps} must be at least 1")
    _check(q.screen_seconds > 0, f"search.screen_seconds={q.screen_seconds} must be > 0")
