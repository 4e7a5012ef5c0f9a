"""One typed config tree for a run, and the study specifications that sit beside it.

A :class:`Config` is what one run needs and what is recorded with it: ``model``, ``precision``,
``optim``, ``parallel``, ``data``, ``train`` and ``launch``. A :class:`Study` adds what to do with runs:
a ``sweep`` or a ``search`` of them, and where they are ``tracking``-recorded. Both come from one YAML
file, overridden with ``section.key=value`` strings in the style of a command line; building resolves
derived values (model presets, the conv stem's default widths) into a new object, then validation only
checks.

Allowed values are written into the type annotations (``Literal[...]``), so one generic checker covers
every field and error messages can always say what is allowed.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import types
import typing
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Literal, Optional, Union

import yaml

from rayvit.models.presets import ARCH_KEYS, MODEL_PRESETS


class ConfigError(ValueError):
    """A config key, value or combination of values that rayvit cannot run."""


def reduces_in_half(cfg: "Config") -> bool:
    """Whether ``cfg``'s half-precision gradients are reduced in half (``parallel.reduce_dtype`` resolved)."""
    return _half_reduce(cfg.parallel, cfg.precision)


def _half_reduce(p: "ParallelConfig", prec: "PrecisionConfig") -> bool:
    return p.reduce_dtype == "half" or (p.reduce_dtype == "auto" and prec.mode == "pure")


def rayvit_home() -> Path:
    """Where rayvit keeps local results (the MLflow store, Ray Train's runs): ``$RAYVIT_HOME``, else ~/.rayvit."""
    return Path(os.environ.get("RAYVIT_HOME") or Path.home() / ".rayvit").expanduser().resolve()




@dataclass
class ModelConfig:
    """The ViT: a named size (or ``custom``) plus the study's architectural options."""

    name: Literal["custom", "vit_ti16", "vit_s16", "vit_b16", "vit_l16", "vit_h16", "vit_h14"] = "custom"
    # Architecture; filled from the preset when ``name`` is not ``custom``.
    hidden_dim: Optional[int] = 64
    depth: Optional[int] = 2
    num_heads: Optional[int] = 4
    mlp_dim: Optional[int] = 128
    patch_size: Optional[int] = 4
    image_size: int = 32
    num_classes: int = 10
    stem: Literal["patchify", "conv"] = "patchify"
    # Conv stem ("early convolutions"): one stride-s 3x3 conv + BN + ReLU per entry, then a 1x1 conv to
    # the hidden width. The strides must multiply to the patch size. Empty = derived: log2(patch) stride-2
    # convs whose widths double up to hidden_dim / 2.
    conv_stem_dims: list[int] = field(default_factory=list)
    conv_stem_strides: list[int] = field(default_factory=list)
    classifier: Literal["token", "pooled"] = "token"
    layout: Literal["batch_first", "batch_second"] = "batch_first"
    dropout: float = 0.0
    # Kernel fusion with torch.compile, the way each strategy supports it (rayvit.worker.strategies):
    # each encoder block compiled before sharding (FSDP2, as torchtitan does; FairScale OSS), or the
    # DDP-wrapped model (DDPOptimizer splits its graph at the gradient buckets). FairScale FSDP is refused.
    # The steps that compile run among train.warmup_steps, outside the timed window; their extra time is
    # recorded as compile_time_s.
    compile: bool = False


@dataclass
class PrecisionConfig:
    """Numeric precision, named after the familiar AMP optimisation levels.

    ``fp32`` = O0, ``amp`` = O1 (autocast), ``mixed`` = O2 (half weights, fp32 master copy and optimizer
    state), ``pure`` = O3 (everything half, the study's "full FP16").
    """

    mode: Literal["fp32", "amp", "mixed", "pure"] = "fp32"
    dtype: Literal["fp16", "bf16"] = "bf16"
    # ``mixed`` only: keep LayerNorm parameters and computation in fp32 while matmuls run in half (the
    # study's fastest setting without accuracy loss, pycls ``FSDP.LAYER_NORM_FP32``).
    layer_norm_fp32: bool = True


