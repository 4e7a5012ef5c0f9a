"""One worker's training loop: build, parallelise, step, time, evaluate. Knows nothing of Ray.

``Session`` holds everything one worker builds for a config and exposes one training step, so the same
code serves a full run (:func:`train`), the alternating single-process benchmark (``rayvit bench``) and
the Ray layer (``rayvit.launch``), which only adds reporting and checkpoint transport through hooks.
"""

from __future__ import annotations

import gc
import math
import sys
import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from rayvit.errors import DivergedError
from rayvit import process_state
from rayvit.config import as_config
from rayvit.config_schema import Config
from rayvit.data import Data, build_data
from rayvit.data.batching import epoch_start
from rayvit.models import build_model, vit_complexity
from rayvit.results import IMAGENET_TRAIN_IMAGES, RunResult
from rayvit.training import hardware
from rayvit.worker import agree, compiling, metrics
from rayvit.worker.faults import fault_injector
from rayvit.worker import checkpoint_io
from rayvit.training.optim import build_scheduler, state_bytes, tensors_bytes
from rayvit.training.precision import Precision, grads_of
from rayvit.worker.sampler import POWER, UTILIZATION, Sampler, nvml_sampler
from rayvit.strategies import ensure_process_group, rank, strategy_class, world_size


class Session:
    """Everything one worker builds for ``cfg``; ``train_step()`` runs and times one optimizer step."""

    def __init__(self, cfg: Config, device: Optional[torch.device] = None, *,
                 dataset_shards: Optional[dict] = None) -> None:
        self.cfg = cfg
        self.device = device or hardware.default_device(cfg)
        # What this session changes in its process and close() puts back: the thread count, and the
        # excepthook torch.distributed wraps when a one-rank process group is made here.
        self._threads_before, self._excepthook_before = torch.get_num_threads(), sys.excepthook
        # model.compile: the caches it compiles with; made before anything compiles (rayvit.worker.compiling).
        self._compile_scope = compiling.CompileScope(cfg.model, self.device)
        self.owns_process_group = False
        self.data: Optional[Data] = None
        self.model = self.forward = self.optimizer = None
        # NVML readings during this attempt's timed steps (CUDA only): created with the first timed step.
        self.sampler: Optional[Sampler] = None
        try:
            self._build(dataset_shards)
        except BaseException:
            # A setup that fails releases what it made: nobody holds this session to close() it.
            self._release()
            raise

    def _build(self, dataset_shards: Optional[dict]) -> None:
        cfg = self.cfg
        if self.device.type == "cpu":
            # A worker uses exactly the CPUs it was given; more threads than cores only thrash. (Ray sets
            # OMP_NUM_THREADS to them already; torch's intra-op count also sets OpenMP's and MKL's. The
            # inter-op pool, settable once per process, is the Ray worker's business: rayvit.launch.)
            torch.set_num_threads(cfg.parallel.cpus_per_worker)
        # Each session measures its own peak, also when several run one after another in this process.
        hardware.reset_peak_memory(self.device)
        self.owns_process_group = ensure_process_group(self.device)
        self.rank, self.world_size = rank(), world_size()

        # Same seed on every rank: identical initial weights before DDP/FSDP take over.
        torch.manual_seed(cfg.train.seed)
        strategy_cls = strategy_class(cfg.parallel.strategy)
        self.precision = Precision(cfg.precision, self.device, strategy_cls.owns_mixed_precision)
        self.strategy = strategy_cls(cfg, self.precision, self.device)
        model = self.precision.prepare_model(build_model(cfg.model).to(self.device))
        self.model, self.optimizer = self.strategy.parallelize(model)
        self.scheduler = build_scheduler(cfg.optim, self.optimizer, cfg.train.steps)
        # model.compile: blocks were compiled before wrapping, or the wrapped model is compiled here.
        self.forward = self.strategy.forward_of(self.model)
        self.data = build_data(cfg, self.device, rank=self.rank, world_size=self.world_size,
                               dataset_shards=dataset_shards)
        self.complexity = vit_complexity(cfg.model)

        self.step = 0                         # optimizer steps completed, across restarts
        self.restarts = 0
        self.data_fresh_starts = 0            # restarts after which the input started afresh (load_checkpoint)
        self.history: list[dict] = []         # per step: step, loss, lr, step_time_s
        self.evals: list[dict] = []
        self.step_times: list[float] = []     # this attempt's timed (post-warm-up) steps
        self.data_wait_times: list[float] = []   # of those, the seconds each waited for its batch (steady)
        # Of those, the seconds waited by a step whose batch began an epoch (a new Ray Data execution), else
        # 0.0: booked here instead of in data_wait_times, so that the steady wait is not a mean of stalls.
        self.epoch_start_waits: list[float] = []
        self.warmup_step_times: list[float] = []   # this attempt's warm-up steps (model.compile compiles there)
        self.steps_this_attempt = 0
        self.skipped_steps = 0
        self._sampler_tried = False
        self._state_bytes: Optional[int] = None    # model state after the last step (model_state_bytes)
        self._compile_scope.enter()                # last: nothing after it can fail and leave it open
        self._graphs_before = compiling.graphs_compiled() if cfg.model.compile else 0

    @property
    def masters(self):
        """The fp32 master copy of half-precision weights, where the strategy keeps one (else None)."""
        return self.strategy.masters

    # ---------------------------------------------------------------------------------------------
    def train_step(self) -> float:
        """One optimizer step on the next batch; returns the loss. Timed with device synchronisation."""
        timed = self.steps_this_attempt >= self.cfg.train.warmup_steps
        if timed:
            self._sampling(True)                   # outside the clock
        hardware.synchronize(self.device)
        start = time.perf_counter()
        batch = next(self.data.train)
        images, labels = batch
        # The wait for the batch, timed apart: the step's time still includes it (throughput is what the
        # input allowed); data_wait_fraction says how much of it was input, epoch starts apart.
        waited = time.perf_counter() - start
        starts_epoch = epoch_start(batch)
        # Forward in the precision's dtype; the loss itself in fp32.
        with self.precision.autocast():
            logits = self.forward(self.precision.cast_inputs(images))
        loss = F.cross_entropy(logits.float(), labels, label_smoothing=self.cfg.optim.label_smoothing)
        scaler = self.precision.scaler
        (scaler.scale_loss(loss) if scaler else loss).backward()
        self._apply_gradients()
        loss_value = loss.item()                   # syncs too
        hardware.synchronize(self.device)
        elapsed = time.perf_counter() - start
        if timed:
            self._sampling(False)
        # After the clock, on every rank: a loss that is not finite on one rank ends the run on all of them
        # (raised alone, the others would wait for that rank in the next step's collectives).
        diverged = agree.nonfinite_ranks(loss_value, self.device)
        self._state_bytes = None

        self.steps_this_attempt += 1
        if self.steps_this_attempt > self.cfg.train.warmup_steps:
            self.step_times.append(elapsed)
            self.data_wait_times.append(0.0 if starts_epoch else waited)
            self.epoch_start_waits.append(waited if starts_epoch else 0.0)
        else:
            self.warmup_step_times.append(elapsed)
        self.history.append({"step": self.step, "loss": loss_value, "lr": self.optimizer.param_groups[0]["lr"],
                             "step_time_s": elapsed, "data_wait_s": waited, "epoch_start": starts_epoch})
        self.step += 1
        if diverged:
            raise DivergedError(f"loss is not finite (NaN or inf) on rank {', '.join(map(str, diverged))} at step "
                                f"{self.step} ({self.precision.describe()}); the run diverged")
        return loss_value

    def _apply_gradients(self) -> None:
        masters = self.masters
        if masters is not None:
            masters.grads_to_masters()
        finite = True
        if self.precision.scaler is not None:
            params = [p for g in self.optimizer.param_groups for p in g["params"]]
            finite = self.precision.scaler.unscale_and_check(grads_of(params))
        if finite:
            if self.cfg.optim.grad_clip > 0:
                self.strategy.clip_grad_norm_(self.model, self.optimizer, self.cfg.optim.grad_clip)
            self.strategy.optimizer_step(self.model, self.optimizer)
            if masters is not None:
                masters.masters_to_model()
        else:
            self.skipped_steps += 1                # fp16 overflow: skip, the scaler has backed off
        # Gradients stay allocated until the next step's clear_grads() so model-state bytes count them.
        self.scheduler.step()

    def _sampling(self, during_step: bool) -> None:
        """Let the NVML sampler's readings count during a timed step only; start it with the first one."""
        if not self._sampler_tried:
            self._sampler_tried = True
            self.sampler = nvml_sampler(self.device)
            if self.sampler is not None:
                self.sampler.start()
        if self.sampler is not None:
            if during_step:
                self.sampler.activate()
            else:
                self.sampler.deactivate()

    def align_ranks(self) -> None:
        """Wait for every rank, outside the timed steps: a report (Ray's health-check tick, or a checkpoint) releases
        ranks at different times, and without this the next timed step would absorb the difference."""
        if self.world_size > 1:
            dist.barrier()

    def clear_grads(self) -> None:
        self.strategy.zero_grad(self.model, self.optimizer)

    @torch.no_grad()
    def evaluate(self) -> Optional[dict]:
        """Validation accuracy and loss over the whole split (all ranks), or None without one."""
        if self.data.val_batches is None:
            return None
        self.model_state_bytes()                   # counted before this forward changes what is held
        was_training = self.model.training
        self.model.eval()
        totals = torch.zeros(3, dtype=torch.float64, device=self.device)  # correct, count, loss sum
        for images, labels in self.data.val_batches():
            with self.precision.autocast():
                logits = self.forward(self.precision.cast_inputs(images)).float()
            totals[0] += (logits.argmax(-1) == labels).sum()
            totals[1] += labels.numel()
            totals[2] += F.cross_entropy(logits, labels, reduction="sum")
        if self.world_size > 1:
            dist.all_reduce(totals)
        self.model.train(was_training)
        count = max(totals[1].item(), 1.0)
        result = {"step": self.step, "val_accuracy": totals[0].item() / count, "val_loss": totals[2].item() / count}
        self.evals.append(result)
        return result

    def running_figures(self) -> dict[str, Any]:
        """This rank's figures so far, for progress reports: step, loss, lr, the mean loss of the last
        ``train.report_every`` steps, and the throughput figures (images/s, TFLOPS, MFU per chip) over the
        timed steps so far (``timed_steps`` of them; over the warm-up steps while none is timed yet)."""
        t, last = self.cfg.train, self.history[-1]
        recent = self.history[-t.report_every:]
        times = self.step_times or self.warmup_step_times
        per_chip = metrics.images_per_sec(t.batch_size, len(times), sum(times))
        rate = self.rate_figures(per_chip)
        figures = {"step": self.step, "loss": last["loss"], "lr": last["lr"], "restarts": self.restarts,
                   "loss_mean": sum(h["loss"] for h in recent) / len(recent),
                   "images_per_sec_per_chip": per_chip, "images_per_sec": per_chip * self.world_size,
                   "tflops_per_chip": rate["tflops_per_chip"], "mfu": rate["mfu"],
                   "timed_steps": len(self.step_times)}
        if self.evals:
            figures["val_accuracy"] = self.evals[-1]["val_accuracy"]
        if self.restarts:
            figures["data_fresh_starts"] = self.data_fresh_starts
        return figures

    # ---------------------------------------------------------------------------------------------
    def model_state_bytes(self) -> int:
        """Parameters + gradients + optimizer state (+ master copies) this rank holds after its last step.

        Counted once per step and kept: a forward without a backward after it (:meth:`evaluate`) leaves
        FSDP2's and FairScale's parameters gathered under ``parallel.reshard_after_forward=false`` (and
        FairScale's root in any case), whole on every rank and without their gradients, until the next
        backward; counted then, a sharded model would look replicated.
        """
        if self._state_bytes is None:
            self._state_bytes = self._held_state_bytes()
        return self._state_bytes

    def _held_state_bytes(self) -> int:
        params = list(self.model.parameters())
        total = tensors_bytes(params) + tensors_bytes(grads_of(params)) + state_bytes(self.optimizer)
        if self.masters is not None:
            total += tensors_bytes(self.masters.masters) + tensors_bytes(grads_of(self.masters.masters))
        return total

    def compile_time_s(self) -> float:
        """Under ``model.compile``: the warm-up steps' time beyond a median timed step, which is what
        compiling them cost (the step that compiles and any that recompile); 0.0 when not compiled."""
        if not self.cfg.model.compile or not self.step_times:
            return 0.0
        return compiling.compile_overhead_s(self.warmup_step_times, self.step_times)

    def rate_figures(self, images_per_sec_per_chip: float) -> dict:
        """TFLOPS per chip and MFU at a per-chip image rate, for this model and precision."""
        return metrics.rate_figures(self.complexity.train_flops_per_image, images_per_sec_per_chip,
                                    self.device, self.precision.compute_dtype)

    def summary(self, wall_time_s: float) -> RunResult:
        """Figures aggregated over ranks (the slowest rank sets the pace), with their conditions.

        Memory and GPU readings are gathered from every rank: the run keeps each rank's value
        (``RunResult.per_rank``) and their max / mean (:func:`metrics.across_ranks`).
        """
        slowest, waited, started, stats, combined, per_rank = self._gathered()
        # The slowest rank's total time over the window sets the pace.
        per_chip = metrics.images_per_sec(self.cfg.train.batch_size, len(self.step_times), stats[0])
        global_rate = per_chip * self.world_size
        rate = self.rate_figures(per_chip)
        figures = {
            "images_per_sec": global_rate,
            "images_per_sec_per_chip": per_chip,
            "tflops_per_chip": rate["tflops_per_chip"],
            "mfu": rate["mfu"],
            "step_time_mean_s": self.cfg.train.batch_size / per_chip if per_chip > 0 else math.nan,
            **metrics.step_time_percentiles(slowest),
            "model_state_bytes_per_rank": stats[1],
            "data_wait_fraction": sum(waited) / sum(slowest) if slowest else math.nan,
            **metrics.epoch_start_figures(started, slowest),
            **combined,
            "final_loss": self.history[-1]["loss"] if self.history else float("nan"),
            "epoch_time_imagenet_h": IMAGENET_TRAIN_IMAGES / global_rate / 3600,
            "train_flops_per_image": float(self.complexity.train_flops_per_image),
            "peak_tflops": rate["peak_tflops"],
            "timed_steps": float(len(self.step_times)),
            "wall_time_s": wall_time_s,
        }
        if self.evals and "val_accuracy" in self.evals[-1]:
            figures["val_accuracy"] = self.evals[-1]["val_accuracy"]
        if self.restarts:
            figures["data_fresh_starts"] = float(self.data_fresh_starts)
        if self.cfg.model.compile:
            figures["compile_time_s"] = stats[2]      # the slowest rank's
            figures["compile_graphs"] = float(compiling.graphs_compiled() - self._graphs_before)
        return RunResult(metrics=figures, conditions=self.conditions(rate["peak_source"]),
                         history=list(self.history), evals=list(self.evals), config=self.cfg.to_dict(),
                         restarts=self.restarts, per_rank=per_rank, step_times=slowest,
                         data_wait_times=waited)

    def _gathered(self) -> tuple[list[float], list[float], list[float], list[float], dict, dict]:
        """Over every rank: each timed step's slowest time, longest steady data wait and longest epoch-start
        wait; the slowest rank's total
        step time, model state and compile time; and each rank's own readings (peak memory, NVML, skipped
        images), combined and per rank (:func:`metrics.across_ranks`)."""
        readings = self.sampler.stop() if self.sampler is not None else {}
        times = torch.tensor(self.step_times or [float("nan")], dtype=torch.float64)
        waits = torch.tensor(self.data_wait_times or [float("nan")], dtype=torch.float64)
        starts = torch.tensor(self.epoch_start_waits or [float("nan")], dtype=torch.float64)
        stats = torch.tensor([times.sum().item(), float(self.model_state_bytes()), self.compile_time_s()],
                             dtype=torch.float64)
        reserved = hardware.peak_reserved_bytes(self.device)
        mine = {"peak_memory_bytes": float(hardware.peak_memory_bytes(self.device)),
                "peak_memory_reserved_bytes": math.nan if reserved is None else float(reserved),
                "gpu_utilization_pct": readings.get(UTILIZATION, math.nan),
                "gpu_power_w": readings.get(POWER, math.nan),
                "gpu_samples": readings.get("samples", math.nan),
                "skipped_images": float(len(self.data.skipped)) if self.data.skipped is not None else math.nan}
        ranks = torch.tensor([list(mine.values())], dtype=torch.float64)
        if self.world_size > 1:
            # Step times and counts are the same length on every rank; take the slowest per step.
            times, waits, starts, stats = (self._max_over_ranks(t) for t in (times, waits, starts, stats))
            mine_d = ranks[0].to(self.device)
            gathered = [torch.empty_like(mine_d) for _ in range(self.world_size)]
            dist.all_gather(gathered, mine_d)
            ranks = torch.stack(gathered).cpu()
        combined, per_rank = metrics.across_ranks(dict(zip(mine, ranks.t().tolist())))
        timed = bool(self.step_times)
        return (times.tolist() if timed else [], waits.tolist() if timed else [],
                starts.tolist() if timed else [], stats.tolist(), combined, per_rank)

    def _max_over_ranks(self, values: torch.Tensor) -> torch.Tensor:
        on_device = values.to(self.device)
        dist.all_reduce(on_device, op=dist.ReduceOp.MAX)
        return on_device.cpu()

    def conditions(self, peak_source: str) -> dict[str, Any]:
        """What every figure of this run is stated with (:func:`metrics.run_conditions`)."""
        return metrics.run_conditions(self.cfg, self.precision, self.strategy, self.world_size, self.device,
                                      peak_source)

    # ---------------------------------------------------------------------------------------------
    def save_checkpoint(self, directory: str) -> None:
        """Write what this run continues from into ``directory`` (:func:`checkpoint_io.save_state`)."""
        checkpoint_io.save_state(self, directory)

    def save_model(self, directory: str) -> None:
        """Write the model alone, whole, into ``directory`` (:func:`checkpoint_io.save_model`)."""
        checkpoint_io.save_model(self, directory)

    def load_checkpoint(self, directory: str) -> None:
        """Continue from a checkpoint (:func:`checkpoint_io.resume`)."""
        checkpoint_io.resume(self, directory)

    def close(self) -> None:
        """Stop the sampler and the data; release the model; end the one-rank process group if this
        session made it; put back the thread count and excepthook."""
        if self.sampler is not None:
            self.sampler.stop()
        if self.data is not None:
            self.data.close()
        self._release()

    def _release(self) -> None:
        """Release the model, the compile scope and the one-rank process group this session made, and put
        the thread count and excepthook back: what close() ends with, and all a failed setup needs.

        The wrapped model (DDP's reducer, the sharded wrappers) holds the process group. Destroyed first
        and collected later, gloo's destructor could wait forever on its own threads (seen in a test
        run: ``~ProcessGroupGloo`` joining inside ``~Reducer``), so the model goes before the group.
        """
        self.forward = self.model = self.optimizer = None
        self._compile_scope.close()
        if self.owns_process_group and dist.is_initialized():
            gc.collect()
            dist.destroy_process_group()
            sys.excepthook = self._excepthook_before
            # Their groups belonged to the group just destroyed.
            strategy_class(self.cfg.parallel.strategy).forget_process_groups()
        torch.set_num_threads(self._threads_before)


