"""rayvit: cluster-scaling experiments on Vision Transformer training with Ray, DDP and FSDP.

"The study" in these docstrings is Meta AI's fast ViT training work in pycls: the PyTorch blog post
"Scaling Vision Model Training Platforms with PyTorch" (December 2022,
https://pytorch.org/blog/scaling-vision-model-training-platforms-with-pytorch/) and pycls's FSDP configs and trainer (https://github.com/facebookresearch/pycls/tree/main/configs/fsdp).
"""

__version__ = "0.1.0"
