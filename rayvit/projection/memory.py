"""Bytes per rank: parameters, gradients, master copies, optimizer state, activations; fit and largest batch.

Model state follows what each library does, tensor by tensor (``shapes.vit_tensors``): each strategy says
what a rank holds (``Strategy.rank_state``, written beside each in :mod:`rayvit.strategies`).
``model_state`` returns the largest rank, as a run's summary reports (``run_figures.summary``: max over ranks).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from rayvit.config_schema import Config
from rayvit.models import vit_complexity
from rayvit.models.activation_checkpointing import checkpointed_blocks
from rayvit.strategies.costs import StateBytes, layout_key
from rayvit.strategies.dtypes import FULL
from rayvit.projection.hardware_profile import HardwareProfile
from rayvit.strategies.shapes import sequence_length, vit_tensors
from rayvit.strategies import strategy_class
from rayvit.strategies.registry import dtypes_of, layout_of


def model_state(cfg: Config, world: Optional[int] = None, *, layer_norm_fp32: Optional[bool] = None,
                flatten: bool = True, per_rank: bool = False, per_node: int = 0):
    """Model-state bytes of the largest rank (or every rank's, ``per_rank=True``) for ``cfg`` at ``world``
    (``per_node`` chips to a node, where known)."""
    world = world or cfg.parallel.num_workers
    strategy = strategy_class(cfg.parallel.strategy)
    key = layout_key(cfg, world, layer_norm_fp32, flatten, per_node, strategy.cost_key(), per_rank)
    ranks = _RANK_STATES.get(key)
    if ranks is None:
        layout = layout_of(cfg, world, layer_norm_fp32=layer_norm_fp32, flatten=flatten, per_node=per_node)
        which = range(layout.n) if per_rank or not _knows_heaviest(strategy) else strategy.heaviest_ranks(layout)
        ranks = _RANK_STATES.setdefault(key, tuple(strategy.rank_state(layout, r) for r in which))
        if len(_RANK_STATES) > 4096:          # a plan's settings share a few hundred; keep it bounded
            _RANK_STATES.clear()
    return list(ranks) if per_rank else max(ranks, key=lambda b: b.total)


def _knows_heaviest(strategy) -> bool:
    """Whether ``strategy.heaviest_ranks`` speaks for its ``rank_state``: defined by the class that defines
    ``rank_state`` or one below it (a plugin overriding ``rank_state`` alone gets every rank costed)."""
    def owner(name):
        return next(c for c in strategy.__mro__ if name in vars(c))

    return issubclass(owner("heaviest_ranks"), owner("rank_state"))


# Every rank's state by the layout it was costed for (``layout_key``): costing it walks every tensor of
# every rank, and a plan asks again for each batch size and image of the same strategy and chip count.
_RANK_STATES: dict[str, tuple[StateBytes, ...]] = {}


# ------------------------------------------------------------------------------------------------
# Activations: what autograd keeps from forward to backward, per image


def activation_bytes_per_image(cfg: Config, *, layer_norm_fp32: Optional[bool] = None,
                               attention: Optional[str] = None) -> dict[str, float]:
    """Bytes saved for backward per image, by part, for the ViT's own forward (``models/vit.py``).

    Per block, in elements of s x h (s tokens, h width, m MLP width): LayerNorm inputs (2, residual dtype,
    or fp32 copies when LayerNorm runs in fp32 on half inputs), the qkv input (1), q/k/v (3, views of one
    qkv output), the attention output (1) and its copy into the projection's layout (1), the MLP input (1),
    the GELU input and output (2 m/h); plus LayerNorm statistics and attention's log-sum-exp (fp32).
    ``attention="math"`` adds the softmax matrix (heads x s x s). Dropout at p=0 saves nothing. Under
    ``model.activation_checkpointing`` a checkpointed block keeps only its input (s x h), and one block's
    activations are added for the block being recomputed in backward.
    """
    m, dt = cfg.model, dtypes_of(cfg, layer_norm_fp32)
    s, h, c = sequence_length(m), m.hidden_dim, dt.compute
    attention = attention or ("math" if m.attention == "math" else "flash")
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
        # model.attention=math: the scaled q (q k^T's input; SDPA's saved output is not kept), the fp32
        # softmax's output (its backward needs it) and, in half precision, its half copy (p v's input).
        per_block["attention_out"] = s * h * c
        per_block["attention_matrix"] = m.num_heads * s * s * (FULL + (c if c != FULL else 0))
    # Activation checkpointing: a checkpointed block keeps only its input; during backward one block's
    # activations exist again while it is recomputed.
    kept = m.depth - len(checkpointed_blocks(m))
    parts = {k: v * kept for k, v in per_block.items()}
    if kept < m.depth:
        parts["checkpointed_block_inputs"] = (m.depth - kept) * s * h * dt.residual
        parts["recomputed_block"] = float(sum(per_block.values()))
    image_bytes = FULL if dt.mode in ("fp32", "amp") else dt.compute
    parts["stem_input"] = 3 * m.image_size ** 2 * (image_bytes if dt.mode != "amp" else dt.compute)
    parts["final_norm"] = s * h * ln_in + 2 * s * FULL
    # The head's input: the pooled mean (h), or the class token's row, a view of the final norm's output
    # whose whole storage (s x h) autograd keeps unless autocast's cast to half copied the row out first.
    autocast = dt.mode == "amp" or dt.layer_norm_fp32
    row_view = m.classifier == "token" and not autocast
    parts["head"] = (s * h * ln_in if row_view else h * c) + m.num_classes * FULL * 2   # + fp32 logits, log-softmax
    return parts


def fixed_activation_bytes(cfg: Config) -> int:
    """Batch-independent bytes kept for backward: autocast's half copies of the weights (``amp`` only)."""
    if cfg.precision.mode != "amp":
        return 0
    tensors = vit_tensors(cfg.model)
    return sum(t.numel for t in tensors if not t.norm and len(t.shape) > 1) * 2


def transient_bytes(cfg: Config, world: int, *, layer_norm_fp32: Optional[bool] = None, per_node: int = 0) -> int:
    """Buffers that exist only during the step, beside model state and activations (the strategy's:
    DDP's gradient buckets, FSDP's gathered units; ``Strategy.transient_bytes``)."""
    layout = layout_of(cfg, world, layer_norm_fp32=layer_norm_fp32, per_node=per_node)
    return strategy_class(cfg.parallel.strategy).transient_bytes(layout)


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
           attention: Optional[str] = None) -> MemoryBreakdown:
    """Peak bytes per rank for ``cfg`` at ``world`` chips, and whether it fits ``profile``'s chip."""
    world = world or cfg.parallel.num_workers
    per_node = profile.chips_per_node if profile else 0
    parts = activation_bytes_per_image(cfg, layer_norm_fp32=layer_norm_fp32, attention=attention)
    return MemoryBreakdown(
        state=model_state(cfg, world, layer_norm_fp32=layer_norm_fp32, per_node=per_node),
        activations_per_image=float(sum(parts.values())), fixed_activations=fixed_activation_bytes(cfg),
        transient=transient_bytes(cfg, world, layer_norm_fp32=layer_norm_fp32, per_node=per_node),
        batch=batch or cfg.train.batch_size, usable=profile.usable_bytes() if profile else None, parts=parts)


def params_count(cfg: Config) -> int:
    """Parameters of the ViT (equal to ``rayvit.models.complexity`` 's count; checked in the tests)."""
    return vit_complexity(cfg.model).params


__all__ = ["StateBytes", "MemoryBreakdown", "model_state", "memory", "activation_bytes_per_image",
           "fixed_activation_bytes", "transient_bytes"]
