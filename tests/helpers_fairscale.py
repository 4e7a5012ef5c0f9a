"""FairScale FSDP on CPU: what its wrapper, flat shards and weight decay are, with no GPU."""

from __future__ import annotations

import torch

from rayvit.config import load_config


def fairscale_fsdp_on_cpu(overrides, seed=0):
    """A FairScale FSDP strategy and its wrapped tiny ViT, built on CPU (one rank)."""
    from rayvit.models import build_model
    from rayvit.strategies import strategy_class
    from rayvit.training.precision import Precision

    CPU = torch.device("cpu")
    cfg = load_config(overrides=["parallel.strategy=fairscale_fsdp", "parallel.use_gpu=true", *overrides])
    cls = strategy_class("fairscale_fsdp")
    precision = Precision(cfg.precision, CPU, cls.owns_mixed_precision)
    strategy = cls(cfg, precision, CPU)
    torch.manual_seed(seed)
    model, optimizer = strategy.parallelize(precision.prepare_model(build_model(cfg.model)))
    return cfg, strategy, model, optimizer


def reference_step(cfg, seed, grads_seed):
    """The step every strategy must reproduce: torch's optimizer over decay groups of the plain model."""
    from rayvit.models import build_model
    from rayvit.training.optim import build_optimizer, param_groups

    torch.manual_seed(seed)
    model = build_model(cfg.model)
    optimizer = build_optimizer(cfg.optim, param_groups(model, cfg.optim.weight_decay))
    gen = torch.Generator().manual_seed(grads_seed)
    grads = {id(p): torch.randn(p.shape, generator=gen) for p in model.parameters()}
    for p in model.parameters():
        p.grad = grads[id(p)].clone()
    optimizer.step()
    return model, grads


def unwrapped_paths(wrapped: "torch.nn.Module") -> dict[int, str]:
    """id(module) -> its path in the unwrapped model (FairScale's wrapper levels left out)."""
    levels = ("_fsdp_wrapped_module", "_fpw_module")
    return {id(m): ".".join(part for part in path.split(".") if part not in levels)
            for path, m in wrapped.named_modules()}
