"""Bytes per rank: parameters, gradients, master copies, optimizer state, activations; fit and largest batch.

Model state follows what each library does, tensor by tensor (``shapes.vit_tensors``):

- ``ddp``: everything replicated.
- ``fsdp`` (FSDP2 ``fully_shard``): each tensor split on dim 0 like ``torch.chunk``: rank r holds rows
  [r*c, (r+1)*c) with c = ceil(d0/N); rank 0 holds the most (the storage is padded to c rows on every rank).
- ``fairscale_oss`` (OSS + ShardedDDP): parameters replicated; OSS gives whole tensors to the rank with the
  least so far (decayed group first, in parameter order); optimizer state only for owned tensors.
  ShardedDDP's gradients: at N > 1 each destination rank's smallest tensors share a bucket of
  min(2**23, model) elements whose gradient views every rank keeps; the other gradients are freed on
  ranks that do not own them. At N = 1 every gradient stays.
- ``fairscale_fsdp``: flattened per wrapped unit (or per tensor), padded to ceil(numel/N) on every rank.

``model_state`` returns the largest rank, as ``Session.summary`` reports (max over ranks).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from rayvit.models import vit_complexity
from rayvit.config import Config
from rayvit.projection.dtypes import FULL, Dtypes
from rayvit.projection.profiles import HardwareProfile
from rayvit.projection.shapes import Tensor, fsdp_units, optimizer_order, sequence_length, vit_tensors

STEP_BYTES = 4                 # Adam's per-tensor `step` counter: a 0-d fp32 tensor
SHARDED_DDP_BUCKET = 2 ** 23   # FairScale ShardedDDP reduce_buffer_size default (elements)


@dataclass(frozen=True)
class StateBytes:
    params: int
    grads: int
    masters: int          # fp32 master weights and their gradients (replicated strategies under `mixed`)
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.masters + self.optimizer


# ------------------------------------------------------------------------------------------------
# What each rank holds, per tensor


def fsdp2_rows(d0: int, world: int, rank: int) -> int:
    chunk = -(-d0 // world)
    return max(0, min(chunk, d0 - rank * chunk))


def fsdp2_local(t: Tensor, world: int, rank: int) -> int:
    return fsdp2_rows(t.shape[0], world, rank) * (t.numel // t.shape[0])


def oss_owner(tensors: list[Tensor], world: int) -> dict[str, int]:
    """FairScale ``OSS.partition_parameters``: each tensor to the rank with the fewest elements so far."""
    sizes, owner = [0] * world, {}
    for t in optimizer_order(tensors):
        rank = sizes.index(min(sizes))
        owner[t.name] = rank
        sizes[rank] += t.numel
    return owner


def sharded_ddp_bucketed(tensors: list[Tensor], owner: dict[str, int], world: int) -> set[str]:
    """Tensors whose gradients live in ShardedDDP's per-destination buckets (kept on every rank)."""
    if world == 1:
        return set()
    cap = min(SHARDED_DDP_BUCKET, sum(t.numel for t in tensors))
    by_rank = [sorted((t for t in optimizer_order(tensors) if owner[t.name] == r), key=lambda t: t.numel)
               for r in range(world)]
    bucketed, fill = set(), [0] * world
    for r, mine in enumerate(by_rank):
        for t in mine:
            if fill[r] + t.numel < cap:
                fill[r] += t.numel
                bucketed.add(t.name)
    return bucketed


def _optimizer_bytes(cfg: Config, local: int, state_dtype: int) -> int:
    if cfg.optim.name == "sgd":
        return local * state_dtype if cfg.optim.momentum else 0
    return 2 * local * state_dtype + STEP_BYTES


