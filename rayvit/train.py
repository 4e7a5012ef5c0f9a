"""One worker's training loop: build, parallelise, step, time, evaluate. Knows nothing of Ray.

``Session`` holds everything one worker builds for a config and exposes one training step, so the same
code serves a full run (:func:`train`), the alternating single-process benchmark (``rayvit.bench``) and
the Ray layer (``rayvit.trainer``), which only adds reporting and checkpoint transport through hooks.
"""

from __future__ import annotations

import math
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

import rayvit
from rayvit import hardware, parallel
from rayvit.complexity import vit_complexity
from rayvit.config import Config
from rayvit.data import build_data
from rayvit.models import build_model
from rayvit.optim import build_scheduler, state_bytes, tensors_bytes
from rayvit.precision import Precision, grads_of
from rayvit.results import RunResult

IMAGENET_TRAIN_IMAGES = 1_281_167


class InjectedFault(RuntimeError):
    """Raised by ``train.fail_at_step`` to prove that a run survives a crashed worker."""


class DivergedError(FloatingPointError):
    """The loss became NaN or infinite."""


def default_device(cfg: Config) -> torch.device:
    if cfg.parallel.use_gpu:
        if not torch.cuda.is_available():
            raise RuntimeError("parallel.use_gpu=true but this worker sees no CUDA device")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class Session:
    """Everything one worker builds for ``cfg``; ``train_step()`` runs and times one optimizer step."""

    def __init__(self, cfg: Config, device: Optional[torch.device] = None, *,
                 dataset_shards: Optional[dict] = None) -> None:
        self.cfg = cfg
        self.device = device or default_device(cfg)
        if self.device.type == "cpu":
            # A worker uses exactly the CPUs it was given; more threads than cores only thrash.
            torch.set_num_threads(cfg.parallel.cpus_per_worker)
        self.owns_process_group = parallel.ensure_process_group(self.device)
        self.rank, self.world_size = parallel.rank(), parallel.world_size()

        # Same seed on every rank: identical initial weights before DDP/FSDP take over.
        torch.manual_seed(cfg.train.seed)
        self.precision = Precision(cfg.precision, self.device, cfg.parallel.strategy)
        model = self.precision.prepare_model(build_model(cfg.model).to(self.device))
        self.model, self.optimizer, self.masters = parallel.parallelize(model, cfg, self.precision, self.device)
        self.scheduler = build_scheduler(cfg.optim, self.optimizer, cfg.train.steps)
        if cfg.train.compile:
            self.forward = torch.compile(self.model)
        else:
            self.forward = self.model
        self.data = build_data(cfg, self.device, rank=self.rank, world_size=self.world_size,
                               dataset_shards=dataset_shards)
        self.complexity = vit_complexity(cfg.model)

        self.step = 0                         # optimizer steps completed, across restarts
        self.restarts = 0
        self.history: list[dict] = []         # per step: step, loss, lr, step_time_s
        self.evals: list[dict] = []
        self.step_times: list[float] = []     # this attempt's timed (post-warm-up) steps
        self.steps_this_attempt = 0
        self.skipped_steps = 0

    # ---------------------------------------------------------------------------------------------
    def train_step(self) -> float:
        """One optimizer step on the next batch; returns the loss. Timed with device synchronisation."""
        hardware.synchronize(self.device)
        start = time.perf_counter()
        images, labels = next(self.data.train)
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

        self.steps_this_attempt += 1
        if self.steps_this_attempt > self.cfg.train.warmup_steps:
            self.step_times.append(elapsed)
        self.history.append({"step": self.step, "loss": loss_value,
                             "lr": self.optimizer.param_groups[0]["lr"], "step_time_s": elapsed})
        self.step += 1
        if not math.isfinite(loss_value):
            raise DivergedError(f"loss is {loss_value} at step {self.step} "
                                f"({self.precision.describe()}); the run diverged")
        return loss_value

    def _apply_gradients(self) -> None:
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        if self.masters is not None:
            self.masters.grads_to_masters()
        finite = True
        if self.precision.scaler is not None:
            finite = self.precision.scaler.unscale_and_check(grads_of(params))
        if finite:
            if self.cfg.optim.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(params, self.cfg.optim.grad_clip)
            self.optimizer.step()
            if self.masters is not None:
                self.masters.masters_to_model()
        else:
            self.skipped_steps += 1                # fp16 overflow: skip, the scaler has backed off
        # Gradients stay allocated until the next step's clear_grads() so model-state bytes count them.
        self.scheduler.step()

    def clear_grads(self) -> None:
        # ShardedDDP reduces gradients through bucket views of .grad: they must be zeroed, never freed.
        set_to_none = self.cfg.parallel.strategy != "fairscale_oss"
        self.optimizer.zero_grad(set_to_none=set_to_none)
        self.model.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def evaluate(self) -> Optional[dict]:
        """Validation accuracy and loss over the whole split (all ranks), or None without one."""
        if self.data.val_batches is None:
            return None
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
        """Parameters + gradients + optimizer state (+ master copies) this rank actually holds."""
        params = list(self.model.parameters())
        total = tensors_bytes(params) + tensors_bytes(grads_of(params)) + state_bytes(self.optimizer)
        if self.masters is not None:
            total += tensors_bytes(self.masters.masters) + tensors_bytes(grads_of(self.masters.masters))
        return total

    def rate_figures(self, images_per_sec_per_chip: float) -> dict:
        """TFLOPS per chip and MFU for a per-chip image rate: analytic training FLOPs x rate / peak."""
        peak, source = hardware.peak_flops(self.device, self.precision.compute_dtype)
        tflops = self.complexity.train_flops_per_image * images_per_sec_per_chip / 1e12
        return {"tflops_per_chip": tflops, "mfu": tflops * 1e12 / peak, "peak_tflops": peak / 1e12,
                "peak_source": source}

    def summary(self, wall_time_s: float) -> RunResult:
        """Figures aggregated over ranks (the slowest rank sets the pace), with their conditions."""
        times = torch.tensor(self.step_times or [float("nan")], dtype=torch.float64)
        stats = torch.tensor([times.sum().item(), float(self.model_state_bytes()),
                              float(hardware.peak_memory_bytes(self.device))], dtype=torch.float64)
        if self.world_size > 1:
            # Step times and counts are the same length on every rank; take the slowest per step.
            times_d, stats_d = times.to(self.device), stats.to(self.device)
            dist.all_reduce(times_d, op=dist.ReduceOp.MAX)
            dist.all_reduce(stats_d, op=dist.ReduceOp.MAX)
            times, stats = times_d.cpu(), stats_d.cpu()
        batch = self.cfg.train.batch_size
        per_chip = batch * len(self.step_times) / stats[0].item() if self.step_times else float("nan")
        global_rate = per_chip * self.world_size
        rate = self.rate_figures(per_chip)
        final_eval = self.evals[-1] if self.evals else {}
        metrics = {
            "images_per_sec": global_rate,
            "images_per_sec_per_chip": per_chip,
            "tflops_per_chip": rate["tflops_per_chip"],
            "mfu": rate["mfu"],
            "step_time_p50_s": float(times.quantile(0.5)),
            "step_time_p90_s": float(times.quantile(0.9)),
            "model_state_bytes_per_rank": stats[1].item(),
            "peak_memory_bytes_per_rank": stats[2].item(),
            "final_loss": self.history[-1]["loss"] if self.history else float("nan"),
            "epoch_time_imagenet_h": IMAGENET_TRAIN_IMAGES / global_rate / 3600,
            "train_flops_per_image": float(self.complexity.train_flops_per_image),
            "peak_tflops": rate["peak_tflops"],
            "timed_steps": float(len(self.step_times)),
            "wall_time_s": wall_time_s,
        }
        if "val_accuracy" in final_eval:
            metrics["val_accuracy"] = final_eval["val_accuracy"]
        m = self.cfg.model
        conditions = {
            "model": m.name if m.name != "custom" else
            f"custom-d{m.hidden_dim}x{m.depth}h{m.num_heads}p{m.patch_size}",
            "image_size": m.image_size, "batch_per_chip": batch,
            "precision": self.precision.describe(), "strategy": self.cfg.parallel.strategy,
            "world_size": self.world_size, "accelerator": hardware.accelerator_name(self.device),
            "peak_source": rate["peak_source"], "data": self.cfg.data.name,
            **library_versions(),
        }
        return RunResult(metrics=metrics, conditions=conditions, history=list(self.history),
                         evals=list(self.evals), config=self.cfg.to_dict(), restarts=self.restarts)

    # ---------------------------------------------------------------------------------------------
    def save_checkpoint(self, directory: str) -> None:
        """Write this run's state to ``directory`` (sharded for FSDP, full from rank 0 otherwise)."""
        from rayvit import checkpoint

        checkpoint.save(self, directory)

    def load_checkpoint(self, directory: str) -> None:
        from rayvit import checkpoint

        checkpoint.load(self, directory)
        self.restarts += 1
        # Continue the data stream where the crashed attempt's checkpoint left it.
        for _ in range(self.step):
            next(self.data.train)

    def close(self) -> None:
        if self.owns_process_group and dist.is_initialized():
            dist.destroy_process_group()


