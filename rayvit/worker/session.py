"""One worker's training session: everything it builds for a config (model, strategy, optimizer, data), one
optimizer step, the evaluation, and closing it all again. Knows nothing of Ray.

The same :class:`Session` serves a whole run (:func:`rayvit.worker.loop.train`), the alternating
single-process benchmark (``rayvit bench``) and the Ray layer (``rayvit.launch``). Its steps' times are
kept by a :class:`~rayvit.worker.step_clock.StepClock`; the figures gathered from them across ranks are
:mod:`rayvit.worker.run_figures`'s, its checkpoints :mod:`rayvit.worker.checkpoint_io`'s.
"""

from __future__ import annotations

import gc
import sys
import time
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from rayvit.errors import DivergedError
from rayvit.config_schema import Config
from rayvit.data import Data, build_data
from rayvit.data.batching import epoch_start
from rayvit.models import build_model, vit_complexity
from rayvit.training import hardware
from rayvit.worker import agree, compiling
from rayvit.worker.step_clock import StepClock
from rayvit.training.optim import build_scheduler, state_bytes, tensors_bytes
from rayvit.training.precision import Precision, grads_of
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
        self.clock = StepClock(self.device, cfg.train.warmup_steps)   # this attempt's steps' times
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
        self.data_fresh_starts = 0            # restarts after which the input started afresh (checkpoint_io.resume)
        self.history: list[dict] = []         # per step: step, loss, lr, step_time_s, data_wait_s, epoch_start
        self.evals: list[dict] = []
        self.skipped_steps = 0                # fp16 overflows: steps the loss scaler skipped
        self._state_bytes: Optional[int] = None    # model state after the last step (model_state_bytes)
        self._compile_scope.enter()                # last: nothing after it can fail and leave it open
        # model.compile: the graphs compiled in this process before this session (compile_graphs counts on)
        self.graphs_before = compiling.graphs_compiled() if cfg.model.compile else 0

    @property
    def masters(self):
        """The fp32 master copy of half-precision weights, where the strategy keeps one (else None)."""
        return self.strategy.masters

    # ---------------------------------------------------------------------------------------------
    def train_step(self) -> float:
        """One optimizer step on the next batch; returns the loss. Timed with device synchronisation."""
        start = self.clock.start()
        batch = next(self.data.train)
        images, labels = batch
        # The wait for the batch, timed apart: the step's time still includes it (throughput is what the
        # input allowed); data_wait_fraction says how much of it was input, epoch starts apart.
        waited, starts_epoch = time.perf_counter() - start, epoch_start(batch)
        # Forward in the precision's dtype; the loss itself in fp32.
        with self.precision.autocast():
            logits = self.forward(self.precision.cast_inputs(images))
        loss = F.cross_entropy(logits.float(), labels, label_smoothing=self.cfg.optim.label_smoothing)
        scaler = self.precision.scaler
        (scaler.scale_loss(loss) if scaler else loss).backward()
        self._apply_gradients()
        loss_value = loss.item()                   # syncs too
        elapsed = self.clock.stop(start)
        # After the clock, on every rank: a loss that is not finite on one rank ends the run on all of them
        # (raised alone, the others would wait for that rank in the next step's collectives).
        diverged = agree.nonfinite_ranks(loss_value, self.device)
        self._state_bytes = None

        self.clock.record(elapsed, waited, starts_epoch)
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

    def close(self) -> None:
        """Stop the sampler and the data; release the model; end the one-rank process group if this
        session made it; put back the thread count and excepthook."""
        self.clock.close()
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

