"""``rayvit plan``: what to run, on which hardware and how many chips, and what an epoch costs. No torch.

For the config's model and dataset it projects, on each hardware profile (shipped or a cluster file) and
chip count, every setting worth weighing (:func:`settings`): each registered strategy the config allows
with its variants (FSDP and HSDP with and without resharding), activation checkpointing off and on, the
precisions and image sizes of the config's search space (a row that changes one of them is marked: what
it costs in accuracy only a search measures, ``rayvit search``), and the batch per chip from a quarter of
the config's up to the largest that fits (:func:`batches`). The settings that fit are ranked by hours per
epoch of the dataset (:func:`epoch_images`), or by cost per epoch where every profile has a price.

Each row says what dominates its step and why the next row loses (:func:`why_behind`): the term of the
step whose share of the epoch grows the most between the two, in hours.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

from rayvit.config_schema import Config, Study
from rayvit.errors import ConfigError
from rayvit.projection import performance
from rayvit.projection.performance import ComputeRate, Projection
from rayvit.projection.hardware_profile import HardwareProfile
from rayvit.results import IMAGENET_TRAIN_IMAGES
from rayvit.strategies import STRATEGIES, strategy_class

# Keys of the search space the plan varies, and whose change may move accuracy (rayvit search measures it).
ACCURACY_KEYS = ("precision.mode", "precision.dtype", "model.image_size")
CHECKPOINTING = ("none", "block")
# The digits dataset bundled with scikit-learn: 1,797 images, of which data.val_fraction are held out.
DIGITS_IMAGES = 1797
# A step's terms (Projection fields) and how the table names them.
TERMS = {"compute_s": "compute", "exposed_comm_s": "communication", "optimizer_s": "optimizer",
         "overhead_s": "strategy overhead", "straggler_s": "stragglers"}


@dataclass
class Row:
    """One setting on one profile at one chip count: its projection and what an epoch takes."""

    hardware: HardwareProfile
    chips: int
    cfg: Config
    point: Projection
    epoch_images: int
    changes: tuple[str, ...] = ()
    rank: Optional[int] = None
    behind: str = ""              # why this row loses to the one above it

    @property
    def fits(self) -> bool:
        return self.point.memory.fits is not False

    @property
    def epoch_hours(self) -> float:
        return self.epoch_images / (self.point.images_per_sec_per_chip * self.chips) / 3600

    @property
    def epoch_cost(self) -> Optional[float]:
        price = self.hardware.price_per_chip_hour
        return None if price is None else self.epoch_hours * self.chips * price

    def term_hours(self) -> dict[str, float]:
        """Each term of the step, as hours of the epoch: steps per epoch x the term's seconds."""
        steps = self.epoch_images / (self.point.batch * self.chips)
        return {name: steps * max(getattr(self.point, key), 0.0) / 3600 for key, name in TERMS.items()}

    def record(self) -> dict[str, Any]:
        m, p = self.cfg.model, self.cfg.precision
        return {"rank": self.rank, "hardware": self.hardware.name, "chips": self.chips,
                "strategy": self.point.label, "batch_per_chip": self.point.batch,
                "global_batch": self.point.batch * self.chips, "fits": self.fits,
                "epoch_hours": self.epoch_hours, "epoch_cost": self.epoch_cost,
                "currency": self.hardware.currency or None,
                "precision": p.mode if p.mode == "fp32" else f"{p.mode}-{p.dtype}", "image_size": m.image_size,
                "activation_checkpointing": m.activation_checkpointing, "changes_accuracy": bool(self.changes),
                "changes": list(self.changes), "dominant": self.point.dominant, "behind": self.behind or None,
                "images_per_sec_per_chip": self.point.images_per_sec_per_chip,
                "step_time_s": self.point.step_s, "memory_bytes_per_rank": self.point.memory.total,
                "max_batch": self.point.memory.max_batch, "epoch_images": self.epoch_images,
                **{f"{name.replace(' ', '_')}_hours": h for name, h in self.term_hours().items()}}


@dataclass
class Searched:
    """What was searched, for the header: settings, batch range, rows that fit, rows left out and why."""

    settings: int = 0
    rows: int = 0
    fit: int = 0
    batches: set = field(default_factory=set)
    skipped: list = field(default_factory=list)


