"""The config's types, at the bottom of rayvit: the typed sections of one run (:class:`Config`) and of a
study (:class:`Study`), and the vocabulary they are written in (the baseline strategy, the ladder's rungs).

Torch-free and importing nothing of rayvit's but its errors, so every layer can type against these
classes without an import that climbs. Loading a YAML file into them and checking the rules is
:mod:`rayvit.config`'s job (above the strategies it asks); :meth:`Config.replace` uses the loader it
registers here (:func:`register_loader`).

Allowed values are written into the type annotations (``Literal[...]``), so one generic checker
(:mod:`rayvit.config_build`) covers every field and an error can always say what is allowed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Literal, Optional

import yaml

from rayvit.errors import ConfigError

# The strategy every figure is compared to (the study's baseline): DDP.
BASELINE = "ddp"

# The optimization ladder's rungs, in the order they are climbed (rayvit/studies/ladder.yaml).
LADDER_RUNGS = ("baseline", "mixed_precision", "fsdp", "mta_optimizer", "pooled_classifier",
                "batch_second", "image_256", "full_half", "compile", "activation_checkpointing")


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
    # Kernel fusion with torch.compile, the way each strategy supports it (rayvit.strategies):
    # each encoder block compiled before sharding (FSDP2, as torchtitan does; FairScale OSS), or the
    # DDP-wrapped model (DDPOptimizer splits its graph at the gradient buckets). FairScale FSDP is refused.
    # The steps that compile run among train.warmup_steps, outside the timed window; their extra time is
    # recorded as compile_time_s.
    compile: bool = False
    # Activation checkpointing (rayvit.models.activation_checkpointing): "block" keeps only each encoder block's input
    # for backward and runs its forward again there; "selective" does so for every checkpoint_every-th
    # block. Less activation memory for one more forward of those blocks; each strategy wraps the blocks
    # its own way before sharding.
    activation_checkpointing: Literal["none", "block", "selective"] = "none"
    checkpoint_every: int = 2
    # Attention kernel: "sdpa" (F.scaled_dot_product_attention: FlashAttention-2 or the memory-efficient
    # kernel on GPUs) or "math": explicit q k^T, an fp32 softmax and p v, as Megatron-style and older ViT
    # code computes it (it keeps the heads x S x S matrix for backward).
    attention: Literal["sdpa", "math"] = "sdpa"
    # torch.compile's backend: inductor generates fused kernels (the point of compiling); aot_eager and
    # eager trace the same graphs and run them as they are (to find which stage a failing compile breaks
    # in, or to test the compile path in seconds).
    compile_backend: Literal["inductor", "aot_eager", "eager"] = "inductor"
    # true: every compiled run compiles from empty caches (dynamo reset, a fresh Inductor cache directory,
    # remote caches off), so compile_time_s is a cold compile's in every run and round. false: Inductor's
    # caches on disk are reused (faster; compile_time_s then depends on what compiled before on the node).
    compile_cold: bool = True


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

    # A strategy registered in rayvit.strategies.STRATEGIES: ddp, fsdp, hsdp, fairscale_oss, fairscale_fsdp.
    strategy: str = BASELINE
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
    # HSDP: ranks per shard group (the mesh is num_workers / shard_size replicas x shard_size); 0: the GPUs
    # (workers) of one node. A count larger than the workers is the workers (one shard group: FSDP).
    shard_size: int = 0


@dataclass
class DataConfig:
    name: Literal["synthetic", "digits", "parquet", "dataset"] = "synthetic"
    # parquet: a file or folder of shards with image-bytes and label columns. dataset: the Ray Datasets
    # handed to rayvit.trainer.make_trainer(datasets=...) (set by it), read from the same two columns.
    path: Optional[str] = None
    val_path: Optional[str] = None
    image_column: str = "image"
    label_column: str = "label"
    # synthetic: number of distinct fixed batches cycled through.
    synthetic_batches: int = 4
    # digits / parquet: fraction held out for validation when no val_path is given.
    val_fraction: float = 0.2
    # parquet: ImageNet's transforms with torchvision's and timm's defaults (rayvit.data.images). Training:
    # a random crop of crop_scale x the area with aspect in crop_ratio, resized to model.image_size,
    # flipped with probability hflip, then the stronger augmentation named by augment (none, randaugment:
    # randaugment_ops operations at randaugment_magnitude on 0-30). crop_scale=[1, 1], crop_ratio=[1, 1],
    # hflip=0: no random crop (the largest central square). Validation: the central image_size square
    # after resizing the shorter side to image_size / crop_pct (1.0: the largest central square).
    crop_scale: list[float] = field(default_factory=lambda: [0.08, 1.0])
    crop_ratio: list[float] = field(default_factory=lambda: [3 / 4, 4 / 3])
    hflip: float = 0.5
    crop_pct: float = 0.875
    augment: Literal["none", "randaugment"] = "none"
    randaugment_ops: int = 2
    randaugment_magnitude: int = 9
    # Where JPEGs are decoded: cpu (Ray Data tasks or this process, with cpu_decoder), or gpu
    # (torchvision.io.decode_jpeg on the worker's device, batched; needs parallel.use_gpu and torchvision).
    decode: Literal["cpu", "gpu"] = "cpu"
    # turbojpeg: only the crop's region is decoded (libjpeg-turbo 3 through rayvit.data.turbo); simplejpeg:
    # the whole image at a DCT scale; pil. Chosen by measurement: docs/data.md.
    cpu_decoder: Literal["turbojpeg", "simplejpeg", "pil"] = "turbojpeg"
    # An image no decoder reads: false stops the run with an error naming the file, row and reason; true
    # drops the row, warns once per image and counts it (the run's skipped_images).
    skip_corrupt: bool = False
    # Batches decoded ahead of the step (Ray Data's prefetch_batches; a thread without Ray).
    prefetch_batches: int = 1
    # Ray Data's progress bars and execution notices for the datasets rayvit runs (off: quiet, as the sweep
    # console is; set in each dataset's own context, never in the caller's).
    progress_bars: bool = False


@dataclass
class TrainConfig:
    batch_size: int = 16
    steps: int = 20
    # Steps excluded from the throughput window (compilation, allocator and cache warm-up).
    warmup_steps: int = 5
    seed: int = 0
    # Report metrics to Ray every N steps (each report waits for Ray Train's health-check tick, so never
    # per step).
    report_every: int = 10
    eval_every: int = 0
    checkpoint_every: int = 0
    max_failures: int = 0
    # Fault injection: crash `fail_rank` (-1: every rank) once when it reaches this step (0 = off): "raise"
    # an exception (a crashed step), or "exit" the worker process at once (a lost worker or node); or
    # "nan": that rank's batch of that step becomes NaN, so its loss alone is not finite (as one rank's
    # fp16 overflow).
    fail_at_step: int = 0
    fail_rank: int = 0
    fail_mode: Literal["raise", "exit", "nan"] = "raise"
    # A run of a worker group that fails on some ranks only: how long a failing rank waits for the others
    # to reach the verdict. Peers that have not answered by then wait for it in a collective: it ends the
    # group, and the sweep measures the group's remaining points in groups of their own.
    failure_timeout_s: float = 30.0


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
    # The hardware the projections describe: a shipped profile's name (rayvit/projection/profiles.py) or a
    # cluster file (cluster/example_cluster.yaml). Empty: `rayvit project` and `rayvit plan` take a100-40gb
    # on GPU configs and cpu otherwise, and a sweep projects each point on its own chip's profile.
    hardware: Optional[str] = None
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
    # (rayvit.studies.search.screen). screen_steps: timed steps per setting and round; screen_seconds: the most
    # one setting's timed steps take per round (a setting many times slower is decided by one step).
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
        """A validated copy with ``section.key`` overrides applied (:func:`rayvit.config.from_dict`)."""
        return _loader("config")(self.to_dict(), overrides)


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
        """A validated copy with ``section.key`` overrides applied to the run or the study sections
        (:func:`rayvit.config.study_from_dict`)."""
        return _loader("study")(self.to_dict(), overrides)


RUN_SECTIONS = tuple(f.name for f in dataclasses.fields(Config))
STUDY_SECTIONS = ("sweep", "search", "tracking")


RUN_SECTIONS = tuple(f.name for f in dataclasses.fields(Config))
STUDY_SECTIONS = ("sweep", "search", "tracking")


# Building a validated copy asks the rules, which ask the strategies, which type against these classes:
# the loader (rayvit.config's from_dict and study_from_dict) registers itself here instead of being
# imported, so no import climbs. Every Config a caller holds came from rayvit.config, which registered it.
_LOADERS: dict[str, Callable[..., Any]] = {}


def register_loader(config: Callable[..., "Config"], study: Callable[..., "Study"]) -> None:
    """Called by :mod:`rayvit.config` when it is imported: what :meth:`Config.replace` and
    :meth:`Study.replace` build their validated copies with."""
    _LOADERS.update(config=config, study=study)


def _loader(kind: str) -> Callable[..., Any]:
    try:
        return _LOADERS[kind]
    except KeyError:
        raise ConfigError("a config is validated by rayvit.config: import it (rayvit.config.load_config, "
                          "from_dict) before calling replace()") from None
