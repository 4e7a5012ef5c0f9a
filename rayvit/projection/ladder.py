"""The study's optimization ladder, projected rung by rung at any chip count, beside what the study published.

``rayvit project`` with ``sweep.mode=ladder``: each rung (``rayvit/studies/ladder.yaml``: the DDP + AMP O1
baseline, then O2, FSDP, multi-tensor apply, the pooled classifier, batch-second, 256 px, full half,
compile, activation checkpointing; cumulative) is projected with the same model as every other row, and
its per-chip TFLOPS set against the baseline's at the same count, as the study reports them. What moved
from one rung to the next is read off the model's own terms (:func:`moved`): the roofline's matmul,
attention and memory-bound time, the exposed communication, the optimizer step and the stragglers, per
image. The published figures are printed beside (:data:`PUBLISHED`); their differences are said in the
same terms (:func:`against_published`). Nothing here is fitted to them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from rayvit.config_schema import Config
from rayvit.projection import performance
from rayvit.projection.performance import ComputeRate, Projection
from rayvit.projection.hardware_profile import HardwareProfile

# What the study published for ViT-H/16 on A100s (DESIGN.md section 1: Meta AI, "significantly faster Vision
# Transformer training", 2022), per-chip TFLOPS against its DDP + AMP O1 baseline: the stack through
# batch-second 1.51x, with 256 px 1.86x, in full FP16 2.18x; FSDP (the stack) 1.83x DDP at 64 GPUs; an
# ImageNet-1K epoch from 0.65 h to 0.43 h at 224 px.
PUBLISHED = {"batch_second": 1.51, "image_256": 1.86, "full_half": 2.18}
PUBLISHED_AT_64 = ("batch_second", 1.83)
PUBLISHED_EPOCH_H = {"baseline": 0.65, "batch_second": 0.43}


@dataclass
class LadderRow:
    rung: str
    chips: int
    cfg: Config
    point: Projection
    ratio: float = 1.0            # per-chip TFLOPS against the baseline rung's at the same count
    moved: str = ""               # what changed from the rung before, in the model's terms

    @property
    def published(self) -> Optional[float]:
        if self.chips == 64 and self.rung == PUBLISHED_AT_64[0]:
            return PUBLISHED_AT_64[1]
        return PUBLISHED.get(self.rung)

    def terms(self) -> dict[str, float]:
        """The step's parts, seconds per image on a chip (compute split as the roofline finds it)."""
        p, b = self.point, self.point.batch
        out = {}
        compute = p.compute_s - p.recompute_s
        if p.compute_shares:
            out.update({f"{k} compute": compute * v / b for k, v in p.compute_shares.items()})
            out["launch gaps and host"] = compute * (1 - sum(p.compute_shares.values())) / b
        else:
            out["compute"] = compute / b
        out.update({"recompute": p.recompute_s / b, "communication": p.exposed_comm_s / b,
                    "optimizer": p.optimizer_s / b, "strategy overhead": p.overhead_s / b,
                    "stragglers": p.straggler_s / b})
        return out

    def record(self) -> dict[str, Any]:
        p, m = self.point, self.cfg.model
        return {"rung": self.rung, "chips": self.chips, "hardware": p.hardware, "strategy": p.label,
                "precision": self.cfg.precision.mode if self.cfg.precision.mode == "fp32"
                else f"{self.cfg.precision.mode}-{self.cfg.precision.dtype}",
                "image_size": m.image_size, "classifier": m.classifier, "layout": m.layout,
                "optim_impl": self.cfg.optim.impl, "tflops_per_chip": p.tflops_per_chip,
                "ratio_to_baseline": self.ratio, "published_ratio": self.published,
                "images_per_sec_per_chip": p.images_per_sec_per_chip, "step_time_s": p.step_s,
                "fits": p.memory.fits, "moved": self.moved or None,
                **{f"{k.replace(' ', '_')}_s_per_image": v for k, v in self.terms().items()}}


def project_ladder(rungs: list[tuple[str, Config]], chips: list[int], profile: HardwareProfile,
                   rate: Optional[ComputeRate] = None) -> list[LadderRow]:
    """Every rung at every chip count; ratios to the first rung (the baseline) at the same count."""
    out = []
    for n in sorted(set(chips)):
        row_of_count: list[LadderRow] = []
        for rung, cfg in rungs:
            # A measured rate is the baseline's: the other rungs change what it measured.
            point = performance.project(cfg, n, profile, rate if not row_of_count else None)
            point.hardware = profile.name
            row = LadderRow(rung, n, cfg, point)
            if row_of_count:
                row.ratio = point.tflops_per_chip / row_of_count[0].point.tflops_per_chip
                row.moved = moved(row_of_count[-1], row)
            row_of_count.append(row)
        out += row_of_count
    return out


def moved(before: LadderRow, after: LadderRow, top: int = 2) -> str:
    """The terms that changed most from ``before`` to ``after``, per image on a chip (largest first)."""
    a, b = before.terms(), after.terms()
    deltas = sorted(((b.get(k, 0.0) - a.get(k, 0.0), k) for k in set(a) | set(b)), key=lambda d: -abs(d[0]))
    parts = [f"{k} {_ms(d, signed=True)}" for d, k in deltas[:top] if abs(d) >= 1e-6]
    flops = after.point.tflops_per_chip / after.point.images_per_sec_per_chip / \
        (before.point.tflops_per_chip / before.point.images_per_sec_per_chip)
    if abs(flops - 1) > 0.005:
        parts.append(f"FLOPs per image x{flops:.3f}")
    return "; ".join(parts) or "no term moved"


