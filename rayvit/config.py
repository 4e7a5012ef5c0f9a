"""Loading configs: one typed tree for a run (:class:`Config`) and the study specifications beside it
(:class:`Study`), from a YAML file or a shipped config's name, overridden with ``section.key=value``
strings in the style of a command line, built (model presets and the conv stem's default widths resolved
into a new object) and validated by the rules (:mod:`rayvit.config_rules`).

The types themselves live at the bottom of rayvit, in :mod:`rayvit.config_schema`; they are importable
from here too, beside the functions that make them.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Iterable, Optional

from rayvit.config_build import build, read_yaml, with_overrides
from rayvit.config_rules import resolved_model, validate, validate_search, validate_sweep
from rayvit.config_schema import (RUN_SECTIONS, STUDY_SECTIONS, Config, DataConfig, LaunchConfig, ModelConfig,
                                  OptimConfig, ParallelConfig, PrecisionConfig, SearchConfig, Study, SweepConfig,
                                  TrackingConfig, TrainConfig, register_loader)
from rayvit.errors import ConfigError, TrackingError


def rayvit_home() -> Path:
    """Where rayvit keeps local results (the MLflow store, Ray Train's runs): ``$RAYVIT_HOME``, else ~/.rayvit."""
    return Path(os.environ.get("RAYVIT_HOME") or Path.home() / ".rayvit").expanduser().resolve()


def tracking_uri(configured: Optional[str] = None) -> str:
    """The MLflow tracking URI rayvit records to: ``configured`` (a config's ``tracking.uri``), else
    ``$MLFLOW_TRACKING_URI``, else ``sqlite:///`` ``rayvit_home()/mlflow.db``.

    Local stores come back absolute (Ray Train workers and ``ray job submit`` drivers run in other
    folders); a bare file path is read as a sqlite database. A file store (``./mlruns``, ``file:``), which
    MLflow 3 refuses, is a ``TrackingError`` naming what to use instead.
    """
    uri = configured or os.environ.get("MLFLOW_TRACKING_URI") or "sqlite:///" + str(rayvit_home() / "mlflow.db")
    if uri.startswith("sqlite:///"):
        path = Path(uri[len("sqlite:///"):]).expanduser()
        return "sqlite:///" + str(path.resolve())
    if "://" not in uri and not uri.startswith(("file:", "databricks")):
        path = Path(uri).expanduser().resolve()  # a bare path: a sqlite database file
        if path.suffix in (".db", ".sqlite", ".sqlite3"):
            return "sqlite:///" + str(path)
        uri = "file:" + str(path)
    if uri.startswith("file:"):
        raise TrackingError(
            f"tracking URI {uri!r} names a file store, which MLflow 3 refuses; use "
            "sqlite:////absolute/folder/mlflow.db, "
            "a server (http://host:5000), or leave it unset for the local default")
    return uri


# --------------------------------------------------------------------------------------------------
# Loading


# The configs shipped with the package (the same files as experiments/configs in a checkout).
SHIPPED_CONFIGS = Path(__file__).resolve().parent / "configs"


def config_path(value: str | os.PathLike) -> str:
    """A YAML file, else the name of one shipped with rayvit (``ladder_cpu.yaml`` or ``ladder_cpu``), so that
    an installed rayvit runs its configs from any directory. Anything else is returned as given: loading
    it reports the missing file and the shipped names."""
    value = os.fspath(value)
    if Path(value).is_file():
        return value
    for name in (value, f"{value}.yaml"):
        if Path(name).name == name and (SHIPPED_CONFIGS / name).is_file():
            return str(SHIPPED_CONFIGS / name)
    return value


def shipped_configs() -> list[str]:
    """The names of the configs rayvit ships (``cpu_default``, ``ladder_cpu``, ...)."""
    return sorted(p.stem for p in SHIPPED_CONFIGS.glob("*.yaml"))


def load_study(path: str | os.PathLike | None = None,
               overrides: Iterable[str] | dict[str, Any] = (), *, baseline_required: bool = True) -> Study:
    """Read a YAML file or a shipped config's name (or the defaults), apply ``section.key=value``
    overrides, build and validate.

    ``baseline_required=False``: ``sweep.strategies`` need not name DDP (the projection adds it itself;
    a sweep measures every point against it, so ``rayvit sweep`` requires it)."""
    return study_from_dict(read_yaml(config_path(path), shipped_configs()) if path is not None else {}, overrides,
                           baseline_required=baseline_required)


def load_config(path: str | os.PathLike | None = None,
                overrides: Iterable[str] | dict[str, Any] = ()) -> Config:
    """The run config of a YAML file or a shipped config (``load_config("cpu_default")``): as
    :func:`load_study`, whose sweep and search sections are checked too (a typo there is still an error)
    but not kept."""
    return load_study(path, overrides).run


def as_config(cfg: "Config | dict[str, Any] | str | os.PathLike") -> "Config":
    """A :class:`Config` from what a public entry point was given: a Config (as is), its dict form
    (``Config.to_dict()``, validated) or a YAML file / shipped config name (:func:`load_config`)."""
    if isinstance(cfg, Config):
        return cfg
    if isinstance(cfg, dict):
        return from_dict(cfg)
    if isinstance(cfg, (str, os.PathLike)):
        return load_config(cfg)
    raise ConfigError(f"expected a rayvit Config, its dict form or a config file / shipped name "
                      f"({', '.join(shipped_configs())}), got {type(cfg).__name__}")


def from_dict(data: dict[str, Any], overrides: Iterable[str] | dict[str, Any] = ()) -> Config:
    """Build a validated run :class:`Config` from nested dicts plus overrides."""
    data = with_overrides(data, overrides)
    study_keys = sorted(set(data) & set(STUDY_SECTIONS))
    if study_keys:
        raise ConfigError(f"section {study_keys[0]!r} belongs to a study, not to a run config: use "
                          "rayvit.config.load_study (or Study.replace) for sweep, search and tracking keys")
    return _run_config(data)


def study_from_dict(data: dict[str, Any], overrides: Iterable[str] | dict[str, Any] = (), *,
                    baseline_required: bool = True) -> Study:
    """Build a validated :class:`Study` from the YAML file's shape plus overrides."""
    data = with_overrides(data, overrides)
    unknown = sorted(set(data) - set(RUN_SECTIONS) - set(STUDY_SECTIONS))
    if unknown:
        raise ConfigError(f"unknown key {unknown[0]!r} in config; allowed: "
                          f"{', '.join(RUN_SECTIONS + STUDY_SECTIONS)}")
    study = Study(run=_run_config({k: v for k, v in data.items() if k in RUN_SECTIONS}),
                  sweep=build(SweepConfig, data.get("sweep"), "sweep."),
                  search=build(SearchConfig, data.get("search"), "search."),
                  tracking=build(TrackingConfig, data.get("tracking"), "tracking."))
    validate_sweep(study.sweep, baseline_required=baseline_required)
    validate_search(study.search)
    return study


def _run_config(data: dict[str, Any]) -> Config:
    cfg = build(Config, data, "")
    cfg = dataclasses.replace(cfg, model=resolved_model(cfg.model))
    validate(cfg)
    return cfg


register_loader(from_dict, study_from_dict)

__all__ = ["Config", "DataConfig", "LaunchConfig", "ModelConfig", "OptimConfig", "ParallelConfig", "PrecisionConfig",
           "SearchConfig", "Study", "SweepConfig", "TrackingConfig", "TrainConfig", "as_config", "config_path",
           "from_dict", "load_config", "load_study", "rayvit_home", "shipped_configs", "study_from_dict",
           "tracking_uri"]
