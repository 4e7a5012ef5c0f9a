"""Ranks that agree on how a run ended, without trusting the next collective to line them up.

A rank that fails on its own (a NaN loss, an out-of-memory error at the margin: FSDP2's rank 0 holds the
largest shard) must not enter a collective its peers are not in: NCCL raises nothing, gloo neither, and
every rank waits for the process group's timeout (Ray Train sets 30 minutes). So:

- what every rank can check at the same point of every step (the loss is finite) is a collective of
  its own: :func:`nonfinite_ranks`, after the step's clock has stopped;
- any other error is agreed through the process group's key-value store, which needs no collective:
  :func:`agree_on_outcome` posts this rank's verdict and waits for the others'. A rank that failed
  waits a short while; peers that do not answer by then are waiting for it in a collective, and it
  raises :class:`GroupAbandoned`, which ends the worker group (Ray Train tears it down) so that the
  sweep measures what is left in groups of its own;
- ranks that all answer may still have issued different numbers of collectives (under NCCL a rank's
  host runs ahead of its peers: it can issue the next all-gather, then fail): each posts its count per
  process group with its verdict (:func:`collective_counts`), and where they differ every rank raises
  :class:`GroupOutOfStep`, ending the group the same way, since the next run's first collective would
  meet the stale one.
"""

from __future__ import annotations

import json
import math
import time
from typing import Optional

import torch
import torch.distributed as dist

from rayvit.errors import GroupAbandoned, GroupOutOfStep

# A rank whose run finished has passed every collective of it, so its peers are on their way (closing
# the run, collecting garbage) or failed after the last collective and already posted: it may wait long.
FINISHED_WAIT_S = 600.0
# Store values are kept small: the end of a traceback says what failed.
MAX_ERROR_CHARS = 6000
_KEY_PREFIX = "rayvit/outcome"
# What a collective raises on the ranks left when a peer's process is gone (gloo's TCP pair, NCCL's
# async error handling): their run did not fail, their group did.
PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "remote process exited", "Broken pipe")


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def nonfinite_ranks(value: float, device: torch.device) -> list[int]:
    """The ranks whose ``value`` (this step's loss) is NaN or infinite, known to every rank alike.

    A collective: every rank calls it at the same point of every step. One element per rank, so the
    verdict names the ranks; at one rank no collective runs.
    """
    rank, size = _world()
    if size == 1:
        return [] if math.isfinite(value) else [0]
    flags = torch.zeros(size, dtype=torch.float32, device=device)
    if not math.isfinite(value):
        flags[rank] = 1.0
    dist.all_reduce(flags)
    return [r for r, flag in enumerate(flags.tolist()) if flag]


def new_series() -> str:
    """A name for a series of agreements (one worker group's rounds), the same on every rank: how many
    series this rank has begun on the process group's store, every rank beginning the same ones. Kept in
    the store, it starts afresh with every process group, whatever a reused process did before."""
    rank, size = _world()
    if size == 1:
        return "local"
    return str(dist.distributed_c10d._get_default_store().add(f"{_KEY_PREFIX}/series/{rank}", 1))


def collective_counts() -> dict[str, int]:
    """How many collectives this rank has issued on each process group it belongs to, by group name (the
    same on every rank): torch's sequence number of the group. gloo and NCCL both count a collective when
    the host issues it, not when it completes (an async one a peer never joins counts at once); gloo
    counts point-to-point sends and receives too, NCCL apart. A group whose backend keeps no count is left
    out. (Read in torch 2.13: ``ProcessGroupGloo::getSequenceNumberForGroup`` returns ``seq_``, which every
    collective and send/receive takes as it is enqueued; ``ProcessGroupNCCL``'s returns ``seqCollective_``,
    advanced as a collective or coalesced group is launched; ``_world.pg_map`` holds the groups this rank
    belongs to.)"""
    from torch.distributed.distributed_c10d import _world

    counts = {}
    for group in list(_world.pg_map):
        try:
            counts[_world.pg_names[group]] = int(group._get_sequence_number_for_group())
        except (RuntimeError, AttributeError, KeyError):
            continue
    return counts


