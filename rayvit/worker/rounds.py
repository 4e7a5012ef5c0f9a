"""Several runs measured on one worker's process group in interleaved rounds. Knows nothing of Ray.

A sweep compares strategies (or ladder rungs) at one worker count. Measured on separate worker groups,
a ratio mixes the strategies' difference with the placements' and the moments'; here every run is
trained on the same workers, one after another, in rounds whose order rotates (A B C, then B C A,
then C A B, ...), so each run sees every position and the ratio of two runs in one round compares
neighbours in time. Each run of each round is a complete :func:`~rayvit.worker.loop.train` from the
same seed: a fresh model, optimizer and wrap, released (CUDA cache emptied, peaks restarted) before
the next.

A run that raises in its round (an OOM, an unsupported setting, a NaN loss) is recorded as failed with
its error, on every rank alike, and left out of later rounds; the others go on. Ranks agree on that
without a collective (:mod:`rayvit.worker.agree`): a run that fails on some ranks only leaves the others
waiting for them in a collective, and then the failing rank ends the worker group after
``train.failure_timeout_s`` (:class:`~rayvit.worker.agree.GroupAbandoned`) instead of hanging it; a run
after which the ranks had issued different numbers of collectives ends it on every rank at once
(:class:`~rayvit.worker.agree.GroupOutOfStep`). The sweep measures the group's remaining configs in groups
of their own.
"""

from __future__ import annotations

import gc
import traceback
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from rayvit.config_schema import Config
from rayvit.worker.agree import GroupAbandoned, GroupOutOfStep, agree_on_outcome, lost_a_peer, new_series
from rayvit.worker.loop import train
from rayvit.strategies import strategy_class

# Called after each run of each round with (index of the run, round, slot, result dict or None, error).
RoundHook = Callable[[int, int, int, Optional[dict], Optional[str]], None]
# Called on a rank that gives up on the group (its run failed, peers never answered) with (index, round,
# slot, error) before it raises: the only rank that can still say which run failed, and why.
AbandonHook = Callable[[int, int, int, str], None]


def round_order(count: int, rounds: int) -> list[list[int]]:
    """The order of ``count`` runs in each of ``rounds`` rounds: rotated by one each round.

    ``round_order(3, 4)`` is ``[[0, 1, 2], [1, 2, 0], [2, 0, 1], [0, 1, 2]]``: over ``count`` rounds
    every run takes every position once.
    """
    return [[(r + j) % count for j in range(count)] for r in range(rounds)]


def measure_rounds(cfgs: Sequence[Config], rounds: int, *, device: Optional[torch.device] = None,
                   dataset_shards: Optional[dict] = None, on_step: Optional[Callable[..., None]] = None,
                   on_round: Optional[RoundHook] = None,
                   between_rounds: Optional[Callable[[int], None]] = None,
                   on_abandon: Optional[AbandonHook] = None) -> list[dict[str, Any]]:
    """Train every config once per round, in rotated order, on this worker's process group.

    Returns one entry per config: ``{"rounds": [result dict of each round it finished], "places":
    [(round, slot), ...], "error": None or the traceback of the round it failed in}``. ``on_step(session,
    index, round)`` runs after every step (live progress), outside the timed window;
    ``between_rounds(round)`` after each round's last run (on every rank alike). Raises
    :class:`~rayvit.worker.agree.GroupAbandoned` on a rank whose run failed while its peers went on
    (``on_abandon`` first, unless its run failed only because a peer's process is gone: that run is
    measured again, :func:`~rayvit.worker.agree.lost_a_peer`), and
    :class:`~rayvit.worker.agree.GroupOutOfStep` on every rank when a run left their collectives out of
    step (rank 0 first passes the run's outcome to ``on_abandon``, or to ``on_round`` if it finished).
    """
    prepare_process_groups(cfgs, device)
    series = new_series()
    outcomes: list[dict[str, Any]] = [{"rounds": [], "places": [], "error": None} for _ in cfgs]
    for r, order in enumerate(round_order(len(cfgs), rounds)):
        slot = 0
        for index in order:
            if outcomes[index]["error"] is not None:
                continue
            step_hook = (lambda session, i=index, rr=r: on_step(session, i, rr)) if on_step else None
            result, error = None, None
            try:
                result = train(cfgs[index], device=device, dataset_shards=dataset_shards, on_step=step_hook).to_dict()
            except (KeyboardInterrupt, SystemExit):
                raise
            except Exception:  # noqa: BLE001 - one run's failure must not lose the others' rounds
                error = traceback.format_exc()
            release(device)
            try:
                error = agree_on_outcome(error, cfgs[index].train.failure_timeout_s, f"{series}/{r}/{index}")
            except GroupOutOfStep as apart:
                _out_of_step(apart, index, r, slot, result, on_round, on_abandon)
                raise
            except GroupAbandoned as abandoned:
                if on_abandon and not lost_a_peer(error):  # a lost peer ends the group, not this run
                    on_abandon(index, r, slot, str(abandoned))
                raise
            if error is None:
                outcomes[index]["rounds"].append(result)
                outcomes[index]["places"].append((r, slot))
            else:
                outcomes[index]["error"] = error
            if on_round:
                on_round(index, r, slot, result if error is None else None, error)
            slot += 1
        if between_rounds:
            between_rounds(r)
    return outcomes


def _out_of_step(apart: GroupOutOfStep, index: int, r: int, slot: int, result: Optional[dict],
                 on_round: Optional[RoundHook], on_abandon: Optional[AbandonHook]) -> None:
    """Every rank ends the group (:class:`~rayvit.worker.agree.GroupOutOfStep`); the run's agreed outcome
    goes to the driver once, from rank 0: a failure through ``on_abandon`` (which waits until it is
    delivered), unless it was a lost peer's; a run that finished everywhere through ``on_round``."""
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    if apart.verdict is None:
        if on_round:
            on_round(index, r, slot, result, None)
    elif on_abandon and not lost_a_peer(apart.verdict):
        on_abandon(index, r, slot, str(apart))


def release(device: Optional[torch.device]) -> None:
    """Free what the last run held before the next one is built: its objects, the CUDA cache."""
    gc.collect()
    if device is not None and device.type == "cuda":
        torch.cuda.empty_cache()


def prepare_process_groups(cfgs: Sequence[Config], device: Optional[torch.device]) -> None:
    """Before the first round, on every rank: the process groups a strategy of the group makes once per
    process and keeps (FairScale FSDP's), so that every config and round runs beside the same
    communicators, and the same free device memory, as the last. Without a process group (one process,
    each run making its own) there is nothing to share."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    for name in dict.fromkeys(c.parallel.strategy for c in cfgs):
        strategy_class(name).prepare_process_groups(device or torch.device("cpu"))
