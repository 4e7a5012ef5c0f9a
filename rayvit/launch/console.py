"""A quiet console while Ray works: rayvit's own lines on the console, Ray's in a log file.

Ray forwards every worker's and controller's output to the driver ("Reporting training result ...",
"Setting up process group ...", bucket sizes, ...). A study writes all of it to a log file whose path it
prints, and lets through to the console only warnings and errors, once each (numbers and ids aside).
``--verbose`` shows everything as Ray prints it.
"""

from __future__ import annotations

import logging
import re
import sys
import threading
from pathlib import Path
from typing import Callable, Optional

from rayvit.launch import compat

# What reaches the console from Ray's forwarded output: Python warnings and errors, tracebacks.
_IMPORTANT = re.compile(r"\b(Warning|WARNING|ERROR|Error|Traceback|Exception)\b")
# Ray's own chatter at error level that says nothing about the run: a PreemptionWatcher actor's
# constructor note in core_worker.cc, printed once per run on every Ray 2.5x/2.60 Train controller.
_NOISE = re.compile(r"PreemptionWatcher|core_worker\.cc:\d+\] Actor with class name")
_NUMBERS = re.compile(r"0x[0-9a-fA-F]+|[0-9a-f]{16,}|\d+")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


class WorkerOutput:
    """Ray's forwarded output: every line to ``path``; important lines once each to ``echo``."""

    def __init__(self, path: Path, echo: Callable[[str], None]):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(self.path, "a", buffering=1)
        self.echo = echo
        self.seen: set[str] = set()
        self.lock = threading.Lock()

    def __call__(self, batch: dict) -> None:
        who = batch.get("actor_name") or batch.get("task_name") or "worker"
        prefix = f"({who} pid={batch.get('pid')}, ip={batch.get('ip')})"
        with self.lock:
            for raw in batch.get("lines", []):
                line = _ANSI.sub("", raw)
                self.file.write(f"{prefix} {line}\n")
                if _IMPORTANT.search(line) and not _NOISE.search(line):
                    key = _NUMBERS.sub("#", line)
                    if key not in self.seen:
                        self.seen.add(key)
                        self.echo(f"{prefix} {line}")


def quiet_loggers() -> None:
    """The driver's own Ray, Tune and MLflow loggers at warnings: their INFO lines are Ray's business."""
    import mlflow  # noqa: F401 - it sets its own logger's level when imported: import first, then quieten

    for name in ("ray", "ray.tune", "ray.train", "mlflow", "alembic"):
        logging.getLogger(name).setLevel(logging.WARNING)


def quiet_ray(log_path: Path, verbose: bool = False) -> Optional[Path]:
    """Route Ray's forwarded output to ``log_path`` (and keep Ray's printing with ``verbose``).

    Returns the log file's path, or None when this Ray cannot route its output (it then prints as usual).
    """
    output = WorkerOutput(log_path, lambda line: print(line, file=sys.stderr, flush=True))
    return output.path if compat.route_worker_output(output, keep_ray_printer=verbose) else None
