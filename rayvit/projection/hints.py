"""What would make a point that does not fit fit, and at what cost: activation checkpointing, a sharded
strategy, a smaller batch, each projected at the same chip count on the same profile."""

from __future__ import annotations

from typing import Optional

from rayvit.config_schema import Config
from rayvit.errors import ConfigError
from rayvit.projection.performance import ComputeRate, Projection, project
from rayvit.projection.hardware_profile import HardwareProfile

GIB = 2 ** 30
SHARDED = ("fsdp", "hsdp")


def _try(cfg: Config, changes: dict) -> Optional[Config]:
    try:
        return cfg.replace(changes)
    except ConfigError:
        return None


def fit_hints(cfg: Config, point: Projection, profile: HardwareProfile,
              compute: Optional[ComputeRate] = None) -> list[str]:
    """One line per way out for ``point`` (``cfg`` at ``point.chips``), cheapest first: what it would hold
    per rank, and its projected step time against the point's."""
    if point.memory.fits is not False:
        return []
    options: list[tuple[float, str]] = []
    usable = point.memory.usable or 0.0

    def consider(label: str, changed: Optional[Config], batch: Optional[int] = None) -> None:
        if changed is None:
            return
        p = project(changed, point.chips, profile, compute, batch=batch)
        if p.memory.fits:
            cost = p.step_s / point.step_s - 1
            per_image = (p.step_s / p.batch) / (point.step_s / point.batch) - 1
            options.append((per_image, f"{label}: {p.memory.total / GIB:.1f} GiB per rank, step "
                                       f"{p.step_s * 1e3:.0f} ms ({cost:+.0%}), time per image {per_image:+.0%}"))

    if cfg.model.activation_checkpointing != "block":
        consider("model.activation_checkpointing=block", _try(cfg, {"model.activation_checkpointing": "block"}))
    if cfg.parallel.strategy not in SHARDED:
        for strategy in SHARDED:
            sharded = _try(cfg, {"parallel.strategy": strategy})
            consider(f"parallel.strategy={strategy}", sharded)
            if sharded is not None and cfg.model.activation_checkpointing != "block":
                consider(f"parallel.strategy={strategy} with activation checkpointing",
                         _try(sharded, {"model.activation_checkpointing": "block"}))
    largest = point.memory.max_batch or 0
    if largest >= 1:
        consider(f"train.batch_size={largest} (the largest that fits)", cfg, batch=largest)
    lines = [text for _, text in sorted(options)]
    head = (f"{point.label} at {point.chips} chips does not fit ({point.memory.total / GIB:.1f} GiB per rank, "
            f"{usable / GIB:.1f} usable)")
    if not lines:
        return [head + ": neither activation checkpointing, sharding nor a smaller batch makes it fit; "
                       "use chips with more memory or a smaller model"]
    return [head + "; it would fit with:"] + [f"  {line}" for line in lines]


__all__ = ["fit_hints"]
