"""The GPU profiles the projection reads a chip by: every CUDA device name rayvit knows reaches a profile of
its own (memory size deciding the variant), a GH200 is never an H200, and an unknown GPU gets a generic GPU
profile, never the CPU's."""

from __future__ import annotations

import pytest

from rayvit.config import load_config
from rayvit.projection.insweep import sweep_profile
from rayvit.projection.profiles import get_profile

# Every name rayvit.training.hardware.accelerator_for_name returns (the PEAK_TFLOPS keys), reached from
# the CUDA device names the chips report, with their memory as CUDA gives it (bytes).
DEVICES = [("Tesla V100-SXM2-16GB", 16.9e9, "V100", "v100-16gb"), ("Tesla V100-SXM2-32GB", 34.1e9, "V100", "v100-32gb"),
           ("NVIDIA A100-SXM4-40GB", 42.3e9, "A100", "a100-40gb"), ("NVIDIA A100-SXM4-80GB", 85.1e9, "A100", "a100-80gb"),
           ("NVIDIA A100 80GB PCIe", 85.1e9, "A100", "a100-80gb"), ("NVIDIA H100 80GB HBM3", 85.0e9, "H100", "h100-sxm"),
           ("NVIDIA H100 PCIe", 85.0e9, "H100 PCIe", "h100-pcie"), ("NVIDIA H100 NVL", 99.9e9, "H100 NVL", "h100-nvl"),
           ("NVIDIA H200", 150.1e9, "H200", "h200"), ("NVIDIA H200 NVL", 150.1e9, "H200 NVL", "h200-nvl"),
           ("NVIDIA GH200 480GB", 102.0e9, "GH200", "gh200"), ("NVIDIA GH200 144G HBM3e", 153.0e9, "GH200", "gh200-144gb")]


@pytest.mark.parametrize("device_name, memory_bytes, accelerator, profile_name", DEVICES)
def test_every_known_gpu_variant_has_a_profile_of_its_own(device_name, memory_bytes, accelerator, profile_name):
    import warnings

    from rayvit.projection.profiles import profile_for_accelerator
    from rayvit.training.hardware import PEAK_TFLOPS, accelerator_for_name

    assert accelerator_for_name(device_name) == accelerator
    with warnings.catch_warnings():
        warnings.simplefilter("error")                     # a known chip is never "unknown"
        profile = profile_for_accelerator(accelerator, memory_bytes)
    assert profile.name == profile_name and profile.accelerator == accelerator
    assert profile.peak_flops("bf16") == PEAK_TFLOPS[accelerator]["bf16"] * 1e12
    assert profile.memory_gib == pytest.approx(memory_bytes / 2 ** 30, rel=0.05)   # the device's size
    # Eight GPUs per node, but a GH200 superchip is a node of its own.
    assert profile.overlap == 0.9 and profile.chips_per_node == (1 if accelerator == "GH200" else 8)
    assert profile.reserved_gib > 0
    # Without a memory size, a chip sold in several sizes falls back to its smallest variant, and says so.
    if accelerator in ("A100", "V100", "GH200"):
        from rayvit.projection.profiles import UnknownMemoryWarning

        with pytest.warns(UnknownMemoryWarning, match="device_memory_bytes"):
            assert profile_for_accelerator(accelerator).accelerator == accelerator
    else:
        assert profile_for_accelerator(accelerator).accelerator == accelerator