@dataclass
class OptimConfig:
    name: Literal["adamw", "adam", "sgd"] = "adamw"
    # loop = one kernel per tensor; foreach = multi-tensor apply (the study's MTA optimizer); fused = one
    # fused kernel where torch has one for the device.
    impl: Literal["loop", "foreach", "fused"] = "foreach"
    lr: float = 1e-3
    weight_decay: float = 0.05
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    momentum: float = 0.9
    # Learning-rate schedule: linear warm-up then cosine (or constant) to min_lr_ratio * lr.
    schedule: Literal["cosine", "constant"] = "cosine"
    lr_warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    label_smoothing: float = 0.0
    grad_clip: float = 0.0


@dataclass
class ParallelConfig:
    """How workers share the model: DDP is the baseline every comparison is made against."""

    strategy: Literal["ddp", "fsdp", "fairscale_oss", "fairscale_fsdp"] = "ddp"
    num_workers: int = 1
    use_gpu: bool = False
    cpus_per_worker: int = 1
    accelerator_type: Optional[str] = None
    # PACK keeps workers together; SPREAD puts them on different nodes.
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    # FSDP: True reshards parameters after forward (ZeRO-3-like); False keeps them (ZeRO-2-like).
    reshard_after_forward: bool = True
    # The dtype half-precision gradients (``mixed``, ``pure``) are reduced in, by every strategy (DDP through
    # a communication hook). fp32 gradients (``fp32``, ``amp``, LayerNorm kept in fp32) always go in fp32.
    # auto: fp32 under ``mixed`` (the study's AMP O2), half under ``pure`` (its "full FP16": everything
    # half, and the only dtype FairScale's strategies can reduce half parameters' gradients in). Each run
    # records the dtype used as its ``reduce_dtype`` condition.
    reduce_dtype: Literal["auto", "fp32", "half"] = "auto"


@dataclass
class DataConfig:
    name: Literal["synthetic", "digits", "parquet"] = "synthetic"
    # parquet: a file or folder of shards with image-bytes and label columns.
    path: Optional[str] = None
    val_path: Optional[str] = None
    image_column: str = "image"
    label_column: str = "label"
    # synthetic: number of distinct fixed batches cycled through.
    synthetic_batches: int = 4
    # digits / parquet: fraction held out for validation when no val_path is given.
    val_fraction: float = 0.2


@dataclass
class TrainConfig:
    batch_size: int = 16
    steps: int = 20
    # Steps excluded from the throughput window (compilation, allocator and cache warm-up).
    warmup_steps: int = 5
    seed: int = 0
    # Report metrics to Ray every N steps (each report costs ~2 s, so never per step).
    report_every: int = 10
    eval_every: int = 0
    checkpoint_every: int = 0
    max_failures: int = 0
    # Fault injection: crash `fail_rank` (-1: every rank) once when it reaches this step (0 = off): "raise"
    # an exception (a crashed step), or "exit" the worker process at once (a lost worker or node).
    fail_at_step: int = 0
    fail_rank: int = 0
    fail_mode: Literal["raise", "exit"] = "raise"


@dataclass
class TrackingConfig:
    # MLflow tracking URI; empty means $MLFLOW_TRACKING_URI, else an absolute local sqlite store.
    uri: Optional[str] = None
    experiment: Optional[str] = None


@dataclass
class LaunchConfig:
    """How runs reach a Ray cluster: where their checkpoints go and how long to wait for nodes."""

    # Ray Train's storage for run folders and checkpoints: a folder every node mounts (NFS, EFS, FSx) or
    # a URI pyarrow's filesystems understand (s3://bucket/prefix, gs://...). Empty: $RAYVIT_HOME/ray_results
    # on the driver's node, which serves only runs whose workers all share that node.
    storage: Optional[str] = None
    # Autoscaling clusters: how long a point may wait for the autoscaler to bring up the nodes it needs.
    scale_up_timeout_s: float = 1800.0
    # How long Ray Train gives a placed worker group to start (RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S);
    # empty: that variable if set, else 30 s.
    worker_start_timeout_s: Optional[float] = None


