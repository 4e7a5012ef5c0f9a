"""Two gloo ranks in forked processes (no Ray), and spies on what they send."""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# The ranks are forked from a forkserver that has imported torch and rayvit's worker once (multiprocessing
# starts it at the first call and keeps it for the session): a fresh interpreter per call (``spawn``)
# spent about a second per rank importing them. Each rank is still a new process of its own, forked from
# a server that never ran anything, so no call sees another's state (or this process's: a server is no
# fork of pytest). The server's sys.path, working directory and environment are those of its start; each
# rank takes this process's current ones before it unpickles its function, as a spawned rank would.
_PRELOAD = ["torch", "torch.distributed", "rayvit.config", "rayvit.worker", "helpers_two_ranks", "helpers_data",
            "helpers_results", "helpers_projection", "helpers_fairscale"]


def _entry(rank: int, folder: str, state: tuple, payload: bytes, timeout_s: float | None = None) -> None:
    import pickle
    import sys
    from datetime import timedelta

    path, cwd, environ = state
    sys.path[:] = path
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(environ)
    fn, args = pickle.loads(payload)
    timeout = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=2, **timeout)
    try:
        torch.save(fn(rank, *args), f"{folder}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def two_ranks(tmp_path, fn, *args, timeout_s: float | None = None, join: bool = True) -> list:
    """Run ``fn(rank, *args)`` on two gloo ranks (new processes, no Ray); their return values, rank 0
    first. ``fn`` must be importable by name (a module-level function). ``timeout_s``: the process group's
    timeout (a collective one rank never joins fails after it; default torch's 30 minutes).
    ``join=False``: the two processes, started (a rank that dies does not end the other; each rank's
    return value is in ``tmp_path / f"rank{rank}.pt"`` once it has returned)."""
    import multiprocessing
    import pickle
    import sys

    multiprocessing.get_context("forkserver").set_forkserver_preload(_PRELOAD)
    state = (list(sys.path), os.getcwd(), dict(os.environ))
    context = mp.start_processes(_entry, args=(str(tmp_path), state, pickle.dumps((fn, args)), timeout_s),
                                 nprocs=2, join=join, start_method="forkserver")
    if not join:
        return context.processes
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]


@contextmanager
def spied(record: Callable[[str, tuple, dict], None], *names: str, module=dist):
    """While inside: each function ``names`` of ``module`` (torch.distributed) first calls
    ``record(name, args, kwargs)``, then does its work."""
    real = {name: getattr(module, name) for name in names}

    def spy(*args, _name, **kwargs):
        record(_name, args, kwargs)
        return real[_name](*args, **kwargs)

    for name in names:
        setattr(module, name, lambda *a, _n=name, **k: spy(*a, _name=_n, **k))
    try:
        yield
    finally:
        for name, fn in real.items():
            setattr(module, name, fn)


@contextmanager
def flag_apart(sent: list, flags: list):
    """While inside, what :func:`rayvit.worker.agree.nonfinite_ranks` sends (one float per rank after every
    step, outside its clock) is moved from the end of ``sent`` (where a spy records a step's collectives)
    to ``flags``, one list per step: a step's own collectives are what the projection counts."""
    from rayvit.worker import agree

    real = agree.nonfinite_ranks

    def apart(value, device):
        before = len(sent)
        verdict = real(value, device)
        flags.append(sent[before:])
        del sent[before:]
        return verdict

    agree.nonfinite_ranks = apart
    try:
        yield
    finally:
        agree.nonfinite_ranks = real
