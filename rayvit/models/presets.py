"""Named ViT sizes: the scaling axis, as in timm and the ViT paper."""

# Standard ViT sizes (Dosovitskiy et al. 2021; "Ti" from DeiT): width, depth, heads, MLP width, patch.
MODEL_PRESETS: dict[str, dict[str, int]] = {
    "vit_ti16": dict(hidden_dim=192, depth=12, num_heads=3, mlp_dim=768, patch_size=16),
    "vit_s16": dict(hidden_dim=384, depth=12, num_heads=6, mlp_dim=1536, patch_size=16),
    "vit_b16": dict(hidden_dim=768, depth=12, num_heads=12, mlp_dim=3072, patch_size=16),
    "vit_l16": dict(hidden_dim=1024, depth=24, num_heads=16, mlp_dim=4096, patch_size=16),
    "vit_h16": dict(hidden_dim=1280, depth=32, num_heads=16, mlp_dim=5120, patch_size=16),
    "vit_h14": dict(hidden_dim=1280, depth=32, num_heads=16, mlp_dim=5120, patch_size=14),
}
# The keys a preset fixes; ``model.name=custom`` sets them by hand.
ARCH_KEYS = ("hidden_dim", "depth", "num_heads", "mlp_dim", "patch_size")
