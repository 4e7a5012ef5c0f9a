"""The rules a config must satisfy beyond its types: derived values resolved (model presets, the conv
stem), then cross-field checks, one function per section. Checks only: nothing here changes a config.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from typing import TYPE_CHECKING

from rayvit.config_schema import BASELINE, LADDER_RUNGS
from rayvit.errors import ConfigError
from rayvit.models.presets import ARCH_KEYS, MODEL_PRESETS
# Each strategy's cost half says what it cannot run (refuses, compile_unsupported, ...), without torch.
from rayvit.strategies import STRATEGIES

if TYPE_CHECKING:
    from rayvit.config_schema import (Config, DataConfig, LaunchConfig, ModelConfig, OptimConfig, ParallelConfig,
                                      SearchConfig, SweepConfig, TrainConfig)


def resolved_model(m: "ModelConfig") -> "ModelConfig":
    """The model with its preset's architecture and the conv stem's default layers filled in."""
    if m.name != "custom":
        preset = MODEL_PRESETS[m.name]
        for key in ARCH_KEYS:
            given = getattr(m, key)
            if given not in (None, getattr(type(m), key), preset[key]):
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


def validate(cfg: Config) -> None:
    """Cross-field checks of a run config; raises ConfigError naming the key, the value and the fix."""
    _validate_model(cfg.model)
    _validate_optim(cfg.optim)
    _validate_parallel(cfg)
    _validate_data(cfg.data)
    if cfg.data.decode == "gpu":
        _check(cfg.parallel.use_gpu and cfg.data.name == "parquet",
               "data.decode=gpu decodes JPEGs on the worker's GPU: it needs parallel.use_gpu=true and "
               "data.name=parquet (use data.decode=cpu otherwise)")
        _check(cfg.data.augment == "none", f"data.augment={cfg.data.augment} runs on the CPU after the crop; "
                                           "with data.decode=gpu use data.augment=none")
        _check(not cfg.data.skip_corrupt, "data.skip_corrupt=true is not available with data.decode=gpu (a JPEG cut off "
               "after a readable header fails on the GPU, where the batch is decoded in one call, and stops the "
               "run naming its row); use data.decode=cpu to drop such rows, or remove them")
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
    _check(m.checkpoint_every >= 1, f"model.checkpoint_every={m.checkpoint_every} must be at least 1 (the "
                                    "stride between checkpointed blocks under activation_checkpointing=selective)")
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
    _check(p.strategy in STRATEGIES,
           f"parallel.strategy={p.strategy!r} is not allowed; choose one of: {', '.join(STRATEGIES)}")
    strategy = STRATEGIES[p.strategy]
    _check(p.num_workers >= 1, f"parallel.num_workers={p.num_workers} must be at least 1")
    _check(p.cpus_per_worker >= 1, f"parallel.cpus_per_worker={p.cpus_per_worker} must be at least 1")
    _check(p.shard_size >= 0, f"parallel.shard_size={p.shard_size} must be 0 (the GPUs of one node) or a "
                              "positive number of ranks per HSDP shard group")
    why = strategy.refuses(cfg)
    _check(why is None, str(why))
    if "torch" in sys.modules:
        check_with_torch(cfg)
    if cfg.model.activation_checkpointing != "none":
        why = strategy.checkpointing_unsupported
        _check(why is None, f"model.activation_checkpointing={cfg.model.activation_checkpointing} cannot run "
                            f"with parallel.strategy={p.strategy}: {why}")
    if cfg.model.compile:
        why = strategy.compile_unsupported
        _check(why is None, f"model.compile=true cannot run with parallel.strategy={p.strategy}: {why}")
        _check(cfg.train.warmup_steps >= 1,
               f"model.compile=true needs train.warmup_steps >= 1 (got {cfg.train.warmup_steps}): the first "
               "step compiles, and it must stay outside the timed window")


def check_with_torch(cfg: "Config") -> None:
    """What only torch can tell about ``cfg``: whether it has fused kernels for ``optim.impl=fused`` on the
    device, and over FSDP2's DTensor parameters a sharding rule for the fused op. Validation runs it when
    torch is loaded already (a config check, a dry run or a projection never load it); a trainer runs it
    on the driver before any worker starts, and a session before it builds a model."""
    if cfg.optim.impl != "fused":
        return
    from rayvit.training.optim import fused_unavailable

    p = cfg.parallel
    why = fused_unavailable(cfg.optim.name, STRATEGIES[p.strategy].dtensor_params, "cuda" if p.use_gpu else "cpu")
    _check(why is None, f"optim.impl=fused with optim.name={cfg.optim.name} and parallel.strategy="
                        f"{p.strategy}: {why}; use optim.impl=foreach")


def _validate_data(d: DataConfig) -> None:
    if d.name == "parquet":
        _check(bool(d.path), "data.name=parquet needs data.path (a parquet file or folder of shards)")
    _check(0 < d.val_fraction < 1, f"data.val_fraction={d.val_fraction} must be in (0, 1)")
    _check(d.synthetic_batches >= 1, "data.synthetic_batches must be at least 1")
    _validate_transforms(d)


def _validate_transforms(d: DataConfig) -> None:
    for key in ("crop_scale", "crop_ratio"):
        pair = getattr(d, key)
        _check(len(pair) == 2 and 0 < pair[0] <= pair[1],
               f"data.{key}={pair} must be two numbers [low, high] with 0 < low <= high")
    _check(d.crop_scale[1] <= 1, f"data.crop_scale={d.crop_scale}: a crop cannot hold more than the whole image (<= 1)")
    _check(0 <= d.hflip <= 1, f"data.hflip={d.hflip} is a probability: it must be in [0, 1]")
    _check(0 < d.crop_pct <= 1, f"data.crop_pct={d.crop_pct} must be in (0, 1]")
    _check(d.randaugment_ops >= 0, f"data.randaugment_ops={d.randaugment_ops} must be >= 0")
    _check(0 <= d.randaugment_magnitude <= 30, f"data.randaugment_magnitude={d.randaugment_magnitude} must be in [0, 30]")
    _check(d.prefetch_batches >= 0, f"data.prefetch_batches={d.prefetch_batches} must be >= 0")


def _validate_train(t: TrainConfig, p: ParallelConfig) -> None:
    _check(t.batch_size > 0, f"train.batch_size={t.batch_size} must be positive")
    _check(t.steps > 0, f"train.steps={t.steps} must be positive")
    _check(0 <= t.warmup_steps < t.steps,
           f"train.warmup_steps={t.warmup_steps} must be >= 0 and below train.steps={t.steps} "
           "so that at least one step is timed")
    _check(t.report_every >= 1, "train.report_every must be at least 1")
    for key in ("eval_every", "checkpoint_every", "max_failures", "fail_at_step"):
        _check(getattr(t, key) >= 0, f"train.{key} must be >= 0")
    _check(t.failure_timeout_s > 0, f"train.failure_timeout_s={t.failure_timeout_s} must be positive")
    _check(-1 <= t.fail_rank < p.num_workers,
           f"train.fail_rank={t.fail_rank} must name a worker in [0, {p.num_workers}), or be -1 (every worker)")


def _validate_launch(launch: LaunchConfig) -> None:
    _check(launch.scale_up_timeout_s >= 0, f"launch.scale_up_timeout_s={launch.scale_up_timeout_s} must be >= 0")
    _check(launch.worker_start_timeout_s is None or launch.worker_start_timeout_s > 0,
           f"launch.worker_start_timeout_s={launch.worker_start_timeout_s} must be positive")


def validate_sweep(s: SweepConfig, baseline_required: bool = True) -> None:
    unknown = sorted(set(s.strategies) - set(STRATEGIES))
    _check(not unknown, f"sweep.strategies has unknown {unknown}; allowed: {', '.join(STRATEGIES)}")
    _check(BASELINE in s.strategies or not baseline_required,
           f"sweep.strategies must include {BASELINE}, the baseline every point is compared to")
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
