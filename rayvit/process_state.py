"""What a public entry point may change in its caller's process, put back when it returns.

rayvit's entry points (``fit``, ``fit_group``, a rayvit trainer's ``fit()``, ``train``, sweeps, searches,
``compare``) set what their run needs: Ray Train settings that only environment variables reach, a quiet
console, the torch thread count a worker was given, Ray itself when the caller had none. Inside
:func:`kept` they may; when the outermost such call returns, the process is put back as it was found:

- ``os.environ``, exactly (keys added during the call removed, changed ones restored);
- the level, handlers and ``propagate`` flag of every logger that existed before the call;
- torch's intra-op thread count (when torch was imported before the call), ``sys.excepthook`` (which
  ``torch.distributed.init_process_group`` wraps) and the Python-level signal handlers (Ray Train's
  ``fit()`` installs a SIGINT handler and leaves it);
- what was registered with :func:`on_exit` is undone first, last registered first: a Ray instance
  started inside the call is shut down (:mod:`rayvit.launch.connect`), Ray's worker output routed back.

Calls nest and may run in several threads at once (a Tune trial beside a plain fit): only the outermost
entry takes the snapshot and only the last one to leave restores it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, TypeVar

__all__ = ["kept", "keeps_process_state", "on_exit", "ProcessState"]

F = TypeVar("F", bound=Callable[..., Any])

# Signals a Python handler can be installed for (SIGKILL and SIGSTOP cannot be caught).
_CATCHABLE = tuple(s for s in signal.valid_signals() if s not in (signal.SIGKILL, signal.SIGSTOP))


@dataclass
class ProcessState:
    """A snapshot of what rayvit may change in a process (see the module docstring)."""

    environ: dict[str, str]
    loggers: dict[str, tuple[int, list, bool]]
    excepthook: Any
    torch_threads: Optional[int]
    signals: dict[int, Any] = field(default_factory=dict)

    @classmethod
    def capture(cls) -> "ProcessState":
        torch = sys.modules.get("torch")
        main = threading.current_thread() is threading.main_thread()
        return cls(environ=dict(os.environ), loggers=_loggers(), excepthook=sys.excepthook,
                   torch_threads=torch.get_num_threads() if torch is not None else None,
                   signals={s: h for s in _CATCHABLE if (h := _handler(s)) is not None} if main else {})

    def restore(self) -> None:
        for key in set(os.environ) - set(self.environ):
            del os.environ[key]
        for key, value in self.environ.items():
            if os.environ.get(key) != value:
                os.environ[key] = value
        for name, (level, handlers, propagate) in self.loggers.items():
            logger = logging.getLogger(name) if name else logging.getLogger()
            logger.setLevel(level)
            logger.handlers[:] = handlers
            logger.propagate = propagate
        sys.excepthook = self.excepthook
        torch = sys.modules.get("torch")
        if torch is not None and self.torch_threads is not None and torch.get_num_threads() != self.torch_threads:
            torch.set_num_threads(self.torch_threads)
        if self.signals and threading.current_thread() is threading.main_thread():
            for sig, handler in self.signals.items():
                if _handler(sig) is not handler:
                    signal.signal(sig, handler)


def _handler(sig: int) -> Any:
    try:
        return signal.getsignal(sig)
    except (ValueError, OSError):
        return None


def _loggers() -> dict[str, tuple[int, list, bool]]:
    found = {"": logging.getLogger()}
    found.update({name: logger for name, logger in logging.Logger.manager.loggerDict.items()
                  if isinstance(logger, logging.Logger)})
    return {name: (logger.level, list(logger.handlers), logger.propagate) for name, logger in found.items()}


class _Scope:
    """The process-wide count of entry points inside :func:`kept` and the snapshot of the outermost."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.depth = 0
        self.snapshot: Optional[ProcessState] = None
        self.undo: list[Callable[[], None]] = []


_SCOPE = _Scope()


def on_exit(undo: Callable[[], None]) -> bool:
    """Run ``undo`` when the outermost :func:`kept` call returns, before the snapshot is restored (last
    registered first). Outside any such call nothing is registered and False is returned: the caller
    asked for the change itself."""
    with _SCOPE.lock:
        if _SCOPE.depth:
            _SCOPE.undo.append(undo)
            return True
        return False


@contextlib.contextmanager
def kept() -> Iterator[None]:
    """Leave the process as it was found when the outermost call inside this returns (module docstring)."""
    with _SCOPE.lock:
        if _SCOPE.depth == 0:
            _SCOPE.snapshot, _SCOPE.undo = ProcessState.capture(), []
        _SCOPE.depth += 1
    try:
        yield
    finally:
        with _SCOPE.lock:
            _SCOPE.depth -= 1
            if _SCOPE.depth == 0:
                _leave(_SCOPE)


def _leave(scope: _Scope) -> None:
    undo, scope.undo = scope.undo, []
    try:
        for step in reversed(undo):
            step()
    finally:
        scope.snapshot.restore()
        scope.snapshot = None


def keeps_process_state(fn: F) -> F:
    """Decorate a public entry point so that it runs inside :func:`kept`."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with kept():
            return fn(*args, **kwargs)
    return wrapper  # type: ignore[return-value]
