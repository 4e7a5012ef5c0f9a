"""Hardware profiles: what a chip computes, holds and moves, with where each number comes from.

A profile names its chip by the key of ``rayvit.accelerators.PEAK_TFLOPS`` (the one table of dense peaks
and of the roofline's per-chip figures, ``CHIPS``; add chips there, not here). Links are described the way
nccl-tests reports them: a *bus bandwidth* (``busbw``: the per-rank rate a collective's bottleneck link sustains, independent of the rank count;
all-reduce time = 2(n-1)/n x bytes / busbw, all-gather and reduce-scatter (n-1)/n x bytes / busbw,
broadcast and reduce 1 x bytes / busbw, see nccl-tests doc/PERFORMANCE.md) plus a per-message latency.
A ring across nodes is bound by each node's network bandwidth, so the inter-node busbw is the node's NIC
total; a collective over more chips than a node holds runs at the slower of NVLink and that.

Every efficiency below is a stated assumption or a published measurement (named beside it), not fitted to
any measurement of rayvit or to any published training run.

:func:`profile_for_accelerator` picks the profile for a run's ``accelerator`` condition (the names
``rayvit.accelerators.accelerator_for_name`` returns): every known GPU variant has its own, the A100, V100
and GH200 chosen by their memory size (every run records it as its ``device_memory_bytes`` condition); a
GPU not in the table gets :func:`generic_gpu_profile` with a warning; only CPU runs get :func:`cpu_profile`.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

from rayvit.errors import ConfigError
from rayvit.projection.hardware_profile import GB, GIB, HardwareProfile, Link

# NVLink: A100 NVLink 3 through NVSwitch, 12 links x 25 GB/s x 2 directions = 600 GB/s per GPU, i.e.
# 300 GB/s each way ("NVIDIA A100 Tensor Core GPU Architecture" whitepaper); H100/H200 NVLink 4,
# 18 links = 900 GB/s, 450 GB/s each way (H100 / H200 data sheets). nccl-tests all-reduce on 8
# NVSwitch GPUs reaches roughly 75-80% of the per-direction figure; 0.75 is assumed.
_NVLINK_EFF = 0.75
# Network: p4d.24xlarge / p4de.24xlarge have 4 x 100 Gb/s EFA = 400 Gb/s = 50 GB/s per node (AWS EC2
# P4 instance page); DGX H100 / H200 have 8 x 400 Gb/s ConnectX-7 InfiniBand = 400 GB/s per node
# (DGX H100/H200 user guides). 0.8 of line rate is assumed achievable by NCCL rings.
_NET_EFF = NET_EFFICIENCY = 0.8
# Latencies: a few microseconds per NVLink hop and ~10 us per network hop; NCCL's small-message
# all-reduce on one 8-GPU node is ~15-25 us, across nodes ~30-60 us. Stated, not measured here.
_NVLINK_A100 = Link(300 * GB * _NVLINK_EFF, 20e-6, "NVLink 3: 300 GB/s each way x 0.75", hw="nvlink")
_NVLINK_H = Link(450 * GB * _NVLINK_EFF, 20e-6, "NVLink 4: 450 GB/s each way x 0.75", hw="nvlink")
_EFA_P4 = Link(50 * GB * _NET_EFF, 50e-6, "4 x 100 Gb/s EFA per node x 0.8", hw="net")
_IB_8X400 = Link(400 * GB * _NET_EFF, 40e-6, "8 x 400 Gb/s InfiniBand per node x 0.8", hw="net")
# DGX A100: 8 single-port ConnectX-6 200 Gb/s HDR InfiniBand for compute traffic = 200 GB/s per node (DGX
# A100 data sheet / user guide), the fabric of NVIDIA's DGX SuperPOD.
_IB_8X200 = Link(200 * GB * _NET_EFF, 40e-6, "8 x 200 Gb/s HDR InfiniBand per node x 0.8", hw="net")
# GH200 in one-superchip nodes (NVIDIA MGX GH200 servers) with one 400 Gb/s ConnectX-7 each (assumed: NVL32
# racks and 4-superchip blades have other fabrics; the sweep's microbenchmark measures them).
_NET_GH200 = Link(400 / 8 * GB * _NET_EFF, 40e-6, "1 x 400 Gb/s InfiniBand per superchip x 0.8 (assumed)", hw="net")
# V100 SXM2: NVLink 2, 6 links x 25 GB/s each way = 150 GB/s each way per GPU in the hybrid cube-mesh of
# p3 / DGX-1 ("NVIDIA Tesla V100 GPU Architecture" whitepaper). AWS p3.16xlarge: 25 Gb/s networking,
# p3dn.24xlarge: 100 Gb/s (AWS EC2 P3 instance page).
_NVLINK_V100 = Link(150 * GB * _NVLINK_EFF, 20e-6, "NVLink 2 hybrid cube-mesh: 150 GB/s each way x 0.75",
                    hw="nvlink")
_ENA_P3 = Link(25 / 8 * GB * _NET_EFF, 50e-6, "25 Gb/s per node (p3.16xlarge) x 0.8", hw="net")
_EFA_P3DN = Link(100 / 8 * GB * _NET_EFF, 50e-6, "100 Gb/s EFA per node (p3dn.24xlarge) x 0.8", hw="net")
# PCIe cards (H100 PCIe, H100 NVL, H200 NVL): PCIe Gen5 x16, 128 GB/s both ways = 64 GB/s each way (the
# data sheets); a ring over the cards of one server crosses PCIe switches and, often, the CPU's root
# complexes, so the same 0.75 is assumed. The NVL cards' NVLink bridges: H100 NVL 600 GB/s per pair
# (300 each way), H200 NVL 900 GB/s (450 each way) over a 2- or 4-way bridge (H100 / H200 data sheets).
# PCIe servers have no standard network: 4 x 100 Gb/s is assumed, as on p4d; the sweep's
# microbenchmark replaces it with what the cluster measures.
_PCIE_GEN5 = Link(64 * GB * _NVLINK_EFF, 25e-6, "PCIe Gen5 x16: 64 GB/s each way x 0.75", hw="pci")
_BRIDGE_H100_NVL = Link(300 * GB * _NVLINK_EFF, 20e-6, "NVLink bridge (H100 NVL pair): 300 GB/s each way x 0.75",
                        hw="nvlink")
_BRIDGE_H200_NVL = Link(450 * GB * _NVLINK_EFF, 20e-6, "NVLink bridge (H200 NVL, 4-way): 450 GB/s each way x 0.75",
                        hw="nvlink")
_NET_PCIE_SERVER = Link(50 * GB * _NET_EFF, 50e-6, "4 x 100 Gb/s per node x 0.8 (assumed)", hw="net")
# Reduction kernels on Hopper (norms, softmax, a loss, a bias gradient's sum): written with torch.compile or
# Liger they run at 1/1.33 to 1/1.5 of the ~3 TB/s that speed-of-light kernels reach on an H100 SXM ("Getting
# Memory-bound Kernels to Speed-of-Light", Guo, Zadouri and Dao, 2025: QuACK is 33-50% faster than both),
# 2.0-2.25 TB/s: 0.60-0.67 of the 3.35 TB/s data sheet; 0.63 is taken, for every Hopper part (an assumption:
# the same SMs and kernels; HBM3e needs still more bytes in flight). Elementwise kernels and copies keep
# ``memory_efficiency`` (0.8; copy and STREAM-triad kernels reach ~0.9 of an H100's data sheet). An A100's
# HBM2e is filled by fewer bytes in flight (2 TB/s against 3.35 at a similar latency, Little's law): its
# reductions keep the streaming figure.
_HOPPER_REDUCTION = 0.63

PROFILES: dict[str, HardwareProfile] = {
    # V100 SXM2 16 / 32 GB: HBM2 900 GB/s (V100 data sheet); AWS p3.16xlarge / p3dn.24xlarge, 8 GPUs.
    "v100-16gb": HardwareProfile("v100-16gb", "V100", 16.0, 900 * GB, 8, _NVLINK_V100, _ENA_P3,
                                 source="V100 SXM2 16GB on AWS p3.16xlarge"),
    "v100-32gb": HardwareProfile("v100-32gb", "V100", 32.0, 900 * GB, 8, _NVLINK_V100, _EFA_P3DN,
                                 source="V100 SXM2 32GB on AWS p3dn.24xlarge"),
    # A100 40 GB SXM4: HBM2 1,555 GB/s (A100 data sheet); AWS p4d.24xlarge: 8 GPUs, NVSwitch, 400 Gb/s EFA.
    "a100-40gb": HardwareProfile("a100-40gb", "A100", 40.0, 1555 * GB, 8, _NVLINK_A100, _EFA_P4,
                                 source="A100 SXM4 40GB on AWS p4d.24xlarge"),
    # A100 80 GB SXM4: HBM2e 2,039 GB/s (A100 data sheet); AWS p4de.24xlarge: same fabric as p4d.
    "a100-80gb": HardwareProfile("a100-80gb", "A100", 80.0, 2039 * GB, 8, _NVLINK_A100, _EFA_P4,
                                 source="A100 SXM4 80GB on AWS p4de.24xlarge"),
    # DGX A100 (80 GB): A100 SXM4 80 GB, NVSwitch, 8 x 200 Gb/s HDR InfiniBand (DGX SuperPOD).
    "dgx-a100": HardwareProfile("dgx-a100", "A100", 80.0, 2039 * GB, 8, _NVLINK_A100, _IB_8X200,
                                source="A100 SXM4 80GB, DGX A100 fabric (8 x 200 Gb/s HDR)"),
    # H100 SXM5 80 GB: HBM3 3.35 TB/s (H100 data sheet); DGX H100: 8 x 400 Gb/s InfiniBand.
    "h100-sxm": HardwareProfile("h100-sxm", "H100", 80.0, 3350 * GB, 8, _NVLINK_H, _IB_8X400,
                                reduction_efficiency=_HOPPER_REDUCTION, source="H100 SXM5 80GB, DGX H100 fabric"),
    # H100 PCIe 80 GB: HBM2e 2 TB/s (H100 PCIe data sheet); 8 cards on PCIe Gen5, no NVLink bridges.
    "h100-pcie": HardwareProfile("h100-pcie", "H100 PCIe", 80.0, 2000 * GB, 8, _PCIE_GEN5, _NET_PCIE_SERVER,
                                 reduction_efficiency=_HOPPER_REDUCTION, source="H100 PCIe 80GB, 8 cards on PCIe Gen5"),
    # H100 NVL 94 GB: HBM3 3.9 TB/s (H100 data sheet, NVL column); 8 cards, NVLink-bridged in pairs.
    "h100-nvl": HardwareProfile("h100-nvl", "H100 NVL", 94.0, 3900 * GB, 8, _PCIE_GEN5, _NET_PCIE_SERVER,
                                bridge=_BRIDGE_H100_NVL, bridge_chips=2,
                                reduction_efficiency=_HOPPER_REDUCTION, source="H100 NVL 94GB, 8 cards on PCIe Gen5, NVLink bridge per pair"),
    # H200 SXM 141 GB: HBM3e 4.8 TB/s (H200 data sheet); DGX H200: 8 x 400 Gb/s InfiniBand.
    "h200": HardwareProfile("h200", "H200", 141.0, 4800 * GB, 8, _NVLINK_H, _IB_8X400,
                            reduction_efficiency=_HOPPER_REDUCTION, source="H200 SXM 141GB, DGX H200 fabric"),
    # H200 NVL 141 GB: HBM3e 4.8 TB/s (H200 data sheet, NVL column); 8 cards, 4-way NVLink bridges.
    "h200-nvl": HardwareProfile("h200-nvl", "H200 NVL", 141.0, 4800 * GB, 8, _PCIE_GEN5, _NET_PCIE_SERVER,
                                bridge=_BRIDGE_H200_NVL, bridge_chips=4,
                                reduction_efficiency=_HOPPER_REDUCTION, source="H200 NVL 141GB, 8 cards on PCIe Gen5, 4-way NVLink bridges"),
    # GH200: the Hopper GPU of a Grace Hopper superchip, 96 GB HBM3 at 4 TB/s (GH200 480GB) or 144 GB
    # HBM3e at 4.9 TB/s (GH200 data sheet), one superchip per node.
    "gh200": HardwareProfile("gh200", "GH200", 96.0, 4000 * GB, 1, _NET_GH200, _NET_GH200,
                             reduction_efficiency=_HOPPER_REDUCTION, source="GH200 96GB HBM3, one superchip per node, 400 Gb/s"),
    "gh200-144gb": HardwareProfile("gh200-144gb", "GH200", 144.0, 4900 * GB, 1, _NET_GH200, _NET_GH200,
                                   reduction_efficiency=_HOPPER_REDUCTION, source="GH200 144GB HBM3e, one superchip per node, 400 Gb/s"),
}

# vCPUs per node of the instances these profiles describe (AWS's instance pages), hyperthreads two per
# physical core: p4d/p4de.24xlarge (8 A100) 96 (48 cores); p5.48xlarge (8 H100) and p5e/p5en.48xlarge
# (8 H200) 192 (96 cores). A cluster file based on one of them inherits its CPUs unless it gives its own.
for _name, _vcpus in {"a100-40gb": 96, "a100-80gb": 96, "h100-sxm": 192, "h200": 192}.items():
    PROFILES[_name] = PROFILES[_name].replace(cpus_per_node=float(_vcpus), cpus_are_vcpus=True)

# The profiles of each ``PEAK_TFLOPS`` chip, by the smallest device memory (GiB) each is chosen from:
# CUDA reports a little less than the marketed size (an A100 80GB has 79.2 GiB).
_BY_CHIP: dict[str, list[tuple[float, str]]] = {
    "V100": [(0.0, "v100-16gb"), (24.0, "v100-32gb")],
    "A100": [(0.0, "a100-40gb"), (60.0, "a100-80gb")],
    "H100": [(0.0, "h100-sxm")],
    "H100 PCIe": [(0.0, "h100-pcie")],
    "H100 NVL": [(0.0, "h100-nvl")],
    "H200": [(0.0, "h200")],
    "H200 NVL": [(0.0, "h200-nvl")],
    "GH200": [(0.0, "gh200"), (120.0, "gh200-144gb")],
}


class UnknownAcceleratorWarning(UserWarning):
    """A GPU without a profile of its own is projected with :func:`generic_gpu_profile`."""


class UnknownMemoryWarning(UserWarning):
    """A chip sold with several memory sizes was named without its memory size: the smallest is assumed."""


def cpu_profile(memory_gib: float = 8.0, memory_bw: float = 10 * GB, chips_per_node: int = 2,
                peaks: Optional[dict] = None) -> HardwareProfile:
    """A host's CPU workers (one 'chip' = one worker): shared-memory gloo links until measured; ``peaks``:
    the host's measured matmul rates by dtype key (:func:`rayvit.measure.host.cpu_peaks`), without which
    nothing unmeasured can be priced on it.

    Overlap is 0: a worker with one core runs gloo's transfer and its compute on that same core.
    The per-tensor optimizer cost is Python/dispatcher overhead on CPU (tens of microseconds).
    """
    gloo = Link(0.7 * GB, 1e-3, "gloo on one host (docs/projection.md: measured links on CPU hosts)")
    # speed_cv 0: on CPUs the measured links carry the host's wait for the slowest rank itself; the memory
    # bandwidth is the measured copy rate (memory_efficiency 1).
    # compute_efficiency: share of a 1024^2 matmul's rate a tiny ViT's step reaches on one core (its
    # matmuls are small and its elementwise work uncounted); 0.3 is assumed, used only when no
    # single-chip rate was measured.
    return HardwareProfile("cpu", None, memory_gib, memory_bw, chips_per_node, gloo, gloo,
                           compute_efficiency=0.3, overlap=0.0, overlap_slowdown=0.0, memory_efficiency=1.0,
                           speed_cv=0.0,
                           per_tensor_s={"loop": 60e-6, "foreach": 30e-6, "fused": 30e-6},
                           reserved_gib=0.0, fragmentation=0.0, source="local CPU workers, gloo",
                           measured_peaks=dict(peaks or {}))


def generic_gpu_profile(name: str, memory_bytes: Optional[float] = None) -> HardwareProfile:
    """A GPU the profiles do not know: its own memory size, conservative links until the sweep's
    microbenchmark measures them (:func:`with_measured_links`), no peak (a measured rate is needed).

    Stated assumptions: 8 cards per node on PCIe Gen4 x16 (32 GB/s each way x 0.75), 100 Gb/s of network
    per node, 1 TB/s of memory bandwidth, 16 GiB when the memory size is not known; GPU overlap (0.9).
    """
    pcie4 = Link(32 * GB * _NVLINK_EFF, 25e-6, "PCIe Gen4 x16: 32 GB/s each way x 0.75 (assumed)", hw="pci")
    net = Link(100 / 8 * GB * _NET_EFF, 50e-6, "100 Gb/s per node x 0.8 (assumed)", hw="net")
    memory_gib = memory_bytes / GIB if memory_bytes else 16.0
    return HardwareProfile("gpu", name, memory_gib, 1000 * GB, 8, pcie4, net,
                           source=f"{name}: generic GPU profile ({memory_gib:.0f} GiB"
                                  f"{'' if memory_bytes else ', assumed'}; links and memory bandwidth assumed)")


def get_profile(name: str, cpu_peaks: Optional[dict] = None) -> HardwareProfile:
    """The profile named ``name``; ``cpu`` is this host's workers, with ``cpu_peaks`` (its measured rates);
    a path ending in .yaml / .yml is a cluster the user describes (:mod:`rayvit.projection.cluster_file`)."""
    from rayvit.projection import cluster_file

    if cluster_file.is_cluster_file(name):
        return cluster_file.load_cluster_file(name, PROFILES, NET_EFFICIENCY)
    if name == "cpu":
        return cpu_profile(peaks=cpu_peaks)
    try:
        return PROFILES[name]
    except KeyError:
        raise ConfigError(f"unknown hardware profile {name!r}; choose one of: "
                          f"{', '.join([*PROFILES, 'cpu'])}, or a cluster file (.yaml: cluster/example_cluster.yaml)"
                          ) from None


def profile_for_accelerator(accelerator: Optional[str], memory_bytes: Optional[float] = None) -> HardwareProfile:
    """The profile for a measured run's ``accelerator`` condition ('A100', 'H100 NVL', 'cpu', ...).

    ``memory_bytes``: the device's memory (the run's ``device_memory_bytes`` condition, CUDA's
    ``total_memory``), which tells an A100 40 GB from an 80 GB, a V100 16 GB from a 32 GB and a GH200 96 GB
    from a 144 GB. Without it the smallest variant is taken, with an :class:`UnknownMemoryWarning`. Any
    other GPU name gets :func:`generic_gpu_profile` and an :class:`UnknownAcceleratorWarning`; ``None`` or
    ``'cpu'`` the CPU profile.
    """
    if accelerator is None or accelerator.lower() == "cpu":
        return cpu_profile()
    choices = _BY_CHIP.get(accelerator)
    if choices:
        if not memory_bytes and len(choices) > 1:
            warnings.warn(f"{accelerator} comes with several memory sizes and none was given: projecting with "
                          f"{choices[0][1]}; results record the device's memory as device_memory_bytes",
                          UnknownMemoryWarning, stacklevel=2)
        gib = memory_bytes / GIB if memory_bytes else 0.0
        return PROFILES[[name for least, name in choices if gib >= least][-1]]
    profile = generic_gpu_profile(accelerator, memory_bytes)
    warnings.warn(f"no hardware profile for GPU {accelerator!r}: projecting with a generic GPU profile "
                  f"({profile.source}); add the chip to rayvit.accelerators (PEAK_TFLOPS, CHIPS) and a profile to "
                  f"rayvit.projection.profiles for figures of its own", UnknownAcceleratorWarning, stacklevel=2)
    return profile


def describe_links(links: dict[str, Any]) -> str:
    """One line per collective: latency and bus bandwidth, as measured; then the wait for the slowest rank
    and each strategy's own host path per collective, where measured."""
    during = " (read between the rounds)" if links.get("host_waits_during_rounds") else ""
    curve = links.get("host_wait_curve")
    head = (f"collectives over {links['world_size']} {links['backend']} ranks on {links['nodes']} node(s) "
            f"(shared-host slowdown {links.get('shared_host_slowdown', 1):.2f}, memory copy "
            f"{links.get('memory_bw', 0) / 1e9:.1f} GB/s, {links.get('seconds', 0):.1f} s)")
    if not curve:
        head += f"; latency includes {links.get('host_wait_s', 0) * 1e6:.0f} us waiting for the slowest rank{during}"
    lines = [head + ":"]
    latency = "transfer_latency_s" if curve else "latency_s"
    for kind, c in links["collectives"].items():
        lines.append(f"  {kind:<15} latency {c.get(latency, c['latency_s']) * 1e6:8.0f} us  "
                     f"busbw {c['busbw'] / 1e9:7.2f} GB/s")
    if curve:
        lines.append(f"  each message also waits for the slowest rank, more the longer the compute before it{during}: "
                     + ", ".join(f"{w * 1e6:.0f} us after {g * 1e3:g} ms" for g, w in curve))
    for name, seconds in (links.get("collective_path_s") or {}).items():
        lines.append(f"  {name}'s own host path per collective (beyond its one-rank path): {seconds * 1e6:.0f} us")
    return "\n".join(lines)
