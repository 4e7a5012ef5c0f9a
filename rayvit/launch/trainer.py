"""The Ray layer: run ``rayvit.worker.train`` on Ray Train workers.

Three entry points, smallest first:

- ``train_loop_per_worker(config)``: the function any ``TorchTrainer`` can run; ``config["rayvit"]`` is
  a config dict (``Config.to_dict()``).
- ``build_trainer(cfg, datasets=None, run_config=None) -> TorchTrainer``: scaling, backend, failure
  handling and datasets derived from the config, for callers who want to ``fit()`` themselves.
- ``fit(cfg) -> RunResult``: run it and return the typed summary; raises ``TrainingError`` on failure.

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
import tempfile
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Optional

import ray
import torch
from ray.train import Checkpoint, CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer

from rayvit.config import Config, from_dict
from rayvit.launch import capacity
from rayvit.launch.connect import ensure_ray, started_local
from rayvit.launch.progress import ProgressChannel
from rayvit.launch.resources import worker_bundle
from rayvit.launch.storage import check_storage, storage_path
from rayvit.results import RunResult
from rayvit.worker import Session, train
from rayvit.worker.metrics import images_per_sec

logger = logging.getLogger(__name__)


HEALTH_CHECK_ENV = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"
_USER_HEALTH_CHECK = os.environ.get(HEALTH_CHECK_ENV)
PREEMPTION_WATCHER_ENV = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"
_USER_PREEMPTION_WATCHER = os.environ.get(PREEMPTION_WATCHER_ENV)


def train_environment(cfg: Config, reports: bool = True) -> None:
    """Ray Train's settings that only environment variables reach, set before its controller starts
    (the driver's values are propagated to the controller and the workers); a user's own value stays."""
    # Each ray.train.report() waits for the controller's health-check tick (2 s by default): a shorter
    # tick makes reports cheap. A worker group measuring rounds never reports, and keeps Ray's 2 s, so
    # that the controller polls its workers less often while they time steps.
    if _USER_HEALTH_CHECK is None:
        os.environ[HEALTH_CHECK_ENV] = "0.5" if reports else "2"
    # How long a placed worker group may take to start: launch.worker_start_timeout_s, else the variable,
    # else 30 s (Ray's 60 s default is long for a group that cannot start on a fixed cluster; points that
    # need new nodes wait for them before Ray Train starts, in rayvit.launch.capacity).
    os.environ[capacity.WORKER_START_TIMEOUT_ENV] = f"{capacity.worker_start_timeout_s(cfg):g}"
    # Ray Train starts a preemption watcher for every worker group, after the workers start: its process
    # imports Ray Train (~1 s of a core) while the group's first steps are timed (measured on a 2-core
    # host: the first round's first point ~15% slower than its later rounds). On a local instance rayvit
    # started there is no node a provider can drain, so it has nothing to watch; on clusters it stays.
    if _USER_PREEMPTION_WATCHER is None:
        if started_local():
            os.environ[PREEMPTION_WATCHER_ENV] = "0"
        else:
            os.environ.pop(PREEMPTION_WATCHER_ENV, None)


class TrainingError(RuntimeError):
    """A Ray Train run failed; the message holds the cause."""


def check_cluster_fits(cfgs: list[Config]) -> list:
    """Raise ``ClusterTooSmall`` if any run can never be placed: on a fixed-size cluster, more than the
    alive nodes hold; on an autoscaling one, more than its autoscaler's maximum (:mod:`rayvit.launch.capacity`).

    Runs an autoscaler can grow into pass (they wait in ``capacity.capacity_for``); returns a verdict per
    run. ``RAYVIT_SKIP_RESOURCE_CHECK=1`` skips the check (returns no verdicts).
    """
    if os.environ.get("RAYVIT_SKIP_RESOURCE_CHECK") == "1":
        return []
    return capacity.check_plan(cfgs)


def train_loop_per_worker(config: dict[str, Any]) -> dict[str, Any]:
    """Ray Train worker entry point: ``config = {"rayvit": Config.to_dict()}``. Returns the summary dict.

    With ``config["group"]`` (a list of config dicts) and ``config["rounds"]``, the workers measure every
    config of the group in interleaved rounds instead (:func:`rayvit.worker.rounds.measure_rounds`) and
    return ``{"group": [one entry per config]}``.
    """
    cfg = from_dict(config["rayvit"])
    device = ray.train.torch.get_device() if cfg.parallel.use_gpu else torch.device("cpu")
    shards = {}
    for name in ("train", "val"):
        try:
            shards[name] = ray.train.get_dataset_shard(name)
        except (KeyError, ValueError, RuntimeError):
            shards[name] = None
    shards = shards if shards["train"] is not None else None
    waits: list[list[list[float]]] = []
    if config.get("group") is not None:
        from rayvit.worker.rounds import measure_rounds

        poster = config.get("progress")
        between = None
        if config.get("links") is not None:
            # The wait for the slowest rank drifts over seconds on a shared host: read it after every
            # round, so the links cover the same minutes as the points they project.
            from rayvit.projection.collectives import wait_curve

            between = lambda r: waits.append(wait_curve(device))  # noqa: E731
        out: dict[str, Any] = {"group": measure_rounds(
            [from_dict(c) for c in config["group"]], config["rounds"], device=device, dataset_shards=shards,
            on_step=poster.step_of_group if poster else None, on_round=poster.round_of_group if poster else None,
            between_rounds=between, on_abandon=poster.round_abandoned if poster else None)}
    else:
        out = _train_one(cfg, config, device, shards).to_dict()
    if config.get("links") is not None:
        out["links"] = _measure_links(cfg, {**config, "links": {**config["links"], "host_waits": waits}})
    return out


def _train_one(cfg: Config, config: dict[str, Any], device: torch.device, shards: Optional[dict]) -> RunResult:
    t = cfg.train

    def report(metrics: dict, session: Session) -> None:
        metrics = {**metrics, "restarts": session.restarts}
        if session.step_times:
            window = session.step_times[-t.report_every:]
            metrics["images_per_sec_per_chip"] = images_per_sec(t.batch_size, len(window), sum(window))
        # A single batch's loss is noisy; schedulers such as ASHA compare trials on the window's mean.
        recent = session.history[-t.report_every:]
        metrics["loss_mean"] = sum(h["loss"] for h in recent) / len(recent)
        if session.evals:
            metrics["val_accuracy"] = session.evals[-1]["val_accuracy"]
        if t.checkpoint_every and session.step % t.checkpoint_every == 0:
            with tempfile.TemporaryDirectory() as tmp:
                session.save_checkpoint(tmp)
                # Ranks that wrote nothing (replicated strategies: rank 0 writes the full copy) report none.
                checkpoint = Checkpoint.from_directory(tmp) if os.listdir(tmp) else None
                ray.train.report(metrics, checkpoint=checkpoint)
        else:
            ray.train.report(metrics)

    checkpoint = ray.train.get_checkpoint()
    with (checkpoint.as_directory() if checkpoint else contextlib.nullcontext()) as resume_from:
        return train(cfg, device=device, dataset_shards=shards, report=report, resume_from=resume_from,
                     on_step=config.get("progress"))


def _measure_links(cfg: Config, config: dict[str, Any]) -> dict[str, Any]:
    """The collective microbenchmark after training, outside every timed step, on these very workers.

    It never fails the run it follows (an OOM on a small GPU, a collective the backend lacks): the error
    comes back as ``{"error": ...}`` and the sweep projects with the hardware profile's links.
    """
    from rayvit.projection.collectives import worker_benchmark

    try:
        return worker_benchmark({"use_gpu": cfg.parallel.use_gpu, "threads": cfg.parallel.cpus_per_worker,
                                 "model": config["rayvit"], "batch": cfg.train.batch_size,
                                 "strategy_configs": config.get("group") or [config["rayvit"]], **config["links"]})
    except Exception as e:  # noqa: BLE001
        logger.warning("the links microbenchmark failed: %s", e)
        return {"error": f"{type(e).__name__}: {e}"}


def build_trainer(cfg: Config, *, datasets: Optional[dict] = None, run_config: Optional[RunConfig] = None,
                  progress: Optional[Callable] = None, measure_links: Optional[dict] = None,
                  group: Optional[list[Config]] = None, rounds: int = 1) -> TorchTrainer:
    """A ``TorchTrainer`` for ``cfg``: one worker per chip, gloo on CPU and nccl on GPU.

    ``progress`` is called by every worker after every step (see :mod:`rayvit.launch.progress`).
    ``measure_links``: options of the collective microbenchmark the workers run after training
    (``{}`` for the defaults), returned in ``RunResult.links``. ``group``: configs to measure on these
    workers in ``rounds`` interleaved rounds instead of training ``cfg`` (see :func:`fit_group`).
    """
    p, t = cfg.parallel, cfg.train
    train_environment(cfg, reports=group is None)
    resources = worker_bundle(cfg)
    scaling = ScalingConfig(num_workers=p.num_workers, use_gpu=p.use_gpu, resources_per_worker=resources,
                            accelerator_type=p.accelerator_type, placement_strategy=p.placement_strategy)
    if run_config is None:
        what = "group" if group is not None else p.strategy
        run_config = RunConfig(
            name=f"rayvit-{what}-{p.num_workers}w-{uuid.uuid4().hex[:8]}",
            storage_path=storage_path(cfg),
            # controller_failure_limit=0: a worker group that cannot start is an error, never a retry loop.
            # A group has no checkpoints to restart from: a lost worker ends it (the sweep falls back).
            failure_config=FailureConfig(max_failures=0 if group is not None else t.max_failures,
                                         controller_failure_limit=0),
            checkpoint_config=CheckpointConfig(num_to_keep=2))
    if datasets is None and cfg.data.name == "parquet":
        from rayvit.data import ray_datasets

        datasets = ray_datasets(cfg)
    loop_config = {"rayvit": cfg.to_dict(), "progress": progress, "links": measure_links,
                   "group": [c.to_dict() for c in group] if group is not None else None, "rounds": rounds}
    return TorchTrainer(train_loop_per_worker, train_loop_config=loop_config,
                        scaling_config=scaling, torch_config=TorchConfig(backend="nccl" if p.use_gpu else "gloo"),
                        run_config=run_config, datasets=datasets)


def fit(cfg: Config, *, datasets: Optional[dict] = None, run_config: Optional[RunConfig] = None,
        on_progress: Optional[Callable[[dict], None]] = None, measure_links: Optional[dict] = None) -> RunResult:
    """Run ``cfg`` on Ray Train and return rank 0's summary. Starts or attaches to Ray as needed.

    ``on_progress`` receives rank 0's figures (step, steps, loss, images/s per chip) about once a second.
    ``measure_links``: see :func:`build_trainer`.
    """
    value = _run([cfg], f"{cfg.parallel.strategy} x {cfg.parallel.num_workers} workers", datasets=datasets,
                 run_config=run_config, on_progress=on_progress, measure_links=measure_links)
    return RunResult.from_dict(value)


@dataclass
class GroupResult:
    """What :func:`fit_group` measured: per config its result over rounds, or the error it failed with."""

    results: list[Optional[RunResult]]
    errors: list[Optional[str]]
    links: Optional[dict[str, Any]] = None


def fit_group(cfgs: list[Config], rounds: int, *, datasets: Optional[dict] = None,
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


def _run(cfgs: list[Config], what: str, *, datasets: Optional[dict] = None,
         run_config: Optional[RunConfig] = None, on_progress: Optional[Callable[[dict], None]] = None,
         measure_links: Optional[dict] = None, group: Optional[list[Config]] = None, rounds: int = 1) -> dict:
    """Check, build and fit one trainer for ``cfgs`` (the first sets the workers); rank 0's return value,
    or ``TrainingError``."""
    ensure_ray()
    check_cluster_fits(cfgs)
    # Before any worker starts: a checkpointing run must not scatter its checkpoints over nodes' disks.
    check_storage(cfgs, storage_given=run_config is not None and run_config.storage_path is not None)
    channel = ProgressChannel(on_progress) if on_progress else contextlib.nullcontext()
    trainer = build_trainer(cfgs[0], datasets=datasets, run_config=run_config,
                            progress=channel.poster() if on_progress else None, measure_links=measure_links,
                            group=group, rounds=rounds)
    try:
        with channel:
            result = trainer.fit()
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
    return text.splitlines()[-1] if len(text) > 2000 else text
