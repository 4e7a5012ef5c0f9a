"""rayvit: cluster-scaling experiments on Vision Transformer training with Ray, DDP and FSDP."""

__version__ = "0.1.0"
