"""``rayvit project`` against published GPU training measurements it was not tuned to.

    python benchmarks/published_vs_projected.py [--json FILE]

Each measurement is a published table of per-chip throughput at 8 to 128 GPUs with its configuration; the
projection is run for the same model, batch, precision, strategy and hardware with the same profiles and
model as ``rayvit project`` (no per-table factor). Printed side by side: per-chip throughput (and the error),
scaling efficiency against the table's smallest count (and the difference in points). Where a
published model cannot be written as rayvit's ViT exactly, the row says what differs and compares
tokens per second (images x tokens per image). docs/projection.md discusses every row.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

NEMO_VIT = ("https://docs.nvidia.com/nemo-framework/user-guide/latest/multimodalmodels/visionlanguagefoundation/"
            "vit/performance.html")
NEMO_VIT_CONFIG = "NVIDIA/NeMo-Framework-Launcher launcher_scripts/conf/training/vit/g_14.yaml"
DLE_BERT = ("NVIDIA/DeepLearningExamples PyTorch/LanguageModeling/BERT/README.md, 'Pre-training NVIDIA DGX A100 "
            "(8x A100 40GB)', pytorch:20.06-py3")

# NeMo's ViT-g/14 (Megatron's ViT, 40 x 1408, MLP 6144, 16 heads, patch 14, 224 px, 256 patches + 8 class
# tokens; bf16 O2 with fp32 gradient reduction, micro batch 64 per GPU, data parallel, hidden dropout 0.1,
# attention through Megatron's core attention (FlashAttention is opt-in: model.use_flash_attention) with
# an fp32 softmax (apply_query_key_layer_scaling), fused Adam). rayvit's closest: the same widths with
# the pooled classifier (256 tokens), model.attention=math, dropout 0.1.
VIT_G14 = {"model.name": "custom", "model.hidden_dim": 1408, "model.depth": 40, "model.num_heads": 16,
           "model.mlp_dim": 6144, "model.patch_size": 14, "model.image_size": 224, "model.num_classes": 1000,
           "model.classifier": "pooled", "model.attention": "math", "model.dropout": 0.1,
           "precision.mode": "mixed", "precision.dtype": "bf16", "precision.layer_norm_fp32": False,
           "optim.name": "adamw", "optim.impl": "fused", "parallel.use_gpu": True, "train.batch_size": 64}
# DeepLearningExamples' BERT-Large pre-training (PyTorch, 2020): 24 x 1024, MLP 4096, 16 heads, apex AMP O2
# (fp16 weights, fp32 master copy), explicit attention (matmul, softmax, matmul), FusedLAMB, gradient
# accumulation to 65536 (phase 1) / 32768 (phase 2) sequences per optimizer step. rayvit's closest encoder:
# the same widths over 12 x 12 = 144 (phase 1: 128 tokens) or 24 x 24 = 576 tokens (phase 2: 512), the
# pooled classifier, model.attention=math; compared in tokens per second.
BERT_LARGE = {"model.name": "custom", "model.hidden_dim": 1024, "model.depth": 24, "model.num_heads": 16,
              "model.mlp_dim": 4096, "model.patch_size": 16, "model.num_classes": 2, "model.classifier": "pooled",
              "model.attention": "math", "model.dropout": 0.1, "precision.mode": "mixed", "precision.dtype": "fp16",
              "precision.layer_norm_fp32": False, "optim.name": "adamw", "optim.impl": "fused",
              "parallel.use_gpu": True}


# BERT's pre-training heads, which rayvit's ViT does not have (DeepLearningExamples modeling.py and
# run_pretraining.py at the 20.06 release): BertPredictionHeadTransform (a 1024x1024 Linear, bias+GELU,
# LayerNorm) and the decoder tied to the word embeddings (1024 -> 30,528 words: 30,522 padded to a
# multiple of 8) over *every* token, its bias added as a separate kernel, then CrossEntropyLoss on the fp16
# logits (apex O2, cast_model_outputs=fp16): log_softmax over each token's 30,528 logits. About 9% of
# BERT-Large's training FLOPs at either sequence length. Costed by the projection's own roofline.
BERT_VOCAB = 30528


def bert_heads(chip, tokens: int, hidden: int, elem: int) -> list:
    """The MLM head's operations over ``tokens`` tokens of one micro-batch, as the roofline costs them."""
    from rayvit.projection.roofline import Op, linear_ops

    ops = linear_ops(chip, "mlm transform", tokens, hidden, hidden, elem)
    ops += linear_ops(chip, "mlm decoder", tokens, hidden, BERT_VOCAB, elem)
    per_token = {
        # forward: bias+GELU and LayerNorm over the transform's output (read, write each); the decoder's
        # bias add and log_softmax over the logits (read, write each)
        ("mlm transform gelu+layernorm", "forward"): 4 * elem * hidden,
        ("mlm logits bias+log_softmax", "forward"): 4 * elem * BERT_VOCAB,
        # backward: the loss's gradient written, log_softmax's backward (its output and gradient read,
        # a gradient written), the bias gradient's reduction; GELU's and LayerNorm's backward
        ("mlm transform gelu+layernorm backward", "backward"): 6 * elem * hidden,
        ("mlm logits backward", "backward"): 5 * elem * BERT_VOCAB,
    }
    ops += [Op(name, "memory", phase, 0.0, b * tokens, b * tokens / chip.memory_bw)
            for (name, phase), b in per_token.items()]
    return ops


@dataclass
class Measurement:
    name: str
    source: str
    hardware: str
    overrides: dict
    published: dict[int, tuple[float, int]]    # chips -> (samples per second, all chips; accumulation steps)
    tokens: tuple[int, int]                     # (published tokens per sample, rayvit's tokens per image)
    strategy: str = "ddp"
    notes: list = field(default_factory=list)
    # Operations the published model runs that rayvit's ViT has not: f(chip, tokens, hidden, elem) -> ops
    heads: Optional[Callable] = None


