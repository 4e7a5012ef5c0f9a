"""What a study runs, planned and validated before anything starts.

A *point* is one training run: a full run :class:`~rayvit.config.Config` plus a stable key (``fsdp/w2``,
``3-mta_optimizer/w8``, ``baseline``). A scaling sweep measures every strategy at every worker count with
otherwise identical settings; the ladder applies the study's optimizations (``ladder.yaml``) one after
another at one worker count; a search varies the settings of ``search.space`` against a baseline.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import yaml

from rayvit.config_schema import BASELINE, Config, LADDER_RUNGS, Study
from rayvit.errors import ConfigError
from rayvit.launch.resources import resources_for

# Settings that do not change what a point measures, so a rerun with them changed still reuses it:
# where and how it is launched, and fault injection used to test recovery.
_UNHASHED_SECTIONS = ("launch",)
_UNHASHED_KEYS = ("train.fail_at_step", "train.fail_rank", "train.fail_mode", "train.max_failures",
                  "train.failure_timeout_s")

LADDER_FILE = Path(__file__).with_name("ladder.yaml")

# Keys a search may vary: how the work is done, never how much (steps, batch and data stay fixed).
SEARCHABLE_KEYS = ("precision.mode", "precision.dtype", "model.image_size", "optim.name", "optim.impl",
                   "model.classifier", "model.layout", "parallel.strategy")
OBJECTIVE_MODES = {"tflops_per_chip": "max", "images_per_sec": "max", "time_to_accuracy": "min"}


@dataclass(frozen=True)
class Point:
    """One training run of a study."""

    index: int              # 1-based position in the plan
    key: str                # stable within a study; how a rerun recognises a finished point
    series: str             # the strategy (scaling), the rung (ladder) or the trial (search)
    world_size: int
    cfg: Config = field(compare=False, repr=False)
    # A search trial's overrides of the base config (empty for sweep points).
    setting: Mapping[str, Any] = field(default_factory=dict, compare=False)

    @property
    def config_hash(self) -> str:
        """A digest of the settings that determine what this point measures."""
        flat = {k: v for k, v in self.cfg.flatten().items()
                if k.split(".")[0] not in _UNHASHED_SECTIONS and k not in _UNHASHED_KEYS}
        if not self.cfg.model.compile:
            # Nothing compiles: no backend, no caches (and points recorded before these keys existed match).
            flat.pop("model.compile_backend")
            flat.pop("model.compile_cold")
        return hashlib.sha1(json.dumps(flat, sort_keys=True, default=str).encode()).hexdigest()[:12]

    def describe(self) -> str:
        c = self.cfg
        what = f"{self.series} @ {self.world_size} worker{'s' if self.world_size > 1 else ''}"
        return (f"{what} ({c.parallel.strategy}, {c.model.name} {c.model.image_size}px, batch "
                f"{c.train.batch_size}/chip, {c.precision.mode}"
                f"{'' if c.precision.mode == 'fp32' else '/' + c.precision.dtype}, {c.train.steps} steps)")


def derive(cfg: Config, overrides: Mapping[str, Any], what: str) -> Config:
    """``cfg`` with ``overrides``, validated; a ConfigError says which point or setting was wrong."""
    try:
        return cfg.replace(dict(overrides))
    except ConfigError as e:
        raise ConfigError(f"{what}: {e}") from None


# --------------------------------------------------------------------------------------------------
# Sweeps


def plan(study: Study) -> list[Point]:
    """Every point of the sweep ``study`` describes, validated; raises ConfigError before anything runs."""
    check_hardware(study)
    return plan_ladder(study) if study.sweep.mode == "ladder" else plan_scaling(study)


def check_hardware(study: Study) -> None:
    """``sweep.hardware``, a profile's name or a cluster file, read once so that a typo fails here."""
    if study.sweep.hardware:
        from rayvit.projection.profiles import get_profile

        try:
            get_profile(study.sweep.hardware)
        except ConfigError as e:
            raise ConfigError(f"sweep.hardware={study.sweep.hardware}: {e}") from None


def plan_scaling(study: Study) -> list[Point]:
    """Every strategy at every worker count, smallest counts first and DDP first at each count.

    That order puts each point's references (DDP at its count, its own strategy at the smallest count)
    before it, so derived figures and curves fill in while the sweep runs.
    """
    strategies = [BASELINE] + [s for s in dict.fromkeys(study.sweep.strategies) if s != BASELINE]
    points = []
    for n in sorted(set(study.sweep.worker_counts)):
        for strategy in strategies:
            cfg = derive(study.run, {"parallel.strategy": strategy, "parallel.num_workers": n},
                         f"{strategy} at {n} workers")
            points.append(Point(len(points) + 1, f"{strategy}/w{n}", strategy, n, cfg))
    return points


