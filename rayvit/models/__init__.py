"""Models. ``build_model(cfg.model)`` is the one entry point; Ray never appears here."""

from rayvit.models.vit import VisionTransformer, build_model

__all__ = ["VisionTransformer", "build_model"]
