"""Activation checkpointing (``model.activation_checkpointing``): each strategy that runs on CPU trains
exactly as without it, wraps the blocks before sharding, and keeps the activation bytes the projection
says, at one rank and at two; FairScale FSDP gets FairScale's own wrapper; the ladder has its rung."""

from __future__ import annotations

from pathlib import Path

import pytest

from rayvit.config import ConfigError, load_config, load_study
from rayvit.models.checkpointing import checkpointed_blocks
from rayvit.projection import memory
from rayvit.measure.memory import saved_bytes_slope

from shared import two_ranks

ROOT = Path(__file__).resolve().parents[2]
DEFAULT = ROOT / "experiments/configs/cpu_default.yaml"
# Four blocks, so that "selective" (every second block) differs from "block"; a few steps at a small batch.
SMALL = ["model.depth=4", "train.steps=3", "train.warmup_steps=1", "train.batch_size=4", "train.report_every=3"]


def _losses_and_slope(cfg) -> tuple[list[float], float]:
    """Three training steps' losses, then the saved bytes per image of the trained session's forward."""
    from rayvit.worker import Session

    session = Session(cfg)
    try:
        losses = []
        for _ in range(cfg.train.steps):
            session.clear_grads()
            losses.append(session.train_step())
        return losses, saved_bytes_slope(session)
    finally:
        session.close()


def modelled_saved(cfg) -> float:
    """What the projection says autograd keeps per image between forward and backward (the recomputed
    block exists only during backward: not in a forward's saved tensors)."""
    parts = memory.activation_bytes_per_image(cfg, layer_norm_fp32=False)
    return sum(parts.values()) - parts.get("recomputed_block", 0.0)


def test_blocks_chosen_per_mode():
    cfg = load_config(DEFAULT, ["model.depth=5"]).model
    assert checkpointed_blocks(cfg) == []
    assert checkpointed_blocks(load_config(DEFAULT, ["model.depth=5", "model.activation_checkpointing=block"]).model) \
        == [0, 1, 2, 3, 4]
    every3 = load_config(DEFAULT, ["model.depth=5", "model.activation_checkpointing=selective",
                                   "model.checkpoint_every=3"]).model
    assert checkpointed_blocks(every3) == [0, 3]
    with pytest.raises(ConfigError, match="model.checkpoint_every=0"):
        load_config(DEFAULT, ["model.checkpoint_every=0"])
    with pytest.raises(ConfigError, match="model.activation_checkpointing"):
        load_config(DEFAULT, ["model.activation_checkpointing=layers"])


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "fairscale_oss"])
def test_checkpointing_trains_exactly_as_without_it_and_keeps_what_the_projection_says(strategy):
    """Same seed, same data: the recomputed forward gives the same losses; the saved bytes per image fall
    from every block's activations to their inputs, as modelled (fp32: each number is exact arithmetic)."""
    runs = {}
    for mode in ("none", "block", "selective"):
        cfg = load_config(DEFAULT, [f"parallel.strategy={strategy}", f"model.activation_checkpointing={mode}", *SMALL])
        runs[mode] = (cfg, *_losses_and_slope(cfg))
    for mode in ("block", "selective"):
        assert runs[mode][1] == pytest.approx(runs["none"][1], rel=1e-5), mode
    measured = {mode: slope for mode, (_, _, slope) in runs.items()}
    assert measured["block"] < measured["selective"] < measured["none"]
    for mode, (cfg, _, slope) in runs.items():
        assert modelled_saved(cfg) == pytest.approx(slope, rel=0.10), (mode, modelled_saved(cfg), slope)