LADDER_RUNGS = ("baseline", "mixed_precision", "fsdp", "mta_optimizer", "pooled_classifier",
                "batch_second", "image_256", "full_half", "compile")
STRATEGIES = ("ddp", "fsdp", "fairscale_oss", "fairscale_fsdp")


@dataclass
class SweepConfig:
    """A scaling sweep (every strategy at every worker count) or the study's optimization ladder."""

    # Sweep name = MLflow parent run name; rerunning the same name resumes (skips finished points).
    name: Optional[str] = None
    mode: Literal["scaling", "ladder"] = "scaling"
    strategies: list[str] = field(default_factory=lambda: ["ddp", "fsdp", "fairscale_oss"])
    worker_counts: list[int] = field(default_factory=lambda: [1, 2])
    # Ladder mode: cumulative rungs, run at parallel.num_workers workers.
    rungs: list[str] = field(default_factory=lambda: list(LADDER_RUNGS))
    # Ladder mode: image size of the "image_256" rung (256 on GPUs; smaller for CPU ladders).
    ladder_image_size: int = 256
    # Every point is trained this many times, in rounds interleaved with the other points at its worker
    # count (A B C, B C A, C A B, ...); each figure is the median over rounds with a 95% interval.
    rounds: int = 3
    # true: the points at one worker count share one Ray Train worker group (placement, process group and
    # data set up once; ratios compare points on the same workers). false: one Ray Train run per point,
    # each running its own rounds (a point then never shares a process with another).
    share_workers: bool = True


@dataclass
class SearchConfig:
    """A Ray Tune search for the fastest setting within an accuracy budget of the baseline."""

    name: Optional[str] = None
    # Dotted config key -> candidate values, e.g. {"precision.mode": ["amp", "pure"]}.
    space: dict[str, list[Any]] = field(default_factory=dict)
    algorithm: Literal["grid", "optuna"] = "grid"
    # optuna: trials to sample (grid runs every combination once and ignores this).
    num_samples: int = 8
    # The reference trial: overrides applied to the base config (fp32, base image size, and the study's
    # baseline optimizer: one kernel per tensor, no multi-tensor apply).
    baseline: dict[str, Any] = field(default_factory=lambda: {"precision.mode": "fp32", "optim.impl": "loop"})
    # Largest allowed absolute drop in validation accuracy (0.02 = two accuracy points).
    max_accuracy_drop: float = 0.02
    objective: Literal["tflops_per_chip", "images_per_sec", "time_to_accuracy"] = "tflops_per_chip"
    # time_to_accuracy: the validation accuracy a trial must reach.
    target_accuracy: float = 0.9
    # ASHA early stopping on the workers' training loss: rungs at asha_grace_steps x reduction_factor^k
    # optimizer steps (0 = a quarter of train.steps).
    asha: bool = False
    asha_grace_steps: int = 0
    asha_reduction_factor: float = 2.0
    # 0 = as many trials at once as the cluster has room for (each trial's workers need their own CPUs/GPUs).
    max_concurrent_trials: int = 0
    # Screen before training (grid searches): time every setting's training step in one process on one
    # device of the kind the trials get, train in the order of the screened objective, skip settings that
    # cannot beat the baseline or the best feasible trial by more than the screen's noise
    # (rayvit.studies.screen). screen_steps: timed steps per setting and round; screen_seconds: the most
    # one setting's timed steps take per round (a setting 20x slower is decided by one step).
    screen: bool = True
    screen_steps: int = 6
    screen_seconds: float = 1.5


class _Sections:
    """The forms a tree of sections is written in; subclasses give ``to_dict`` (the YAML file's shape)."""

    def to_dict(self) -> dict[str, Any]:
        raise NotImplementedError

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def flatten(self) -> dict[str, Any]:
        """``{"model.name": ..., ...}``: the form used for MLflow params and result tables."""
        return {f"{section}.{key}": value for section, values in self.to_dict().items()
                for key, value in values.items()}


