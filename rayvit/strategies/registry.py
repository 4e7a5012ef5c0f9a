"""The registry: each strategy's name (``parallel.strategy``) to its class, and the baseline.

A registered class is a strategy's runtime half, which subclasses its cost half (:mod:`rayvit.strategies.base`),
so one entry answers both the worker (wrap, step, save) and config validation and the projection (what it
refuses, what a step costs). This module imports none of them; :mod:`rayvit.strategies` registers rayvit's
own, and a plugin registers its class with :func:`register` (or a line ``STRATEGIES[name] = cls``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from rayvit.errors import ConfigError
from rayvit.strategies.costs import Layout
from rayvit.strategies.dtypes import Dtypes

if TYPE_CHECKING:
    from rayvit.config_schema import Config
    from rayvit.strategies.base import Strategy

STRATEGIES: dict[str, type["Strategy"]] = {}


def register(cls: type["Strategy"]) -> type["Strategy"]:
    """Register ``cls`` under its ``name``; returns it (usable as a class decorator)."""
    STRATEGIES[cls.name] = cls
    return cls


def strategy_class(name: str) -> type["Strategy"]:
    """The strategy registered as ``name`` (``parallel.strategy``)."""
    try:
        return STRATEGIES[name]
    except KeyError:
        raise ConfigError(f"parallel.strategy={name!r} is not a registered strategy; choose one of: "
                          f"{', '.join(STRATEGIES)}") from None


def lineage(name: str) -> list[str]:
    """``name`` and the registered strategies its class derives from, nearest first (``hsdp``: ``hsdp``,
    ``fsdp``): a figure measured for a strategy's runtime (its wrapper's own overhead, its host path per
    collective) holds for one built on it until that one is measured itself."""
    cls = strategy_class(name)
    by_class = {c: n for n, c in STRATEGIES.items()}
    return [by_class[c] for c in cls.__mro__ if c in by_class and (c is cls or by_class[c] != name)]


def dtypes_of(cfg: "Config", layer_norm_fp32: Optional[bool] = None) -> Dtypes:
    """Bytes per element of what ``cfg``'s strategy stores and sends (:class:`~rayvit.strategies.dtypes.Dtypes`)."""
    return Dtypes.of(cfg, strategy_class(cfg.parallel.strategy).owns_mixed_precision, layer_norm_fp32)


def layout_of(cfg: "Config", n: Optional[int] = None, **options: Any) -> Layout:
    """``cfg``'s tensors over ``n`` ranks as its strategy holds them (:meth:`~rayvit.strategies.costs.Layout.of`)."""
    return Layout.of(cfg, n, sharded=strategy_class(cfg.parallel.strategy).owns_mixed_precision, **options)
