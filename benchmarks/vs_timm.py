"""rayvit's ViT against timm's, same dimensions, same training step, alternating in one process.

    python benchmarks/vs_timm.py [--model vit_s16] [--batch 8] [--rounds 4] [--threads 2]

Needs timm importable (it is not a rayvit dependency: `pip install timm torchvision` beside a matching
torch). Both models run the identical step (AdamW foreach, cross-entropy, fp32 or bf16 autocast) on the
same fixed batch; only the model code differs. Prints each precision's rayvit/timm speed ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from rayvit.config import load_config
from rayvit.models import build_model

TIMM_NAMES = {"vit_ti16": "vit_tiny_patch16_224", "vit_s16": "vit_small_patch16_224",
              "vit_b16": "vit_base_patch16_224"}


def timed_step(model, opt, images, labels, dtype) -> float:
    start = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
        loss = F.cross_entropy(model(images).float(), labels)
    loss.backward()
    opt.step()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="vit_s16", choices=sorted(TIMM_NAMES))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per model per round")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    import timm

    torch.set_num_threads(args.threads)
    cfg = load_config(overrides=[f"model.name={args.model}", "model.image_size=224", "model.num_classes=1000"])
    images = torch.randn(args.batch, 3, 224, 224)
    labels = torch.randint(0, 1000, (args.batch,))
    for label, dtype in (("fp32", None), ("bf16 autocast", torch.bfloat16)):
        models = {"rayvit": build_model(cfg.model), "timm": timm.create_model(TIMM_NAMES[args.model])}
        counts = {k: sum(p.numel() for p in m.parameters()) for k, m in models.items()}
        assert counts["rayvit"] == counts["timm"], counts
        opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4, foreach=True) for k, m in models.items()}
        times = {k: [] for k in models}
        for k in models:                                     # warm-up
            timed_step(models[k], opts[k], images, labels, dtype)
        for _ in range(args.rounds):
            for k in models:
                times[k] += [timed_step(models[k], opts[k], images, labels, dtype) for _ in range(args.steps)]
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"{args.model} batch {args.batch} {label:14s} rayvit {med['rayvit']:.3f} s/step  timm "
              f"{med['timm']:.3f} s/step  rayvit speed / timm speed = {med['timm'] / med['rayvit']:.3f}")


if __name__ == "__main__":
    main()
