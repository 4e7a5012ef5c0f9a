"""One collective's time as NCCL's own cost model prices it: ring and tree, three protocols, the cheapest.

NCCL chooses an algorithm and a protocol per call from a model of each (``src/graph/tuning.cc``,
``ncclTopoTuneModel`` and ``ncclTopoGetAlgoTime``; the figures below are its 2.8-era tables): time =
latency + bytes / algorithm bandwidth, where

- latency = a base per (algorithm, protocol) plus one hop latency per step of the algorithm: a ring
  all-reduce takes 2(n-1) steps, 2(nodes-1) of them over the network; all-gather and reduce-scatter n-1
  (nodes-1 over the network); broadcast and reduce n. A tree all-reduce climbs and descends
  ``ranks per node - 1`` NVLink hops and ``log2(nodes)`` network hops each way. A ring all-reduce of a
  large message across nodes pays its latency 1.9x (NCCL's "plateau effect of ring"). Latency therefore
  grows with the rank count: with 128 ranks a ring all-reduce's latency is ~1 ms (Simple protocol).
- bandwidth = the link's bus bandwidth x the protocol's share (Simple all of it, LL128 0.92, LL a quarter:
  LL's 8-byte lines carry 4 bytes of data and 4 of flags) converted to algorithm bandwidth (a ring moves
  ``factor(kind, n)`` x bytes over it; a tree all-reduce runs at half of 0.9 x bus bandwidth).

What a link is (NVLink, PCIe, network) is ``Link.hw``; links without one (gloo, measured links) keep their
own measured latency and are not priced here.
"""

from __future__ import annotations

import functools
import math

from rayvit.strategies.costs import bus_factor

US = 1e-6
PROTOCOLS = ("ll", "ll128", "simple")
BASE_LATENCY_US = {("tree", "ll"): 4.4, ("tree", "ll128"): 4.4, ("tree", "simple"): 0.0,
                   ("ring", "ll"): 3.6, ("ring", "ll128"): 10.0, ("ring", "simple"): 8.4}
HOP_LATENCY_US = {
    "nvlink": {("tree", "ll"): 0.52, ("tree", "ll128"): 1.2, ("tree", "simple"): 28.0,
               ("ring", "ll"): 0.47, ("ring", "ll128"): 1.9, ("ring", "simple"): 3.4},
    "pci": {("tree", "ll"): 1.0, ("tree", "ll128"): 1.9, ("tree", "simple"): 28.0,
            ("ring", "ll"): 1.0, ("ring", "ll128"): 2.5, ("ring", "simple"): 5.7},
    "net": {("tree", "ll"): 5.0, ("tree", "ll128"): 8.5, ("tree", "simple"): 50.0,
            ("ring", "ll"): 2.7, ("ring", "ll128"): 4.0, ("ring", "simple"): 9.6},
}
PROTOCOL_BANDWIDTH = {"simple": 1.0, "ll128": 0.92, "ll": 0.25}


def _steps(kind: str, n: int, nodes: int) -> tuple[int, int]:
    """(all steps, network steps) of a ring collective over ``n`` ranks on ``nodes`` nodes."""
    if kind == "all_reduce":
        return 2 * (n - 1), 2 * (nodes - 1)
    if kind in ("all_gather", "reduce_scatter"):
        return n - 1, nodes - 1
    return n, nodes


def ring_seconds(kind: str, nbytes: float, n: int, nodes: int, intra_hw: str, busbw: float, proto: str) -> float:
    steps, net = _steps(kind, n, nodes)
    intra = HOP_LATENCY_US[intra_hw][("ring", proto)]
    hop_net = HOP_LATENCY_US["net"][("ring", proto)] if nodes > 1 else intra
    latency = BASE_LATENCY_US[("ring", proto)] + (steps - net) * intra + net * hop_net
    if kind == "all_reduce" and proto == "simple" and nodes > 1 and nbytes >= n / 16 * 65536:
        latency *= 1.9
    return latency * US + bus_factor(kind, n) * nbytes / (busbw * PROTOCOL_BANDWIDTH[proto])


def tree_seconds(nbytes: float, n: int, nodes: int, intra_hw: str, busbw: float, proto: str) -> float:
    per_node = max(1, n // max(nodes, 1))
    intra = HOP_LATENCY_US[intra_hw][("tree", proto)]
    hop_net = HOP_LATENCY_US["net"][("tree", proto)]
    latency = BASE_LATENCY_US[("tree", proto)] + 2 * ((per_node - 1) * intra + math.log2(max(nodes, 1)) * hop_net)
    bandwidth = 0.5 * 0.9 * busbw * (PROTOCOL_BANDWIDTH[proto] if proto != "ll" else 1 / 3.8)
    return latency * US + nbytes / bandwidth


@functools.lru_cache(maxsize=65536)         # pure in its arguments; a plan prices the same message often
def collective_seconds(kind: str, nbytes: float, n: int, nodes: int, intra_hw: str, busbw: float
                       ) -> tuple[float, str]:
    """(seconds, 'algorithm/protocol') of the cheapest way NCCL has to run one collective."""
    if n <= 1:
        return 0.0, "none"
    options = {f"ring/{p}": ring_seconds(kind, nbytes, n, nodes, intra_hw, busbw, p) for p in PROTOCOLS}
    if kind == "all_reduce" and nodes > 1:
        options.update({f"tree/{p}": tree_seconds(nbytes, n, nodes, intra_hw, busbw, p) for p in PROTOCOLS})
    best = min(options, key=options.get)
    return options[best], best


__all__ = ["collective_seconds", "ring_seconds", "tree_seconds"]