def agree_on_outcome(error: Optional[str], timeout_s: float, run: str) -> Optional[str]:
    """Every rank's verdict on the run just ended: None when it finished on every rank, else the first
    failing rank's error, the same text on every rank.

    ``error`` is this rank's traceback (None: it finished); ``run`` names the run alike on every rank
    (its :func:`new_series` and place). A rank that failed waits ``timeout_s`` for its peers' verdicts,
    a rank that finished up to :data:`FINISHED_WAIT_S`; when some have not answered by then it raises
    :class:`GroupAbandoned` (with its own error) instead of entering the next run. When all answered but
    their :func:`collective_counts` differ, every rank raises :class:`GroupOutOfStep` with the verdict.
    """
    rank, size = _world()
    if size == 1:
        return error
    store = dist.distributed_c10d._get_default_store()
    keys = [f"{_KEY_PREFIX}/{run}/{r}" for r in range(size)]
    posted = {"error": error[-MAX_ERROR_CHARS:] if error else None, "collectives": collective_counts()}
    store.set(keys[rank], json.dumps(posted))
    wait_s = timeout_s if error else max(timeout_s, FINISHED_WAIT_S)
    missing = _wait_for(store, keys, wait_s)
    if missing:
        who = ", ".join(str(r) for r in missing)
        raise GroupAbandoned(
            f"rank {who} did not answer within {wait_s:g} s after the run ended on rank {rank}"
            + (" (it is waiting for this rank in a collective): the worker group ends here so that "
               f"the sweep measures what is left (train.failure_timeout_s={timeout_s:g})" if error else "")
            + (f"; the run failed on rank {rank}:\n{error[-MAX_ERROR_CHARS:]}" if error else ""))
    answers = [json.loads(store.get(key).decode()) for key in keys]
    verdict = next((f"on rank {r}:\n{a['error']}" for r, a in enumerate(answers) if a["error"] is not None), None)
    apart = out_of_step([a["collectives"] for a in answers])
    if apart:
        raise GroupOutOfStep(
            f"the ranks' collectives are out of step after the run ({apart}): the next run's collectives "
            "would meet a stale one, so the worker group ends here and the sweep measures what is left in "
            "groups of their own" + (f"; the run failed {verdict}" if verdict else ""), verdict)
    return verdict


def out_of_step(counts: list[dict[str, int]]) -> str:
    """Where ranks' :func:`collective_counts` (one dict per rank) differ, e.g. ``process group '0': rank 0
    issued 33 collectives, rank 1 34``; empty when every group's members agree."""
    apart = []
    for name in dict.fromkeys(n for c in counts for n in c):
        issued = {r: c[name] for r, c in enumerate(counts) if name in c}
        if len(set(issued.values())) > 1:
            (first, n), *rest = issued.items()
            apart.append(f"process group {name!r}: rank {first} issued {n} collectives, "
                         + ", ".join(f"rank {r} {m}" for r, m in rest))
    return "; ".join(apart)


def lost_a_peer(error: Optional[str]) -> bool:
    """Whether this rank's error is a peer's disappearance (a lost worker or node) rather than its run's
    own failure: the run is then measured again, not recorded as failed."""
    return error is not None and any(marker in error for marker in PEER_LOST)


def _wait_for(store: dist.Store, keys: list[str], timeout_s: float) -> list[int]:
    """Poll until every key is set or ``timeout_s`` passes; the ranks whose key is missing. (Polled rather
    than ``store.wait``: its timeout and error differ between the TCP and file stores.)"""
    deadline = time.monotonic() + timeout_s
    pause = 0.005
    while not store.check(keys):
        if time.monotonic() >= deadline:
            return [r for r, key in enumerate(keys) if not store.check([key])]
        time.sleep(pause)
        pause = min(pause * 2, 0.2)
    return []
