"""Forward and backward time of one training step on one GPU, from the ViT's operations and their shapes.

Each operation of ``models/vit.py``'s forward, and the ones autograd runs for it in backward, is costed
by what bounds it on the chip (:class:`Chip`):

- **matmuls** (``Linear``/patchify conv as GEMMs; the attention's batched matmuls on the math path): the
  tiles cuBLAS would launch (128x128, 128x256 and 256x128; NVIDIA's "Matrix Multiplication Background
  User's Guide" lists them as its most efficient and explains both effects below) run in waves over the
  SMs, so a GEMM costs ``waves x tile time``: *tile quantisation* (an edge tile computes a full tile) and
  *wave quantisation* (a last wave that fills few SMs costs a whole wave) follow from the shape. A tile's
  time is its FLOPs at the SM's sustained rate (the chip's best-shape matmul efficiency, ``ChipSpec.
  gemm_efficiency``, at the clock it sustains at its power limit, ``ChipSpec.sustained_clock``: both from
  published maximum achievable/sustainable matmul measurements) plus a fixed ``TILE_OVERHEAD_CYCLES``
  (filling the load pipeline, writing the tile out), which is why short-K GEMMs reach less of the peak,
  and more so on chips whose SMs compute more per clock; every GEMM launch costs ``GEMM_LAUNCH_S`` more
  (launch, ramp-up, the tail). GEMMs of fewer tiles than SMs split K (as cuBLAS's split-K kernels do) and
  pay for the partial sums' reduction. No GEMM runs faster than its operands stream from memory.
- **attention** (``F.scaled_dot_product_attention``): FlashAttention-2 on half precision from sm80
  (A100, H100), its forward and backward at the published fraction of the peak (``ChipSpec.
  flash_efficiency``), reduced for short sequences (each CTA's fixed work against its loop over
  ``S / 128`` key blocks) and for head dims that are not a multiple of 32; elsewhere the math path
  (two batched GEMMs and a softmax over the ``heads x S x S`` matrix at memory bandwidth).
- **memory-bound operations** (LayerNorm, GELU, residual adds, dropout, dtype casts, the attention
  output's transpose copy, bias gradients): the bytes each reads and writes at the chip's HBM bandwidth
  x ``memory_efficiency``; under ``model.compile`` the elementwise chains between two matmuls are fused
  (each chain reads its inputs and writes its outputs once).
- every kernel adds a launch gap, and the host cannot issue kernels faster than ``host_op_s`` each (eager
  PyTorch's dispatch; a compiled block issues a third as many): a small model's step is host-bound.

The optimizer is not here: ``performance.optimizer_time`` costs it at memory bandwidth.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

from rayvit.accelerators import BOOST_CLOCK_GHZ, CHIPS, NO_BF16_TENSOR_CORES, ChipSpec
from rayvit.config_schema import Config
from rayvit.models.activation_checkpointing import checkpointed_blocks
from rayvit.strategies.dtypes import FULL, HALF
from rayvit.strategies.shapes import sequence_length, vit_tensors
from rayvit.strategies.registry import dtypes_of

TILES = ((128, 128), (128, 256), (256, 128))
# Cycles a GEMM tile spends beyond its math (the first loads of its software pipeline, its epilogue), and
# the fixed cost of one GEMM launch: read off XLA's measured H100 matmul table (openxla/xla
# xla/service/gpu/model/matmul_interpolator_data.h, sm_90, bf16), where 4096x4096 GEMMs run at 783 TFLOPS
# with K=4096, 674 with K=1024 (batch 4, N=1024), 620 with K=512 (batch 4) and 392 with K=256, and a
# 2048^3 GEMM (one wave of tiles) at 632: K-loop overhead ~2,500 cycles per tile and ~4 us per launch
# reproduce those within ~10%. Taken for every chip (the same pipeline structure; an assumption).
TILE_OVERHEAD_CYCLES = 2500
GEMM_LAUNCH_S = 4e-6
# cuBLAS's fastest Tensor Core kernels load each operand in 16-byte vectors along the dimension that is
# contiguous in memory, so they need that dimension and each row's stride (the leading dimension) to be a
# multiple of 16 bytes: the cuBLAS documentation, "Tensor Core Usage" (section 2.1.11 since CUDA 11), lists
# exactly those conditions, per operand, in its column-major terms ((op_A == N ? m : k), (op_B == N ? k : n),
# m of C, lda, ldb, ldc); the other dimension of each operand, the one a tile only strides along, is not among
# them. In a Linear's three GEMMs the token count is that other dimension everywhere (rows of X and Y; the
# reduced K of the weight gradient, whose operands are X and dY read along their feature dimension): it never
# needs aligning, whatever the batch. Below the documented conditions cuBLAS falls back to kernels with
# narrower loads. Assumed: half the rate (no published measurement of the fallback's speed was found).
MISALIGNED_RATE = 0.5
SPLIT_K_MIN = 512           # split-K keeps at least this much K per part
# Memory-bound operations that reduce along a row (their kernels, not their bytes, set their speed: profiles
# ``reduction_efficiency``): a LayerNorm and its backward, a softmax, a loss, a bias gradient's sum, a mean.
REDUCTIONS = ("layernorm", "softmax", "bias grads", "pool", "loss")
FLASH_BLOCK = 128           # FlashAttention-2's query/key block rows
FLASH_HEAD_DIMS = (32, 64, 96, 128, 160, 192, 224, 256)


@dataclass(frozen=True)
class Chip:
    """One GPU as the roofline sees it, in the precision a step computes in."""

    spec: ChipSpec
    peak: float                 # dense FLOP/s for the compute dtype
    memory_bw: float            # bytes/s achievable by streaming kernels (data sheet x efficiency)
    clock_hz: float
    half: bool                  # tensor-core half-precision matmuls (flash attention needs them)
    kernel_gap_s: float
    host_op_s: float
    reduction_bw: float = 0.0   # bytes/s reduction kernels reach (norms, softmax, sums); 0: memory_bw

    def stream_s(self, nbytes: float, name: str = "") -> float:
        """Seconds a memory-bound kernel named ``name`` takes over ``nbytes``: reductions (:data:`REDUCTIONS`)
        at ``reduction_bw``, everything else at ``memory_bw``."""
        reduces = self.reduction_bw and any(word in name for word in REDUCTIONS)
        return nbytes / (self.reduction_bw if reduces else self.memory_bw)

    @property
    def sm_rate(self) -> float:
        """FLOP/s one SM sustains in a large GEMM at the chip's power limit."""
        return self.peak * self.spec.sustained_gemm_efficiency / self.spec.sms


