"""A session's checkpoints: what a run writes (:func:`save_state` to continue from, :func:`save_model`
to keep), how it continues (:func:`resume`), and how anyone reads a checkpoint of any strategy back into
one plain model (:func:`load_checkpoint`).

Replicated strategies' full copy is loaded as is, FSDP2's sharded folder consolidated by
torch.distributed.checkpoint, FairScale FSDP's per-rank flat shards by FairScale's own offline routine
(the file layouts: :mod:`rayvit.training.checkpoint_layout`).
"""

from __future__ import annotations

import glob
import os
import tempfile
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from rayvit.training.checkpoint_layout import FULL_STATE, META, SHARDED_DIR, load_full_state, read_meta, write_meta

if TYPE_CHECKING:
    from rayvit.worker.session import Session


def _progress(session: "Session") -> dict[str, Any]:
    """What rank 0 writes beside any model: steps, restarts, history, evaluations and the run's config."""
    return {"step": session.step, "restarts": session.restarts, "data_fresh_starts": session.data_fresh_starts,
            "history": session.history, "evals": session.evals, "strategy": session.cfg.parallel.strategy,
            "config": session.cfg.to_dict()}


def save_state(session: "Session", directory: str) -> None:
    """Everything a run continues from (a collective: every rank calls it): the strategy's model and
    optimizer in its own layout, and rank 0's progress, schedule and loss scale."""
    session.strategy.save(directory, session.model, session.optimizer)
    if session.rank == 0:
        scaler = session.precision.scaler
        write_meta(directory, {**_progress(session), "scheduler": session.scheduler.state_dict(),
                               "loss_scale": scaler.scale if scaler else None})


def save_model(session: "Session", directory: str) -> None:
    """The trained model alone, for :func:`load_checkpoint` (a collective: every rank calls it): whole
    from rank 0, or in a sharded strategy's own layout (:meth:`rayvit.strategies.Strategy.save_model`).
    No optimizer state, so no run resumes from it (``resumable`` false in its ``meta.json``)."""
    session.strategy.save_model(directory, session.model)
    if session.rank == 0:
        write_meta(directory, {**_progress(session), "resumable": False})


def resumable(directory: str) -> bool:
    """Whether ``directory`` holds a checkpoint a run continues from (not a model alone, not a summary)."""
    return os.path.isfile(os.path.join(directory, META)) and read_meta(directory).get("resumable", True)


def resume(session: "Session", directory: str) -> None:
    """Continue ``session`` from a :func:`save_state` checkpoint: its weights, optimizer, schedule, loss
    scale, steps and history, and the input where it left off."""
    meta = read_meta(directory)
    if meta["strategy"] != session.cfg.parallel.strategy:
        raise ValueError(f"checkpoint in {directory} was written by strategy {meta['strategy']}, "
                         f"not {session.cfg.parallel.strategy}")
    session.strategy.load(directory, session.model, session.optimizer)
    session.scheduler.load_state_dict(meta["scheduler"])
    if session.precision.scaler is not None and meta["loss_scale"]:
        session.precision.scaler.scale = meta["loss_scale"]
    session.step, session.history, session.evals = meta["step"], meta["history"], meta["evals"]
    session.restarts = meta["restarts"] + 1
    session.data_fresh_starts = meta.get("data_fresh_starts", 0)
    if dist.is_initialized() and session.world_size > 1:
        dist.barrier()
    # The input continues where the checkpoint left it, by arithmetic on the step: drawing the batches
    # before it would decode each again. Ray Data's order cannot be replayed: that input starts afresh (a
    # new pass over its shard), and the run says so (data_fresh_starts).
    data = session.data
    if data.train_from is not None:
        data.close()
        data.train = data.train_from(session.step)
    else:
        session.data_fresh_starts += 1