def against_published(rows: list[LadderRow]) -> list[str]:
    """For each published figure with a projected row: both ratios, and what the projected gain is made of
    (the terms that fell from the baseline to the rung, per image), then what the published ratio would ask
    of those terms."""
    lines = []
    for row in rows:
        if row.published is None:
            continue
        base = next(r for r in rows if r.chips == row.chips and r.ratio == 1.0 and r.rung == rows[0].rung)
        a, b = base.terms(), row.terms()
        flops = row.point.tflops_per_chip / row.point.images_per_sec_per_chip / \
            (base.point.tflops_per_chip / base.point.images_per_sec_per_chip)
        fell = sorted(((a.get(k, 0) - b.get(k, 0), k) for k in set(a) | set(b)), key=lambda d: -d[0])
        gains = ", ".join(f"{k} {_ms(-d, signed=True)}" for d, k in fell[:3] if d > 1e-6) or "nothing"
        per_image = sum(a.values())
        needed = per_image * flops / row.published          # the per-image time the published ratio implies
        lines.append(
            f"{row.rung} at {row.chips} chips: projected {row.ratio:.2f}x, published {row.published:.2f}x. "
            f"Per image on a chip the baseline takes {_ms(per_image)} and this rung {_ms(sum(b.values()))} "
            f"(FLOPs per image x{flops:.2f}); the gain is {gains}. The published ratio would need "
            f"{_ms(needed)} per image: {_ms(sum(b.values()) - needed)} less than the model's own terms give"
            + (" (more than the whole optimizer, communication and memory-bound time of the rung)"
               if sum(b.values()) - needed > b.get("optimizer", 0) + b.get("communication", 0)
               + b.get("memory-bound compute", 0) else "") + ".")
    return lines


def epoch_lines(rows: list[LadderRow], images: int) -> list[str]:
    out = []
    for n in sorted({r.chips for r in rows}):
        mine = {r.rung: r for r in rows if r.chips == n}
        hours = {k: images / (r.point.images_per_sec_per_chip * n) / 3600 for k, r in mine.items()}
        if all(k in hours for k in PUBLISHED_EPOCH_H):
            out.append(f"ImageNet-1K epoch at {n} chips: baseline {hours['baseline']:.2f} h, the stack through "
                       f"batch_second {hours['batch_second']:.2f} h (published, chip count not stated: "
                       f"{PUBLISHED_EPOCH_H['baseline']} h and {PUBLISHED_EPOCH_H['batch_second']} h)")
    return out


HEADER = ["chips", "rung", "strategy", "precision", "px", "classifier", "optimizer", "TFLOPS/chip", "vs baseline",
          "published", "img/s/chip", "step ms", "what moved from the rung above (per image on a chip)"]


def table(rows: list[LadderRow]) -> str:
    lines = []
    for r in rows:
        rec = r.record()
        lines.append([str(r.chips), r.rung, rec["strategy"], rec["precision"], str(rec["image_size"]),
                      rec["classifier"], rec["optim_impl"], f"{rec['tflops_per_chip']:.4g}", f"{r.ratio:.2f}x",
                      f"{r.published:.2f}x" if r.published else "", f"{rec['images_per_sec_per_chip']:.4g}",
                      f"{rec['step_time_s'] * 1e3:.1f}", r.moved])
    widths = [max(len(h), *(len(c[i]) for c in lines)) for i, h in enumerate(HEADER)]
    out = ["  ".join(h.ljust(w) for h, w in zip(HEADER, widths)), "  ".join("-" * w for w in widths)]
    return "\n".join(out + ["  ".join(c.ljust(w) for c, w in zip(line, widths)) for line in lines])


def run(rungs: list[tuple[str, Config]], profiles: list[HardwareProfile], chips: list[int], *,
        rate: Optional[ComputeRate] = None, as_json: bool = False, out=print) -> list[LadderRow]:
    """Print the ladder on each profile at each chip count (``as_json``: one JSON record per rung and count),
    the study's published figures beside it and each difference in the model's terms."""
    import json

    from rayvit.results import IMAGENET_TRAIN_IMAGES

    everything = []
    for profile in profiles:
        rows = project_ladder(rungs, chips, profile, rate)
        everything += rows
        if as_json:
            for r in rows:
                out(json.dumps(r.record(), default=float))
            continue
        out(f"\nladder on {profile.name} ({profile.source}): each rung adds its change to the rungs above it; "
            "per-chip TFLOPS against the baseline rung at the same count, as the study reports them")
        out(table(rows))
        out("published (ViT-H/16 on A100s, against DDP + AMP O1): the stack through batch_second 1.51x, with 256 px "
            "1.86x, full FP16 2.18x, the stack 1.83x DDP at 64 GPUs; said in the model's terms:")
        for line in against_published(rows) + epoch_lines(rows, IMAGENET_TRAIN_IMAGES):
            out(f"  {line}")
    return everything


def _ms(seconds: float, signed: bool = False) -> str:
    value = seconds * 1e3
    return f"{value:+.3g} ms" if signed else f"{value:.3g} ms"


__all__ = ["LadderRow", "PUBLISHED", "project_ladder", "moved", "against_published", "epoch_lines", "run", "table"]