def worker_groups(points: list[Point], share_workers: bool = True) -> list[list[Point]]:
    """The points that share one Ray Train worker group, in plan order of their first point.

    Points share when they ask for the same workers (count, resources, accelerator, placement) and read
    the same data (a parquet source is read through Ray Data, set up once per group, at one image size).
    A point that checkpoints or injects a fault runs alone: recovering a group from a checkpoint would
    retrain the others too.
    """
    groups: dict[Any, list[Point]] = {}
    for p in points:
        c = p.cfg
        alone = not share_workers or c.train.checkpoint_every or c.train.fail_at_step or c.train.max_failures
        key = (p.key,) if alone else (
            p.world_size, tuple(sorted(resources_for(c).items())), c.parallel.accelerator_type,
            c.parallel.placement_strategy, c.data.name,
            # Ray Data decodes parquet images at the model's size, on the driver's plan.
            json.dumps(c.to_dict()["data"], sort_keys=True) + str(c.model.image_size) if c.data.name == "parquet" else None)
        groups.setdefault(key, []).append(p)
    return list(groups.values())


def ladder_overrides(study: Study) -> list[tuple[str, dict[str, Any]]]:
    """``(rung, cumulative overrides)`` for each rung of ``sweep.rungs``, in the study's order."""
    if study.run.precision.mode not in ("fp32", "amp"):
        raise ConfigError(f"the ladder's baseline runs in precision.mode fp32 or amp (the study's DDP "
                          f"baseline); got precision.mode={study.run.precision.mode}")
    wanted = set(study.sweep.rungs)
    if "baseline" not in wanted:
        raise ConfigError("sweep.rungs must include baseline: every rung is reported relative to it")
    steps = yaml.safe_load(LADDER_FILE.read_text())
    # fp16 has no fast CPU kernels (docs/measurement.md); bf16 is the CPU's half type.
    overrides = {} if study.run.parallel.use_gpu else {"precision.dtype": "bf16"}
    rungs = []
    for rung in LADDER_RUNGS:
        step = {k: (study.sweep.ladder_image_size if v == "sweep.ladder_image_size" else v)
                for k, v in steps[rung].items()}
        overrides = {**overrides, **step}
        if rung in wanted:
            rungs.append((rung, dict(overrides)))
    return rungs


def plan_ladder(study: Study) -> list[Point]:
    """The cumulative optimization rungs at ``parallel.num_workers`` workers."""
    n = study.run.parallel.num_workers
    return [Point(i + 1, f"{i}-{rung}/w{n}", rung, n, derive(study.run, overrides, f"ladder rung {rung}"))
            for i, (rung, overrides) in enumerate(ladder_overrides(study))]


def describe_plan(study: Study, points: list[Point]) -> str:
    """The planned points and the resources each asks of the cluster (what ``--dry-run`` prints)."""
    lines = [f"{study.sweep.mode} sweep: {len(points)} points, run one after another",
             f"  {'#':>3}  {'point':<28} {'strategy':<14} {'workers':>7}  resources"]
    needs = [resources_for(p.cfg) for p in points]
    for p, res in zip(points, needs):
        text = ", ".join(f"{k} {v:g}" for k, v in sorted(res.items()))
        lines.append(f"  {p.index:>3}  {p.key:<28} {p.cfg.parallel.strategy:<14} {p.world_size:>7}  {text}")
    peak = {k: max(r.get(k, 0.0) for r in needs) for r in needs for k in r}
    lines.append("largest point needs: " + ", ".join(f"{k} {v:g}" for k, v in sorted(peak.items())))
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# Searches


@dataclass(frozen=True)
class SearchPlan:
    """A validated search: the base config, its baseline point, the space and every setting it spans."""

    study: Study
    baseline: Point
    space: dict[str, list[Any]]
    settings: list[dict[str, Any]]      # every combination of the space, in grid order

    @property
    def base(self) -> Config:
        return self.study.run

    @property
    def mode(self) -> str:
        return OBJECTIVE_MODES[self.study.search.objective]

    @property
    def num_trials(self) -> int:
        s = self.study.search
        return len(self.settings) if s.algorithm == "grid" else s.num_samples

    def trial(self, index: int, label: str, setting: Mapping[str, Any]) -> Point:
        cfg = derive(self.base, setting, f"search setting {setting_label(setting)}")
        return Point(index, label, label, cfg.parallel.num_workers, cfg, dict(setting))

    def candidates(self) -> list[Point]:
        """Every setting of a grid as a trial point: ``t01``, ``t02``, ... in grid order (stable across
        reruns, so a resumed search finds its finished trials by label)."""
        return [self.trial(i + 1, trial_key(i + 1), s) for i, s in enumerate(self.settings)]


