"""Bytes per element of each thing a precision level stores or sends, per strategy.

Mirrors ``rayvit.training.precision`` (and the strategy changes planned beside it, as parameters). A
strategy that owns ``mixed`` itself (``Strategy.owns_mixed_precision``: FSDP2, FairScale FSDP) keeps fp32
shards as the master copy and gathers half weights for compute:

| level  | weights stored (replicated strategies) | strategies owning mixed precision (sharded) | masters | compute |
| ------ | --------------------------------------- | ------------------------------------------- | ------- | ------- |
| fp32   | fp32                                    | fp32                                        | no      | fp32    |
| amp    | fp32                                    | fp32                                        | no      | half    |
| mixed  | half (LayerNorm fp32 if layer_norm_fp32)| fp32 shards, half when gathered             | fp32 copy of the half weights (ddp) | half |
| pure   | half                                    | half                                        | no      | half    |

Gradients are stored in the dtype of the tensor that holds them. Half gradients (``mixed`` weights,
``pure``) are *reduced* in ``parallel.reduce_dtype``; fp32 gradients always in fp32: every gradient under
``fp32`` and ``amp`` (autocast computes in half, but the parameters and their gradients stay fp32), and
LayerNorm's under ``mixed`` with ``layer_norm_fp32``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rayvit.config_schema import Config

HALF, FULL = 2, 4


def reduces_in_half(cfg: "Config") -> bool:
    """Whether ``cfg``'s half-precision gradients are reduced in half (``parallel.reduce_dtype`` resolved:
    ``auto`` is half under ``pure``, fp32 otherwise)."""
    p = cfg.parallel
    return p.reduce_dtype == "half" or (p.reduce_dtype == "auto" and cfg.precision.mode == "pure")


@dataclass(frozen=True)
class Dtypes:
    mode: str
    sharded: bool           # the strategy owns mixed precision: fp32 shards are the master copy
    layer_norm_fp32: bool
    reduce_half: bool

    @classmethod
    def of(cls, cfg: "Config", sharded: bool, layer_norm_fp32: bool | None = None) -> "Dtypes":
        """``cfg``'s, for a strategy that owns mixed precision (``sharded``) or not; the registry's
        :func:`~rayvit.strategies.registry.dtypes_of` asks ``cfg``'s strategy which."""
        ln = cfg.precision.layer_norm_fp32 if layer_norm_fp32 is None else layer_norm_fp32
        return cls(cfg.precision.mode, sharded, bool(ln) and cfg.precision.mode == "mixed", reduces_in_half(cfg))

    def stored(self, norm: bool) -> int:
        """Bytes per element of a parameter as this rank stores it (and of its gradient)."""
        if self.mode in ("fp32", "amp"):
            return FULL
        if self.mode == "pure":
            return HALF
        # mixed: sharded strategies keep fp32 shards (they are the master copy).
        return FULL if self.sharded or (norm and self.layer_norm_fp32) else HALF

    def has_master(self, norm: bool) -> bool:
        """A separate fp32 master (and its gradient) exists only for half weights of replicated strategies."""
        return self.mode == "mixed" and not self.sharded and self.stored(norm) == HALF

    def optimizer_state(self, norm: bool) -> int:
        """Bytes per element of optimizer state: the dtype of the tensor the optimizer steps."""
        return FULL if self.has_master(norm) else self.stored(norm)

    def gathered(self, norm: bool) -> int:
        """Bytes per element a sharded strategy all-gathers (the compute copy of the weights)."""
        if self.mode in ("fp32", "amp"):
            return FULL
        return FULL if norm and self.layer_norm_fp32 else HALF

    def reduced(self, norm: bool = False) -> int:
        """Bytes per element gradients are reduced in (of a LayerNorm parameter when ``norm``)."""
        if self.mode in ("fp32", "amp") or (norm and self.layer_norm_fp32):
            return FULL
        return HALF if self.reduce_half else FULL

    @property
    def compute(self) -> int:
        return FULL if self.mode == "fp32" else HALF

    @property
    def residual(self) -> int:
        """The residual stream between blocks: fp32 unless the weights themselves are half."""
        return HALF if self.mode in ("mixed", "pure") else FULL

    def peak_key(self, half_name: str) -> str:
        return "fp32" if self.mode == "fp32" else half_name