@dataclass
class Checkpointed:
    """What :func:`load_checkpoint` read: the model (fp32, eval mode), the optimizer state and progress."""

    model: nn.Module
    config: Any                          # the run's rayvit Config
    step: int
    # As the strategy saved it: a torch optimizer state_dict (replicated strategies: the whole; FSDP2:
    # keyed by parameter name, as torch.distributed.checkpoint's get_state_dict gives it); FairScale FSDP:
    # one flat-shard state_dict per rank, in rank order. None when the checkpoint holds none.
    optimizer_state: Any = None
    history: list = field(default_factory=list)
    evals: list = field(default_factory=list)


def load_checkpoint(path: Any, *, cfg: Any = None, device: str | torch.device = "cpu") -> Checkpointed:
    """The model (and optimizer state) of a checkpoint rayvit wrote, whatever the strategy: a folder, or a
    ``ray.train.Checkpoint`` (``result.checkpoint``). ``cfg``: the run's config, for checkpoints older than
    the config in their ``meta.json``.

    Replicated strategies' full copy is loaded as is (under ``precision.mode=mixed`` the fp32 master
    weights replace the half ones); FSDP2's sharded folder is consolidated by torch.distributed.checkpoint;
    FairScale FSDP's per-rank flat shards by FairScale's ``consolidate_shard_weights``.
    """
    if hasattr(path, "as_directory"):
        with path.as_directory() as folder:
            return load_checkpoint(folder, cfg=cfg, device=device)
    from rayvit.config import as_config
    from rayvit.errors import ConfigError
    from rayvit.models import build_model

    directory = os.fspath(path)
    if not os.path.isfile(os.path.join(directory, META)):
        raise ConfigError(f"{directory} holds no rayvit model checkpoint (no {META}): a make_trainer() run's "
                          "final checkpoint holds its model, and with train.checkpoint_every > 0 every N "
                          "steps' does; rayvit.trainer.fit() keeps only what train.checkpoint_every writes")
    meta = read_meta(directory)
    if cfg is None and "config" not in meta:
        raise ConfigError(f"{directory}/{META} was written before checkpoints recorded their config: pass "
                          "cfg=, the run's config")
    cfg = as_config(cfg if cfg is not None else meta["config"])
    model = build_model(cfg.model)
    model_state, optim_state = _read_states(directory)
    model.load_state_dict(model_state)          # copies into the fp32 model, whatever dtype was saved
    model.to(device).eval()
    return Checkpointed(model=model, config=cfg, step=meta["step"], optimizer_state=optim_state,
                        history=meta.get("history", []), evals=meta.get("evals", []))


def _read_states(directory: str) -> tuple[dict[str, torch.Tensor], Any]:
    """(full model state dict, optimizer state) of whichever layout ``directory`` holds."""
    if os.path.isfile(os.path.join(directory, FULL_STATE)):
        state = load_full_state(directory, torch.device("cpu"))
        # ``mixed``: the optimizer stepped the fp32 masters of the half parameters (saved by name).
        return {**state["model"], **(state.get("masters") or {})}, state.get("optim")
    sharded = os.path.join(directory, SHARDED_DIR)
    if os.path.isdir(sharded):
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        with tempfile.TemporaryDirectory() as tmp:
            dcp_to_torch_save(sharded, os.path.join(tmp, "full.pt"))
            state = torch.load(os.path.join(tmp, "full.pt"), map_location="cpu", weights_only=False)
        return state["model"], state.get("optim")
    ranks = sorted(glob.glob(os.path.join(directory, "rank*.pt")),
                   key=lambda f: int(os.path.basename(f)[4:-3]))
    if ranks:
        from fairscale.nn import FullyShardedDataParallel

        shards = [torch.load(f, map_location="cpu", weights_only=False) for f in ranks]
        if any("metadata" not in s for s in shards):
            raise ValueError(f"{directory}: FairScale FSDP shards without their metadata (written before "
                             "checkpoints kept it) cannot be consolidated")
        full = FullyShardedDataParallel.consolidate_shard_weights([s["model"] for s in shards],
                                                                  [s["metadata"] for s in shards])
        return full, [s["optim"] for s in shards] if all("optim" in s for s in shards) else None
    raise ValueError(f"{directory} has {META} but no model state ({FULL_STATE}, {SHARDED_DIR}/ or rank*.pt)")
