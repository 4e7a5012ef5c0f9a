"""Checkpoint files of one run: the loop's progress (``meta.json``) and a replicated model's full state
(:func:`rayvit.worker.checkpoint_io.load_checkpoint` reads any strategy's back into one plain model).

What each strategy writes for its model and optimizer is the strategy's business
(:meth:`rayvit.strategies.Strategy.save`): one full copy from rank 0 for replicated strategies
(``state.pt``), a shard per rank for sharded ones (Ray merges the ranks' folders into one checkpoint).
Rank 0 always writes ``meta.json`` with the step counter, the loss history, the schedule and the run's
config, so a restarted run continues its step count and history without a gap.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

META = "meta.json"
FULL_STATE = "state.pt"
# Where FSDP2 keeps its sharded state (torch.distributed.checkpoint's folder) inside a checkpoint.
SHARDED_DIR = "sharded"


def write_meta(directory: str, meta: dict[str, Any]) -> None:
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, META), "w") as f:
        json.dump(meta, f)


def read_meta(directory: str) -> dict[str, Any]:
    with open(os.path.join(directory, META)) as f:
        return json.load(f)


def save_full_state(directory: str, state: dict[str, Any]) -> None:
    os.makedirs(directory, exist_ok=True)
    torch.save(state, os.path.join(directory, FULL_STATE))


def load_full_state(directory: str, device: torch.device) -> dict[str, Any]:
    return torch.load(os.path.join(directory, FULL_STATE), map_location=device, weights_only=False)
