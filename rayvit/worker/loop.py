"""One worker's training loop, read top to bottom: build a session, continue from a checkpoint if asked,
then step, evaluate and report until ``train.steps``; evaluate once more and sum the run up. Knows nothing
of Ray: the Ray layer (``rayvit.launch``) only adds reporting and checkpoint transport through its hook.

The pieces: :class:`~rayvit.worker.session.Session` (what a worker builds, one step, the evaluation),
:mod:`rayvit.worker.run_figures` (the figures, gathered across ranks), :mod:`rayvit.worker.checkpoint_io`
(checkpoints) and :mod:`rayvit.worker.faults` (the test-only fault injection, a hook before each step).
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import torch

from rayvit import process_state
from rayvit.config import as_config
from rayvit.config_schema import Config
from rayvit.results import RunResult
from rayvit.worker import checkpoint_io, run_figures
from rayvit.worker.faults import fault_injector
from rayvit.worker.session import Session

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
    t = cfg.train
    session = Session(cfg, device, dataset_shards=dataset_shards)
    before_step = fault_injector(t)                # train.fail_at_step (tests, the GPU check); else None
    try:
        if resume_from:
            checkpoint_io.resume(session, resume_from)
        while session.step < t.steps:
            session.clear_grads()
            if before_step:
                before_step(session)
            session.train_step()
            if on_step:
                on_step(session)
            if session.step == t.steps:
                break                              # the last step reports after the final evaluation
            if t.eval_every and session.step % t.eval_every == 0:
                session.evaluate()
            if report and (session.step % t.report_every == 0
                           or (t.checkpoint_every and session.step % t.checkpoint_every == 0)):
                report(run_figures.running(session), session)
                session.align_ranks()
        session.evaluate()
        result = run_figures.summary(session, time.perf_counter() - start)
        if report:
            report({**run_figures.running(session), **RunResult.of_rounds([result]).report_metrics(), "final": True},
                   session)
        return result
    finally:
        session.close()
