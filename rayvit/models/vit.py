"""Vision Transformer with the fast-ViT-training study's architectural options.

Options: patchify or conv stem, class-token or pooled classifier, and batch-first ``(B, S, D)`` or
batch-second ``(S, B, D)`` activations. Both layouts share one set of weights (same shapes, same
state-dict keys), so a checkpoint trained in one layout loads in the other.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from rayvit.config_schema import ModelConfig


class FP32LayerNorm(nn.LayerNorm):
    """LayerNorm whose parameters and arithmetic stay fp32 whatever dtype comes in; returns fp32.

    The study's fastest setting without accuracy loss ran AMP O2 with LayerNorm kept in fp32 (pycls
    ``FSDP.LAYER_NORM_FP32``). Its fp32 output feeds only matmuls (qkv, MLP, head), which autocast runs in
    half again, and the pooled mean, which is better in fp32 anyway.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Autocast off: on CPU it would run layer_norm in the input's half dtype.
        with torch.autocast(x.device.type, enabled=False):
            weight = None if self.weight is None else self.weight.float()
            bias = None if self.bias is None else self.bias.float()
            return F.layer_norm(x.float(), self.normalized_shape, weight, bias, self.eps)


def keep_layer_norms_fp32(model: nn.Module) -> list[nn.LayerNorm]:
    """Turn every LayerNorm of ``model`` into an :class:`FP32LayerNorm` with fp32 parameters, in place.

    Same parameters and state-dict keys, so checkpoints move freely between the two. Returns the norms.
    """
    norms = [m for m in model.modules() if isinstance(m, nn.LayerNorm)]
    for norm in norms:
        norm.__class__ = FP32LayerNorm
        norm.float()
    return norms


class Attention(nn.Module):
    """Multi-head self-attention with a fused qkv projection and SDPA."""

    def __init__(self, dim: int, num_heads: int, dropout: float = 0.0, math_kernel: bool = False) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.dropout = dropout
        self.math_kernel = math_kernel

    def forward(self, x: torch.Tensor, batch_second: bool) -> torch.Tensor:
        heads, head_dim = self.num_heads, self.head_dim
        qkv = self.qkv(x)
        if batch_second:
            s, b, d = x.shape
            # (S, B, 3, H, hd) viewed as (3, B, H, S, hd): SDPA takes the strided view, no copy here.
            q, k, v = qkv.view(s, b, 3, heads, head_dim).permute(2, 1, 3, 0, 4).unbind(0)
        else:
            b, s, d = x.shape
            q, k, v = qkv.view(b, s, 3, heads, head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        if self.math_kernel:
            out = self.math_attention(q, k, v)
        else:
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0)
        # (B, H, S, hd) -> back to the block's layout.
        if batch_second:
            out = out.permute(2, 0, 1, 3).reshape(s, b, d)
        else:
            out = out.transpose(1, 2).reshape(b, s, d)
        return self.proj(out)


    def math_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``model.attention=math``: softmax(q k^T / sqrt(d)) v with the softmax in fp32."""
        scores = (q * self.head_dim ** -0.5) @ k.transpose(-2, -1)
        probs = scores.float().softmax(dim=-1).to(q.dtype)
        probs = F.dropout(probs, self.dropout, self.training) if self.dropout else probs
        return probs @ v


class MLP(nn.Sequential):
    def __init__(self, dim: int, hidden: int, dropout: float = 0.0) -> None:
        super().__init__(nn.Linear(dim, hidden), nn.GELU(), nn.Dropout(dropout), nn.Linear(hidden, dim),
                         nn.Dropout(dropout))


class Block(nn.Module):
    """Pre-norm transformer encoder block. Layout-agnostic except for attention's head split."""

    def __init__(self, dim: int, num_heads: int, mlp_dim: int, dropout: float, batch_second: bool,
                 math_attention: bool = False) -> None:
        super().__init__()
        self.batch_second = batch_second
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, num_heads, dropout, math_attention)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = MLP(dim, mlp_dim, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), self.batch_second)
        return x + self.mlp(self.norm2(x))


class PatchifyStem(nn.Sequential):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(nn.Conv2d(3, cfg.hidden_dim, cfg.patch_size, stride=cfg.patch_size))