MEASUREMENTS = [
    Measurement("NeMo ViT-g/14, DGX A100 80GB (SuperPOD)", f"{NEMO_VIT}; {NEMO_VIT_CONFIG}", "dgx-a100", VIT_G14,
                {8: (693, 1), 16: (1347, 1), 32: (2642, 1), 64: (5454, 1), 128: (10644, 1)}, (264, 256)),
    Measurement("NeMo ViT-g/14, DGX H100 80GB (SuperPOD)", f"{NEMO_VIT}; {NEMO_VIT_CONFIG}", "h100-sxm", VIT_G14,
                {8: (1428, 1), 16: (2846, 1), 32: (5737, 1), 64: (11222, 1), 128: (21561, 1)}, (264, 256)),
    Measurement("BERT-Large phase 1 (128 tokens), DGX A100 40GB", DLE_BERT, "a100-40gb",
                {**BERT_LARGE, "model.image_size": 192, "train.batch_size": 64},
                {1: (415, 1024), 4: (1618, 256), 8: (3231, 128)}, (128, 144), heads=bert_heads),
    Measurement("BERT-Large phase 2 (512 tokens), DGX A100 40GB", DLE_BERT, "a100-40gb",
                {**BERT_LARGE, "model.image_size": 384, "train.batch_size": 16},
                {1: (78, 2048), 4: (308, 512), 8: (620, 256)}, (512, 576), heads=bert_heads),
]


def compare(m: Measurement) -> list[dict]:
    from rayvit.config import load_study
    from rayvit.projection.performance import add_ratios, project
    from rayvit.projection.profiles import get_profile

    study = load_study(None, {**m.overrides, "parallel.strategy": m.strategy, "sweep.strategies": [m.strategy]},
                       baseline_required=False)
    chips = sorted(m.published)
    profile = get_profile(m.hardware)
    compute = with_heads(study.run, profile, m.heads) if m.heads else None
    points = [project(study.run, n, profile, compute, accumulation=m.published[n][1]) for n in chips]
    add_ratios(points)
    published_tokens, our_tokens = m.tokens
    first = m.published[chips[0]][0] / chips[0]
    rows = []
    for p in points:
        per_chip = m.published[p.chips][0] / p.chips
        projected = p.images_per_sec_per_chip * our_tokens / published_tokens   # in the published unit
        rows.append({"measurement": m.name, "hardware": m.hardware, "chips": p.chips,
                     "published_per_chip": per_chip, "projected_per_chip": projected,
                     "error": projected / per_chip - 1, "published_scaling": per_chip / first,
                     "projected_scaling": p.scaling_efficiency,
                     "scaling_points": 100 * (p.scaling_efficiency - per_chip / first),
                     "mfu": p.mfu, "compute": p.compute_detail, "straggler_ms": p.straggler_s * 1e3,
                     "exposed_comm_ms": p.exposed_comm_s * 1e3})
    return rows


def with_heads(cfg, profile, heads: Callable):
    """The roofline's forward + backward of ``cfg`` with the published model's extra operations added."""
    from rayvit.projection import roofline
    from rayvit.projection.performance import ComputeRate, peak_key
    from rayvit.strategies.registry import dtypes_of
    from rayvit.strategies.shapes import sequence_length

    batch, chip = cfg.train.batch_size, roofline.chip_for(profile, peak_key(cfg))
    extra = heads(chip, batch * sequence_length(cfg.model), cfg.model.hidden_dim, dtypes_of(cfg).compute)
    ct = roofline.step_compute(cfg, chip, batch, extra)
    return ComputeRate((ct.seconds - ct.recompute_s) / batch,
                       f"roofline of {chip.spec.name} at batch {batch} with the published model's heads "
                       f"({ct.describe()})", ct)


def command(m: Measurement) -> str:
    sets = " ".join(f"--set {k}={v}" for k, v in m.overrides.items())
    extras = (["gradient accumulation"] if any(a > 1 for _, a in m.published.values()) else []) \
        + (["the pre-training heads"] if m.heads else [])
    if extras:
        sets += f" (with {' and '.join(extras)}: benchmarks/published_vs_projected.py)"
    return (f"rayvit project --hardware {m.hardware} --chips {' '.join(map(str, sorted(m.published)))} "
            f"--set sweep.strategies={m.strategy} {sets}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="also write the rows to this JSON file")
    args = parser.parse_args(argv)
    everything = []
    for m in MEASUREMENTS:
        rows = compare(m)
        everything += rows
        print(f"\n{m.name} ({m.source})")
        print(f"  as: {command(m)}")
        for note in m.notes:
            print(f"  note: {note}")
        print(f"  {'chips':>5} {'published/chip':>14} {'projected/chip':>14} {'error':>7} {'scaling pub.':>12} "
              f"{'proj.':>6} {'diff':>6}  {'MFU':>5}")
        for r in rows:
            print(f"  {r['chips']:>5} {r['published_per_chip']:>14.1f} {r['projected_per_chip']:>14.1f} "
                  f"{r['error']:>+7.1%} {r['published_scaling']:>12.1%} {r['projected_scaling']:>6.1%} "
                  f"{r['scaling_points']:>+6.1f}  {r['mfu']:>5.1%}")
        print(f"  compute: {rows[0]['compute']}")
    worst = max(abs(r["error"]) for r in everything)
    points = max(abs(r["scaling_points"]) for r in everything)
    print(f"\nlargest per-chip error {worst:.1%}; largest scaling-efficiency difference {points:.1f} points")
    if args.json:
        Path(args.json).write_text(json.dumps(everything, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