@dataclass(frozen=True)
class Op:
    """One kernel (or a group of identical ones) of a step: what bounds it, and its time."""

    name: str
    kind: str                   # matmul, attention, memory
    phase: str                  # forward, backward
    flops: float
    bytes: float
    seconds: float
    kernels: int = 1


@dataclass
class ComputeTime:
    """Forward + backward of one step at ``batch`` images, op by op, and how it adds up."""

    batch: int
    ops: list[Op]
    recompute_s: float           # the forward of checkpointed blocks, again in backward
    host_s: float                # the host's dispatch time for every kernel
    kernel_gaps_s: float
    attention_kernel: str
    notes: list[str] = field(default_factory=list)

    def total(self, kind: Optional[str] = None, phase: Optional[str] = None) -> float:
        return sum(o.seconds for o in self.ops if (kind is None or o.kind == kind)
                   and (phase is None or o.phase == phase))

    @property
    def device_s(self) -> float:
        return self.total() + self.recompute_s + self.kernel_gaps_s

    @property
    def seconds(self) -> float:
        """The step's compute: the device's work, unless the host cannot issue kernels that fast."""
        return max(self.device_s, self.host_s)

    @property
    def forward_share(self) -> float:
        f = self.total(phase="forward")
        return f / max(self.total(), 1e-30)

    def describe(self) -> str:
        t = self.seconds
        parts = [f"matmul {self.total('matmul') / t:.0%}", f"attention ({self.attention_kernel}) "
                 f"{self.total('attention') / t:.0%}", f"memory-bound ops {self.total('memory') / t:.0%}"]
        if self.recompute_s:
            parts.append(f"recompute {self.recompute_s / t:.0%}")
        if self.host_s > self.device_s:
            parts.append(f"host-bound ({self.host_s * 1e3:.1f} ms of dispatch)")
        return ", ".join(parts)