def test_each_strategy_wraps_its_blocks_before_sharding():
    """FSDP2: the checkpoint wrapper is what fully_shard shards (torchtitan's order); its state-dict keys are
    the model's own, so checkpoints move between settings."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from torch.distributed.fsdp import FSDPModule

    from rayvit.worker import Session

    cfg = load_config(DEFAULT, ["parallel.strategy=fsdp", "model.activation_checkpointing=selective", *SMALL])
    session = Session(cfg)
    try:
        blocks = list(session.model.blocks)
        assert [isinstance(b, CheckpointWrapper) for b in blocks] == [True, False, True, False]
        assert all(isinstance(b, FSDPModule) for b in blocks)
        assert not any("_checkpoint_wrapped_module" in k for k in session.model.state_dict())
    finally:
        session.close()


def test_fairscale_fsdp_uses_fairscales_own_wrapper():
    """FairScale FSDP documents its own checkpoint wrapper inside FSDP: it patches forward in place, so the
    block stays the module FairScale flattens, under its own name. (Training it needs CUDA: gpu-check.)"""
    import torch

    from rayvit.models import build_model
    from rayvit.training.precision import Precision
    from rayvit.strategies.fairscale_fsdp import FairScaleFSDP

    cfg = load_config(DEFAULT, ["parallel.strategy=fairscale_fsdp", "parallel.use_gpu=true",
                                "model.activation_checkpointing=block", "model.depth=2"])
    strategy = FairScaleFSDP(cfg, Precision(cfg.precision, torch.device("cpu"), True), torch.device("cpu"))
    model = build_model(cfg.model)
    names = [n for n, _ in model.named_parameters()]
    assert strategy.checkpoint_blocks(model) == [0, 1]
    assert [n for n, _ in model.named_parameters()] == names
    assert all(getattr(b.forward, "func", None).__name__ == "_checkpointed_forward" for b in model.blocks)


def test_the_ladder_has_a_checkpointing_rung():
    from rayvit.studies.plan import plan

    points = plan(load_study(ROOT / "experiments/configs/ladder_cpu.yaml",
                             ["sweep.rungs=baseline,activation_checkpointing"]))
    assert [p.series for p in points] == ["baseline", "activation_checkpointing"]
    assert points[-1].cfg.model.activation_checkpointing == "block"
    assert points[0].cfg.model.activation_checkpointing == "none"


def test_projection_prices_checkpointing_as_memory_saved_for_a_second_forward():
    from rayvit.projection.performance import project
    from rayvit.projection.profiles import get_profile

    cfg = load_config(ROOT / "experiments/configs/study_a100.yaml", ["train.batch_size=32"])
    a100 = get_profile("a100-80gb")
    plain, ckpt = project(cfg, 8, a100), project(cfg.replace({"model.activation_checkpointing": "block"}), 8, a100)
    assert plain.recompute_s == 0 and ckpt.recompute_s > 0
    # The forward is a third of forward + backward: recomputing every block costs about that.
    assert 0.2 < ckpt.recompute_s / plain.compute_s < 0.4
    assert ckpt.memory.activations < plain.memory.activations / 3
    half = project(cfg.replace({"model.activation_checkpointing": "selective"}), 8, a100)
    assert ckpt.recompute_s > half.recompute_s > 0 and ckpt.memory.activations < half.memory.activations


def _two_rank_runs(rank):
    import torch

    torch.set_num_threads(1)
    out = {}
    for strategy in ("ddp", "fsdp", "fairscale_oss"):
        for mode in ("none", "block"):
            cfg = load_config(DEFAULT, [f"parallel.strategy={strategy}", f"model.activation_checkpointing={mode}",
                                        "parallel.num_workers=2", *SMALL])
            out[(strategy, mode)] = _losses_and_slope(cfg)
    return out


@pytest.mark.slow
def test_at_two_ranks_checkpointing_trains_the_same_and_keeps_what_the_projection_says(tmp_path):
    ranks = two_ranks(tmp_path, _two_rank_runs)
    for strategy in ("ddp", "fsdp", "fairscale_oss"):
        for rank in ranks:
            none, block = rank[(strategy, "none")], rank[(strategy, "block")]
            assert block[0] == pytest.approx(none[0], rel=1e-5), strategy
            for mode, (_, slope) in (("none", none), ("block", block)):
                cfg = load_config(DEFAULT, [f"parallel.strategy={strategy}", f"model.activation_checkpointing={mode}",
                                            "parallel.num_workers=2", *SMALL])
                assert modelled_saved(cfg) == pytest.approx(slope, rel=0.10), (strategy, mode, slope)
