"""What each known accelerator computes: data-sheet peaks and the figures the projection's roofline needs.

No torch here: MFU (``rayvit.training.hardware``), config validation and the analytic projection all read
these tables, and the projection must not import torch.

Dense (no sparsity) peak TFLOP/s per dtype, from NVIDIA's data sheets (the sheets' larger Tensor Core
figures are with 2:4 sparsity, twice these):

- V100 SXM2: "NVIDIA Tesla V100 GPU Architecture" whitepaper (15.7 fp32, 125 fp16 tensor; no bf16 units:
  bf16 runs at the fp32 rate).
- A100 SXM4: "NVIDIA A100 Tensor Core GPU" data sheet (19.5 fp32, 156 tf32, 312 fp16/bf16); the PCIe
  cards have the same figures.
- H100 SXM5: "NVIDIA H100 Tensor Core GPU" data sheet (67 fp32, 494.7 tf32, 989.4 fp16/bf16).
- H100 PCIe: "NVIDIA H100 Tensor Core GPU Architecture" whitepaper, H100 PCIe column (51.2 fp32, 378 tf32,
  756 fp16/bf16): fewer SMs (114) at lower clocks and 350 W.
- H100 NVL: "NVIDIA H100 Tensor Core GPU" data sheet, H100 NVL column, per GPU (60 fp32, 835 tf32 and
  1,671 fp16/bf16 with sparsity, so 417.5 and 835.5 dense).
- H200 SXM: "NVIDIA H200 Tensor Core GPU" data sheet, same compute as H100 SXM (more, faster memory).
- H200 NVL: "NVIDIA H200 Tensor Core GPU" data sheet, H200 NVL column (60 fp32, 835 tf32 and 1,671
  fp16/bf16 with sparsity): the PCIe card at up to 600 W, same compute as the H100 NVL.
- GH200: "NVIDIA GH200 Grace Hopper Superchip" data sheet: its Hopper GPU has the H100 SXM's compute
  (67 fp32, 494 tf32, 990 fp16/bf16 dense) with 96 GB HBM3 (4 TB/s) or 144 GB HBM3e (4.9 TB/s).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "V100": {"fp32": 15.7, "tf32": 15.7, "fp16": 125.0, "bf16": 15.7},
    "A100": {"fp32": 19.5, "tf32": 156.0, "fp16": 312.0, "bf16": 312.0},
    "H100": {"fp32": 67.0, "tf32": 494.7, "fp16": 989.4, "bf16": 989.4},
    "H100 PCIe": {"fp32": 51.2, "tf32": 378.0, "fp16": 756.0, "bf16": 756.0},
    "H100 NVL": {"fp32": 60.0, "tf32": 417.5, "fp16": 835.5, "bf16": 835.5},
    "H200": {"fp32": 67.0, "tf32": 494.7, "fp16": 989.4, "bf16": 989.4},
    "H200 NVL": {"fp32": 60.0, "tf32": 417.5, "fp16": 835.5, "bf16": 835.5},
    "GH200": {"fp32": 67.0, "tf32": 494.7, "fp16": 989.4, "bf16": 989.4},
}

# Chips without bf16 tensor cores: a bf16 matmul runs at the fp32 rate there.
NO_BF16_TENSOR_CORES = ("V100",)


@dataclass(frozen=True)
class ChipSpec:
    """What the roofline needs beyond the peak: how many SMs share it, how much of it a matmul sustains,
    and which attention kernel a half-precision SDPA gets.

    ``gemm_efficiency``: the largest fraction of the dense half-precision peak a single matmul reaches
    (its best shape, in a short burst at boost clock). ``sustained_clock``: the fraction of that rate a chip
    keeps when it computes for minutes at its power limit, as training does. ``flash``: FlashAttention-2
    runs here (sm80 and newer); ``flash_efficiency``: its forward and backward fraction of the peak at long
    sequences.
    """

    name: str
    generation: str
    sms: int
    gemm_efficiency: float
    gemm_source: str
    sustained_clock: float
    flash: bool
    flash_efficiency: tuple[float, float]
    flash_source: str

    @property
    def sustained_gemm_efficiency(self) -> float:
        return self.gemm_efficiency * self.sustained_clock

    def flops_per_sm_per_clock(self, peak_flops: float, clock_hz: float) -> float:
        return peak_flops / (self.sms * clock_hz)


# gemm_efficiency: the "Maximum Achievable Matmul FLOPS" (MAMF) table of stas00/ml-engineering
# (compute/accelerator/README.md; mean of 100 bf16 matmuls after 50 warm-up, best shape of a brute-force
# search): A100 SXM 271.2 of 312 (86.9%), GH200 828.6 of 989 (83.8%, 900 W module), H100 SXM 794.5 of 989
# (80.3%, "H200 is the same"). No row exists for V100 or the PCIe/NVL Hopper cards: V100 takes the A100's
# figure, the Hopper cards the H100 SXM's (stated assumptions).
# sustained_clock: the same table's "maximum sustainable matmul FLOPS" (MSMF, measured after the GPU has
# settled at its power limit) against its burst figure: H200 702.9 / 828.0 = 0.85 (saturated clock ~1.45
# GHz against 1.98 boost; "H200 is the same" silicon as H100, taken for every Hopper part). A100: no MSMF
# row; NVIDIA's HPL practice quotes the clock an A100 sustains at its power limit, 1305 of 1410 MHz = 0.93
# (glennklockwood.com "peak-FLOPS"), taken for V100 too.
# flash_efficiency: FlashAttention-2 (Dao, 2023) reaches up to 73% of the A100's peak forward and 63%
# backward at long sequences. On H100 "FlashAttention-2 achieving only 35% utilization" (FlashAttention-3
# paper, Shah et al. 2024, abstract; FA3 itself is not what PyTorch's SDPA runs): 35% forward, and backward
# at the A100's backward/forward ratio of that, 0.35 x 63/73 = 30% (an assumption; the paper's own backward
# figures are for FA3). Taken for every Hopper part. V100 has no FlashAttention-2 (sm80+ only): SDPA uses
# its memory-efficient kernel there, taken at half the A100's fraction (assumption).
_MAMF = "stas00/ml-engineering MAMF table"
_FA2_HOPPER = (0.35, 0.30)
_FA2 = "FlashAttention-2 paper (A100), FlashAttention-3 paper (FA2 on H100)"
CHIPS: dict[str, ChipSpec] = {
    "V100": ChipSpec("V100", "volta", 80, 0.869, "assumed equal to the A100's MAMF fraction", 0.926, False,
                     (0.35, 0.30), "memory-efficient SDPA kernel, assumed"),
    "A100": ChipSpec("A100", "ampere", 108, 0.869, f"{_MAMF}: A100 SXM 271.2/312", 0.926, True, (0.73, 0.63), _FA2),
    "H100": ChipSpec("H100", "hopper", 132, 0.803, f"{_MAMF}: H100 SXM 794.5/989", 0.849, True, _FA2_HOPPER, _FA2),
    "H100 PCIe": ChipSpec("H100 PCIe", "hopper", 114, 0.803, "assumed equal to the H100 SXM's MAMF fraction",
                          0.849, True, _FA2_HOPPER, _FA2),
    "H100 NVL": ChipSpec("H100 NVL", "hopper", 132, 0.803, "assumed equal to the H100 SXM's MAMF fraction",
                         0.849, True, _FA2_HOPPER, _FA2),
    "H200": ChipSpec("H200", "hopper", 132, 0.803, f"{_MAMF}: H100 SXM 794.5/989, 'H200 is the same'", 0.849, True,
                     _FA2_HOPPER, _FA2),
    "H200 NVL": ChipSpec("H200 NVL", "hopper", 132, 0.803, "assumed equal to the H100 SXM's MAMF fraction",
                         0.849, True, _FA2_HOPPER, _FA2),
    "GH200": ChipSpec("GH200", "hopper", 132, 0.838, f"{_MAMF}: GH200 828.6/989 (900 W)", 0.849, True, _FA2_HOPPER,
                      _FA2),
}

# The tensor-core clock each dense peak is quoted at (boost), GHz: V100 SXM2 1.53, A100 1.41, H100 SXM and
# its siblings 1.83 (989.4 TFLOPS = 132 SMs x 4096 FLOPs/clock x 1.83 GHz), H100 PCIe 1.62 (756 =
# 114 x 4096 x 1.62). The roofline derives each SM's rate per clock from these.
BOOST_CLOCK_GHZ = {"V100": 1.53, "A100": 1.41, "H100": 1.83, "H100 PCIe": 1.62, "H100 NVL": 1.545,
                   "H200": 1.83, "H200 NVL": 1.545, "GH200": 1.83}


def accelerator_for_name(device_name: str) -> Optional[str]:
    """The ``PEAK_TFLOPS`` entry for a CUDA device name, or None for a chip the table does not know.

    CUDA names the SXM parts without a suffix ('NVIDIA H100 80GB HBM3', 'NVIDIA H200') and the cards with
    one ('NVIDIA H100 PCIe', 'NVIDIA H100 NVL', 'NVIDIA H200 NVL'); the Grace Hopper superchip is 'NVIDIA
    GH200 480GB'. Names are compared word by word (split at spaces and dashes), so 'GH200' is never read
    as 'H200', and variants are matched first, so a card never gets its SXM sibling's figures.
    """
    words = {w.upper() for w in re.split(r"[^0-9A-Za-z]+", device_name) if w}
    for known in sorted(PEAK_TFLOPS, key=len, reverse=True):      # "H100 NVL" before "H100"
        chip, _, variant = known.upper().partition(" ")
        if chip in words and (not variant or variant in words):
            return known
    return None


__all__ = ["PEAK_TFLOPS", "CHIPS", "ChipSpec", "BOOST_CLOCK_GHZ", "NO_BF16_TENSOR_CORES", "accelerator_for_name"]