def epoch_images(study: Study, given: Optional[int] = None) -> tuple[int, str]:
    """(training images per epoch, what they are): ``given`` (``--epoch-images``), the bundled digits' training
    split, a local parquet source's rows (less the validation fraction when it has no ``val_path``), else
    ImageNet-1K's 1,281,167."""
    d = study.run.data
    if given:
        return given, f"{given:,} images (--epoch-images)"
    if d.name == "digits":
        n = round(DIGITS_IMAGES * (1 - d.val_fraction))
        return n, f"{n:,} images (the digits' training split)"
    if d.name == "parquet" and d.path and "://" not in d.path:
        from pathlib import Path

        if Path(d.path).exists():
            import pyarrow.parquet as pq

            rows = sum(f.metadata.num_rows for f in pq.ParquetDataset(d.path).fragments)
            n = rows if d.val_path else round(rows * (1 - d.val_fraction))
            return n, f"{n:,} images ({d.path}{'' if d.val_path else ', less data.val_fraction'})"
    return IMAGENET_TRAIN_IMAGES, f"{IMAGENET_TRAIN_IMAGES:,} images (ImageNet-1K's training split)"


def settings(study: Study, strategies: Optional[list[str]] = None) -> Iterator[tuple[Config, tuple[str, ...]]]:
    """Every setting the plan weighs, with the accuracy keys it changes against the config's own: the search
    space's precisions and image sizes, activation checkpointing off and on, each strategy the config allows
    (``strategies``: only those) and its variants. A combination the config's rules refuse is left out."""
    base, flat = study.run, study.run.flatten()
    axes = {k: list(dict.fromkeys([flat[k], *study.search.space.get(k, [])])) for k in ACCURACY_KEYS}
    for values in itertools.product(*axes.values()):
        chosen = dict(zip(axes, values))
        changes = tuple(f"{k}={v}" for k, v in chosen.items() if v != flat[k])
        for ckpt in dict.fromkeys([base.model.activation_checkpointing, *CHECKPOINTING]):
            for name in strategies or STRATEGIES:
                try:
                    cfg = base.replace({**chosen, "model.activation_checkpointing": ckpt, "parallel.strategy": name})
                except ConfigError:
                    continue          # e.g. fairscale_oss under mixed, fairscale_fsdp without GPUs
                for variant in strategy_class(name).variants(cfg):
                    yield variant, changes


def batches(base: int, largest: Optional[int]) -> list[int]:
    """Batch sizes per chip to weigh: powers of two from a quarter of the config's up to the largest that fits,
    the config's own and that largest (the config's own only where memory is unknown)."""
    if not largest:
        return [base]
    out = {base, largest}
    b = max(1, base // 4)
    while b <= largest:
        out.add(b)
        b *= 2
    return sorted(out)


def at_chips(cfg: Config, chips: int) -> Optional[Config]:
    """``cfg`` at ``chips`` workers, or None where its strategy refuses that count (HSDP's shard size)."""
    scaled = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, num_workers=chips))
    return None if strategy_class(cfg.parallel.strategy).refuses(scaled) else scaled


def rows_for(study: Study, profile: HardwareProfile, chips: list[int], *, rate: Optional[ComputeRate] = None,
             overheads: Optional[dict[str, float]] = None, images: int = IMAGENET_TRAIN_IMAGES,
             strategies: Optional[list[str]] = None, batch_sizes: Optional[list[int]] = None,
             searched: Optional[Searched] = None) -> list[Row]:
    """Every setting (:func:`settings`) at every batch (:func:`batches`) and chip count on ``profile``.

    ``rate``: a measured compute rate of the config's own model, image size and precision, used for the
    settings that keep them; the others are costed by the roofline where the chip has one, else left out
    (said in ``searched.skipped``). ``overheads``: each strategy's measured per-step overhead.
    ``batch_sizes``: these batches per chip only, fitting or not (``--batch-per-chip``)."""
    searched = searched or Searched()
    out = []
    for cfg, changes in settings(study, strategies):
        # A measured rate is the config's own model, image size and precision (rates.load_measured checks).
        compute = rate if not changes else None
        if compute is None and not _has_roofline(cfg, profile):
            searched.skipped.append(f"{'/'.join(changes) or 'the config'}: no measured rate for it on {profile.name}")
            continue
        searched.settings += 1
        extra = performance.inherited(overheads or {}, cfg.parallel.strategy)
        for n in chips:
            scaled = at_chips(cfg, n)
            if scaled is None:
                continue
            first = performance.project(scaled, n, profile, compute, overhead_s=extra)
            for b in batch_sizes or batches(cfg.train.batch_size, first.memory.max_batch):
                point = first if b == cfg.train.batch_size else \
                    performance.project(scaled, n, profile, compute, batch=b, overhead_s=extra)
                point.hardware = profile.name
                out.append(Row(profile, n, cfg, point, images, changes))
                searched.batches.add(b)
    searched.rows += len(out)
    searched.fit += sum(r.fits for r in out)
    return out


