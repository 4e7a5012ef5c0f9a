"""What ``rayvit project`` prints and draws: a sweep's projection table and figure, without Ray (its command
line is :mod:`rayvit.cli.projection_commands`).

Everything a user gives is checked before anything is projected (chip counts, the ``--measured`` file,
the profiles), and files go where the user says or under ``$RAYVIT_HOME/projections``, never over an
earlier projection's. ``--json`` prints one JSON record per projected row instead of the tables.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Optional

from rayvit.accelerators import NO_BF16_TENSOR_CORES
from rayvit.config import load_study, rayvit_home
from rayvit.config_schema import BASELINE, Config, Study
from rayvit.errors import ConfigError
from rayvit.strategies.dtypes import reduces_in_half
from rayvit.projection import cluster_file, inputs, render
from rayvit.projection.hints import fit_hints
from rayvit.projection.performance import ComputeRate, Projection, project_grid
from rayvit.projection.hardware_profile import HardwareProfile
from rayvit.projection.profiles import get_profile
from rayvit.projection.rates import load_rate
from rayvit.strategies import strategy_class

STUDY_NOTE = ("Published (ViT-H/16 on A100s, the study this project reproduces): FSDP 1.83x DDP at 64 GPUs; the "
              "optimization stack 1.51x, 256 px 1.86x, full FP16 2.18x, all against a DDP + AMP O1 baseline "
              "(docs/projection.md).")


def load(config: str, overrides: list[str]) -> Study:
    """The study to project: as ``rayvit sweep`` reads it, except that ``sweep.strategies`` need not name
    DDP (the projection compares every strategy with DDP and adds it itself)."""
    return load_study(config, overrides, baseline_required=False)


def default_hardware(study: Study) -> list[str]:
    """``sweep.hardware`` where the config names one, else a100-40gb on GPU configs and cpu otherwise."""
    if study.sweep.hardware:
        return [study.sweep.hardware]
    return ["a100-40gb"] if study.run.parallel.use_gpu else ["cpu"]


def check_chips(chips: Optional[list[int]]) -> None:
    bad = [n for n in chips or [] if n < 1]
    if bad:
        raise ConfigError(f"--chips takes chip counts of 1 or more, got {', '.join(map(str, bad))}")


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
    return [{"model": model_name(cfg), "image_size": m.image_size, "batch_per_chip": cfg.train.batch_size,
             "precision": p.mode if p.mode == "fp32" else f"{p.mode}-{p.dtype}", "accelerator": profile_name}]


def model_name(cfg: Config) -> str:
    """The model as results name it: a preset, or a custom one by its architecture."""
    m = cfg.model
    return m.name if m.name != "custom" else f"custom-d{m.hidden_dim}x{m.depth}h{m.num_heads}p{m.patch_size}"


def unique_path(folder: Path, stem: str, suffix: str = ".png") -> Path:
    """``folder/stem.png``, or ``stem-2.png``, ``stem-3.png``, ... : never an existing file."""
    path, i = folder / f"{stem}{suffix}", 2
    while path.exists():
        path, i = folder / f"{stem}-{i}{suffix}", i + 1
    return path


def header(cfg: Config, profile: HardwareProfile, rate_source: str) -> list[str]:
    """What is projected, where its compute comes from, the links; a warning where the chip lacks the
    tensor cores for the dtype."""
    m, p = cfg.model, cfg.precision
    precision = p.mode if p.mode == "fp32" else f"{p.mode}/{p.dtype}"
    checkpointing = "" if m.activation_checkpointing == "none" else \
        f", activation checkpointing {m.activation_checkpointing}"
    bridge = "" if profile.bridge is None else \
        f", within {profile.bridge_chips} chips busbw {profile.bridge.busbw / 1e9:.0f} GB/s ({profile.bridge.source})"
    lines = [f"projection: {model_name(cfg)} {m.image_size}px, batch {cfg.train.batch_size}/chip, {precision}, "
             f"reduce {'half' if reduces_in_half(cfg) else 'fp32'}, {cfg.optim.name}-{cfg.optim.impl}{checkpointing} "
             f"on {profile.name} ({profile.source})",
             f"compute: {rate_source}",
             f"links: intra-node busbw {profile.intra.busbw / 1e9:.0f} GB/s ({profile.intra.source}){bridge}, "
             f"{profile.chips_per_node} chips/node, inter-node busbw {profile.inter.busbw / 1e9:.0f} GB/s per node; "
             f"overlap {profile.overlap:g} (compute beside a collective {profile.overlap_slowdown:.1%} slower); "
             f"chips' speed spread {profile.speed_cv:.2%} (stragglers)"]
    described = cluster_file.describe(profile)
    if described:
        lines.append(described)
    if profile.accelerator in NO_BF16_TENSOR_CORES and p.mode != "fp32" and p.dtype == "bf16":
        lines.append(f"warning: {profile.accelerator} has no bf16 tensor cores: bf16 runs at its fp32 rate "
                     f"({profile.peak_flops('bf16') / 1e12:.4g} TFLOPS); use precision.dtype=fp16 there")
    return lines


def footnotes(points: list[Projection], chips: list[int]) -> list[str]:
    lines = [f"scaling eff. = per-chip img/s / the same strategy's at {chips[0]} chip(s), the smallest count given"]
    if any((p.scaling_efficiency or 0) > 1.0005 for p in points):
        lines.append("  above 100%: with more chips a sharded strategy's optimizer and memory traffic per rank "
                     "shrink faster than its communication grows")
    if any(p.vs_ddp is None and p.strategy != BASELINE for p in points):
        lines.append("vs DDP '-': DDP does not fit at that count, so there is nothing to compare with")
    return lines


def run(study: Study, *, hardware: list[str], chips: Optional[list[int]] = None, measured: Optional[str] = None,
        out_dir: Optional[str] = None, as_json: bool = False, out: Callable[[str], None] = print,
        data_rate: Optional[str] = None, node_cpus: Optional[float] = None,
        cpu_peaks: Optional[dict] = None) -> list[Projection]:
    """Print the projection of the study's sweep on each hardware profile (or, ``as_json``, one JSON record
    per row) and write one PNG per profile (``as_json``: only where ``out_dir`` is given); with
    ``data_rate`` (:func:`rayvit.projection.inputs.load_rate`) also whether the input keeps up.
    ``cpu_peaks``: the host's measured matmul rates, for the ``cpu`` profile (:mod:`rayvit.measure.host`)."""
    cfg = study.run
    check_chips(chips)
    input_rate = inputs.load_rate(data_rate, cfg.model.image_size) if data_rate else None
    chips = sorted(set(chips or study.sweep.worker_counts))
    profiles = [get_profile(name, cpu_peaks) for name in hardware]   # every name checked before any output
    if measured and not Path(measured).is_file():
        raise ConfigError(f"--measured {measured}: no such file (give a point's result.json, `rayvit bench "
                          "--json` output or `rayvit gpu-check`'s JSON)")
    folder = Path(out_dir) if out_dir else rayvit_home() / "projections"
    everything = []
    for profile in profiles:
        rate: Optional[ComputeRate] = load_rate(measured, cfg, profile) if measured else None
        configs = {strategy_class(v.parallel.strategy).label(v): v for v in variants(cfg, study.sweep.strategies)}
        points = project_grid(cfg, chips, list(configs.values()), profile, rate)
        everything += points
        # --node-cpus: the user's count, taken as physical cores.
        cpus, threads = (node_cpus, 1.0) if node_cpus else inputs.node_cpus(profile)
        if input_rate is not None:
            inputs.annotate(points, input_rate, cpus, profile.chips_per_node, cfg.parallel.cpus_per_worker, threads)
        if as_json:
            for p in points:
                out(json.dumps(p.record(), default=float))
            if out_dir:
                _figure(cfg, points, profile, folder)
            continue
        source = rate.source if rate else points[0].compute_source
        out("")
        for line in header(cfg, profile, source):
            out(line)
        out(render.format_table(points))
        for line in footnotes(points, chips):
            out(line)
        out("")
        out(render.memory_table([q for q in points if q.chips == chips[-1]]))
        if input_rate is not None:
            out("")
            out(inputs.input_table(points, input_rate, cpus, profile.chips_per_node, cfg.parallel.cpus_per_worker,
                                   threads))
        for p in points:
            for line in fit_hints(configs[p.label], p, profile, rate):
                out(line)
        out(f"figure: {_figure(cfg, points, profile, folder).resolve()}")
        if cfg.model.name == "vit_h16" and profile.accelerator == "A100":
            out("\n" + STUDY_NOTE)
    return everything


