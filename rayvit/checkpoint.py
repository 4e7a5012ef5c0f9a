"""Save and restore a training ``Session`` (model, optimizer, schedule, loss scale, history).

FSDP2 state is sharded: every rank writes its own shard with ``torch.distributed.checkpoint`` into the same
folder (Ray merges the ranks' folders into one checkpoint). Replicated strategies write one full copy
from rank 0. Either way rank 0 writes ``meta.json`` with the step counter and the loss history, so a
restarted run continues its step count and history without a gap.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from rayvit.parallel import unwrap

if TYPE_CHECKING:
    from rayvit.train import Session

META = "meta.json"
FULL_STATE = "state.pt"
SHARDED_DIR = "sharded"


def save(session: "Session", directory: str) -> None:
    os.makedirs(directory, exist_ok=True)
    strategy = session.cfg.parallel.strategy
    if strategy == "fsdp":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(session.model, session.optimizer)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=os.path.join(directory, SHARDED_DIR))
    elif strategy == "fairscale_fsdp":
        torch.save({"model": session.model.local_state_dict(), "optim": session.optimizer.state_dict()},
                   os.path.join(directory, f"rank{session.rank}.pt"))
    else:
        if strategy == "fairscale_oss":
            session.optimizer.consolidate_state_dict(recipient_rank=0)   # collective: every rank joins
        if session.rank == 0:
            state = {"model": unwrap(session.model).state_dict(), "optim": session.optimizer.state_dict()}
            if session.masters is not None:
                state["masters"] = [m.detach() for m in session.masters.masters]
            torch.save(state, os.path.join(directory, FULL_STATE))
    if session.rank == 0:
        meta = {"step": session.step, "restarts": session.restarts, "history": session.history,
                "evals": session.evals, "scheduler": session.scheduler.state_dict(),
                "loss_scale": session.precision.scaler.scale if session.precision.scaler else None,
                "strategy": strategy}
        with open(os.path.join(directory, META), "w") as f:
            json.dump(meta, f)


def load(session: "Session", directory: str) -> None:
    with open(os.path.join(directory, META)) as f:
        meta = json.load(f)
    strategy = session.cfg.parallel.strategy
    if meta["strategy"] != strategy:
        raise ValueError(f"checkpoint in {directory} was written by strategy {meta['strategy']}, "
                         f"not {strategy}")
    if strategy == "fsdp":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_state, optim_state = get_state_dict(session.model, session.optimizer)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=os.path.join(directory, SHARDED_DIR))
        set_state_dict(session.model, session.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
    elif strategy == "fairscale_fsdp":
        state = torch.load(os.path.join(directory, f"rank{session.rank}.pt"), map_location=session.device)
        session.model.load_local_state_dict(state["model"])
        session.optimizer.load_state_dict(state["optim"])
    else:
        state = torch.load(os.path.join(directory, FULL_STATE), map_location=session.device, weights_only=False)
        unwrap(session.model).load_state_dict(state["model"])
        session.optimizer.load_state_dict(state["optim"])
        if session.masters is not None:
            with torch.no_grad():
                for master, saved in zip(session.masters.masters, state["masters"]):
                    master.copy_(saved)
    session.step = meta["step"]
    session.restarts = meta["restarts"]
    session.history = meta["history"]
    session.evals = meta["evals"]
    session.scheduler.load_state_dict(meta["scheduler"])
    if session.precision.scaler is not None and meta["loss_scale"]:
        session.precision.scaler.scale = meta["loss_scale"]
    if dist.is_initialized() and session.world_size > 1:
        dist.barrier()