@dataclass
class Config(_Sections):
    """Everything one run needs; recorded with every run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, overrides: Iterable[str] | dict[str, Any] = ()) -> "Config":
        """A validated copy with ``section.key`` overrides applied."""
        return from_dict(self.to_dict(), overrides)


@dataclass
class Study(_Sections):
    """A run config and what to do with it: a sweep or a search of runs, recorded where ``tracking`` says."""

    run: Config = field(default_factory=Config)
    sweep: SweepConfig = field(default_factory=SweepConfig)
    search: SearchConfig = field(default_factory=SearchConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    def to_dict(self) -> dict[str, Any]:
        """The YAML file's shape: the run's sections, then the study's."""
        return {**self.run.to_dict(), **{name: dataclasses.asdict(getattr(self, name)) for name in STUDY_SECTIONS}}

    def replace(self, overrides: Iterable[str] | dict[str, Any] = ()) -> "Study":
        """A validated copy with ``section.key`` overrides applied to the run or the study sections."""
        return study_from_dict(self.to_dict(), overrides)


RUN_SECTIONS = tuple(f.name for f in dataclasses.fields(Config))
STUDY_SECTIONS = ("sweep", "search", "tracking")


# --------------------------------------------------------------------------------------------------
# Loading


def load_study(path: str | os.PathLike | None = None,
               overrides: Iterable[str] | dict[str, Any] = ()) -> Study:
    """Read a YAML file (or the defaults), apply ``section.key=value`` overrides, build and validate."""
    return study_from_dict(read_yaml(path) if path is not None else {}, overrides)


def load_config(path: str | os.PathLike | None = None,
                overrides: Iterable[str] | dict[str, Any] = ()) -> Config:
    """The run config of a YAML file: as :func:`load_study`, whose sweep and search sections are
    checked too (a typo there is still an error) but not kept."""
    return load_study(path, overrides).run


def read_yaml(path: str | os.PathLike) -> dict[str, Any]:
    if not os.path.isfile(path):
        raise ConfigError(f"config file not found: {path}")
    with open(path) as f:
        try:
            data = yaml.safe_load(f) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping of sections, got {type(data).__name__}")
    return data


def from_dict(data: dict[str, Any], overrides: Iterable[str] | dict[str, Any] = ()) -> Config:
    """Build a validated run :class:`Config` from nested dicts plus overrides."""
    data = _with_overrides(data, overrides)
    study_keys = sorted(set(data) & set(STUDY_SECTIONS))
    if study_keys:
        raise ConfigError(f"section {study_keys[0]!r} belongs to a study, not to a run config: use "
                          "rayvit.config.load_study (or Study.replace) for sweep, search and tracking keys")
    return _run_config(data)


def study_from_dict(data: dict[str, Any], overrides: Iterable[str] | dict[str, Any] = ()) -> Study:
    """Build a validated :class:`Study` from the YAML file's shape plus overrides."""
    data = _with_overrides(data, overrides)
    unknown = sorted(set(data) - set(RUN_SECTIONS) - set(STUDY_SECTIONS))
    if unknown:
        raise ConfigError(f"unknown key {unknown[0]!r} in config; allowed: "
                          f"{', '.join(RUN_SECTIONS + STUDY_SECTIONS)}")
    study = Study(run=_run_config({k: v for k, v in data.items() if k in RUN_SECTIONS}),
                  sweep=_build(SweepConfig, data.get("sweep"), "sweep."),
                  search=_build(SearchConfig, data.get("search"), "search."),
                  tracking=_build(TrackingConfig, data.get("tracking"), "tracking."))
    validate_sweep(study.sweep)
    validate_search(study.search)
    return study


def _run_config(data: dict[str, Any]) -> Config:
    cfg = _build(Config, data, "")
    cfg = dataclasses.replace(cfg, model=_resolved_model(cfg.model))
    validate(cfg)
    return cfg


# Keys that moved: old name -> new name. An old name still works, with a warning naming the new one.
RENAMED_KEYS = {"train.compile": "model.compile"}


