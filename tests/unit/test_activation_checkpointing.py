"""Activation checkpointing (``model.activation_checkpointing``): each strategy that runs on CPU trains
exactly as without it, wraps the blocks before sharding, and keeps the activation bytes the projection
says (at two ranks: tests/system/test_projection_at_two_ranks.py); FairScale FSDP gets FairScale's own
wrapper; the ladder has its rung."""

from __future__ import annotations

from pathlib import Path

import pytest

from rayvit.config import load_config, load_study
from rayvit.errors import ConfigError
from rayvit.models.activation_checkpointing import checkpointed_blocks

from helpers_activation_checkpointing import SMALL, losses_and_slope, modelled_saved

ROOT = Path(__file__).resolve().parents[2]
DEFAULT = ROOT / "experiments/configs/cpu_default.yaml"
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
        runs[mode] = (cfg, *losses_and_slope(cfg))
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


def _dtypes_seen(strategy: str, mode: str, checkpointing: str = "block") -> tuple[list, list, dict]:
    """The dtype each checkpointed block's first matmul computed in, in the forward (under the run's
    autocast, bf16) and in its recompute (during backward, outside any autocast, as the loop runs it);
    and the gradients, by parameter name."""
    import torch

    from rayvit.models import build_model
    from rayvit.strategies import strategy_class
    from rayvit.training.precision import Precision

    cfg = load_config(DEFAULT, [f"parallel.strategy={strategy}", "parallel.use_gpu=true", f"precision.mode={mode}",
                                "precision.dtype=bf16", f"model.activation_checkpointing={checkpointing}",
                                "model.depth=2"])
    cpu = torch.device("cpu")
    cls = strategy_class(strategy)
    precision = Precision(cfg.precision, cpu, cls.owns_mixed_precision)
    torch.manual_seed(0)
    model = precision.prepare_model(build_model(cfg.model))
    names = [n for n, _ in model.named_parameters()]
    cls(cfg, precision, cpu).checkpoint_blocks(model)
    assert [n.replace("_checkpoint_wrapped_module.", "") for n, _ in model.named_parameters()] == names
    seen: dict[str, list] = {"forward": [], "backward": []}
    phase = ["forward"]
    for block in model.blocks:
        block.mlp[0].register_forward_hook(lambda m, args, out: seen[phase[0]].append(out.dtype))
    images = precision.cast_inputs(torch.randn(2, 3, cfg.model.image_size, cfg.model.image_size))
    with precision.autocast():
        loss = model(images).float().logsumexp(-1).mean()
    phase[0] = "backward"
    loss.backward()
    grads = {n.replace("_checkpoint_wrapped_module.", ""): p.grad for n, p in model.named_parameters()}
    return seen["forward"], seen["backward"], grads


@pytest.fixture
def fairscale_as_on_cuda(monkeypatch):
    """FairScale's checkpoint wrapper doing on CPU what its source does on CUDA: it notes whether the
    forward ran under autocast (``torch.is_autocast_enabled()``, CUDA's) and re-enters
    ``torch.cuda.amp.autocast(True)`` around the recompute, fp16 by default. Here both read and enter CPU
    autocast, with the same default dtype (FairScale's own code otherwise unchanged)."""
    import contextlib

    import torch
    from fairscale.nn.checkpoint import checkpoint_activations as fairscale

    @contextlib.contextmanager
    def autocast(enabled: bool):
        with torch.autocast("cpu", dtype=torch.float16, enabled=enabled):
            yield

    monkeypatch.setattr(fairscale, "is_autocast_enabled", lambda: torch.is_autocast_enabled("cpu"))
    monkeypatch.setattr(fairscale, "autocast", autocast)


@pytest.mark.parametrize("strategy,mode", [("ddp", "amp"), ("fsdp", "amp"), ("fairscale_fsdp", "amp"),
                                           ("fairscale_fsdp", "mixed")])
def test_each_recompute_runs_in_the_dtype_its_forward_ran_in(strategy, mode):
    """bf16 autocast (amp; mixed with fp32 LayerNorm): every checkpointed block's recompute computes in bf16,
    as its forward did. torch's non-reentrant wrapper (ddp, fsdp) restores the forward's autocast itself;
    FairScale's, on CPU, re-entered none (its recompute ran in fp32)."""
    import torch

    forward, recomputed, grads = _dtypes_seen(strategy, mode)
    assert forward == [torch.bfloat16, torch.bfloat16]
    assert recomputed == forward
    # The same arithmetic as without checkpointing, so the same gradients, bit for bit.
    _, none, plain = _dtypes_seen(strategy, mode, "none")
    assert none == [] and all(torch.equal(grads[n], plain[n]) for n in plain)


@pytest.mark.parametrize("mode", ["amp", "mixed"])
def test_fairscales_fp16_recompute_runs_in_the_forwards_bf16(mode, fairscale_as_on_cuda):
    """FairScale's recompute as on CUDA (inside an fp16 autocast, the gradients through it fp16 with no loss
    scaler): the block still computes in the bf16 its forward ran in. (Training it needs CUDA: gpu-check's
    ``recompute dtype fairscale_fsdp`` cases.)"""
    import torch

    forward, recomputed, grads = _dtypes_seen("fairscale_fsdp", mode)
    assert forward == [torch.bfloat16, torch.bfloat16]
    assert recomputed == forward
    _, _, plain = _dtypes_seen("fairscale_fsdp", mode, "none")
    assert all(torch.equal(grads[n], plain[n]) for n in plain)


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
