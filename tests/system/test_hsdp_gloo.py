"""HSDP on two gloo ranks (no Ray): its 2-D mesh as a 2x1 (two replicas of one-rank shards) and a 1x2 (one
replica sharded over both), against DDP and FSDP after the same steps; the collectives its cost half counts."""

from __future__ import annotations

import pytest
import torch

from rayvit.config import load_config

from helpers_two_ranks import flag_apart, spied, two_ranks

TINY = ["train.batch_size=4", "model.depth=2", "optim.lr=0.01", "optim.grad_clip=1.0"]
RUNS = {"ddp": ["parallel.strategy=ddp"], "fsdp": ["parallel.strategy=fsdp"],
        "hsdp 2x1": ["parallel.strategy=hsdp", "parallel.shard_size=1"],
        "hsdp 1x2": ["parallel.strategy=hsdp", "parallel.shard_size=2"],
        "hsdp auto": ["parallel.strategy=hsdp"]}
STEPS = 3


def _full(value: torch.Tensor) -> torch.Tensor:
    return (value.full_tensor() if hasattr(value, "full_tensor") else value).detach().float().clone()


def _runs(rank: int, extra: list[str]) -> dict:
    """Per run: the losses, the whole model's parameters after the steps, the mesh and its placements."""
    from rayvit.worker import Session

    out = {}
    for name, overrides in RUNS.items():
        session = Session(load_config(overrides=TINY + overrides + extra))
        try:
            losses = []
            for _ in range(STEPS):
                session.clear_grads()
                losses.append(session.train_step())
            params = {k: _full(v) for k, v in session.strategy.unwrap(session.model).named_parameters()}
            first = next(session.model.parameters())
            mesh = tuple(first.device_mesh.shape) if hasattr(first, "device_mesh") else None
            placements = [type(p).__name__ for p in first.placements] if hasattr(first, "placements") else None
        finally:
            session.close()
        out[name] = {"losses": losses, "params": params, "mesh": mesh, "placements": placements}
    return out


NAMES = {"all_reduce": "all_reduce", "all_gather_single": "all_gather", "reduce_scatter_single": "reduce_scatter"}


def _collectives(rank: int) -> dict:
    """Per shard size: (kind, bytes) of every collective of the third step (the finite-loss flag apart)."""
    from rayvit.worker import Session

    seen = {}
    for shard in (1, 2):
        session = Session(load_config(overrides=TINY[:-1] + ["parallel.strategy=hsdp", f"parallel.shard_size={shard}",
                                                             "precision.mode=mixed"]))
        sent: list = []

        def record(name, args, kwargs, _sent=sent):
            # all_reduce(tensor), all_gather_single(output, input), reduce_scatter_single(output, input)
            tensor = (kwargs["input"] if "input" in kwargs else args[1]) if name == "reduce_scatter_single" \
                else args[0]
            # FSDP2 still calls the collective of a mesh dimension of one rank (it moves nothing): left out.
            if torch.distributed.get_world_size(kwargs.get("group")) > 1:
                _sent.append((NAMES[name], tensor.numel() * tensor.element_size()))

        try:
            for _ in range(3):
                sent.clear()
                with spied(record, *NAMES), flag_apart(sent, []):
                    session.clear_grads()
                    session.train_step()
        finally:
            session.close()
        seen[shard] = sorted(sent)
    return seen


def _largest_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize("extra", [[], ["precision.mode=mixed"]], ids=["fp32", "mixed"])
def test_hsdp_as_2x1_is_ddp_and_as_1x2_is_fsdp(tmp_path, extra):
    ranks = two_ranks(tmp_path, _runs, extra)
    for run in ranks:
        assert run["hsdp 2x1"]["mesh"] == (2, 1) and run["hsdp 1x2"]["mesh"] == (1, 2)
        assert run["hsdp 2x1"]["placements"] == ["Replicate", "Shard"]
        # No shard_size and no LOCAL_WORLD_SIZE: both ranks are one host's, one shard group.
        assert run["hsdp auto"]["mesh"] == (1, 2)
        twins = [("hsdp 1x2", "fsdp"), ("hsdp auto", "fsdp")]
        if extra:
            # Under mixed, DDP keeps half weights beside an fp32 master copy; FSDP2 (HSDP too) keeps fp32
            # shards and gathers half copies: the same training, rounded at other places.
            assert run["hsdp 2x1"]["losses"] == pytest.approx(run["ddp"]["losses"], rel=1e-3)
        else:
            twins.append(("hsdp 2x1", "ddp"))
        for twin, of in twins:
            assert run[twin]["losses"] == pytest.approx(run[of]["losses"], rel=1e-5), (twin, of)
            # Adam turns last-bit differences in the reduction order into ~1e-6 of a step.
            assert _largest_difference(run[twin]["params"], run[of]["params"]) < 1e-4, (twin, of)
    # Every rank holds the same whole model.
    assert _largest_difference(ranks[0]["hsdp 2x1"]["params"], ranks[1]["hsdp 2x1"]["params"]) == 0
    # The losses moved: the runs trained.
    assert ranks[0]["ddp"]["losses"][-1] != ranks[0]["ddp"]["losses"][0]


def test_hsdp_sends_what_its_cost_half_counts(tmp_path):
    """2x1: no gather, every group's gradient all-reduced across the two replicas (fp32 under mixed); 1x2:
    FSDP's gathers and reduce-scatters, nothing across replicas. Kinds and bytes as the projection counts."""
    from rayvit.projection import comms

    seen, _ = two_ranks(tmp_path, _collectives)
    for shard, sent in seen.items():
        cfg = load_config(overrides=TINY[:-1] + ["parallel.strategy=hsdp", f"parallel.shard_size={shard}",
                                                 "precision.mode=mixed", "parallel.num_workers=2"])
        projected = sorted((m.kind, m.bytes) for m in comms.step_messages(cfg, 2))
        assert sent == projected, (shard, sent, projected)
    assert {kind for kind, _ in seen[1]} == {"all_reduce"}
    assert {kind for kind, _ in seen[2]} == {"all_gather", "reduce_scatter"}


def _resumed(rank: int, folder: str, shard: int) -> dict:
    """Two steps, a checkpoint, a third step; then a new session from the checkpoint and its third step."""
    from rayvit.worker import Session
    from rayvit.worker.checkpoint_io import resume, save_state

    overrides = TINY + ["parallel.strategy=hsdp", f"parallel.shard_size={shard}"]
    session = Session(load_config(overrides=overrides))
    try:
        for _ in range(2):
            session.clear_grads()
            session.train_step()
        save_state(session, folder)
        session.clear_grads()
        straight = session.train_step()
    finally:
        session.close()
    again = Session(load_config(overrides=overrides))
    try:
        resume(again, folder)
        again.clear_grads()
        resumed = again.train_step()
        params = {k: _full(v) for k, v in again.strategy.unwrap(again.model).named_parameters()}
    finally:
        again.close()
    return {"straight": straight, "resumed": resumed, "params": params}


@pytest.mark.parametrize("shard", [1, 2])
def test_hsdp_checkpoints_resume_and_load_into_a_plain_model(tmp_path, shard):
    from rayvit.worker.checkpoint_io import load_checkpoint

    folder = tmp_path / "checkpoint"
    ranks = two_ranks(tmp_path, _resumed, str(folder), shard)
    for run in ranks:
        assert run["resumed"] == pytest.approx(run["straight"], rel=1e-5)
    plain = load_checkpoint(folder)
    assert plain.step == 2 and plain.config.parallel.strategy == "hsdp"
    assert set(dict(plain.model.named_parameters())) == set(ranks[0]["params"])
