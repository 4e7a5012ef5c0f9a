"""The collectives each strategy issues in one training step: kind, bytes, when, and whether it can hide.

``bytes`` is the collective's size as nccl-tests counts it (the whole array: an all-gather's output, a
reduce-scatter's input), so its time is ``latency + factor(kind, n) x bytes / busbw`` with the factors of
:func:`bus_factor`. Each strategy lists its own messages (``Strategy.step_messages``; what DDP, FSDP2,
FairScale FSDP and OSS issue is written beside each in :mod:`rayvit.strategies`).
"""

from __future__ import annotations

from typing import Optional

from rayvit.config import Config
from rayvit.strategies.costs import Layout, Message, bus_factor
from rayvit.strategies import strategy_class


def step_messages(cfg: Config, n: Optional[int] = None, *, layer_norm_fp32: Optional[bool] = None,
                  per_node: int = 0) -> list[Message]:
    """Every collective one rank takes part in during one step of ``cfg`` at ``n`` chips (``per_node`` to a
    node, where known), in issue order."""
    layout = Layout.of(cfg, n, layer_norm_fp32=layer_norm_fp32, per_node=per_node)
    return strategy_class(cfg.parallel.strategy).step_messages(layout)


def bytes_moved_per_rank(messages: list[Message], n: int) -> float:
    """Bytes each rank sends (the bus-bandwidth numerator): sum of factor x size, over each message's group."""
    return sum(bus_factor(m.kind, m.group or n) * m.bytes for m in messages)


__all__ = ["Message", "bus_factor", "step_messages", "bytes_moved_per_rank"]
