"""Precision levels, optimizers and peak figures, on a tiny ViT in one process."""

import warnings

import pytest
import torch

from rayvit.training import hardware, precision
from rayvit.config import load_config
from rayvit.errors import ConfigError
from rayvit.models import build_model
from rayvit.training.optim import build_optimizer, lr_factor, param_groups
from rayvit.worker import Session, train
from rayvit.strategies import strategy_class

TINY = ["train.batch_size=16", "train.steps=30", "train.warmup_steps=2", "optim.lr=2e-3"]


@pytest.mark.parametrize("mode", ["fp32", "amp", "mixed", "pure"])
def test_every_bf16_level_trains_with_falling_loss(mode):
    result = train(load_config(overrides=TINY + [f"precision.mode={mode}", "precision.dtype=bf16"]))
    losses = [h["loss"] for h in result.history]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-5:]) / 5 < 0.9 * sum(losses[:5]) / 5


@pytest.mark.parametrize("mode", ["amp", "mixed", "pure"])
def test_every_fp16_level_trains_and_warns_once_on_cpu(mode, monkeypatch):
    monkeypatch.setattr(precision, "_warned_cpu_fp16", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # fp16 on CPU is ~15x slower: a short run with a higher learning rate still shows learning.
        result = train(load_config(overrides=["train.batch_size=8", "train.steps=12", "train.warmup_steps=1",
                                              "optim.lr=5e-3", f"precision.mode={mode}",
                                              "precision.dtype=fp16"]))
    slow = [w for w in caught if "fp16 on CPU" in str(w.message)]
    assert len(slow) == 1
    losses = [h["loss"] for h in result.history]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3


def test_level_dtypes():
    cpu = torch.device("cpu")
    # Every weight half: mixed without its default fp32 LayerNorm (test_fidelity covers that default).
    cfg = load_config(overrides=["precision.mode=mixed", "precision.layer_norm_fp32=false"])
    mixed = Session(cfg)
    try:
        assert all(p.dtype == torch.bfloat16 for p in mixed.model.parameters())
        assert all(m.dtype == torch.float32 for m in mixed.masters.masters)
        state = next(iter(mixed.optimizer.state.values()), None)
        mixed.train_step()
        state = next(iter(mixed.optimizer.state.values()))
        assert state["exp_avg"].dtype == torch.float32
    finally:
        mixed.close()
    pure = precision.Precision(load_config(overrides=["precision.mode=pure"]).precision, cpu)
    assert pure.param_dtype == torch.bfloat16 and not pure.uses_master_weights and pure.scaler is None
    fsdp = strategy_class("fsdp")
    fsdp_mixed = precision.Precision(cfg.precision, cpu, fsdp.owns_mixed_precision)
    assert fsdp_mixed.param_dtype == torch.float32
    assert fsdp(cfg, fsdp_mixed, cpu).mixed_precision_policy().param_dtype == torch.bfloat16
    with pytest.raises(ConfigError, match="fairscale_oss"):
        load_config(overrides=["precision.mode=mixed", "parallel.strategy=fairscale_oss"])


def test_loss_scaler_skips_overflow_and_backs_off():
    scaler = precision.LossScaler(init_scale=1024.0)
    grads = [torch.tensor([float("inf"), 1.0])]
    assert not scaler.unscale_and_check(grads)
    assert scaler.scale == 512.0
    assert scaler.unscale_and_check([torch.tensor([512.0])])


def _trained_params(impl, name):
    torch.manual_seed(0)
    cfg = load_config(overrides=[f"optim.impl={impl}", f"optim.name={name}"])
    model = build_model(cfg.model)
    opt = build_optimizer(cfg.optim, param_groups(model, cfg.optim.weight_decay))
    data = torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    labels = torch.arange(8) % 10
    for _ in range(5):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(data), labels).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("name", ["adamw", "adam", "sgd"])