def _rank_state(cfg: Config, tensors: list[Tensor], dt: Dtypes, world: int, rank: int,
                flatten: bool) -> StateBytes:
    s = cfg.parallel.strategy
    params = grads = masters = optim = 0
    if s == "fairscale_fsdp" and flatten:
        for unit in fsdp_units(tensors).values():
            local = -(-sum(t.numel for t in unit) // world)
            width = dt.stored(False)
            params += local * width
            grads += local * width
            optim += _optimizer_bytes(cfg, local, dt.optimizer_state(False))
        return StateBytes(params, grads, 0, optim)
    owner = oss_owner(tensors, world) if s == "fairscale_oss" else {}
    bucketed = sharded_ddp_bucketed(tensors, owner, world) if s == "fairscale_oss" else set()
    for t in tensors:
        width = dt.stored(t.norm)
        local = {"fsdp": lambda: fsdp2_local(t, world, rank),
                 "fairscale_fsdp": lambda: -(-t.numel // world)}.get(s, lambda: t.numel)()
        params += local * width
        owned = owner.get(t.name, rank) == rank
        if s != "fairscale_oss" or owned or t.name in bucketed:
            grads += local * width
        if not owned:
            continue
        if dt.has_master(t.norm):
            masters += 2 * local * FULL
        optim += _optimizer_bytes(cfg, local, dt.optimizer_state(t.norm))
    return StateBytes(params, grads, masters, optim)


def model_state(cfg: Config, world: Optional[int] = None, *, layer_norm_fp32: Optional[bool] = None,
                flatten: bool = True, per_rank: bool = False):
    """Model-state bytes of the largest rank (or every rank's, ``per_rank=True``) for ``cfg`` at ``world``."""
    world = world or cfg.parallel.num_workers
    dt = Dtypes.of(cfg, layer_norm_fp32)
    tensors = vit_tensors(cfg.model)
    ranks = [_rank_state(cfg, tensors, dt, world, r, flatten) for r in range(world)]
    return ranks if per_rank else max(ranks, key=lambda b: b.total)


# ------------------------------------------------------------------------------------------------
# Activations: what autograd keeps from forward to backward, per image


def activation_bytes_per_image(cfg: Config, *, layer_norm_fp32: Optional[bool] = None,
                               attention: str = "flash") -> dict[str, float]:
    """Bytes saved for backward per image, by part, for the ViT's own forward (``models/vit.py``).

    Per block, in elements of s x h (s tokens, h width, m MLP width): LayerNorm inputs (2, residual dtype,
    or fp32 copies when LayerNorm runs in fp32 on half inputs), the qkv input (1), q/k/v (3, views of one
    qkv output), the attention output (1) and its copy into the projection's layout (1), the MLP input (1),
    the GELU input and output (2 m/h); plus LayerNorm statistics and attention's log-sum-exp (fp32).
    ``attention="math"`` adds the softmax matrix (heads x s x s). Dropout at p=0 saves nothing.
    """
    m, dt = cfg.model, Dtypes.of(cfg, layer_norm_fp32)
    s, h, c = sequence_length(m), m.hidden_dim, dt.compute
    ln_in = FULL if dt.layer_norm_fp32 else dt.residual
    per_block = {
        "layernorm_inputs": 2 * s * h * ln_in,
        "layernorm_stats": 2 * 2 * s * FULL,
        "matmul_inputs": (1 + 1 + 1) * s * h * c,            # qkv input, projection input, MLP input
        "qkv": 3 * s * h * c,
        "attention_out": s * h * c + m.num_heads * s * FULL,  # SDPA output + log-sum-exp
        "mlp_hidden": 2 * s * m.mlp_dim * c,                  # GELU input and output
    }
    if attention == "math":
        per_block["attention_matrix"] = m.num_heads * s * s * c
    parts = {k: v * m.depth for k, v in per_block.items()}
    image_bytes = FULL if dt.mode in ("fp32", "amp") else dt.compute
    parts["stem_input"] = 3 * m.image_size ** 2 * (image_bytes if dt.mode != "amp" else dt.compute)
    parts["final_norm"] = s * h * ln_in + 2 * s * FULL
    parts["head"] = h * c + m.num_classes * FULL * 2          # head input; fp32 logits and log-softmax
    return parts


def fixed_activation_bytes(cfg: Config) -> int:
    """Batch-independent bytes kept for backward: autocast's half copies of the weights (``amp`` only)."""
    if cfg.precision.mode != "amp":
        return 0
    tensors = vit_tensors(cfg.model)
    return sum(t.numel for t in tensors if not t.norm and len(t.shape) > 1) * 2


def transient_bytes(cfg: Config, world: int, *, layer_norm_fp32: Optional[bool] = None) -> int:
    """Buffers that exist only during the step, beside model state and activations.

    DDP: its gradient buckets (a second copy of every gradient, in the gradient dtype; at one rank too,
    where the reducer still builds and all-reduces them). FSDP: gathered
    units in the compute dtype (two at a time when resharding after forward; all of them from forward to
    backward when not) plus one unit's unsharded gradient. OSS: nothing beyond its views.
    """
    dt = Dtypes.of(cfg, layer_norm_fp32)
    tensors = vit_tensors(cfg.model)
    s = cfg.parallel.strategy
    if s == "ddp":
        return sum(t.numel * dt.stored(t.norm) for t in tensors)
    if s not in ("fsdp", "fairscale_fsdp"):
        return 0
    units = fsdp_units(tensors).values()
    gathered = sorted((sum(t.numel * dt.gathered(t.norm) for t in u) for u in units), reverse=True)
    largest = max(sum(t.numel for t in u) for u in units)
    held = sum(gathered) if not cfg.parallel.reshard_after_forward else sum(gathered[:2])
    return held + largest * dt.reduced()


@dataclass
class MemoryBreakdown:
    state: StateBytes
    activations_per_image: float
    fixed_activations: int
    transient: int
    batch: int
    usable: Optional[float] = None
    parts: dict = field(default_factory=dict)

    @property
    def activations(self) -> float:
        return self.fixed_activations + self.batch * self.activations_per_image

    @property
    def total(self) -> float:
        return self.state.total + self.activations + self.transient

    @property
    def fits(self) -> Optional[bool]:
        return None if self.usable is None else self.total <= self.usable

    @property
    def max_batch(self) -> Optional[int]:
        if self.usable is None:
            return None
        room = self.usable - self.state.total - self.fixed_activations - self.transient
        return max(0, int(room // self.activations_per_image))


def memory(cfg: Config, world: Optional[int] = None, profile: Optional[HardwareProfile] = None, *,
           batch: Optional[int] = None, layer_norm_fp32: Optional[bool] = None,
           attention: str = "flash") -> MemoryBreakdown:
    """Peak bytes per rank for ``cfg`` at ``world`` chips, and whether it fits ``profile``'s chip."""
    world = world or cfg.parallel.num_workers
    parts = activation_bytes_per_image(cfg, layer_norm_fp32=layer_norm_fp32, attention=attention)
    return MemoryBreakdown(
        state=model_state(cfg, world, layer_norm_fp32=layer_norm_fp32),
        activations_per_image=float(sum(parts.values())), fixed_activations=fixed_activation_bytes(cfg),
        transient=transient_bytes(cfg, world, layer_norm_fp32=layer_norm_fp32),
        batch=batch or cfg.train.batch_size, usable=profile.usable_bytes() if profile else None, parts=parts)


def params_count(cfg: Config) -> int:
    """Parameters of the ViT (equal to ``rayvit.models.complexity`` 's count; checked in the tests)."""
    return vit_complexity(cfg.model).params


__all__ = ["StateBytes", "MemoryBreakdown", "model_state", "memory", "activation_bytes_per_image",
           "fixed_activation_bytes", "transient_bytes", "oss_owner", "sharded_ddp_bucketed", "fsdp2_local"]
