"""Measured single-chip rates from what rayvit writes: a run's result, a ``rayvit bench --json`` file, a ``gpu_check`` JSON.

Each becomes a :class:`~rayvit.projection.performance.ComputeRate` (forward + backward seconds per
image on one chip) for the projection; the measured step's modelled optimizer time is taken out.
The rate is only as good as its match: model, image size and precision should be the projected ones.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from rayvit.config import from_dict
from rayvit.config_schema import BASELINE, Config
from rayvit.errors import ConfigError
from rayvit.projection.performance import ComputeRate, compute_from_measured, project
from rayvit.projection.hardware_profile import HardwareProfile, with_measured_links


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
    data = _read(path)
    if "groups" in data:
        return from_bench(data, cfg, profile, str(path))
    if "ladder" in data:
        return from_gpu_check(data, cfg, profile, str(path))
    if "metrics" in data and "config" in data:
        return from_result(data, cfg, profile, str(path))
    raise ConfigError(f"{path}: not a rayvit result.json, bench --json or gpu_check JSON")


def _read(path: str | Path) -> dict[str, Any]:
    try:
        return json.loads(Path(path).read_text())
    except OSError as e:
        raise ConfigError(f"--measured {path}: cannot be read ({e.strerror})") from None
    except ValueError as e:
        raise ConfigError(f"--measured {path}: not JSON ({e})") from None


def is_links(data: dict[str, Any]) -> bool:
    """A sweep's ``links.json`` (``rayvit.measure.links``): its collectives, backend and world size."""
    return "collectives" in data and "backend" in data


def load_measured(paths: list[str], cfg: Config, profile: HardwareProfile
                  ) -> tuple[HardwareProfile, Optional[ComputeRate], dict[str, float]]:
    """What several measurements say together, as a sweep's own projection reads them
    (:mod:`rayvit.projection.insweep`): a sweep's ``links.json`` replaces the profile's links; the compute
    rate comes from DDP's point at the smallest count among the ``result.json`` files given (else any
    strategy's; else a ``bench`` or ``gpu-check`` file); and each strategy whose point is given has its own
    per-step overhead: its measured step less its projection without one, at its smallest count.

    Returns (the profile, the rate or None, {strategy: overhead seconds})."""
    loaded = [(str(p), _read(p)) for p in paths]
    for path, data in loaded:
        if is_links(data):
            profile = with_measured_links(profile, data)
    results = sorted(((p, d) for p, d in loaded if "metrics" in d and "config" in d),
                     key=lambda pd: (int(pd[1]["conditions"].get("world_size", 1)),
                                     from_dict(pd[1]["config"]).parallel.strategy != BASELINE))
    others = [(p, d) for p, d in loaded if not is_links(d) and (p, d) not in results]
    if not results:
        return profile, (load_rate(others[0][0], cfg, profile) if others else None), {}
    path, data = results[0]
    rate = from_result(data, cfg, profile, path)
    overheads: dict[str, float] = {}
    for path, data in results:
        measured = from_dict(data["config"])
        _check_match(measured, cfg, path)
        if measured.parallel.strategy in overheads:
            continue
        n = int(data["conditions"].get("world_size", 1))
        step = measured.train.batch_size / data["metrics"]["images_per_sec_per_chip"]
        overheads[measured.parallel.strategy] = step - project(measured, n, profile, rate, peak=1.0).step_s
    overheads[from_dict(results[0][1]["config"]).parallel.strategy] = 0.0   # the rate's own point
    return profile, rate, overheads