@pytest.mark.parametrize("impl", ["foreach", "fused"])
def test_multi_tensor_and_fused_match_the_loop(name, impl):
    # foreach applies the loop's arithmetic in the same order; fused kernels reorder it, so after 5 steps
    # of lr 1e-3 (5e-3 of movement) they may differ by ~5e-5.
    atol = 1e-5 if impl == "foreach" else 1e-4
    for a, b in zip(_trained_params("loop", name), _trained_params(impl, name)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=atol)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "fairscale_oss"])
@pytest.mark.parametrize("name", ["adamw", "adam", "sgd"])
def test_fused_optimizers_are_decided_when_the_config_loads(strategy, name):
    """Where torch runs a fused kernel the config loads; where it does not (SGD over FSDP2's DTensors: no
    sharding rule for aten._fused_sgd_) it is refused at load, before any model is built."""
    overrides = [f"parallel.strategy={strategy}", f"optim.name={name}", "optim.impl=fused"]
    if strategy == "fsdp" and name == "sgd":
        with pytest.raises(ConfigError, match=r"optim.impl=fused with optim.name=sgd and parallel.strategy=fsdp: "
                                              r"torch .* cannot run fused sgd on FSDP2's sharded \(DTensor\) "
                                              r"parameters .*; use optim.impl=foreach"):
            load_config(overrides=overrides)
    else:
        assert load_config(overrides=overrides).optim.impl == "fused"


def test_weight_decay_groups_come_from_parameter_objects():
    model = build_model(load_config().model)
    decay, no_decay = param_groups(model, 0.1)
    no_decay_ids = {id(p) for p in no_decay["params"]}
    assert id(model.pos_embed) in no_decay_ids and id(model.class_token) in no_decay_ids
    assert all(id(b.attn.qkv.bias) in no_decay_ids and id(b.norm1.weight) in no_decay_ids for b in model.blocks)
    assert id(model.blocks[0].attn.qkv.weight) not in no_decay_ids
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_weight_decay_groups_survive_fsdp_wrapping():
    session = Session(load_config(overrides=["parallel.strategy=fsdp"]))
    try:
        groups = session.optimizer.param_groups
        params = list(session.model.parameters())
        assert all(type(p).__name__ == "DTensor" or hasattr(p, "to_local") for p in params)
        no_decay = {id(p) for p in groups[1]["params"]}
        assert id(session.model.pos_embed) in no_decay
        assert groups[1]["weight_decay"] == 0.0 and len(groups[0]["params"]) == 1 + 2 * 4 + 1  # stem, 4 per block, head
    finally:
        session.close()


def test_schedule_warms_up_then_decays():
    cfg = load_config(overrides=["optim.lr_warmup_steps=10", "optim.min_lr_ratio=0.1"]).optim
    assert lr_factor(cfg, 0, 100) == pytest.approx(0.1)
    assert lr_factor(cfg, 9, 100) == pytest.approx(1.0)
    assert lr_factor(cfg, 100, 100) == pytest.approx(0.1)
    assert lr_factor(cfg, 55, 100) == pytest.approx(0.55)


def test_peak_table_and_measured_cpu_rate():
    assert hardware.PEAK_TFLOPS["A100"]["bf16"] == 312.0
    peak, source = hardware.peak_flops(torch.device("cpu"), torch.float32)
    assert source == "measured" and 1e8 < peak < 1e13


@pytest.mark.parametrize("device_name, key, bf16", [
    ("NVIDIA H100 80GB HBM3", "H100", 989.4), ("NVIDIA H100 PCIe", "H100 PCIe", 756.0),
    ("NVIDIA H100 NVL", "H100 NVL", 835.5), ("NVIDIA H200", "H200", 989.4), ("NVIDIA H200 NVL", "H200 NVL", 835.5),
    ("NVIDIA A100-SXM4-80GB", "A100", 312.0), ("Tesla V100-SXM2-32GB", "V100", 15.7),
    ("NVIDIA GeForce RTX 4090", None, None),
])
def test_peak_table_tells_the_card_variants_apart(device_name, key, bf16):
    assert hardware.accelerator_for_name(device_name) == key
    if key is not None:
        assert hardware.PEAK_TFLOPS[key]["bf16"] == bf16
