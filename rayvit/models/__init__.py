"""Models: the ViT, its named sizes and its analytic complexity. No Ray and no distributed code here.

``build_model(cfg.model)`` builds one; ``vit_complexity(cfg.model)`` counts its FLOPs without building it.
The names are resolved on first use, so that ``rayvit.config`` can read the presets without importing torch.
"""

from rayvit.models.presets import ARCH_KEYS, MODEL_PRESETS

_LAZY = {"VisionTransformer": "rayvit.models.vit", "build_model": "rayvit.models.vit",
         "Complexity": "rayvit.models.complexity", "vit_complexity": "rayvit.models.complexity"}

__all__ = ["ARCH_KEYS", "MODEL_PRESETS", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
