"""The Ray Train worker's side of rayvit: the functions the workers run, one per payload
(:mod:`rayvit.launch.payload`): :func:`train_loop_per_worker` for one run, with the config it takes
(:func:`loop_config`), and :func:`measure_group_per_worker` for a group measured in rounds; what a run
reports to Ray Train and when.

Every ``train.report_every`` steps a worker reports its running figures; the last report (``final``
true), after the final evaluation, carries the run's summary and a checkpoint (rank 0 writes the summary
into it), so that Ray Train builds ``result.metrics`` from it. That checkpoint also holds the trained
model (``final_model``, the default): whole from rank 0, or in FairScale FSDP's own sharded layout, so
``load_checkpoint(result.checkpoint).model`` is the model. A worker group measuring rounds
(:func:`measure_group_per_worker`) reports nothing and returns every round's results instead.

Ray Train registers a reported checkpoint only once its controller has taken every rank's report of it,
which it polls every ``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S`` (2 s by default), while ``ray.train.report``
returns as soon as the report is queued on the worker. A group lost between the two loses the
checkpoint, and its replacement starts from an older one, or from step 0. So after every checkpoint but
the last, the workers wait until Ray Train has committed it (:func:`_committed`): a checkpoint, once
written, survives a failure that follows it, whatever the report cadence and the tick.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
from typing import Any, Optional

import ray
import torch
from ray.train import Checkpoint

from rayvit.config import as_config, from_dict
from rayvit.config_schema import Config
from rayvit.errors import ConfigError
from rayvit.launch.payload import GroupPayload, Payload, RunPayload
from rayvit.results import RunResult
from rayvit.worker import Session, train
from rayvit.worker.checkpoint_io import resumable, save_model, save_state

logger = logging.getLogger(__name__)

# The key of the final report, and the file rank 0 writes the summary into in its checkpoint.
FINAL_KEY = "final"
SUMMARY_FILE = "rayvit_summary.json"


def loop_config(cfg: Config | dict, *, final_model: bool = True) -> dict[str, Any]:
    """The ``train_loop_config`` of :func:`train_loop_per_worker` for ``cfg``, validated here on the driver
    (a typo is a ``ConfigError`` now, not a worker's error seconds later): a :class:`RunPayload` as one key
    (:mod:`rayvit.launch.payload`). ``final_model``: the final checkpoint carries the trained model (else
    only the summary, and the state ``train.checkpoint_every`` writes)."""
    return RunPayload(as_config(cfg).to_dict(), final_model=final_model).to_loop_config()


def train_loop_per_worker(config: dict[str, Any]) -> dict[str, Any]:
    """Ray Train worker entry point of one run: ``config`` is :func:`loop_config`'s (a :class:`RunPayload`).
    Returns the summary dict; every ``train.report_every`` steps it reports the running figures, and once
    more at the end the run's summary (see :func:`rayvit.launch.torch_trainer.make_trainer`)."""
    payload = RunPayload.of(config)
    cfg, device, shards = _start(payload.config)
    out = _train_one(cfg, payload, device, shards).to_dict()
    if payload.links is not None:
        out["links"] = _measure_links(cfg, payload, [payload.config], host_waits=[])
    return out


def measure_group_per_worker(config: dict[str, Any]) -> dict[str, Any]:
    """Ray Train worker entry point of a group (a :class:`GroupPayload`): the workers measure every config
    of the group in interleaved rounds (:func:`rayvit.worker.rounds.measure_rounds`), report nothing and
    return ``{"group": [one entry per config]}`` (with ``"links"`` when the payload asks for them)."""
    from rayvit.worker.rounds import measure_rounds

    payload = GroupPayload.of(config)
    cfg, device, shards = _start(payload.config)
    poster, waits = payload.progress, []
    between = None
    if payload.links is not None:
        # The wait for the slowest rank drifts over seconds on a shared host: read it after every
        # round, so the links cover the same minutes as the points they project.
        from rayvit.measure.timers import wait_curve

        between = lambda r: waits.append(wait_curve(device))  # noqa: E731
    out: dict[str, Any] = {"group": measure_rounds(
        [from_dict(c) for c in payload.group], payload.rounds, device=device, dataset_shards=shards,
        on_step=poster.step_of_group if poster else None, on_round=poster.round_of_group if poster else None,
        between_rounds=between, on_abandon=poster.round_abandoned if poster else None)}
    if payload.links is not None:
        out["links"] = _measure_links(cfg, payload, payload.group, host_waits=waits)
    return out


def _start(config: dict[str, Any]) -> tuple[Config, torch.device, Optional[dict]]:
    """The worker's config (checked against what Ray gave it), device and dataset shards."""
    cfg = from_dict(config)
    _check_worker_matches(cfg)
    device = ray.train.torch.get_device() if cfg.parallel.use_gpu else torch.device("cpu")
    if device.type == "cpu":
        # The inter-op pool can be sized once per process, before any inter-op work: this Ray worker is
        # rayvit's own process, so it is sized here, to the CPUs the worker was given.
        with contextlib.suppress(RuntimeError):
            torch.set_num_interop_threads(cfg.parallel.cpus_per_worker)
    shards = {}
    for name in ("train", "val"):
        try:
            shards[name] = ray.train.get_dataset_shard(name)
        except (KeyError, ValueError, RuntimeError):
            shards[name] = None
    return cfg, device, (shards if shards["train"] is not None else None)


def _check_worker_matches(cfg: Config) -> None:
    """A ``TorchTrainer`` built by hand may give more workers or CPUs than the config says: every figure
    would then be stated for the wrong world size or thread count. Refused on the first worker."""
    p = cfg.parallel
    context = ray.train.get_context()
    world = context.get_world_size()
    given = ray.get_runtime_context().get_assigned_resources().get("CPU")
    problems = []
    if world != p.num_workers:
        problems.append(f"the ScalingConfig started {world} workers, the config says parallel.num_workers="
                        f"{p.num_workers}")
    if given is not None and round(given) != p.cpus_per_worker:
        problems.append(f"each worker was given {given:g} CPUs, the config says parallel.cpus_per_worker="
                        f"{p.cpus_per_worker}")
    if problems:
        raise ConfigError("; ".join(problems) + ". Build the trainer with rayvit.trainer.make_trainer(cfg), or "
                          "pass scaling_config=rayvit.trainer.scaling_config(cfg) to your TorchTrainer")


def _train_one(cfg: Config, payload: RunPayload, device: torch.device, shards: Optional[dict]) -> RunResult:
    t = cfg.train
    final_model = payload.final_model

    def report(metrics: dict, session: Session) -> None:
        final = bool(metrics.get(FINAL_KEY))
        if not (final or (t.checkpoint_every and session.step % t.checkpoint_every == 0)):
            ray.train.report(metrics)
            return
        with tempfile.TemporaryDirectory() as tmp:
            if t.checkpoint_every:
                save_state(session, tmp)               # what a run continues from
            elif final and final_model:
                save_model(session, tmp)               # the model alone
            if final and session.rank == 0:
                # Ray Train builds Result.metrics from the last report that carried a checkpoint: the
                # final one always does, with the summary in it, so result.metrics holds the figures.
                with open(os.path.join(tmp, SUMMARY_FILE), "w") as f:
                    json.dump(metrics, f, default=str)
            # Ranks that wrote nothing (replicated strategies: rank 0 writes the full copy) report none.
            checkpoint = Checkpoint.from_directory(tmp) if os.listdir(tmp) else None
            ray.train.report(metrics, checkpoint=checkpoint)
        if not final:
            _committed()

    checkpoint = ray.train.get_checkpoint()
    with (checkpoint.as_directory() if checkpoint else contextlib.nullcontext()) as resume_from:
        if resume_from is not None and not resumable(resume_from):
            resume_from = None      # a final checkpoint with the model alone, or the summary: nothing to resume
        return train(cfg, device=device, dataset_shards=shards, report=report, resume_from=resume_from,
                     on_step=payload.progress)


def _committed() -> None:
    """Wait until Ray Train has registered every checkpoint reported so far (the module's docstring): at
    most one controller tick, between steps, never inside a timed one. Checked on Ray 2.60. An older Ray
    without ``CheckpointConsistencyMode`` is not asked: before ray-project/ray#58870 the call could wait
    forever after reports that carried no checkpoint."""
    mode = getattr(ray.train, "CheckpointConsistencyMode", None)
    if mode is not None:
        ray.train.get_all_reported_checkpoints(consistency_mode=mode.COMMITTED)


def _measure_links(cfg: Config, payload: Payload, strategy_configs: list[dict[str, Any]],
                   host_waits: list[list[list[float]]]) -> dict[str, Any]:
    """The collective microbenchmark after training, outside every timed step, on these very workers.

    It never fails the run it follows (an OOM on a small GPU, a collective the backend lacks): the error
    comes back as ``{"error": ...}`` and the sweep projects with the hardware profile's links.
    """
    from rayvit.measure.links import worker_benchmark

    try:
        return worker_benchmark({"use_gpu": cfg.parallel.use_gpu, "threads": cfg.parallel.cpus_per_worker,
                                 "model": payload.config, "batch": cfg.train.batch_size,
                                 "strategy_configs": strategy_configs, **(payload.links or {}),
                                 "host_waits": host_waits})
    except Exception as e:  # noqa: BLE001
        logger.warning("the links microbenchmark failed: %s", e)
        return {"error": f"{type(e).__name__}: {e}"}