class ConvStem(nn.Sequential):
    """"Early convolutions" (Xiao et al. 2021): stride-s 3x3 conv + BN + ReLU per entry, 1x1 to width."""

    def __init__(self, cfg: ModelConfig) -> None:
        layers: list[nn.Module] = []
        c_in = 3
        for dim, stride in zip(cfg.conv_stem_dims, cfg.conv_stem_strides):
            layers += [nn.Conv2d(c_in, dim, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(dim),
                       nn.ReLU(inplace=True)]
            c_in = dim
        layers.append(nn.Conv2d(c_in, cfg.hidden_dim, 1))
        super().__init__(*layers)


class VisionTransformer(nn.Module):
    """ViT classifier. ``forward_features`` returns normalised tokens, ``forward_head`` the logits."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.batch_second = cfg.layout == "batch_second"
        self.use_class_token = cfg.classifier == "token"
        dim = cfg.hidden_dim
        num_patches = (cfg.image_size // cfg.patch_size) ** 2
        self.seq_len = num_patches + int(self.use_class_token)

        self.stem = PatchifyStem(cfg) if cfg.stem == "patchify" else ConvStem(cfg)
        # Shaped (dim,) and (S, dim), not (1, 1, dim) and (1, S, dim): FSDP2 shards dim 0 and pads it to the
        # world size, so a leading 1 made every rank gather N padded copies (N x S x dim at N chips).
        self.class_token = nn.Parameter(torch.zeros(dim)) if self.use_class_token else None
        self.pos_embed = nn.Parameter(torch.empty(self.seq_len, dim))
        self.pos_drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(
            Block(dim, cfg.num_heads, cfg.mlp_dim, cfg.dropout, self.batch_second, cfg.attention == "math")
            for _ in range(cfg.depth))
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.head = nn.Linear(dim, cfg.num_classes)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Standard ViT init: truncated-normal patch embedding, small normal positions, zero head."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                nn.init.zeros_(m.bias)
        if isinstance(self.stem, PatchifyStem):
            conv = self.stem[0]
            fan_in = conv.in_channels * conv.kernel_size[0] * conv.kernel_size[1]
            nn.init.trunc_normal_(conv.weight, std=math.sqrt(1.0 / fan_in))
            nn.init.zeros_(conv.bias)
        else:
            for m in self.stem.modules():
                if isinstance(m, nn.Conv2d):
                    nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        nn.init.normal_(self.pos_embed, std=0.02)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        # Checkpoints written before the (S, dim) and (dim,) shapes hold (1, S, dim) and (1, 1, dim).
        for name in ("pos_embed", "class_token"):
            own, key = getattr(self, name), prefix + name
            if own is not None and key in state_dict and state_dict[key].shape != own.shape \
                    and state_dict[key].numel() == own.numel():
                state_dict[key] = state_dict[key].reshape(own.shape)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def no_weight_decay(self) -> list[nn.Parameter]:
        """Parameters besides biases and norm weights that must not decay (position embedding, class token).

        Returned as objects, looked up at call time, so the answer stays right after FSDP replaces them.
        """
        params = [self.pos_embed]
        if self.class_token is not None:
            params.append(self.class_token)
        return params

    def forward_features(self, images: torch.Tensor) -> torch.Tensor:
        x = self.stem(images).flatten(2)                     # (B, D, N)
        if self.batch_second:
            x = x.permute(2, 0, 1)                           # (N, B, D), kept to the end of the encoder
            # (S, 1, D), a view of the contiguous weights: the gradient stays contiguous, as DDP's gradient
            # buckets expect.
            pos = self.pos_embed.unsqueeze(1)
            if self.class_token is not None:
                x = torch.cat([self.class_token.view(1, 1, -1).expand(1, x.shape[1], -1), x], dim=0)
        else:
            x = x.transpose(1, 2)                            # (B, N, D)
            pos = self.pos_embed                             # (S, D) broadcasts over the batch
            if self.class_token is not None:
                x = torch.cat([self.class_token.view(1, 1, -1).expand(x.shape[0], 1, -1), x], dim=1)
        # Contiguous tokens: without a class token (whose cat copies) x would stay a strided view of the
        # stem's output through every block, making each LayerNorm copy and each residual add strided.
        # ``pos + x`` (pos first) already comes out contiguous batch-first; batch-second still copies once.
        x = self.pos_drop((pos + x).contiguous())
        for block in self.blocks:
            x = block(x)
        return self.norm(x)

    def forward_head(self, tokens: torch.Tensor) -> torch.Tensor:
        seq_dim = 0 if self.batch_second else 1
        if self.use_class_token:
            feature = tokens.select(seq_dim, 0)
        else:
            feature = tokens.mean(dim=seq_dim)
        return self.head(feature)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(images))


def build_model(cfg: ModelConfig) -> VisionTransformer:
    """The ViT described by a validated ``ModelConfig``."""
    return VisionTransformer(cfg)
