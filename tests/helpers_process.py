"""A caller's process, as a public entry point must leave it."""

from __future__ import annotations

import logging
import os
import signal
import sys

import torch


class ProcessSnapshot:
    """What a public entry point must leave as it found it: the environment, every logger's level,
    handlers and propagation, torch's thread count, ``sys.excepthook`` and the signal handlers."""

    def __init__(self) -> None:
        import ray  # noqa: F401 - importing Ray sets RAY_CLIENT_MODE itself: compare after it

        loggers = {"": logging.getLogger(), **{n: lg for n, lg in logging.Logger.manager.loggerDict.items()
                                               if isinstance(lg, logging.Logger)}}
        self.environ = dict(os.environ)
        self.loggers = {n: (lg.level, list(lg.handlers), lg.propagate) for n, lg in loggers.items()}
        self.threads = torch.get_num_threads()
        self.excepthook = sys.excepthook
        self.signals = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    def differences(self) -> list[str]:
        now = ProcessSnapshot()
        found = [f"env {k}: {self.environ.get(k)!r} -> {now.environ.get(k)!r}"
                 for k in set(self.environ) | set(now.environ) if self.environ.get(k) != now.environ.get(k)]
        found += [f"logger {n!r}: {self.loggers[n]} -> {now.loggers.get(n)}" for n in self.loggers
                  if now.loggers.get(n) != self.loggers[n]]
        if now.threads != self.threads:
            found.append(f"torch threads {self.threads} -> {now.threads}")
        if now.excepthook is not self.excepthook:
            found.append("sys.excepthook replaced")
        found += [f"signal {s}" for s in self.signals if now.signals[s] is not self.signals[s]]
        return found
