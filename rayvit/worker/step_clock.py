"""The clock of one attempt's training steps: each step's time with the device synchronised, warm-up and
timed steps apart, each timed step's wait for its batch (steady, or at an epoch's start), and the NVML
sampler whose readings count during timed steps only (CUDA; :mod:`rayvit.worker.sampler`)."""

from __future__ import annotations

import time
from typing import Optional

import torch

from rayvit.training import hardware
from rayvit.worker.sampler import Sampler, nvml_sampler


class StepClock:
    """Times the steps of one attempt (a restart starts a new one): ``start()`` before a step, ``stop()``
    after it, ``record()`` once its figures are in."""

    def __init__(self, device: torch.device, warmup_steps: int) -> None:
        self.device, self.warmup_steps = device, warmup_steps
        self.steps = 0                           # steps timed by this clock: this attempt's
        self.step_times: list[float] = []        # this attempt's timed (post-warm-up) steps
        self.data_wait_times: list[float] = []   # of those, the seconds each waited for its batch (steady)
        # Of those, the seconds waited by a step whose batch began an epoch (a new Ray Data execution), else
        # 0.0: booked here instead of in data_wait_times, so that the steady wait is not a mean of stalls.
        self.epoch_start_waits: list[float] = []
        self.warmup_step_times: list[float] = []  # this attempt's warm-up steps (model.compile compiles there)
        # NVML readings during this attempt's timed steps (CUDA only): created with the first timed step.
        self.sampler: Optional[Sampler] = None
        self._sampler_tried = False

    @property
    def timing(self) -> bool:
        """Whether the next step is a timed one (past the warm-up)."""
        return self.steps >= self.warmup_steps

    def start(self) -> float:
        """The start of a step, the device synchronised; the sampler's readings count from here when timed."""
        if self.timing:
            self._sampling(True)                 # outside the clock
        hardware.synchronize(self.device)
        return time.perf_counter()

    def stop(self, start: float) -> float:
        """The seconds since ``start``, the device synchronised; the sampler's readings stop counting."""
        hardware.synchronize(self.device)
        elapsed = time.perf_counter() - start
        if self.timing:
            self._sampling(False)
        return elapsed

    def record(self, elapsed: float, waited: float, starts_epoch: bool) -> None:
        """Book a step's time and its wait for the batch (as an epoch start's or a steady wait)."""
        if self.timing:
            self.step_times.append(elapsed)
            self.data_wait_times.append(0.0 if starts_epoch else waited)
            self.epoch_start_waits.append(waited if starts_epoch else 0.0)
        else:
            self.warmup_step_times.append(elapsed)
        self.steps += 1

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

    def readings(self) -> dict:
        """The sampler's readings over the timed steps (it stops), or {} without one."""
        return self.sampler.stop() if self.sampler is not None else {}

    def close(self) -> None:
        if self.sampler is not None:
            self.sampler.stop()
