"""``rayvit search --dry-run``: what a search would run and what it would cost, before any cluster exists.

No Ray, no MLflow, nothing trains: the trials (every setting of the space), the screening plan, each
trial's projected throughput (:mod:`rayvit.projection`, from the chip's peak x the profile's stated
efficiency, since nothing is measured yet) and the GPU-hours of the whole search, as an upper bound
(every trial trained for its whole budget) and with ASHA's expected cut.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

from rayvit.config_schema import Study
from rayvit.launch.resources import resources_for
from rayvit.studies.search import screen
from rayvit.studies.plan import SearchPlan, plan_search, setting_label

# Seconds each trial spends outside its timed steps (Ray Train's worker group start, NCCL set-up, data
# pipeline warm-up, validation): stated assumptions, of the order a 2-worker CPU run takes
# (docs/search.md); 8 GPUs loading a parquet ImageNet take longer.
TRIAL_OVERHEAD_S = {"cpu": 30.0, "gpu": 180.0}


def _profile(plan: SearchPlan):
    from rayvit.projection.profiles import cpu_profile, get_profile, profile_for_accelerator

    cfg = plan.base
    if not cfg.parallel.use_gpu:
        # This host's CPU has no data sheet: its matmul rate is timed here (torch), for every dtype a trial
        # computes in. A GPU search's dry run is analytic and imports no torch.
        from rayvit.measure.host import cpu_peaks_for

        return cpu_profile(peaks=cpu_peaks_for([plan.baseline.cfg, *(plan.trial(0, "", o).cfg for o in plan.settings)]))
    if cfg.parallel.accelerator_type:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return profile_for_accelerator(cfg.parallel.accelerator_type)
    return get_profile("a100-40gb")


def describe_search(study: Study, plan: Optional[SearchPlan] = None) -> str:
    """The dry run's text: trials, screening plan, projected throughput per trial, estimated device-hours."""
    plan = plan or plan_search(study)
    profile = _profile(plan)
    lines = _header(plan, profile) + [""]
    table, trial_minutes = _trial_table(plan, profile)
    lines += table + [""]
    screen_lines, screen_min = _screen_cost(plan, profile)
    lines += screen_lines + [""]
    lines += _device_hours(plan, sum(trial_minutes) * 60, screen_min)
    lines.append("nothing ran: no Ray, no MLflow")
    return "\n".join(lines)


def _unit(cfg) -> str:
    return "GPU" if cfg.parallel.use_gpu else "worker"


def _header(plan: SearchPlan, profile) -> list[str]:
    s, cfg = plan.study.search, plan.base
    unit = _unit(cfg)
    return [f"search {s.name or '(unnamed)'}: {plan.num_trials} setting(s) by {s.algorithm}"
            f"{' + ASHA' if s.asha else ''} against the baseline {setting_label(plan.baseline.setting)}; "
            f"objective {s.objective}, at most {s.max_accuracy_drop * 100:.1f} accuracy points below the baseline",
            f"each trial: {cfg.model.name} {cfg.model.image_size}px (as set), {cfg.parallel.strategy} on "
            f"{cfg.parallel.num_workers} {unit}(s), batch {cfg.train.batch_size}/{unit}, {cfg.train.steps} steps, "
            f"data {cfg.data.name}; resources per trial: "
            + ", ".join(f"{k} {v:g}" for k, v in sorted(resources_for(cfg).items())),
            f"projection: {profile.name} ({profile.source}); compute from "
            + ("the chip's op-level roofline" if profile.accelerator else
               f"a timed matmul rate x efficiency {profile.compute_efficiency:g}")
            + " (nothing measured yet: the screen measures it)"]


def _points(plan: SearchPlan) -> list[tuple[str, dict, Any]]:
    return [("baseline", plan.baseline.setting, plan.baseline.cfg)] + \
           [(p.key, p.setting, p.cfg) for p in plan.candidates()]


