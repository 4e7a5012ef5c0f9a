"""What a hardware profile is: a chip's compute, memory and links (:class:`HardwareProfile`, :class:`Link`),
how the network loses bandwidth under load, and a profile with links measured on the spot. The shipped
profiles and their sources are :mod:`rayvit.projection.profiles`; a cluster a user describes,
:mod:`rayvit.projection.cluster_file`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Optional

from rayvit.accelerators import PEAK_TFLOPS

GB = 1e9
GIB = 2 ** 30
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce")


@dataclass(frozen=True)
class Link:
    """One kind of interconnect: achievable bus bandwidth (bytes/s) and per-message latency (s).

    A measured link also carries the host's wait for the slowest rank against the compute since the
    previous collective (``wait_curve``: ``((gap_s, wait_s), ...)`` as ``rayvit.measure.timers``
    reads it); its ``latency_s`` is then the transfer's alone.
    """

    busbw: float
    latency_s: float
    source: str = ""
    wait_curve: tuple = ()
    # What carries it, for NCCL's cost model (rayvit.projection.nccl): 'nvlink', 'pci' or 'net'; empty for
    # gloo and measured links, which keep their own latency.
    hw: str = ""

    def wait_s(self, gap_s: Optional[float]) -> float:
        """The wait of a collective issued ``gap_s`` of compute after the previous one.

        ``a + b x sqrt(gap)`` fitted through the curve (least squares; one point: that wait at every gap),
        never decreasing with the gap, never negative: a rank computing alone longer is preempted more
        often. The square root is the random-walk form (a rank's lateness spreads like the square root of
        the time it computes alone) and stays finite at short gaps, where a logarithm runs to minus
        infinity; how well it fits measured waits: docs/projection.md.
        """
        if not self.wait_curve or gap_s is None:
            return 0.0
        xs = [g ** 0.5 for g, _ in self.wait_curve]
        ws = [w for _, w in self.wait_curve]
        mx, mw = sum(xs) / len(xs), sum(ws) / len(ws)
        sxx = sum((x - mx) ** 2 for x in xs)
        b = max(0.0, sum((x - mx) * (w - mw) for x, w in zip(xs, ws)) / sxx) if sxx else 0.0
        return max(0.0, mw + b * (max(gap_s, 0.0) ** 0.5 - mx))


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    accelerator: Optional[str]          # key of rayvit.training.hardware.PEAK_TFLOPS (or an unknown GPU's
                                        # name, no peak), None for CPUs
    memory_gib: float                   # device memory per chip
    memory_bw: float                    # device memory bandwidth, bytes/s (bounds the optimizer step)
    chips_per_node: int
    intra: Link                         # inside a node (NVLink/NVSwitch, PCIe, or shared memory for CPUs)
    inter: Link                         # between nodes (EFA / InfiniBand / Ethernet)
    # Fraction of the dense peak a ViT training step reaches when no single-chip rate was measured.
    compute_efficiency: float = 0.45
    # Fraction of forward/backward compute time that can hide communication issued during it
    # (separate NCCL streams on GPUs; 0 where the collective and the compute share one core).
    overlap: float = 0.9
    # Compute running beside a collective runs slower: the collective's kernels hold SMs (each NCCL
    # channel is a CTA on an SM of its own) and memory bandwidth. Measured: 18.9% slower on average, up to
    # 40%, against the same compute alone (A100, H100, MI250, MI210; "Characterizing Compute-Communication
    # Overlap in GPU-Accelerated Distributed Deep Learning", arXiv 2507.03114). 0 where nothing overlaps.
    overlap_slowdown: float = 0.189
    # Fraction of ``memory_bw`` streaming kernels reach (elementwise ops, the optimizer): copy benchmarks
    # reach ~90% of an HBM data sheet's figure; eager PyTorch's elementwise kernels less. 0.8 assumed.
    memory_efficiency: float = 0.8
    # Fraction reduction kernels reach (LayerNorm, softmax, the loss, bias-gradient sums); None: as streaming
    # ones. Lower on Hopper (``_HOPPER_REDUCTION``).
    reduction_efficiency: Optional[float] = None
    # Spread of chips' sustained speed (coefficient of variation): "5% and higher differences on an 8-gpu
    # node" between GPUs of one SKU (stas00/ml-engineering, compute/accelerator, "Not all accelerators are
    # created equal": silicon lottery, cooling); the expected range of 8 normal draws is 2.85 sigma, so
    # sigma = 5% / 2.85 = 1.75%. Every synchronous step waits for the slowest of N chips (performance.
    # straggler_s). 0 where measured links carry the host's own wait (CPUs).
    speed_cv: float = 0.0175
    # Each kernel's launch gap on the device, and the host's dispatch time per eager op (PyTorch's
    # Python + dispatcher overhead, ~5-10 us per op on data-center CPUs); assumptions of the roofline.
    kernel_gap_s: float = 2e-6
    host_op_s: float = 8e-6
    # Per-tensor cost of an optimizer step beyond its bytes (kernel launches), seconds, per optim.impl.
    per_tensor_s: dict = field(default_factory=lambda: {"loop": 40e-6, "foreach": 2e-6, "fused": 1e-6})
    # Memory a process cannot use for tensors: CUDA context, cuBLAS/NCCL workspaces (GiB), and the
    # caching allocator's fragmentation (fraction of the rest).
    reserved_gib: float = 1.5
    fragmentation: float = 0.05
    # Compute slowdown when all chips of a node run at once (1.0 for GPUs: each has its own silicon).
    shared_host_slowdown: float = 1.0
    # Host work per collective a strategy's wrapper adds at more than one rank (FSDP2's copy-in and
    # copy-out), seconds by strategy name, as measured on this device (``Strategy.collective_path_s``).
    collective_path_s: dict = field(default_factory=dict)
    # Per-collective overrides, e.g. measured on the spot: {"all_gather": Link(...)}; used for the
    # node count they were measured at (see :func:`with_measured_links`).
    measured: dict = field(default_factory=dict)
    measured_nodes: int = 0
    measured_ranks: int = 0
    source: str = ""
    # PCIe cards joined by an NVLink bridge (H100 NVL pairs, H200 NVL up to four): a collective over at
    # most ``bridge_chips`` chips runs over the bridge; larger ones over ``intra`` (PCIe).
    bridge: Optional[Link] = None
    bridge_chips: int = 0
    # A host without a data-sheet peak (CPUs): the matmul rate measured on it, FLOP/s by dtype key
    # ('fp32', 'bf16', ...), by whoever measured it (rayvit.measure.host); the projection measures nothing.
    measured_peaks: dict = field(default_factory=dict)
    # What a cluster file (rayvit.projection.cluster_file) adds: the node's CPUs (vCPUs or physical cores),
    # the price of one chip-hour, and which figures came from the file (for every header).
    cpus_per_node: Optional[float] = None
    cpus_are_vcpus: Optional[bool] = None
    price_per_chip_hour: Optional[float] = None
    currency: str = ""
    described: tuple = ()
    described_by: str = ""

    def peak_flops(self, dtype_key: str) -> Optional[float]:
        """Dense peak FLOP/s for 'fp32' / 'tf32' / 'fp16' / 'bf16', from ``PEAK_TFLOPS``; for CPUs the rate
        measured on the host (``measured_peaks``), or None where nothing was measured."""
        if self.accelerator is None or self.accelerator not in PEAK_TFLOPS:
            return self.measured_peaks.get(dtype_key)
        return PEAK_TFLOPS[self.accelerator][dtype_key] * 1e12

    def nodes(self, chips: int) -> int:
        return -(-chips // self.chips_per_node)

    def link(self, collective: str, chips: int) -> Link:
        """The link a collective over ``chips`` chips runs at: measured if measured for that span, else the
        slower of NVLink and (past one node) the inter-node fabric."""
        nodes = self.nodes(chips)
        spans = "inter" if nodes > 1 else "intra"
        measured_spans = "inter" if self.measured_nodes > 1 else "intra"
        if collective in self.measured and spans == measured_spans:
            return self.measured[collective]
        if self.bridge is not None and chips <= self.bridge_chips:
            return self.bridge
        if nodes == 1:
            return self.intra
        inter = dataclasses.replace(self.inter, busbw=self.inter.busbw * network_load_factor(nodes))
        slow = inter if inter.busbw < self.intra.busbw else self.intra
        return Link(slow.busbw, max(self.intra.latency_s, inter.latency_s), slow.source, hw=self.inter.hw and "net")

    def intra_hw(self, chips: int) -> str:
        """What carries a collective's hops inside a node (NCCL's intra-node hop latency)."""
        if self.bridge is not None and chips <= self.bridge_chips:
            return self.bridge.hw
        return self.intra.hw

    def usable_bytes(self) -> float:
        return (self.memory_gib - self.reserved_gib) * GIB * (1 - self.fragmentation)

    def replace(self, **changes) -> "HardwareProfile":
        return dataclasses.replace(self, **changes)


# The network's efficiency under load: a ring across more nodes crosses more switch hops and shares more
# uplinks; with ECMP hashing, flows collide on some of them. Assumed: each doubling of nodes beyond two
# loses 2% of the achievable bus bandwidth (no fabric-wide measurement of ours; adaptive routing on NDR
# InfiniBand or EFA's packet spraying lose less, an oversubscribed Ethernet fabric more).
NET_LOAD_LOSS = 0.02


def network_load_factor(nodes: int) -> float:
    """Fraction of the 2-node bus bandwidth a ring over ``nodes`` nodes achieves."""
    return 1.0 if nodes <= 2 else max(0.5, 1.0 - NET_LOAD_LOSS * math.log2(nodes / 2))


def with_measured_links(profile: HardwareProfile, links: dict) -> HardwareProfile:
    """``profile`` with the collectives measured by ``rayvit.measure.links`` (a links dict)."""
    curve = tuple(tuple(float(x) for x in point) for point in links.get("host_wait_curve") or ())
    source = f"measured ({links.get('backend')}, {links.get('world_size')} ranks)"
    # With a wait curve the latency is the transfer's and the wait follows each message's gap; links
    # without one (older links.json files) carry one flat wait inside ``latency_s``.
    measured = {k: Link(v["busbw"], v.get("transfer_latency_s", v["latency_s"]) if curve else v["latency_s"],
                        source, curve)
                for k, v in links.get("collectives", {}).items() if v.get("busbw")}
    changes = dict(measured=measured, measured_nodes=int(links.get("nodes", 1)),
                   measured_ranks=int(links.get("world_size", 0)))
    paths = {k: float(v) for k, v in (links.get("collective_path_s") or {}).items() if v is not None}
    if paths:
        changes["collective_path_s"] = paths
    if links.get("shared_host_slowdown"):
        changes["shared_host_slowdown"] = float(links["shared_host_slowdown"])
    if links.get("memory_bw"):
        changes["memory_bw"] = float(links["memory_bw"])
    return profile.replace(**changes)
