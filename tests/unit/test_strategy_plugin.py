"""A strategy is one module and a registry line: a throwaway ``ddp_zero1`` (ZeRO-1 over DDP, in
``tests/helpers_ddp_zero1.py``), registered for these tests only, is validated, trains, and is projected and
drawn, with nothing else in rayvit changed (at two ranks: tests/system/test_projection_at_two_ranks.py)."""

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

from helpers_ddp_zero1 import SHORT, DDPZero1, zero_owner
from helpers_projection import vit_b16

DEFAULT = Path(__file__).resolve().parents[2] / "experiments/configs/cpu_default.yaml"


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