def _has_roofline(cfg: Config, profile: HardwareProfile) -> bool:
    from rayvit.projection import roofline

    return roofline.chip_for(profile, performance.peak_key(cfg)) is not None or \
        profile.peak_flops(performance.peak_key(cfg)) is not None


def best_batches(rows: list[Row], by: str = "hours") -> list[Row]:
    """Each setting (hardware, chips, strategy, precision, image size, checkpointing) at its best batch per
    chip among those that fit (its smallest batch where none fits)."""
    best: dict[tuple, Row] = {}
    for row in rows:
        m = row.cfg.model
        key = (row.hardware.name, row.chips, row.point.label, row.changes, m.image_size, m.activation_checkpointing)
        held = best.get(key)
        if held is None or _better(row, held, by):
            best[key] = row
    return list(best.values())


def _better(a: Row, b: Row, by: str) -> bool:
    if a.fits != b.fits:
        return a.fits
    if not a.fits:
        return a.point.batch < b.point.batch
    return _order(by)(a) < _order(by)(b)


def _order(by: str):
    if by == "cost":
        return lambda r: (r.epoch_cost if r.epoch_cost is not None else float("inf"), r.epoch_hours)
    return lambda r: (r.epoch_hours, r.epoch_cost or 0.0)


def rank(rows: list[Row], by: str = "hours") -> list[Row]:
    """The rows that fit, fastest (``by="hours"``) or cheapest (``"cost"``) epoch first, numbered, each with
    why it loses to the one above; then the rows that do not fit, unnumbered."""
    fit = sorted((r for r in rows if r.fits), key=_order(by))
    for i, row in enumerate(fit):
        row.rank, row.behind = i + 1, why_behind(fit[i - 1], row, by) if i else ""
    rest = [dataclasses.replace(r, rank=None, behind="") for r in rows if not r.fits]
    return fit + rest


def why_behind(ahead: Row, behind: Row, by: str = "hours") -> str:
    """Why ``behind`` loses to ``ahead``: the term whose hours of the epoch (chip-hours, ``by="cost"``: what
    is paid for) grow the most between them, with its time per image on a chip (a step's term over its
    batch), and what else differs (chips, batch)."""
    a, b = ahead.term_hours(), behind.term_hours()
    if by == "cost":
        a, b = ({k: v * r.chips for k, v in d.items()} for d, r in ((a, ahead), (b, behind)))
    term = max(b, key=lambda t: b[t] - a[t])
    grown = b[term] - a[term]
    if grown <= 0:
        return "a tie"
    field_ = next(k for k, v in TERMS.items() if v == term)
    mine, theirs = (getattr(r.point, field_) / r.point.batch for r in (behind, ahead))
    per_step = f"{_seconds(mine)} per image against {_seconds(theirs)}"
    moved = [f"{what} {x} against {y}" for what, x, y in (
        ("chips", behind.chips, ahead.chips), ("batch", behind.point.batch, ahead.point.batch))
        if x != y]
    text = f"{term} +{_hours(grown)}{' of chip time' if by == 'cost' else ''} ({per_step})"
    return text + (f"; {', '.join(moved)}" if moved else "")


def _seconds(s: float) -> str:
    return f"{s * 1e3:.3g} ms" if s >= 1e-3 else f"{s * 1e6:.3g} us"


def _hours(h: float) -> str:
    return f"{h * 60:.2g} min" if h < 1 else f"{h:.2g} h"


__all__ = ["Row", "Searched", "settings", "batches", "rows_for", "best_batches", "rank", "why_behind",
           "epoch_images", "ACCURACY_KEYS"]