def chip_for(profile, dtype_key: str) -> Optional[Chip]:
    """The roofline's chip for a hardware profile, or None where there is none (CPUs, unknown GPUs)."""
    spec = CHIPS.get(profile.accelerator or "")
    peak = profile.peak_flops(dtype_key)
    if spec is None or peak is None:
        return None
    half = dtype_key in ("fp16", "bf16") and not (dtype_key == "bf16" and spec.name in NO_BF16_TENSOR_CORES)
    reduction = profile.reduction_efficiency
    return Chip(spec, peak, profile.memory_bw * profile.memory_efficiency,
                BOOST_CLOCK_GHZ[spec.name] * 1e9 * spec.sustained_clock, half, profile.kernel_gap_s, profile.host_op_s,
                profile.memory_bw * reduction if reduction else 0.0)


# ------------------------------------------------------------------------------------------------
# Matmuls


def gemm_seconds(chip: Chip, m: int, n: int, k: int, *, batch: int = 1, elem: int = HALF,
                 contiguous: Optional[Sequence[int]] = None) -> float:
    """One (batched) GEMM of ``m x k`` by ``k x n``: the best of cuBLAS's large tiles, waves over the SMs.

    ``contiguous``: the dimensions the operands are laid out along in memory, which must be multiples of 16
    bytes for the fast kernels (:data:`MISALIGNED_RATE`). Default ``(k, n)``: A row-major (``m x k``, as
    activations are), B either way, C row-major; a weight gradient, whose A is a transposed view, has ``(m, n)``.
    """
    sms, best = chip.spec.sms, math.inf
    aligned = all(d * elem % 16 == 0 for d in (contiguous if contiguous is not None else (k, n)))
    rate = chip.sm_rate * (1.0 if aligned else MISALIGNED_RATE)
    for tm, tn in TILES:
        tiles = -(-m // tm) * -(-n // tn) * batch
        split = 1
        if tiles < sms:
            split = max(1, min(sms // tiles, k // SPLIT_K_MIN))
        waves = -(-tiles * split // sms)
        tile_s = 2.0 * tm * tn * -(-k // split) / rate + TILE_OVERHEAD_CYCLES / chip.clock_hz
        reduce_s = (2 * split * m * n * batch * FULL / chip.memory_bw) if split > 1 else 0.0
        best = min(best, waves * tile_s + reduce_s)
    streamed = (m * k + k * n + m * n) * elem * batch / chip.memory_bw
    return max(best, streamed) + GEMM_LAUNCH_S


def linear_ops(chip: Chip, name: str, tokens: int, d_in: int, d_out: int, elem: int,
               weight_grad: bool = True, input_grad: bool = True) -> list[Op]:
    """A Linear's forward GEMM, and in backward its input-gradient and weight-gradient GEMMs."""
    flops = 2.0 * tokens * d_in * d_out
    mem = (tokens * (d_in + d_out) + d_in * d_out) * elem
    out = [Op(name, "matmul", "forward", flops, mem, gemm_seconds(chip, tokens, d_out, d_in, elem=elem))]
    if input_grad:
        out.append(Op(f"{name} dgrad", "matmul", "backward", flops, mem,
                      gemm_seconds(chip, tokens, d_in, d_out, elem=elem)))
    if weight_grad:
        # dW = dY^T X: both read along their feature dimension; the tokens are the reduced K.
        out.append(Op(f"{name} wgrad", "matmul", "backward", flops, mem,
                      gemm_seconds(chip, d_in, d_out, tokens, elem=elem, contiguous=(d_in, d_out))))
    return out


# ------------------------------------------------------------------------------------------------
# Attention


def attention_kernel(cfg: Config, chip: Optional[Chip]) -> str:
    """Which kernel attention gets: ``model.attention=math`` its explicit matmuls and fp32 softmax; SDPA
    'flash' (half, sm80+), 'efficient' (other GPUs) or 'math' (CPUs)."""
    if chip is None or cfg.model.attention == "math":
        return "math"
    return "flash" if chip.half and chip.spec.flash else "efficient"


def attention_ops(chip: Chip, cfg: Config, batch: int, kernel: str) -> list[Op]:
    m, dt = cfg.model, dtypes_of(cfg)
    s, heads = sequence_length(m), m.num_heads
    hd = m.hidden_dim // heads
    fwd = 4.0 * batch * heads * s * s * hd
    if kernel in ("flash", "efficient"):
        padded = next((p for p in FLASH_HEAD_DIMS if p >= hd), hd)
        blocks = -(-s // FLASH_BLOCK)
        ctas = batch * heads * blocks
        waves = ctas / (-(-ctas // chip.spec.sms) * chip.spec.sms)
        shape = (s / (blocks * FLASH_BLOCK)) * (hd / padded) * waves * (s / (s + FLASH_BLOCK))
        f_eff, b_eff = chip.spec.flash_efficiency
        io = 4 * batch * s * m.hidden_dim * dt.compute
        return [Op("attention", "attention", "forward", fwd, io, fwd / (chip.peak * f_eff * shape)),
                Op("attention backward", "attention", "backward", 2.5 * fwd, 2 * io,
                   2.5 * fwd / (chip.peak * b_eff * shape), kernels=2)]
    # Math path: scores = q k^T, an fp32 softmax (cast up, softmax, cast down), out = p v; backward two
    # GEMMs per matmul and the softmax's backward (its fp32 output and gradient), plus dropout's mask.
    bh, c = batch * heads, dt.compute
    qk = gemm_seconds(chip, s, s, hd, batch=bh, elem=c)
    pv = gemm_seconds(chip, s, hd, s, batch=bh, elem=c)
    elements = bh * s * s
    drop = (2 * c + 1) if m.dropout > 0 else 0
    forward_bytes = elements * ((c + FULL) + 2 * FULL + (FULL + c) + drop)
    backward_bytes = elements * ((c + FULL) + 3 * FULL + (FULL + c) + drop)
    return [Op("q k^T", "attention", "forward", fwd / 2, elements * c, qk),
            Op("softmax", "attention", "forward", 0.0, forward_bytes, chip.stream_s(forward_bytes, "softmax"), kernels=3),
            Op("p v", "attention", "forward", fwd / 2, elements * c, pv),
            Op("attention matmuls backward", "attention", "backward", 2 * fwd, 4 * elements * c,
               2 * (qk + pv), kernels=4),
            Op("softmax backward", "attention", "backward", 0.0, backward_bytes, chip.stream_s(backward_bytes, "softmax"),
               kernels=3)]


# ------------------------------------------------------------------------------------------------
# Memory-bound operations of one encoder block, in bytes per token


def block_memory_bytes(cfg: Config, fused: bool) -> dict[tuple[str, str], float]:
    """{(name, phase): bytes per token} of one block's memory-bound operations.

    Widths: ``r`` the residual stream, ``l`` a LayerNorm's output (fp32 under autocast or fp32
    LayerNorm), ``c`` the compute dtype, ``h`` and ``m`` the block's widths.
    """
    m, dt = cfg.model, dtypes_of(cfg)
    h, w = m.hidden_dim, m.mlp_dim
    c, r = dt.compute, dt.residual
    ln_fp32 = cfg.precision.mode == "amp" or dt.layer_norm_fp32
    l_ = FULL if ln_fp32 or dt.mode == "fp32" else r
    cast = (l_ + c) * h if l_ != c else 0.0              # the matmul's input cast to the compute dtype
    # Dropout after GELU and after fc2: eager reads and writes each and writes a 1-byte mask; fused into
    # its chain, only the mask is written (and read back in backward).
    drop = (2 * c + 1) * (w + h) if m.dropout > 0 else 0.0
    drop_fused = float(w + h) if m.dropout > 0 else 0.0
    bias_grads = (3 * h + h + w + h) * c                  # sum of each Linear's output gradient
    if fused:
        # Chains between matmuls become one kernel: LayerNorm+cast, the transpose copy, residual
        # add+LayerNorm+cast, GELU(+dropout), residual add (into the next block's LayerNorm).
        fwd = {"layernorm+cast": (r + c) * h, "attention out copy": 2 * c * h,
               "add+layernorm+cast": (2 * r + c + c) * h, "gelu": 2 * c * w + drop_fused,
               "residual add": (r + c + r) * h}
        bwd = {"layernorm backward": (c + 2 * r + r) * h * 2, "attention out copy": 2 * c * h,
               "gelu backward": 3 * c * w + drop_fused, "bias grads": bias_grads}
    else:
        fwd = {"layernorm": 2 * (r + l_) * h, "casts": 2 * cast, "attention out copy": 2 * c * h,
               "residual adds": 2 * (r + c + r) * h, "gelu": 2 * c * w, "dropout": drop}
        bwd = {"layernorm backward": 2 * (l_ + r + r) * h, "casts": 2 * cast, "attention out copy": 2 * c * h,
               "residual grads": 2 * 3 * r * h, "gelu backward": 3 * c * w, "dropout": drop,
               "bias grads": bias_grads}
    return {**{(k, "forward"): v for k, v in fwd.items() if v}, **{(k, "backward"): v for k, v in bwd.items() if v}}


def block_kernels(cfg: Config, fused: bool) -> int:
    """Kernels one block launches in forward + backward (eager: every op; compiled: a third)."""
    eager = 14 + 28 + (4 if cfg.model.dropout > 0 else 0)
    return eager // 3 if fused else eager


# ------------------------------------------------------------------------------------------------
# The step


def block_ops(chip: Chip, cfg: Config, batch: int, kernel: str) -> list[Op]:
    """One encoder block's operations at ``batch`` images."""
    m = cfg.model
    tokens, h, c = batch * sequence_length(m), m.hidden_dim, dtypes_of(cfg).compute
    ops = (linear_ops(chip, "qkv", tokens, h, 3 * h, c) + linear_ops(chip, "proj", tokens, h, h, c)
           + linear_ops(chip, "fc1", tokens, h, m.mlp_dim, c) + linear_ops(chip, "fc2", tokens, m.mlp_dim, h, c)
           + attention_ops(chip, cfg, batch, kernel))
    fused = cfg.model.compile
    for (name, phase), per_token in block_memory_bytes(cfg, fused).items():
        ops.append(Op(name, "memory", phase, 0.0, per_token * tokens, chip.stream_s(per_token * tokens, name)))
    return ops


def outer_ops(chip: Chip, cfg: Config, batch: int) -> list[Op]:
    """The stem, position embedding, final LayerNorm, pooling and head, and the loss."""
    m, dt = cfg.model, dtypes_of(cfg)
    s, h, c, r = sequence_length(m), m.hidden_dim, dt.compute, dt.residual
    patches = (m.image_size // m.patch_size) ** 2
    image = batch * 3 * m.image_size ** 2
    # The stem as one GEMM (patchify) or its convolutions' implicit GEMMs; no input gradient for images.
    ops = linear_ops(chip, "stem", batch * patches, 3 * m.patch_size ** 2, h, c, input_grad=False) \
        if m.stem == "patchify" else _conv_stem_ops(chip, cfg, batch)
    tokens = batch * s
    per_token = {"pos add": (r + c + r) * h, "final layernorm": 2 * (r + FULL) * h,
                 "pool / select": r * h}
    for name, b in per_token.items():
        ops.append(Op(name, "memory", "forward", 0.0, b * tokens, chip.stream_s(b * tokens, name)))
        ops.append(Op(f"{name} backward", "memory", "backward", 0.0, 1.5 * b * tokens,
                      chip.stream_s(1.5 * b * tokens, name)))
    ops.append(Op("image read", "memory", "forward", 0.0, image * (FULL + c), image * (FULL + c) / chip.memory_bw))
    ops += linear_ops(chip, "head", batch, h, m.num_classes, c)
    return ops + autocast_weight_ops(chip, cfg)


def autocast_weight_ops(chip: Chip, cfg: Config) -> list[Op]:
    """``precision.mode=amp`` (AMP O1): the weights stay fp32 and autocast casts each matmul's weight to half on
    its first use in every forward (``torch.autocast`` caches the cast for the rest of that forward), and the
    cast's backward turns the half weight gradient into the fp32 gradient the parameter keeps: 4 + 2 bytes
    read and written per weight element each way, one kernel per weight tensor each way. O2 (``mixed``)
    keeps half weights and does neither; its master copy's casts are the optimizer's
    (``performance.optimizer_time``)."""
    if cfg.precision.mode != "amp":
        return []
    weights = [t for t in vit_tensors(cfg.model) if not t.norm and len(t.shape) > 1]
    moved = sum(t.numel for t in weights) * (FULL + HALF)
    return [Op("weight casts to half (autocast)", "memory", "forward", 0.0, moved, moved / chip.memory_bw,
               kernels=len(weights)),
            Op("weight gradient casts to fp32", "memory", "backward", 0.0, moved, moved / chip.memory_bw,
               kernels=len(weights))]


def _conv_stem_ops(chip: Chip, cfg: Config, batch: int) -> list[Op]:
    m, c = cfg.model, dtypes_of(cfg).compute
    size, c_in, ops = m.image_size, 3, []
    for i, (c_out, stride) in enumerate(zip(m.conv_stem_dims, m.conv_stem_strides)):
        size = (size - 1) // stride + 1
        pixels = batch * size * size
        ops += linear_ops(chip, f"stem conv {i}", pixels, 9 * c_in, c_out, c, input_grad=i > 0)
        b = 3 * 2 * c * c_out * pixels                    # BatchNorm + ReLU, forward and backward
        ops.append(Op(f"stem norm {i}", "memory", "forward", 0.0, b / 3, b / 3 / chip.memory_bw))
        ops.append(Op(f"stem norm {i} backward", "memory", "backward", 0.0, 2 * b / 3, 2 * b / 3 / chip.memory_bw))
        c_in = c_out
    return ops + linear_ops(chip, "stem 1x1", batch * size * size, c_in, m.hidden_dim, c)


def step_compute(cfg: Config, chip: Chip, batch: int, extra_ops: Sequence[Op] = ()) -> ComputeTime:
    """Forward + backward of one training step of ``cfg`` at ``batch`` images on ``chip``; ``extra_ops``:
    operations a model other than rayvit's ViT runs besides (a published run's heads), issued and timed
    like the rest. The same model, precision, chip and batch are costed once (``rayvit plan`` asks for each
    strategy and chip count); the result is shared: read it, never change it."""
    if extra_ops:
        return _step_compute(cfg, chip, batch, extra_ops)
    key = (repr((cfg.model, cfg.precision)), chip, batch)
    if key not in _COMPUTED:
        if len(_COMPUTED) > 4096:
            _COMPUTED.clear()
        _COMPUTED[key] = _step_compute(cfg, chip, batch, ())
    return _COMPUTED[key]


_COMPUTED: dict = {}


def _step_compute(cfg: Config, chip: Chip, batch: int, extra_ops: Sequence[Op]) -> ComputeTime:
    kernel = attention_kernel(cfg, chip)
    block = block_ops(chip, cfg, batch, kernel)
    depth = cfg.model.depth
    ops = [Op(o.name, o.kind, o.phase, o.flops * depth, o.bytes * depth, o.seconds * depth, o.kernels * depth)
           for o in block] + outer_ops(chip, cfg, batch) + list(extra_ops)
    block_forward = sum(o.seconds for o in block if o.phase == "forward")
    recompute = len(checkpointed_blocks(cfg.model)) * block_forward
    kernels = depth * block_kernels(cfg, cfg.model.compile) + 30 + sum(o.kernels for o in extra_ops) \
        + sum(o.kernels for o in autocast_weight_ops(chip, cfg))
    notes = []
    if not chip.half and cfg.precision.mode != "fp32":
        notes.append(f"{chip.spec.name} has no {cfg.precision.dtype} tensor cores: its matmuls run at the "
                     f"fp32 rate ({chip.peak / 1e12:.4g} TFLOPS)")
    return ComputeTime(batch, ops, recompute, kernels * chip.host_op_s, kernels * chip.kernel_gap_s, kernel, notes)


__all__ = ["Chip", "Op", "ComputeTime", "chip_for", "gemm_seconds", "step_compute", "attention_kernel",
           "block_memory_bytes"]
