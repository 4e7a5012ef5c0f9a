"""Measured single-chip rates from what rayvit writes: a run's result, a ``rayvit bench --json`` file, a ``gpu_check`` JSON.

Each becomes a :class:`~rayvit.projection.performance.ComputeRate` (forward + backward seconds per
image on one chip) for the projection; the measured step's modelled optimizer time is taken out.
The rate is only as good as its match: model, image size and precision should be the projected ones.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rayvit.config import Config, ConfigError, from_dict
from rayvit.projection.performance import ComputeRate, compute_from_measured
from rayvit.projection.profiles import HardwareProfile


def _check_match(measured: Config, cfg: Config, where: str) -> None:
    a, b = measured, cfg
    same = (a.model.name, a.model.hidden_dim, a.model.depth, a.model.image_size, a.precision.mode) == \
           (b.model.name, b.model.hidden_dim, b.model.depth, b.model.image_size, b.precision.mode)
    if not same:
        raise ConfigError(f"{where} measured {a.model.name} {a.model.image_size}px {a.precision.mode}, but the "
                          f"projection is for {b.model.name} {b.model.image_size}px {b.precision.mode}")


def from_result(data: dict[str, Any], cfg: Config, profile: HardwareProfile, where: str) -> ComputeRate:
    """A ``RunResult`` dict (``result.json`` of a point): its per-chip rate at its world size."""
    measured = from_dict(data["config"])
    _check_match(measured, cfg, where)
    n = int(data["conditions"].get("world_size", 1))
    return compute_from_measured(measured, data["metrics"]["images_per_sec_per_chip"], profile,
                                 f"{where} ({measured.parallel.strategy}, {n} chip(s))", chips=n)


def from_bench(data: dict[str, Any], cfg: Config, profile: HardwareProfile, where: str) -> ComputeRate:
    """``rayvit bench --json``: the first variant of the first group (one process, one chip)."""
    measured = from_dict(data["config"])
    _check_match(measured, cfg, where)
    row = data["groups"][0]["rows"][0]
    return compute_from_measured(measured, row["images_per_sec"], profile, f"{where} (bench {row['variant']})")


def from_gpu_check(data: dict[str, Any], cfg: Config, profile: HardwareProfile, where: str) -> ComputeRate:
    """``experiments/gpu_check.py`` JSON: the ladder rung with the projected model, image size and precision."""
    want = cfg.precision.mode if cfg.precision.mode == "fp32" else f"{cfg.precision.mode}-{cfg.precision.dtype}"
    rows = [r for r in data.get("ladder", []) if r.get("status") == "done" and r.get("precision") == want
            and r.get("image_size") == cfg.model.image_size and r.get("model") == cfg.model.name]
    if not rows:
        raise ConfigError(f"{where}: no ladder rung measured {cfg.model.name} {cfg.model.image_size}px {want}")
    row = rows[-1]
    measured = cfg.replace({"parallel.strategy": row["strategy"], "parallel.num_workers": 1,
                            "train.batch_size": row["batch_per_chip"]})
    return compute_from_measured(measured, row["images_per_sec_per_chip"], profile,
                                 f"{where} (gpu_check rung {row['series']})")


def load_rate(path: str | Path, cfg: Config, profile: HardwareProfile) -> ComputeRate:
    data = json.loads(Path(path).read_text())
    if "groups" in data:
        return from_bench(data, cfg, profile, str(path))
    if "ladder" in data:
        return from_gpu_check(data, cfg, profile, str(path))
    if "metrics" in data and "config" in data:
        return from_result(data, cfg, profile, str(path))
    raise ConfigError(f"{path}: not a rayvit result.json, bench --json or gpu_check JSON")
