"""The ViT's parameter tensors, derived from its config alone (no torch): name, shape and where they live.

Mirrors ``rayvit.models.vit.VisionTransformer`` tensor by tensor, in ``model.parameters()`` order, so that
byte counts can copy what the sharding libraries do per tensor (FSDP2 splits dim 0 of each tensor, OSS
assigns whole tensors to ranks). ``tests/unit/test_projection.py`` checks it against the real model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rayvit.config_schema import ModelConfig

ROOT_UNIT = "root"


@dataclass(frozen=True)
class Tensor:
    name: str
    shape: tuple[int, ...]
    unit: str                 # FSDP unit: "blocks.<i>" or "root" (stem, tokens, final norm, head)
    norm: bool = False        # a LayerNorm parameter (kept in fp32 under precision.layer_norm_fp32)
    no_decay: bool = False    # in the optimizer's no-weight-decay group

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _linear(prefix: str, d_in: int, d_out: int, unit: str) -> list[Tensor]:
    return [Tensor(f"{prefix}.weight", (d_out, d_in), unit),
            Tensor(f"{prefix}.bias", (d_out,), unit, no_decay=True)]


def _norm(prefix: str, dim: int, unit: str) -> list[Tensor]:
    return [Tensor(f"{prefix}.weight", (dim,), unit, norm=True, no_decay=True),
            Tensor(f"{prefix}.bias", (dim,), unit, norm=True, no_decay=True)]


def _stem(cfg: ModelConfig) -> list[Tensor]:
    d = cfg.hidden_dim
    if cfg.stem == "patchify":
        return [Tensor("stem.0.weight", (d, 3, cfg.patch_size, cfg.patch_size), ROOT_UNIT),
                Tensor("stem.0.bias", (d,), ROOT_UNIT, no_decay=True)]
    out, c_in, i = [], 3, 0
    for c_out in cfg.conv_stem_dims:
        out.append(Tensor(f"stem.{i}.weight", (c_out, c_in, 3, 3), ROOT_UNIT))
        # BatchNorm's affine parameters (its running statistics are buffers, not parameters).
        out += [Tensor(f"stem.{i + 1}.weight", (c_out,), ROOT_UNIT, no_decay=True),
                Tensor(f"stem.{i + 1}.bias", (c_out,), ROOT_UNIT, no_decay=True)]
        c_in, i = c_out, i + 3
    return out + [Tensor(f"stem.{i}.weight", (d, c_in, 1, 1), ROOT_UNIT),
                  Tensor(f"stem.{i}.bias", (d,), ROOT_UNIT, no_decay=True)]


def sequence_length(cfg: ModelConfig) -> int:
    return (cfg.image_size // cfg.patch_size) ** 2 + (1 if cfg.classifier == "token" else 0)


def vit_tensors(cfg: ModelConfig) -> list[Tensor]:
    """Every parameter tensor of the ViT ``cfg`` describes, in ``model.parameters()`` order."""
    d, m = cfg.hidden_dim, cfg.mlp_dim
    # nn.Module.parameters() yields a module's own parameters before its submodules'.
    tensors = []
    if cfg.classifier == "token":
        tensors.append(Tensor("class_token", (d,), ROOT_UNIT, no_decay=True))
    tensors.append(Tensor("pos_embed", (sequence_length(cfg), d), ROOT_UNIT, no_decay=True))
    tensors += _stem(cfg)
    for i in range(cfg.depth):
        unit = f"blocks.{i}"
        tensors += (_norm(f"{unit}.norm1", d, unit) + _linear(f"{unit}.attn.qkv", d, 3 * d, unit)
                    + _linear(f"{unit}.attn.proj", d, d, unit) + _norm(f"{unit}.norm2", d, unit)
                    + _linear(f"{unit}.mlp.0", d, m, unit) + _linear(f"{unit}.mlp.3", m, d, unit))
    return tensors + _norm("norm", d, ROOT_UNIT) + _linear("head", d, cfg.num_classes, ROOT_UNIT)


def fsdp_units(tensors: list[Tensor]) -> dict[str, list[Tensor]]:
    """Tensors per FSDP unit, in forward order: the root first (its all-gather opens the step), then blocks."""
    units: dict[str, list[Tensor]] = {ROOT_UNIT: []}
    for t in tensors:
        units.setdefault(t.unit, []).append(t)
    return units


def optimizer_order(tensors: list[Tensor]) -> list[Tensor]:
    """The order ``rayvit.training.optim.param_groups`` hands tensors to an optimizer: decayed group, then the rest."""
    return [t for t in tensors if not t.no_decay] + [t for t in tensors if t.no_decay]
