"""``rayvit project`` (``experiments/scaling.py --project``): the projection table and figure, without Ray."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

from rayvit.config import BASELINE, Config, ConfigError, Study, reduces_in_half
from rayvit.projection import inputs, report
from rayvit.projection.performance import Projection, compute_from_peak, project_grid
from rayvit.projection.profiles import get_profile
from rayvit.projection.rates import load_rate
from rayvit.worker.strategies import strategy_class

STUDY_NOTE = ("Published (ViT-H/16, A100s): FSDP 1.83x DDP at 64 GPUs; the optimization stack 1.51x, 256 px "
              "1.86x, full FP16 2.18x, all against a DDP + AMP O1 baseline (see README: Projecting before you rent).")


def variants(cfg: Config, strategies: list[str]) -> list[Config]:
    """Every strategy of ``strategies`` as configured, with the variants each adds (``Strategy.variants``:
    FSDP with the other resharding setting)."""
    out = []
    for strategy in dict.fromkeys([BASELINE, *strategies]):
        try:
            v = cfg.replace({"parallel.strategy": strategy})
        except ConfigError:
            continue          # e.g. fairscale_oss under precision.mode=mixed, fairscale_fsdp without GPUs
        out += strategy_class(strategy).variants(v)
    return out


def conditions(cfg: Config, profile_name: str) -> list[dict]:
    m, p = cfg.model, cfg.precision
    return [{"model": m.name, "image_size": m.image_size, "batch_per_chip": cfg.train.batch_size,
             "precision": p.mode if p.mode == "fp32" else f"{p.mode}-{p.dtype}", "accelerator": profile_name}]


def run(study: Study, *, hardware: list[str], chips: Optional[list[int]] = None, measured: Optional[str] = None,
        out_dir: str = "results", out: Callable[[str], None] = print, data_rate: Optional[str] = None,
        node_cpus: Optional[float] = None) -> list[Projection]:
    """Print the projection of the study's sweep on each hardware profile and write one PNG per profile;
    with ``data_rate`` (:func:`rayvit.projection.inputs.load_rate`) also whether the input keeps up."""
    cfg = study.run
    input_rate = inputs.load_rate(data_rate, cfg.model.image_size) if data_rate else None
    chips = sorted(set(chips or study.sweep.worker_counts))
    everything = []
    for name in hardware:
        profile = get_profile(name)
        rate = load_rate(measured, cfg, profile) if measured else compute_from_peak(cfg, profile)
        points = project_grid(cfg, chips, variants(cfg, study.sweep.strategies), profile, rate)
        m, p = cfg.model, cfg.precision
        out(f"\nprojection: {m.name} {m.image_size}px, batch {cfg.train.batch_size}/chip, "
            f"{p.mode}{'' if p.mode == 'fp32' else '/' + p.dtype}, reduce {'half' if reduces_in_half(cfg) else 'fp32'}, "
            f"{cfg.optim.name}-{cfg.optim.impl} on {profile.name} ({profile.source})")
        out(f"compute: {rate.source}; overlap {profile.overlap:g}; links: intra-node busbw "
            f"{profile.intra.busbw / 1e9:.0f} GB/s, {profile.chips_per_node} chips/node, inter-node busbw "
            f"{profile.inter.busbw / 1e9:.0f} GB/s per node")
        out(report.format_table(points))
        out("")
        out(report.memory_table([q for q in points if q.chips == chips[-1]]))
        if input_rate is not None:
            out("")
            out(inputs.input_table(points, input_rate, node_cpus or inputs.node_cpus(profile.name),
                                   profile.chips_per_node, cfg.parallel.cpus_per_worker))
        path = Path(out_dir) / f"projection-{m.name}-{profile.name}.png"
        report.projection_figure(points, path, title=f"Projected per-chip TFLOPS: {m.name} on {profile.name}",
                                 caption_rows=conditions(cfg, profile.name))
        out(f"figure: {path.resolve()}")
        everything += points
    if cfg.model.name in ("vit_h16", "vit_h14"):
        out("\n" + STUDY_NOTE)
    return everything