def library_versions() -> dict[str, str]:
    versions = {"torch_version": torch.__version__, "rayvit_version": rayvit.__version__}
    for name in ("ray", "fairscale"):
        try:
            module = __import__(name)
            versions[f"{name}_version"] = module.__version__
        except ImportError:
            versions[f"{name}_version"] = "absent"
    return versions


# A hook receives (metrics, session) every ``train.report_every`` steps and at the end; the Ray layer uses
# it to report and checkpoint. It runs between steps, never inside a timed step.
ReportHook = Callable[[dict, Session], None]


def train(cfg: Config, *, device: Optional[torch.device] = None, dataset_shards: Optional[dict] = None,
          report: Optional[ReportHook] = None, resume_from: Optional[str] = None) -> RunResult:
    """Run ``cfg.train.steps`` optimizer steps on this worker and return the run's summary."""
    start = time.perf_counter()
    session = Session(cfg, device, dataset_shards=dataset_shards)
    try:
        t = cfg.train
        if resume_from:
            session.load_checkpoint(resume_from)
        while session.step < t.steps:
            session.clear_grads()
            # Fault injection: crash once (never after a restart), to prove recovery from checkpoints.
            if t.fail_at_step and session.step == t.fail_at_step and session.restarts == 0 \
                    and session.rank == t.fail_rank:
                raise InjectedFault(f"injected fault on rank {session.rank} at step {session.step}")
            loss = session.train_step()
            last = session.step == t.steps
            if t.eval_every and (session.step % t.eval_every == 0) and not last:
                session.evaluate()
            if report and (session.step % t.report_every == 0 or last
                           or (t.checkpoint_every and session.step % t.checkpoint_every == 0)):
                report({"step": session.step, "loss": loss, "lr": session.history[-1]["lr"]}, session)
        session.evaluate()
        return session.summary(time.perf_counter() - start)
    finally:
        session.close()