# A hook receives (metrics, session) every ``train.report_every`` steps, and once more at the end with the
# run's figures (``metrics["final"]`` true, after the final evaluation); the Ray layer uses it to report and
# checkpoint. It runs between steps, never inside a timed step.
ReportHook = Callable[[dict, Session], None]


def train(cfg: Config | dict, *, device: Optional[torch.device] = None, dataset_shards: Optional[dict] = None,
          report: Optional[ReportHook] = None, resume_from: Optional[str] = None,
          on_step: Optional[Callable[[Session], None]] = None) -> RunResult:
    """Run ``cfg.train.steps`` optimizer steps on this worker and return the run's summary.

    ``cfg``: a :class:`~rayvit.config.Config` or its dict form (validated). ``on_step(session)`` runs after
    every step, outside its timed window (live progress). In the caller's process, the torch thread count
    and the process group (with its ``sys.excepthook``) that a one-rank run sets up are put back afterwards.
    """
    with process_state.kept():
        return _train(as_config(cfg), device, dataset_shards, report, resume_from, on_step)


def _train(cfg: Config, device: Optional[torch.device], dataset_shards: Optional[dict],
           report: Optional[ReportHook], resume_from: Optional[str],
           on_step: Optional[Callable[[Session], None]]) -> RunResult:
    start = time.perf_counter()
    session = Session(cfg, device, dataset_shards=dataset_shards)
    before_step = fault_injector(cfg.train)
    try:
        t = cfg.train
        if resume_from:
            session.load_checkpoint(resume_from)
        while session.step < t.steps:
            session.clear_grads()
            if before_step:
                before_step(session)   # fault injection (train.fail_at_step)
            session.train_step()
            if on_step:
                on_step(session)
            if session.step == t.steps:
                break                              # the last step reports after the final evaluation
            if t.eval_every and session.step % t.eval_every == 0:
                session.evaluate()
            if report and (session.step % t.report_every == 0
                           or (t.checkpoint_every and session.step % t.checkpoint_every == 0)):
                report(session.running_figures(), session)
                session.align_ranks()
        session.evaluate()
        result = session.summary(time.perf_counter() - start)
        if report:
            report({**session.running_figures(), **RunResult.of_rounds([result]).report_metrics(), "final": True},
                   session)
        return result
    finally:
        session.close()
