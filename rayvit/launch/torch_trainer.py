"""The Ray layer: run ``rayvit.worker.train`` on Ray Train workers.

Entry points, smallest first:

- ``train_loop_per_worker(config)``: the function any ``TorchTrainer`` can run, with
  ``train_loop_config=loop_config(cfg)`` and ``scaling_config=scaling_config(cfg)``.
- ``make_trainer(cfg, ...) -> TorchTrainer``: scaling, backend, failure handling and datasets derived from
  the config and checked on the driver, for callers who want to ``fit()`` themselves or inside Ray Tune.
- ``fit(cfg) -> RunResult`` and ``fit_group(cfgs, rounds) -> GroupResult``: run and return the typed
  summary; raise ``TrainingError`` on failure.

Ray is started locally when the caller has not initialised it, and attached to, in the cluster's own
authentication mode, when ``RAY_ADDRESS`` is set (as under ``ray job submit``; :mod:`rayvit.launch.connect`).
Requests the cluster can never satisfy, and checkpointing runs without storage every node reaches
(``launch.storage``, :mod:`rayvit.launch.storage`), fail before any worker starts.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Optional

from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer

from rayvit.errors import CorruptImageError, TrainingError
from rayvit import process_state
from rayvit.config import as_config
from rayvit.config_schema import Config
from rayvit.errors import ConfigError
from rayvit.config_rules import check_with_torch
from rayvit.launch import capacity
from rayvit.launch.capacity import ClusterTooSmall
from rayvit.launch.connect import ensure_ray, started_local
from rayvit.launch.entry import measure_group_per_worker, train_loop_per_worker
from rayvit.launch.payload import GroupPayload, RunPayload
from rayvit.launch.progress import ProgressChannel
from rayvit.launch.resources import worker_bundle
from rayvit.launch.storage import StorageError, check_storage, storage_path
from rayvit.results import Comparison, RunResult

logger = logging.getLogger(__name__)


HEALTH_CHECK_ENV = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"
PREEMPTION_WATCHER_ENV = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"


def train_environment(cfg: Optional[Config], reports: bool = True) -> dict[str, Optional[str]]:
    """Ray Train's settings that only environment variables reach, for one ``fit()``: ``{name: value}``,
    None where the variable must be unset. Ray Train reads them when its controller starts (the driver's
    values are propagated to the controller and the workers); a value the caller set stays. Without a
    config (the links microbenchmark's own workers), Ray's worker start timeout stays as it is."""
    env: dict[str, Optional[str]] = {}
    # Each ray.train.report() waits for the controller's health-check tick (2 s by default): a shorter
    # tick makes reports cheap. A worker group measuring rounds never reports, and keeps Ray's 2 s, so
    # that the controller polls its workers less often while they time steps.
    if os.environ.get(HEALTH_CHECK_ENV) is None:
        env[HEALTH_CHECK_ENV] = "0.5" if reports else "2"
    # How long a placed worker group may take to start: launch.worker_start_timeout_s, else the variable,
    # else 30 s (Ray's 60 s default is long for a group that cannot start on a fixed cluster; points that
    # need new nodes wait for them before Ray Train starts, in rayvit.launch.capacity).
    if cfg is not None:
        env[capacity.WORKER_START_TIMEOUT_ENV] = f"{capacity.worker_start_timeout_s(cfg):g}"
    # Ray Train starts a preemption watcher for every worker group, after the workers start: its process
    # imports Ray Train while the group's first steps are timed, slowing the first round's first point
    # (docs/measurement.md). On a local instance this process started (rayvit's, or the caller's own
    # ray.init()) there is no node a provider can drain, so it has nothing to watch; on clusters it stays.
    if os.environ.get(PREEMPTION_WATCHER_ENV) is None:
        env[PREEMPTION_WATCHER_ENV] = "0" if started_local() else None
    return env


def apply_train_environment(env: dict[str, Optional[str]]) -> None:
    """Set (or unset, for None) :func:`train_environment`'s variables; inside :func:`process_state.kept`,
    which puts them back when the entry point returns."""
    for key, value in env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def check_cluster_fits(cfgs: list[Config]) -> list:
    """Raise ``ClusterTooSmall`` if any run can never be placed: on a fixed-size cluster, more than the
    alive nodes hold; on an autoscaling one, more than its autoscaler's maximum (:mod:`rayvit.launch.capacity`).

    Runs an autoscaler can grow into pass (they wait in ``capacity.capacity_for``); returns a verdict per
    run. ``RAYVIT_SKIP_RESOURCE_CHECK=1`` skips the check (returns no verdicts).
    """
    if os.environ.get("RAYVIT_SKIP_RESOURCE_CHECK") == "1":
        return []
    return capacity.check_plan(cfgs)


# --------------------------------------------------------------------------------------------------
# The driver side


def scaling_config(cfg: Config | dict) -> ScalingConfig:
    """The ``ScalingConfig`` a run of ``cfg`` needs: one worker per chip, ``parallel.cpus_per_worker`` CPUs
    (and a GPU) each, its accelerator type and placement strategy."""
    return _scaling(as_config(cfg))


def _scaling(cfg: Config) -> ScalingConfig:
    p = cfg.parallel
    return ScalingConfig(num_workers=p.num_workers, use_gpu=p.use_gpu, resources_per_worker=worker_bundle(cfg),
                         accelerator_type=p.accelerator_type, placement_strategy=p.placement_strategy)


def _check_scaling(cfg: Config, given: ScalingConfig) -> None:
    """A ScalingConfig the caller passed must agree with the config its figures are stated for."""
    wanted = _scaling(cfg)
    problems = []
    if given.num_workers != wanted.num_workers:
        problems.append(f"num_workers={given.num_workers} against parallel.num_workers={wanted.num_workers}")
    if bool(given.use_gpu) != bool(wanted.use_gpu):
        problems.append(f"use_gpu={given.use_gpu} against parallel.use_gpu={wanted.use_gpu}")
    cpus = (given.resources_per_worker or {}).get("CPU")
    if cpus is not None and cpus != wanted.resources_per_worker["CPU"]:
        problems.append(f"resources_per_worker CPU={cpus:g} against parallel.cpus_per_worker="
                        f"{cfg.parallel.cpus_per_worker}")
    if problems:
        raise ConfigError(f"the scaling_config given disagrees with the rayvit config: {'; '.join(problems)}. "
                          "Set these in the config (e.g. parallel.num_workers) and leave scaling_config out: "
                          "make_trainer derives it")


def _own_datasets(cfg: Config, datasets: dict) -> tuple[Config, dict]:
    """The caller's Ray Datasets, checked on the driver: ``train`` (and optionally ``val``) holding images
    (encoded files, decoded here by rayvit's transforms, or decoded uint8 crops) and integer labels in the
    columns the config names; the config then says it trains on them (``data.name=dataset``)."""
    from rayvit.data import decode_dataset
    from rayvit.data.parquet import INFO_KEY
    from rayvit.data.schema import check_dataset

    unknown = sorted(set(datasets) - {"train", "val"})
    if "train" not in datasets or unknown:
        raise ConfigError(f"datasets must be {{'train': ..., 'val': ... (optional)}}; got keys {sorted(datasets)}")
    if cfg.data.name not in ("parquet", "dataset"):
        cfg = cfg.replace({"data.name": "dataset"})
    from rayvit.data.context import own_context

    ready = {}
    for name, dataset in datasets.items():
        if check_dataset(dataset, cfg, name) == "encoded":
            dataset = decode_dataset(dataset, cfg, training=name == "train")
        else:
            dataset = own_context(dataset, cfg)      # the caller's dataset and its context stay as they were
        if dataset.context.get_config(INFO_KEY) is None:
            # Not counted: a count would run the caller's whole pipeline; workers take model.num_classes.
            dataset.context.set_config(INFO_KEY, {"num_train": None, "num_val": None,
                                                  "num_classes": cfg.model.num_classes})
        ready[name] = dataset
    return cfg, ready


class RayvitTrainer(TorchTrainer):
    """A ``TorchTrainer`` running rayvit's worker loop for one config (or a group measured in rounds).

    Everything a caller could get wrong is checked when it is built (the config, a ScalingConfig that
    disagrees with it, the datasets' columns) or at the start of :meth:`fit`, before any worker starts
    (a cluster too small, Ray Data with no CPU to read on, checkpoints without shared storage).
    :meth:`fit` sets Ray Train's environment-only settings for its own duration and leaves the caller's
    process as it found it (:mod:`rayvit.process_state`).

    Built by :func:`make_trainer` (the public options), and by :func:`fit` / :func:`fit_group` with rayvit's
    own: ``progress`` (called by every worker after every step), ``measure_links`` (the collective
    microbenchmark's options) and ``group`` with ``rounds`` (configs measured in interleaved rounds). Its
    workers get a typed payload (:mod:`rayvit.launch.payload`).
    """

    def __init__(self, cfg: Config | dict, *, scaling_config: Optional[ScalingConfig] = None,
                 run_config: Optional[RunConfig] = None, datasets: Optional[dict] = None,
                 progress: Optional[Callable] = None, measure_links: Optional[dict] = None,
                 group: Optional[list[Config]] = None, rounds: int = 1, final_model: bool = True) -> None:
        cfg = as_config(cfg)
        for each in [cfg, *(group or [])]:
            check_with_torch(each)          # a config validated before torch was loaded was not asked
        if scaling_config is not None:
            _check_scaling(cfg, scaling_config)
        if datasets is not None:
            cfg, datasets = _own_datasets(cfg, datasets)
        self.rayvit_config, self.rayvit_group = cfg, group
        self._storage_given = run_config is not None and run_config.storage_path is not None
        self._reports = group is None
        if run_config is None:
            what = "group" if group is not None else cfg.parallel.strategy
            run_config = RunConfig(
                name=f"rayvit-{what}-{cfg.parallel.num_workers}w-{uuid.uuid4().hex[:8]}",
                storage_path=storage_path(cfg),
                # controller_failure_limit=0: a worker group that cannot start is an error, never a retry
                # loop. A group has no checkpoints to restart from: a lost worker ends it (the sweep falls back).
                failure_config=FailureConfig(max_failures=0 if group is not None else cfg.train.max_failures,
                                             controller_failure_limit=0),
                checkpoint_config=CheckpointConfig(num_to_keep=2))
        if datasets is None and cfg.data.name == "parquet":
            from rayvit.data import ray_datasets

            datasets = ray_datasets(cfg)
        if group is None:
            loop, payload = train_loop_per_worker, RunPayload(cfg.to_dict(), progress, measure_links, final_model)
        else:
            loop, payload = measure_group_per_worker, GroupPayload(
                cfg.to_dict(), progress, measure_links, group=[c.to_dict() for c in group], rounds=rounds)
        super().__init__(loop, train_loop_config=payload.to_loop_config(),
                         scaling_config=scaling_config or _scaling(cfg),
                         torch_config=TorchConfig(backend="nccl" if cfg.parallel.use_gpu else "gloo"),
                         run_config=run_config, datasets=datasets)

    def fit(self):
        """``TorchTrainer.fit()`` after the driver-side checks; Ray is started (and stopped again) when the
        caller has not started it. ``result.metrics`` holds the run's summary (:func:`make_trainer`)."""
        with process_state.kept():
            ensure_ray()
            cfgs = self.rayvit_group or [self.rayvit_config]
            check_cluster_fits(cfgs)
            # Before any worker starts: a checkpointing run must not scatter its checkpoints over nodes' disks.
            check_storage(cfgs, storage_given=self._storage_given)
            apply_train_environment(train_environment(self.rayvit_config, reports=self._reports))
            try:
                return super().fit()
            except Exception as e:  # noqa: BLE001 - a corrupt image is named first; anything else as Ray raised it
                from rayvit.data.rows import corrupt_cause

                corrupt = corrupt_cause(e)
                if corrupt is None:
                    raise
                # Ray's WorkerGroupError holds every rank's traceback with rayvit's line at its end: the caller
                # gets that line first (the row, its label, its file), Ray's error as the cause.
                raise CorruptImageError(corrupt) from e


def make_trainer(cfg: Config | dict | str, *, scaling_config: Optional[ScalingConfig] = None,
                 run_config: Optional[RunConfig] = None, datasets: Optional[dict] = None,
                 final_model: bool = True) -> RayvitTrainer:
    """A ``ray.train.torch.TorchTrainer`` that trains ``cfg`` (a Config, its dict or a config file / shipped
    name) with rayvit's loop: one worker per chip, gloo on CPU and nccl on GPU.

    ``scaling_config``: derived from the config when left out; one given must agree with it (else
    ``ConfigError`` naming both values). ``run_config``: yours (add ``TuneReportCallback()`` inside a Tune
    trial), else rayvit's (storage under ``launch.storage``, no retry loop for a group that cannot start).
    ``datasets``: ``{"train": ..., "val": ...}`` Ray Datasets, else built from ``data.path`` for
    ``data.name=parquet``.

    Every ``ray.train.report`` carries the running ``tflops_per_chip``, ``images_per_sec_per_chip``,
    ``images_per_sec``, ``mfu``, ``step``, ``loss``, ``loss_mean``, ``lr``, ``restarts`` and
    ``timed_steps`` (rank 0's, over its timed steps so far), and ``val_accuracy`` once evaluated. The
    last one (``final`` true) carries the run's summary: every figure of
    :data:`rayvit.results.METRIC_KEYS` the run has, with ``<key>_lo``/``<key>_hi`` for the throughput
    figures, the final ``val_accuracy``, and the run's conditions; it carries a checkpoint, so
    ``result.metrics`` holds it (the whole summary is also ``result.return_value``). That checkpoint
    holds the trained model (``final_model=True``): ``load_checkpoint(result.checkpoint).model``; with
    ``train.checkpoint_every > 0`` all a run continues from, as every N steps' checkpoint does. A lost
    worker's group restarts from the latest (``train.max_failures``).
    """
    return RayvitTrainer(cfg, scaling_config=scaling_config, run_config=run_config, datasets=datasets,
                         final_model=final_model)


@process_state.keeps_process_state
def fit(cfg: Config | dict | str, *, datasets: Optional[dict] = None, run_config: Optional[RunConfig] = None,
        on_progress: Optional[Callable[[dict], None]] = None, measure_links: Optional[dict] = None) -> RunResult:
    """Run ``cfg`` on Ray Train and return its summary, with 95% intervals over blocks of timed steps.
    Uses the caller's Ray, else starts a local instance for the call.

    ``on_progress`` receives rank 0's figures (step, steps, loss, images/s per chip) about once a second.
    ``measure_links``: options of the collective microbenchmark the workers run after training (``{}`` for
    its defaults), returned in ``RunResult.links``.
    """
    cfg = as_config(cfg)
    value = _run([cfg], f"{cfg.parallel.strategy} x {cfg.parallel.num_workers} workers", datasets=datasets,
                 run_config=run_config, on_progress=on_progress, measure_links=measure_links)
    return RunResult.of_rounds([RunResult.from_dict(value)])


@dataclass
class GroupResult:
    """What :func:`fit_group` measured: per config its result over rounds, or the error it failed with."""

    results: list[Optional[RunResult]]
    errors: list[Optional[str]]
    links: Optional[dict[str, Any]] = None


@process_state.keeps_process_state
def fit_group(cfgs: list[Config | dict], rounds: int, *, datasets: Optional[dict] = None,
              on_progress: Optional[Callable[[dict], None]] = None,
              measure_links: Optional[dict] = None) -> GroupResult:
    """Measure ``cfgs`` (the same worker count and resources) on one Ray Train worker group.

    The workers start, place and join their process group once; every config is then trained once per
    round, in rotated order (:mod:`rayvit.worker.rounds`), and its figures are the medians over rounds
    with their intervals (:meth:`RunResult.of_rounds`). A config that fails in a round is returned with
    its error and the others go on; a failure of the group itself raises ``TrainingError``.
    ``on_progress`` receives step items (``"kind": "step"``, with the config's ``index`` and ``round``)
    and one ``"kind": "round"`` item per config and round, with its result dict or error.
    """
    if not cfgs:
        raise ValueError("fit_group needs at least one config")
    cfgs = [as_config(c) for c in cfgs]
    sizes = {(c.parallel.num_workers, json.dumps(worker_bundle(c), sort_keys=True), c.parallel.use_gpu) for c in cfgs}
    if len(sizes) > 1:
        raise ValueError(f"one worker group serves configs of one worker count and resources; got {sorted(sizes)}")
    value = _run(cfgs, f"the group of {len(cfgs)} run(s) at {cfgs[0].parallel.num_workers} workers",
                 datasets=datasets, on_progress=on_progress, measure_links=measure_links, group=cfgs,
                 rounds=rounds)
    results: list[Optional[RunResult]] = []
    errors: list[Optional[str]] = []
    for entry in value["group"]:
        done = [RunResult.from_dict(r) for r in entry["rounds"]]
        results.append(RunResult.of_rounds(done, [tuple(p) for p in entry["places"]])
                       if done and entry["error"] is None else None)
        errors.append(entry["error"])
    return GroupResult(results, errors, value.get("links"))


@process_state.keeps_process_state
def compare(a: Config | dict | str, b: Config | dict | str, *, rounds: int = 3,
            key: str = "images_per_sec_per_chip", on_ray: bool = False,
            datasets: Optional[dict] = None) -> Comparison:
    """An A/B of two configs: each trained once per round in ``rounds`` interleaved rounds (A B, B A, ...),
    and ``b``'s ``key`` over ``a``'s as a paired ratio with its 95% interval and verdict
    (``comparison.ratio``, ``comparison.verdict``, ``comparison.text()``).

    ``on_ray=False``: in this process, on one device (``rayvit bench --compare`` is its command line).
    ``on_ray=True``: on one Ray Train worker group of the configs' worker count (:func:`fit_group`).
    Raises ``TrainingError`` when either config fails.
    """
    a, b = as_config(a), as_config(b)
    if not on_ray:
        from rayvit.worker.bench import CompareFailed, compare_configs

        try:
            first, second = compare_configs([a, b], rounds)
        except CompareFailed as e:
            raise TrainingError(str(e)) from e
        return Comparison(first, second, key)
    group = fit_group([a, b], rounds, datasets=datasets)
    for cfg, error in zip((a, b), group.errors):
        if error is not None:
            raise TrainingError(f"{cfg.parallel.strategy} failed in the comparison: {error.strip().splitlines()[-1]}")
    return Comparison(group.results[0], group.results[1], key)


def _run(cfgs: list[Config], what: str, *, datasets: Optional[dict] = None,
         run_config: Optional[RunConfig] = None, on_progress: Optional[Callable[[dict], None]] = None,
         measure_links: Optional[dict] = None, group: Optional[list[Config]] = None, rounds: int = 1) -> dict:
    """Build and fit one trainer for ``cfgs`` (the first sets the workers); rank 0's return value, or
    ``TrainingError``."""
    ensure_ray()                   # before the progress channel, an actor
    channel = ProgressChannel(on_progress) if on_progress else contextlib.nullcontext()
    # fit() returns the summary, not the checkpoint: its final one need not carry the model.
    trainer = RayvitTrainer(cfgs[0], datasets=datasets, run_config=run_config,
                            progress=channel.poster() if on_progress else None, measure_links=measure_links,
                            group=group, rounds=rounds, final_model=False)
    try:
        with channel:
            result = trainer.fit()
    except (ClusterTooSmall, StorageError, ConfigError):
        raise
    except Exception as e:  # Ray raises its own wrappers; keep the cause readable
        raise TrainingError(f"{what} failed: {_root_cause(e)}") from e
    if result.error is not None:
        raise TrainingError(f"{what} failed: {_root_cause(result.error)}")
    if result.return_value is None:
        raise TrainingError("the run finished without a summary from rank 0")
    return result.return_value


def _root_cause(error: BaseException) -> str:
    seen = error
    while seen.__cause__ is not None:
        seen = seen.__cause__
    text = str(seen).strip() or type(seen).__name__
    # Ray Train's WorkerGroupError holds each rank's traceback; its last line is the worker's exception.
    return text.splitlines()[-1] if len(text) > 2000 or "Traceback (most recent call last)" in text else text
