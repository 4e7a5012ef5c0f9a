"""The collectives each strategy issues in one training step: kind, bytes, when, and whether it can hide.

``bytes`` is the collective's size as nccl-tests counts it (the whole array: an all-gather's output, a
reduce-scatter's input), so its time is ``latency + factor(kind, n) x bytes / busbw`` with the factors of
:func:`bus_factor`. Each strategy lists its own messages (``Strategy.step_messages``; what DDP, FSDP2,
FairScale FSDP and OSS issue is written beside each in :mod:`rayvit.strategies`).
"""

from __future__ import annotations

from typing import Optional

from rayvit.config_schema import Config
from rayvit.strategies.costs import Message, bus_factor, layout_key
from rayvit.strategies import strategy_class
from rayvit.strategies.registry import layout_of


def step_messages(cfg: Config, n: Optional[int] = None, *, layer_norm_fp32: Optional[bool] = None,
                  per_node: int = 0) -> list[Message]:
    """Every collective one rank takes part in during one step of ``cfg`` at ``n`` chips (``per_node`` to a
    node, where known), in issue order."""
    strategy = strategy_class(cfg.parallel.strategy)
    key = layout_key(cfg, n or cfg.parallel.num_workers, layer_norm_fp32, per_node, strategy.cost_key())
    messages = _MESSAGES.get(key)
    if messages is None:
        layout = layout_of(cfg, n, layer_norm_fp32=layer_norm_fp32, per_node=per_node)
        messages = _MESSAGES.setdefault(key, tuple(strategy.step_messages(layout)))
        if len(_MESSAGES) > 4096:
            _MESSAGES.clear()
    return list(messages)


# Each layout's messages (``layout_key``): a plan asks again for every batch size of a strategy and count.
_MESSAGES: dict[str, tuple[Message, ...]] = {}


def bytes_moved_per_rank(messages: list[Message], n: int) -> float:
    """Bytes each rank sends (the bus-bandwidth numerator): sum of factor x size, over each message's group."""
    return sum(bus_factor(m.kind, m.group or n) * m.bytes for m in messages)


__all__ = ["Message", "bus_factor", "step_messages", "bytes_moved_per_rank"]
