"""Several runs measured on one worker's process group in interleaved rounds. Knows nothing of Ray.

A sweep compares strategies (or ladder rungs) at one worker count. Measured on separate worker groups,
a ratio mixes the strategies' difference with the placements' and the moments'; here every run is
trained on the same workers, one after another, in rounds whose order rotates (A B C, then B C A,
then C A B, ...), so each run sees every position and the ratio of two runs in one round compares
neighbours in time. Each run of each round is a complete :func:`~rayvit.worker.loop.train` from the
same seed: a fresh model, optimizer and wrap, released (CUDA cache emptied, peaks restarted) before
the next.

A run that raises in its round (an OOM, an unsupported setting) is recorded as failed with its error,
on every rank alike, and left out of later rounds; the others go on.
"""

from __future__ import annotations

import gc
import traceback
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from rayvit.config import Config
from rayvit.worker.loop import train

# Called after each run of each round with (index of the run, round, slot, result dict or None, error).
RoundHook = Callable[[int, int, int, Optional[dict], Optional[str]], None]


def round_order(count: int, rounds: int) -> list[list[int]]:
    """The order of ``count`` runs in each of ``rounds`` rounds: rotated by one each round.

    ``round_order(3, 4)`` is ``[[0, 1, 2], [1, 2, 0], [2, 0, 1], [0, 1, 2]]``: over ``count`` rounds
    every run takes every position once.
    """
    return [[(r + j) % count for j in range(count)] for r in range(rounds)]


def measure_rounds(cfgs: Sequence[Config], rounds: int, *, device: Optional[torch.device] = None,
                   dataset_shards: Optional[dict] = None, on_step: Optional[Callable[..., None]] = None,
                   on_round: Optional[RoundHook] = None,
                   between_rounds: Optional[Callable[[int], None]] = None) -> list[dict[str, Any]]:
    """Train every config once per round, in rotated order, on this worker's process group.

    Returns one entry per config: ``{"rounds": [result dict of each round it finished], "places":
    [(round, slot), ...], "error": None or the traceback of the round it failed in}``. ``on_step(session,
    index, round)`` runs after every step (live progress), outside the timed window;
    ``between_rounds(round)`` after each round's last run (on every rank alike).
    """
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
            error = _agree(error)
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


def release(device: Optional[torch.device]) -> None:
    """Free what the last run held before the next one is built: its objects, the CUDA cache."""
    gc.collect()
    if device is not None and device.type == "cuda":
        torch.cuda.empty_cache()


def _agree(error: Optional[str]) -> Optional[str]:
    """Every rank's verdict on the run just finished: failed if it failed on any rank, with the first
    failing rank's traceback.

    Without this a rank that failed would skip to the next run while the others still wait for it in a
    collective of this one; with it they all move on together, and record the same outcome.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return error
    errors: list[Optional[str]] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error[-6000:] if error else None)
    for rank, text in enumerate(errors):
        if text:
            return text if rank == dist.get_rank() else f"on rank {rank}:\n{text}"
    return None
