"""The ViT-B/16 and the strategy-by-precision combinations the projection is checked on."""

from __future__ import annotations

from rayvit.config import from_dict

COMBOS = [(s, m) for s in ("ddp", "fsdp", "fairscale_oss") for m in ("fp32", "amp", "mixed", "pure")
          if not (s == "fairscale_oss" and m == "mixed")]


def reduce_dtype(strategy: str, mode: str) -> str:
    """ShardedDDP reduces in the parameters' dtype: under pure it can only be told to reduce in half."""
    return "parallel.reduce_dtype=" + ("half" if strategy == "fairscale_oss" and mode == "pure" else "fp32")


def vit_b16(**overrides):
    cfg = from_dict({"model": {"name": "vit_b16", "image_size": 224, "num_classes": 1000}})
    return cfg.replace(overrides) if overrides else cfg