def _trial_table(plan: SearchPlan, profile) -> tuple[list[str], list[float]]:
    """One line per trial (the baseline first) with its projection; and each trial's minutes."""
    from rayvit.projection.performance import project

    cfg = plan.base
    unit, chips = _unit(cfg), cfg.parallel.num_workers
    overhead = TRIAL_OVERHEAD_S["gpu" if cfg.parallel.use_gpu else "cpu"]
    lines = [f"  {'trial':<9} {'setting':<44} {'step ms':>8} {'img/s/' + unit:>13} {'TFLOPS/' + unit:>13} "
             f"{'vs base':>7} {'GiB/' + unit:>8}  {'fits':<4} {'trial min':>9}"]
    base_tflops, minutes = None, []
    for label, setting, c in _points(plan):
        p = project(c, chips, profile)
        base_tflops = base_tflops or p.tflops_per_chip
        minutes.append((overhead + c.train.steps * p.step_s) / 60)
        lines.append(f"  {label:<9} {setting_label(setting):<44} {p.step_s * 1e3:>8.1f} "
                     f"{p.images_per_sec_per_chip:>13.1f} {p.tflops_per_chip:>13.1f} "
                     f"{p.tflops_per_chip / base_tflops:>6.2f}x {p.memory.total / 2 ** 30:>8.1f}  "
                     f"{'-' if p.memory.fits is None else 'yes' if p.memory.fits else 'NO':<4} {minutes[-1]:>9.1f}")
    return lines, minutes


def _screen_cost(plan: SearchPlan, profile) -> tuple[list[str], float]:
    """What the screen will do and its minutes on one device (0 when there is no screen)."""
    from rayvit.projection.performance import project

    s, cfg = plan.study.search, plan.base
    if not (s.screen and s.algorithm == "grid"):
        return ["screen: off" + (" (optuna chooses what to train)" if s.screen else "")], 0.0
    points = _points(plan)
    unit = _unit(cfg)
    screen_steps = (screen.WARMUP_STEPS["gpu" if cfg.parallel.use_gpu else "cpu"] + s.screen_steps) * screen.ROUNDS
    minutes = sum(screen_steps * project(c.replace({"parallel.num_workers": 1}), 1, profile).step_s
                  for _, _, c in points) / 60 + 0.5 * len(points) * screen.ROUNDS / 60
    return screen.screen_plan_lines(cfg, s, len(points) - 1) + [
        f"  screen cost: about {minutes:.1f} min on one {unit} (model builds included), "
        f"{minutes / 60:.3f} {unit}-hours"], minutes


def _device_hours(plan: SearchPlan, trial_seconds: float, screen_min: float) -> list[str]:
    """Device-hours of the whole search: every trial to its budget, and with ASHA's expected cut."""
    s, cfg = plan.study.search, plan.base
    unit, chips = _unit(cfg), cfg.parallel.num_workers
    overhead = TRIAL_OVERHEAD_S["gpu" if cfg.parallel.use_gpu else "cpu"]
    hours = trial_seconds / 3600 * chips + screen_min / 60
    lines = [f"estimated {unit}-hours, every setting trained to its budget: {hours:.1f} "
             f"({plan.num_trials + 1} runs x {chips} {unit}s, {overhead:.0f} s start-up each; "
             f"{trial_seconds / 3600:.1f} h of trials one at a time)"]
    if s.asha:
        rungs, share = asha_share(cfg.train.steps, s.asha_grace_steps or max(1, cfg.train.steps // 4),
                                  s.asha_reduction_factor)
        lines.append(f"with ASHA (rungs at {', '.join(str(r) for r in rungs)} steps, 1/{s.asha_reduction_factor:g} "
                     f"kept at each): about {share:.0%} of the trials' steps, "
                     f"{trial_seconds / 3600 * chips * share + screen_min / 60:.1f} "
                     f"{unit}-hours; the screen's pruning and stop rule save more, decided on the cluster")
    return lines


def asha_share(steps: int, grace: int, eta: float) -> tuple[list[int], float]:
    """ASHA's rungs (in steps) and the expected share of the budget a trial uses: 1/eta of the trials
    go on at each rung."""
    rungs, t = [], grace
    while t < steps:
        rungs.append(t)
        t = int(t * eta)
    share, frac, previous = 0.0, 1.0, 0
    for r in rungs + [steps]:
        share += frac * (r - previous) / steps
        previous, frac = r, frac / eta
    return rungs, share