def run_ladder(study: Study, rungs: list[tuple[str, Config]], *, hardware: list[str],
               chips: Optional[list[int]] = None, measured: Optional[str] = None, as_json: bool = False,
               out: Callable[[str], None] = print, cpu_peaks: Optional[dict] = None) -> list:
    """``sweep.mode=ladder``: the rungs (``rayvit.studies.plan.ladder_overrides``, each a config) projected at
    each chip count (default: ``parallel.num_workers``, where the ladder runs) on each profile
    (:mod:`rayvit.projection.ladder`); ``measured``: the baseline rung's single-chip rate."""
    from rayvit.projection import ladder

    check_chips(chips)
    profiles = [get_profile(name, cpu_peaks) for name in hardware]
    if measured and not Path(measured).is_file():
        raise ConfigError(f"--measured {measured}: no such file")
    rows = []
    for profile in profiles:
        rate = load_rate(measured, rungs[0][1], profile) if measured else None
        rows += ladder.run(rungs, [profile], chips or [study.run.parallel.num_workers], rate=rate,
                           as_json=as_json, out=out)
    return rows


def _figure(cfg: Config, points: list[Projection], profile: HardwareProfile, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = unique_path(folder, f"projection-{model_name(cfg)}-{profile.name}")
    title = f"Projected per-chip TFLOPS: {model_name(cfg)} on {profile.name}"
    return render.projection_figure(points, path, title=title, caption_rows=conditions(cfg, profile.name))


__all__ = ["run", "run_ladder", "load", "default_hardware", "variants", "unique_path", "check_chips", "STUDY_NOTE"]