def trial_key(index: int) -> str:
    return f"t{index:02d}"


def setting_label(overrides: Mapping[str, Any]) -> str:
    """``mode=pure image_size=40 impl=loop``: short enough for a table column and a run name."""
    return " ".join(f"{key.split('.')[-1]}={value}" for key, value in overrides.items()) or "(base config)"


def plan_search(study: Study) -> SearchPlan:
    """Check the ``search`` section against the run config; raise ``ConfigError`` before any trial runs."""
    s, cfg = study.search, study.run
    space = _search_space(study)
    _check_baseline_keys(s.baseline, cfg)
    baseline_cfg = derive(cfg, s.baseline, "search.baseline")
    if cfg.data.name == "synthetic":
        raise ConfigError("the accuracy constraint needs a real dataset with a validation split: set "
                          "data.name=digits (bundled, no download) or data.name=parquet with data.path")
    if s.objective == "time_to_accuracy" and not cfg.train.eval_every:
        raise ConfigError("search.objective=time_to_accuracy needs evaluations during training: set "
                          "train.eval_every to a number of steps (e.g. train.eval_every=25)")
    settings = [dict(zip(space, combo)) for combo in itertools.product(*space.values())]
    if len(settings) > 10_000 and s.algorithm == "grid":
        raise ConfigError(f"search.space spans {len(settings)} settings: too many for a grid; use "
                          "search.algorithm=optuna with search.num_samples")
    baseline = Point(0, "baseline", "baseline", baseline_cfg.parallel.num_workers, baseline_cfg, dict(s.baseline))
    kept = []
    for setting in settings:
        point = Point(0, "", "", 0, derive(cfg, setting, "search.space setting " + setting_label(setting)))
        # The baseline's own setting is not a trial: the baseline's run is its measurement.
        if point.config_hash != baseline.config_hash:
            kept.append(setting)
    if not kept:
        raise ConfigError("search.space holds only the baseline's own setting: give it settings to try")
    return SearchPlan(study, baseline, space, kept)


def _search_space(study: Study) -> dict[str, list[Any]]:
    s, known, allowed = study.search, study.run.flatten(), ", ".join(SEARCHABLE_KEYS)
    if not s.space:
        raise ConfigError(
            "search.space is empty: give at least one key with candidate values, e.g. "
            "--set 'search.space={precision.mode: [amp, pure], model.image_size: [32, 40]}'; "
            f"searchable keys: {allowed}")
    space: dict[str, list[Any]] = {}
    for key, values in s.space.items():
        if key not in known:
            raise ConfigError(f"search.space has unknown key {key!r}: not a config key "
                              f"(section.key); searchable keys: {allowed}")
        if key not in SEARCHABLE_KEYS:
            raise ConfigError(f"search.space key {key!r} cannot be searched: every trial gets the same "
                              f"training budget and data; searchable keys: {allowed}")
        values = list(dict.fromkeys(values if isinstance(values, list) else [values]))
        if not values:
            raise ConfigError(f"search.space.{key} is an empty list: give at least one candidate value")
        for value in values:
            derive(study.run, {key: value}, f"search.space.{key}={value!r}")
        space[key] = values
    return space


def _check_baseline_keys(baseline: Mapping[str, Any], cfg: Config) -> None:
    known, allowed = cfg.flatten(), ", ".join(SEARCHABLE_KEYS)
    if not baseline:
        raise ConfigError(
            "search.max_accuracy_drop needs a baseline to measure the drop from, but search.baseline is "
            "empty: set it to the reference setting's overrides, e.g. {precision.mode: fp32, optim.impl: "
            "loop} (the base config's image size is kept)")
    for key in baseline:
        if key not in known:
            raise ConfigError(f"search.baseline has unknown key {key!r}: not a config key (section.key)")
        if key not in SEARCHABLE_KEYS:
            raise ConfigError(f"search.baseline key {key!r} would give the baseline another budget or "
                              f"data than the trials; baseline keys must be among: {allowed}")
