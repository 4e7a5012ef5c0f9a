"""What the roofline knows of Hopper beyond its peaks: FlashAttention-2 at 35% of the H100's peak (the
FlashAttention-3 paper), reduction kernels at 0.63 of its HBM3 data sheet (Guo, Zadouri and Dao 2025), and
what that does to long-sequence models of different widths."""

from __future__ import annotations

import pytest

from rayvit.config import load_config
from rayvit.projection import roofline
from rayvit.projection.performance import project
from rayvit.projection.profiles import get_profile


def decoder_like(width: int, depth: int, heads: int):
    """An encoder of a decoder's widths at 4,096 tokens (64 x 64 patches), bf16, FlashAttention-2."""
    return load_config(None, {"model.name": "custom", "model.hidden_dim": width, "model.depth": depth,
                              "model.num_heads": heads, "model.mlp_dim": 4 * width, "model.patch_size": 16,
                              "model.image_size": 1024, "model.classifier": "pooled", "precision.mode": "mixed",
                              "precision.dtype": "bf16", "precision.layer_norm_fp32": False,
                              "parallel.use_gpu": True, "train.batch_size": 4})


def test_reductions_run_slower_than_streams_on_hopper_only():
    h100 = roofline.chip_for(get_profile("h100-sxm"), "bf16")
    a100 = roofline.chip_for(get_profile("a100-80gb"), "bf16")
    gib = 2 ** 30
    assert gib / h100.stream_s(gib, "layernorm backward") == pytest.approx(3350e9 * 0.63)
    assert gib / h100.stream_s(gib, "gelu") == pytest.approx(3350e9 * 0.8)
    assert a100.stream_s(gib, "layernorm") == a100.stream_s(gib, "gelu") == gib / (2039e9 * 0.8)
    # Every Hopper profile, described clusters built on them included, carries it; no A100 or V100 does.
    for name in ("h100-sxm", "h100-pcie", "h100-nvl", "h200", "h200-nvl", "gh200", "gh200-144gb"):
        assert get_profile(name).reduction_efficiency == 0.63
    for name in ("a100-40gb", "a100-80gb", "dgx-a100", "v100-32gb"):
        assert get_profile(name).reduction_efficiency is None


def test_flashattention2_reaches_35_percent_of_an_h100():
    cfg = decoder_like(2048, 2, 16)
    h100 = roofline.chip_for(get_profile("h100-sxm"), "bf16")
    ops = roofline.attention_ops(h100, cfg, 8, "flash")
    forward = ops[0].flops / ops[0].seconds / h100.peak
    backward = ops[1].flops / ops[1].seconds / h100.peak
    # At 4,096 tokens the short-sequence and wave terms take 3-6% of that.
    assert 0.32 < forward <= 0.35 and 0.27 < backward <= 0.30


def test_at_4096_tokens_narrow_models_gain_less_from_an_h100_than_wide_ones():
    """Attention (4 s h FLOPs per token against 24 h^2 in the matmuls) and the reductions (per token in
    proportion to h) weigh most in narrow models, and both run further below the H100's peak than the
    A100's: the projected H100/A100 ratio grows with width."""
    ratio = {}
    for width, depth, heads in ((1024, 24, 16), (2048, 24, 16), (4096, 32, 32), (8192, 80, 64)):
        cfg = decoder_like(width, depth, heads)
        h100, a100 = (project(cfg, 8, get_profile(p)).images_per_sec_per_chip for p in ("h100-sxm", "a100-80gb"))
        ratio[width] = h100 / a100
    widths = sorted(ratio)
    assert all(ratio[a] < ratio[b] for a, b in zip(widths, widths[1:])), ratio
    assert 1.7 < ratio[1024] < ratio[8192] < 2.6
