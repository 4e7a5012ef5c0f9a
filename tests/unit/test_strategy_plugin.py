"""A strategy is one module and a registry line: a throwaway ``ddp_zero1`` (ZeRO-1 over DDP, in
``_ddp_zero1.py``), registered for these tests only, is validated, trains, and is projected and drawn, with
nothing else in rayvit changed."""

from __future__ import annotations

from pathlib import Path

import pytest

from rayvit.config import load_config, load_study
from rayvit.errors import ConfigError
from rayvit.projection import comms, memory
from rayvit.projection.performance import ComputeRate, project
from rayvit.projection.profiles import get_profile
from rayvit.strategies.shapes import vit_tensors
from rayvit.record.plots import strategy_colour
from rayvit.strategies import STRATEGIES

from _ddp_zero1 import DDPZero1, zero_owner
from shared import flag_apart, spied, two_ranks, vit_b16

DEFAULT = Path(__file__).resolve().parents[2] / "experiments/configs/cpu_default.yaml"
SHORT = ["train.steps=6", "train.warmup_steps=1", "train.batch_size=4", "model.depth=2"]


@pytest.fixture
def zero1(monkeypatch):
    """The registry line, for one test."""
    monkeypatch.setitem(STRATEGIES, DDPZero1.name, DDPZero1)
    return DDPZero1


def test_an_unregistered_strategy_is_refused_naming_the_registered_ones():
    with pytest.raises(ConfigError, match=r"parallel.strategy='ddp_zero1' is not allowed; choose one of: "
                                          r"ddp, fsdp, hsdp, fairscale_oss, fairscale_fsdp"):
        load_config(overrides=["parallel.strategy=ddp_zero1"])
    with pytest.raises(ConfigError, match="sweep.strategies has unknown"):
        load_study(overrides=["sweep.strategies=[ddp,ddp_zero1]"])


def test_its_config_checks_come_with_its_class(zero1):
    assert load_config(overrides=["parallel.strategy=ddp_zero1"]).parallel.strategy == "ddp_zero1"
    assert load_study(overrides=["sweep.strategies=[ddp,ddp_zero1]"]).sweep.strategies == ["ddp", "ddp_zero1"]
    with pytest.raises(ConfigError, match="precision.mode=mixed cannot combine with parallel.strategy=ddp_zero1"):
        load_config(overrides=["parallel.strategy=ddp_zero1", "precision.mode=mixed"])


def test_it_trains_and_holds_the_bytes_its_cost_model_projects(zero1):
    from rayvit.worker import train

    cfg = load_config(DEFAULT, ["parallel.strategy=ddp_zero1", *SHORT])
    result = train(cfg)
    losses = [h["loss"] for h in result.history]
    assert losses[-1] < losses[0]
    assert result.metrics["model_state_bytes_per_rank"] == memory.model_state(cfg, 1).total
    assert result.conditions["strategy"] == "ddp_zero1"


def test_the_projection_costs_it_from_its_class(zero1):
    cfg, ddp = vit_b16(**{"parallel.strategy": "ddp_zero1"}), vit_b16()
    tensors = vit_tensors(cfg.model)
    params = sum(t.numel for t in tensors)
    msgs = comms.step_messages(cfg, 8)
    # DDP's bucketed all-reduces, then each parameter broadcast from the rank that updated it.
    assert [m for m in msgs if m.kind == "all_reduce"] == comms.step_messages(ddp, 8)
    broadcasts = [m for m in msgs if m.kind == "broadcast"]
    assert len(broadcasts) == len(tensors) and sum(m.bytes for m in broadcasts) == 4 * params
    # Replicated parameters and gradients; AdamW's two fp32 moments (and a step counter per tensor) only
    # for the tensors the busiest rank owns.
    owner = zero_owner(tensors, 8)
    state, replicated = memory.model_state(cfg, 8, per_rank=True), memory.model_state(ddp, 8)
    for rank, s in enumerate(state):
        mine = [t for t in tensors if owner[t.name] == rank]
        assert (s.params, s.grads, s.masters) == (replicated.params, replicated.grads, 0)
        assert s.optimizer == 8 * sum(t.numel for t in mine) + 4 * len(mine)
    assert max(s.optimizer for s in state) < replicated.optimizer / 6
    a100, rate = get_profile("a100-40gb"), ComputeRate(1e-3, "given")
    mine, theirs = project(cfg, 8, a100, rate, peak=312e12), project(ddp, 8, a100, rate, peak=312e12)
    assert mine.label == "ddp_zero1" and mine.messages == theirs.messages + len(tensors)
    assert mine.optimizer_s < theirs.optimizer_s and mine.exposed_comm_s > theirs.exposed_comm_s
    assert mine.memory.total < theirs.memory.total
    assert strategy_colour("ddp_zero1") == DDPZero1.colour


def _step(rank: int) -> dict:
    """On one of two ranks: the (kind, bytes) of every all-reduce and broadcast of the third step (DDP has
    rebuilt its buckets by then), and the model-state bytes this rank holds. torch's own all-reduce hook
    sends DDP's fp32 buckets through ``dist.all_reduce``, where they can be seen."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from rayvit.worker import Session

    STRATEGIES[DDPZero1.name] = DDPZero1           # the registry line, in this process
    session = Session(load_config(DEFAULT, ["parallel.strategy=ddp_zero1", *SHORT]))
    session.model.register_comm_hook(None, default_hooks.allreduce_hook)
    sent: list = []

    def record(name, args, kwargs):
        tensor = args[0] if args else kwargs["tensor"]
        sent.append((name, tensor.numel() * tensor.element_size()))

    flags: list = []
    try:
        for _ in range(3):
            sent.clear()
            with spied(record, "all_reduce", "broadcast"), flag_apart(sent, flags):
                session.clear_grads()
                session.train_step()
        return {"sent": sorted(sent), "state": session.model_state_bytes(), "flags": flags}
    finally:
        session.close()


@pytest.mark.slow
def test_at_two_ranks_it_sends_and_holds_what_its_cost_model_says(zero1, tmp_path):
    ranks = two_ranks(tmp_path, _step)
    cfg = load_config(DEFAULT, ["parallel.strategy=ddp_zero1", "parallel.num_workers=2", *SHORT])
    projected = sorted((m.kind, m.bytes) for m in comms.step_messages(cfg, 2))
    for r in ranks:
        assert r["flags"] == [[("all_reduce", 8)]] * 3        # the finite-loss flag, after each step's clock
        assert [k for k, _ in r["sent"]] == [k for k, _ in projected]
        assert sum(b for _, b in r["sent"]) == sum(b for _, b in projected)
    assert [s.total for s in memory.model_state(cfg, 2, per_rank=True)] == [r["state"] for r in ranks]
