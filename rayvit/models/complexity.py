"""Analytic complexity of the ViT, per image, mirroring ``VisionTransformer.forward`` layer by layer.

Like pycls, counts come from the architecture alone (no tracing, no device), so they are cheap and
regression-testable anywhere. Unlike pycls's multiply-accumulate count, ``flops`` is 2 per MAC (the
convention of ``torch.utils.flop_counter`` and of TFLOPS figures). Only matmuls and convolutions are
counted, attention's two matmuls included; elementwise work (norms, GELU, softmax) is not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rayvit.config_schema import ModelConfig


# Training = forward + backward, and backward costs about twice the forward (grad wrt inputs and weights).
TRAIN_FLOPS_MULTIPLIER = 3


@dataclass(frozen=True)
class Complexity:
    flops: int                  # forward FLOPs per image (2 per multiply-accumulate)
    params: int
    acts: int                   # output elements of every conv/linear/norm/attention op, per image
    train_flops_per_image: int  # forward + backward

    def as_dict(self) -> dict[str, int]:
        return dict(flops=self.flops, params=self.params, acts=self.acts,
                    train_flops_per_image=self.train_flops_per_image)


class _Counter:
    def __init__(self) -> None:
        self.macs = self.params = self.acts = 0

    def conv(self, h: int, w: int, c_in: int, c_out: int, k: int, stride: int, bias: bool) -> tuple[int, int]:
        pad = (k - 1) // 2
        h_out, w_out = (h + 2 * pad - k) // stride + 1, (w + 2 * pad - k) // stride + 1
        self.macs += h_out * w_out * c_in * c_out * k * k
        self.params += c_in * c_out * k * k + (c_out if bias else 0)
        self.acts += h_out * w_out * c_out
        return h_out, w_out

    def linear(self, tokens: int, d_in: int, d_out: int) -> None:
        self.macs += tokens * d_in * d_out
        self.params += d_in * d_out + d_out
        self.acts += tokens * d_out

    def norm(self, elements: int, channels: int) -> None:
        self.params += 2 * channels
        self.acts += elements


def vit_complexity(cfg: ModelConfig) -> Complexity:
    """Forward FLOPs, parameters and activations per image for a validated ``ModelConfig``."""
    c = _Counter()
    dim, size = cfg.hidden_dim, cfg.image_size
    if cfg.stem == "patchify":
        h, w = size // cfg.patch_size, size // cfg.patch_size
        c.macs += h * w * 3 * dim * cfg.patch_size ** 2
        c.params += 3 * dim * cfg.patch_size ** 2 + dim
        c.acts += h * w * dim
    else:
        h = w = size
        c_in = 3
        for c_out, stride in zip(cfg.conv_stem_dims, cfg.conv_stem_strides):
            h, w = c.conv(h, w, c_in, c_out, 3, stride, bias=False)
            c.norm(h * w * c_out, c_out)                       # BatchNorm (running stats are buffers)
            c_in = c_out
        h, w = c.conv(h, w, c_in, dim, 1, 1, bias=True)
    num_patches = h * w
    seq = num_patches + (1 if cfg.classifier == "token" else 0)
    c.params += seq * dim + (dim if cfg.classifier == "token" else 0)   # position embedding, class token

    for _ in range(cfg.depth):
        c.norm(seq * dim, dim)
        c.linear(seq, dim, 3 * dim)                            # fused qkv
        c.macs += 2 * seq * seq * dim                          # q @ k^T and attn @ v over all heads
        c.acts += cfg.num_heads * seq * seq + seq * dim        # attention map, attention output
        c.linear(seq, dim, dim)                                # output projection
        c.norm(seq * dim, dim)
        c.linear(seq, dim, cfg.mlp_dim)
        c.linear(seq, cfg.mlp_dim, dim)
    c.norm(seq * dim, dim)
    c.linear(1, dim, cfg.num_classes)                          # head on the class token or the mean
    flops = 2 * c.macs
    return Complexity(flops=flops, params=c.params, acts=c.acts,
                      train_flops_per_image=TRAIN_FLOPS_MULTIPLIER * flops)