def test_every_accelerator_name_is_covered_and_variants_differ():
    from rayvit.projection.profiles import PROFILES, profile_for_accelerator
    from rayvit.training.hardware import PEAK_TFLOPS

    assert {d[2] for d in DEVICES} == set(PEAK_TFLOPS)
    # Every profile but the fabric variants, which a user names (dgx-a100: an A100 80GB on HDR InfiniBand).
    assert {d[3] for d in DEVICES} == set(PROFILES) - {"dgx-a100"}
    assert profile_for_accelerator("A100", 42.3e9).name == "a100-40gb"
    assert profile_for_accelerator("A100", 85.1e9).memory_bw > profile_for_accelerator("A100", 42.3e9).memory_bw
    sxm, pcie, nvl = (get_profile(n) for n in ("h100-sxm", "h100-pcie", "h100-nvl"))
    assert sxm.link("all_reduce", 8).busbw > nvl.link("all_reduce", 8).busbw == pcie.link("all_reduce", 8).busbw
    # The NVL cards' NVLink bridges carry collectives within a bridged pair (H100 NVL) or four (H200 NVL).
    assert nvl.link("all_gather", 2).busbw == 225e9 and nvl.link("all_gather", 4).busbw == 48e9
    assert get_profile("h200-nvl").link("all_gather", 4).busbw == 337.5e9
    assert profile_for_accelerator("cpu").name == profile_for_accelerator(None).name == "cpu"


def test_a_gh200_is_never_read_as_an_h200():
    """'NVIDIA GH200 480GB' contains 'H200': names are compared word by word, so it gets its own entry."""
    from rayvit.accelerators import accelerator_for_name
    from rayvit.projection.profiles import profile_for_accelerator

    assert accelerator_for_name("NVIDIA GH200 480GB") == "GH200"
    assert accelerator_for_name("NVIDIA H200") == "H200" and accelerator_for_name("NVIDIA H200 NVL") == "H200 NVL"
    assert accelerator_for_name("NVIDIA H100 80GB HBM3") == "H100" and accelerator_for_name("NVIDIA L4") is None
    profile = profile_for_accelerator("GH200", 102.0e9)
    assert profile.name == "gh200" and profile.memory_bw == 4000e9 and profile.memory_gib == 96.0


def test_an_unknown_gpu_gets_a_generic_gpu_profile_with_a_warning_never_the_cpu_one():
    from rayvit.projection.profiles import UnknownAcceleratorWarning, profile_for_accelerator

    with pytest.warns(UnknownAcceleratorWarning, match="'NVIDIA L4'"):
        profile = profile_for_accelerator("NVIDIA L4", 24.0 * 2 ** 30)
    assert profile.name == "gpu" and profile.accelerator == "NVIDIA L4" and profile.memory_gib == 24.0
    assert profile.overlap == 0.9 and profile.peak_flops("bf16") is None and profile.reserved_gib > 0

    # In a sweep: the device's memory and the links the microbenchmark measured.
    cfg = load_config(overrides=["parallel.use_gpu=true", "parallel.num_workers=2"])
    links = {"backend": "nccl", "world_size": 2, "nodes": 1, "device_name": "NVIDIA L4",
             "device_memory_bytes": 23.6 * 2 ** 30, "memory_bw": 250e9,
             "collectives": {"all_reduce": {"latency_s": 3e-5, "busbw": 20e9}}}
    with pytest.warns(UnknownAcceleratorWarning):
        profile = sweep_profile(cfg, [{"accelerator": "NVIDIA L4"}], links)
    assert profile.name == "gpu" and profile.memory_gib == pytest.approx(23.6) and profile.memory_bw == 250e9
    assert profile.link("all_reduce", 2).busbw == 20e9
    # A GPU sweep with nothing known about its chip yet is still projected as a GPU.
    with pytest.warns(UnknownAcceleratorWarning):
        assert sweep_profile(cfg, [], None).overlap == 0.9
    assert sweep_profile(cfg, [{"accelerator": "A100"}], {**links, "device_name": "A100",
                                                           "device_memory_bytes": 85.1e9}).name == "a100-80gb"
    # Without links the points' own conditions say which variant they ran on.
    rows = [{"accelerator": "A100", "device_memory_bytes": 85.1e9}]
    assert sweep_profile(cfg, rows, None).name == "a100-80gb"
    assert sweep_profile(cfg, [{"accelerator": "A100", "device_memory_bytes": 42.3e9}], None).name == "a100-40gb"