def _renamed(key: str) -> str:
    new = RENAMED_KEYS.get(key)
    if new is None:
        return key
    warnings.warn(f"{key} is now {new} (torch.compile is applied per strategy, decided with the model); "
                  f"read as {new}: write {new} instead", FutureWarning, stacklevel=4)
    return new


def _with_overrides(data: dict[str, Any], overrides: Iterable[str] | dict[str, Any]) -> dict[str, Any]:
    data = copy.deepcopy(data)
    # Renamed keys in the base data first, so that an override of either name still wins over the file.
    for old in RENAMED_KEYS:
        section, _, name = old.partition(".")
        if isinstance(data.get(section), dict) and name in data[section]:
            new_section, _, new_name = _renamed(old).partition(".")
            value = data[section].pop(name)
            if not isinstance(data.get(new_section), dict):
                data[new_section] = {}
            data[new_section][new_name] = value
    for key, value in _parse_overrides(overrides):
        key = _renamed(key)
        section, _, name = key.partition(".")
        if not name:
            raise ConfigError(f"override {key!r} must look like section.key=value")
        if section not in data or data[section] is None:
            data[section] = {}
        if not isinstance(data[section], dict):
            raise ConfigError(f"section {section!r} must be a mapping")
        data[section][name] = value
    return data


def _parse_overrides(overrides: Iterable[str] | dict[str, Any]) -> list[tuple[str, Any]]:
    if isinstance(overrides, dict):
        return list(overrides.items())
    pairs = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        pairs.append((key.strip(), _parse_scalar(raw.strip())))
    return pairs


def _parse_scalar(raw: str) -> Any:
    """CLI values: YAML scalars/lists (``[2, 2]``), or a comma list (``ddp,fsdp``)."""
    try:
        value = yaml.safe_load(raw) if raw else None
    except yaml.YAMLError:
        value = raw
    if isinstance(value, str) and "," in value:
        return [_parse_scalar(part.strip()) for part in value.split(",")]
    return value


# --------------------------------------------------------------------------------------------------
# Building: the generic type checker


def _build(cls: type, data: Any, prefix: str) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'} must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        where = prefix.rstrip(".") or "config"
        raise ConfigError(f"unknown key {prefix + unknown[0]!r} in {where}; allowed: {', '.join(fields)}")
    return cls(**{name: _coerce(value, hints[name], prefix + name) for name, value in data.items()})


def _coerce(value: Any, tp: Any, key: str) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key + ".")
    if origin in (Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if value is None or value in ("", "none", "None", "null"):
            return None
        return _coerce(value, inner[0], key)
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key}={value!r} is not allowed; choose one of: {', '.join(map(str, args))}")
        return value
    if origin is list:
        values = value if isinstance(value, list) else [value]     # `--set key=2` for a list of one
        return [_coerce(v, args[0] if args else Any, f"{key}[{i}]") for i, v in enumerate(values)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a mapping, got {value!r}")
        return {str(k): (_coerce(v, args[1], f"{key}.{k}") if args else v) for k, v in value.items()}
    return _SCALARS.get(tp, lambda v, k: v)(value, key)


def _to_bool(value: Any, key: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
        return value.lower() in ("true", "yes", "1")
    raise ConfigError(f"{key}={value!r} must be a boolean (true/false)")


def _to_int(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ConfigError(f"{key}={value!r} must be an integer")
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{key}={value!r} must be an integer") from None


def _to_float(value: Any, key: str) -> float:
    if isinstance(value, bool):
        raise ConfigError(f"{key}={value!r} must be a number")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{key}={value!r} must be a number") from None


def _to_str(value: Any, key: str) -> str:
    if isinstance(value, (dict, list)):
        raise ConfigError(f"{key}={value!r} must be a string")
    return str(value)


_SCALARS = {bool: _to_bool, int: _to_int, float: _to_float, str: _to_str}


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


# --------------------------------------------------------------------------------------------------
# Validation: checks only, one function per section


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
