"""Screen before training: time every candidate's training step, then train in that order and stop early.

A search's trials each cost a multi-worker run (tens of seconds on a CPU, GPU-hours on a cluster). A
training *step* costs milliseconds to seconds, and the step is what the throughput objective measures.
So, before any trial:

1. :func:`measure` times the baseline's and every candidate's step in one process on one device of the
   kind the trials get (a Ray task with one worker's resources: one GPU on a GPU cluster, a worker's CPUs
   on CPU), synthetic data, a few steps each, in interleaved rounds (a shared machine's drift hits all
   alike). A round stops timing a setting after ``search.screen_seconds``, so a setting many times slower
   than the baseline (bf16 on a CPU without native bf16) costs one step, not a trial.
2. :func:`screen` turns step times into each setting's *screened objective*: the projection
   (:mod:`rayvit.projection`) carries the single-device step to the trial's worker count (communication,
   the optimizer), so screened figures are per-chip figures of the trial, and each has a 95% interval
   from the blocks of timed steps (:mod:`rayvit.stats`), never narrower than :data:`NOISE_FLOOR`.
3. Trials run best screened objective first. The stop rule (:func:`stop_reason`): a setting is not
   trained when its screened objective does not exceed the baseline's (the baseline counts as the first
   feasible setting), nor once a feasible trial's measured objective exceeds its screened objective
   (:class:`~rayvit.studies.search.tuner.ScreenedOrder` applies it before each trial): since trials run
   best screened first, the search then stops. The reason says whether the setting is below the baseline
   beyond the screen's noise (:mod:`rayvit.stats`' rule; e.g. bf16 on a CPU without bf16 instructions)
   or only not above it.

Accuracy is not screened: a setting is feasible only after its trial. Screening orders and prunes a
grid; ``time_to_accuracy`` is ordered by screened images/s and nothing is pruned (time to a target
accuracy depends on how fast it learns, which a few steps do not show).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

from rayvit import stats
from rayvit.config import from_dict
from rayvit.config_schema import Config
from rayvit.studies.plan import SearchPlan, setting_label

# A screened ratio is never taken as surer than +-5%: a few steps in one process do not see everything a
# multi-worker trial adds, nor how a shared machine's load moves between the screen and the trials.
NOISE_FLOOR = 0.05
# After the first round, settings this far below the baseline are decided: they get no second round.
DECIDED_BELOW = 0.5
ROUNDS = 3
# Untimed steps per setting and round: one on CPUs (nothing to tune), three on GPUs (cuDNN autotune,
# the caching allocator, lazy CUDA initialisation).
WARMUP_STEPS = {"cpu": 1, "gpu": 3}
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


@dataclass
class Screened:
    """One setting's screen: its step times per round, screened objective, ratio and decision."""

    label: str
    setting: dict[str, Any]
    cfg: Config = field(repr=False)
    step_times: list[list[float]] = field(default_factory=list)    # per round
    seconds: float = 0.0                   # what screening it cost (build, warm-up, timed steps)
    error: Optional[str] = None
    objective: Optional[stats.Estimate] = None      # screened, in the trial's per-chip terms
    ratio: Optional[stats.Estimate] = None          # to the baseline's screened objective
    step_s: Optional[float] = None                  # projected trial step (median)
    step_s_offset: float = 0.0                      # what the projection adds to the single-device step
    note: str = ""                                  # why it is slow, where the screen can tell
    decision: str = "train"                         # train | screened out
    reason: str = ""

    @property
    def trained(self) -> bool:
        return self.decision == "train"


@dataclass
class ScreenReport:
    """The screen of a search: the baseline's, every candidate's, where it ran and what it cost."""

    baseline: Screened
    candidates: list[Screened]
    device: str
    native_bf16: Optional[bool]
    seconds: float
    objective: str
    prunes: bool                           # throughput objectives prune; time_to_accuracy only orders
    profile: Optional[str] = None          # the hardware profile the steps were projected with
    memory_bytes: Optional[int] = None     # the screen's device memory (CUDA's total_memory)

    @property
    def order(self) -> list[Screened]:
        """Candidates to train, best screened objective first (failed screens last, in plan order)."""
        ok = [c for c in self.candidates if c.trained and c.objective is not None]
        failed = [c for c in self.candidates if c.trained and c.objective is None]
        return sorted(ok, key=lambda c: -c.objective.median) + failed

    @property
    def screened_out(self) -> list[Screened]:
        return [c for c in self.candidates if not c.trained]


# --------------------------------------------------------------------------------------------------
# The search's screen, start to end


def run_screen(plan: SearchPlan, out: Callable[[str], None]) -> ScreenReport:
    """Time every setting's step on one trial device and decide what to train; say so in lines."""
    s = plan.study.search
    points = plan.candidates()
    cfgs = [plan.baseline.cfg] + [p.cfg for p in points]
    out(f"screen: timing the baseline and {len(points)} setting(s), a few steps each in one process ...")
    started = time.monotonic()
    measured = measure(cfgs, s.screen_steps, s.screen_seconds)
    entries = from_measurement(["baseline"] + [p.key for p in points],
                               [plan.baseline.setting] + [p.setting for p in points], cfgs, measured)
    memory = measured.get("device_memory_bytes")
    report = screen(entries[0], entries[1:], s.objective, device=measured["device"],
                    native_bf16=measured["native_bf16"],
                    profile=profile_for(measured["device"], plan.base.parallel.use_gpu, memory),
                    seconds=time.monotonic() - started)
    report.memory_bytes = memory
    bf16 = {True: ", native bf16", False: ", no native bf16"}.get(report.native_bf16, "")
    out(f"screen: {len(cfgs)} settings in {report.seconds:.0f} s on {report.device}{where_projected(report, plan)}"
        f"{bf16}; "
        f"baseline {screen_figure(report.baseline, s.objective)}; "
        f"{len(report.order)} to train, best screened first, {len(report.screened_out)} screened out")
    for c in sorted(report.candidates, key=lambda c: -(c.ratio.median if c.ratio else 0.0)):
        out(f"  {c.label} {setting_label(c.setting):<40} {c.decision:<12} "
            f"{c.ratio.text('.2f', 'x') if c.ratio else '-':<20} {c.reason if not c.trained else ''}".rstrip())
    return report


def screen_figure(c: Screened, objective: str) -> str:
    """``tflops_per_chip 0.0213 (0.0201-0.0222)``, or why the setting was not screened."""
    return f"{objective} {c.objective.text('.4g')}" if c.objective else f"not screened ({c.error})"


# --------------------------------------------------------------------------------------------------
# Measuring: one process, one device, a few steps per setting


def screen_config(cfg: Config) -> Config:
    """``cfg`` as the screen times it: one worker, synthetic data, every step counted by the screen."""
    return cfg.replace({"data.name": "synthetic", "parallel.num_workers": 1, "train.warmup_steps": 0,
                        "train.eval_every": 0, "train.checkpoint_every": 0, "train.fail_at_step": 0,
                        "model.compile": False})


def cpu_has_native_bf16() -> Optional[bool]:
    """Whether this CPU has bf16 instructions (avx512_bf16 or amx_bf16), from /proc/cpuinfo; None if unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), None)
    except OSError:
        return None
    return None if flags is None else any(flag in flags for flag in BF16_CPU_FLAGS)


def time_steps(cfgs: Sequence[Config], *, steps: int, max_seconds: float, rounds: int = ROUNDS,
               warmup: Optional[int] = None, decided_below: float = DECIDED_BELOW,
               clock: Callable[[], float] = time.perf_counter) -> dict[str, Any]:
    """Time each config's training step in this process (``cfgs[0]`` is the reference).

    Per round and config: build a :class:`~rayvit.worker.Session` (one at a time, so a GPU holds one
    model), ``warmup`` untimed steps, then timed steps until ``steps`` or ``max_seconds``. After the
    first round, configs whose objective-free rate (training FLOPs per second) is below ``decided_below``
    x the reference's get no further round. Returns per config its step times per round, seconds spent
    and error, and the device with its memory (CUDA's total memory: an A100 40 GB or 80 GB).
    """
    import torch

    from rayvit.models import vit_complexity
    from rayvit.worker import Session
    from rayvit.training.hardware import accelerator_name, device_memory_bytes

    times: list[list[list[float]]] = [[] for _ in cfgs]
    spent = [0.0] * len(cfgs)
    errors: list[Optional[str]] = [None] * len(cfgs)
    flops = [vit_complexity(c.model).train_flops_per_image * c.train.batch_size for c in cfgs]
    device, memory = None, None
    if warmup is None:
        warmup = WARMUP_STEPS["gpu" if cfgs[0].parallel.use_gpu else "cpu"]
    live = list(range(len(cfgs)))
    for r in range(rounds):
        for i in live:
            start = clock()
            session = None
            try:
                session = Session(screen_config(cfgs[i]))
                if device is None:
                    device, memory = accelerator_name(session.device), device_memory_bytes(session.device)
                for _ in range(warmup):
                    session.clear_grads()
                    session.train_step()
                begun, timed = clock(), []
                while len(timed) < steps and (not timed or clock() - begun < max_seconds):
                    session.clear_grads()
                    session.train_step()
                    timed.append(session.history[-1]["step_time_s"])
                times[i].append(timed)
            except Exception as e:  # noqa: BLE001 - a setting that cannot step is reported, not fatal
                errors[i] = f"{type(e).__name__}: {e}".strip()[:500]
            finally:
                if session is not None:
                    session.close()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
            spent[i] += clock() - start
        if r == 0 and times[0]:
            ref = flops[0] / _median(times[0][0])
            live = [i for i in live if errors[i] is None and times[i]
                    and (i == 0 or flops[i] / _median(times[i][0]) >= decided_below * ref)]
        live = [i for i in live if errors[i] is None]
    return {"times": times, "seconds": spent, "errors": errors, "device": device or "cpu",
            "native_bf16": cpu_has_native_bf16() if (device or "cpu") == "cpu" else None,
            "device_memory_bytes": memory}


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    n = len(ordered)
    return ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2


def measure(cfgs: Sequence[Config], steps: int, max_seconds: float) -> dict[str, Any]:
    """:func:`time_steps` in a Ray task with one trial worker's resources (a GPU on GPU clusters)."""
    import ray

    from rayvit.launch.resources import worker_bundle

    bundle = worker_bundle(cfgs[0])
    options: dict[str, Any] = {"num_cpus": bundle.get("CPU", 1.0), "num_gpus": bundle.get("GPU", 0.0)}
    if cfgs[0].parallel.accelerator_type:
        options["accelerator_type"] = cfgs[0].parallel.accelerator_type

    def task(dicts: list[dict], steps: int, max_seconds: float) -> dict[str, Any]:
        return time_steps([from_dict(d) for d in dicts], steps=steps, max_seconds=max_seconds)

    remote = ray.remote(max_retries=0, **options)(task)
    return ray.get(remote.remote([c.to_dict() for c in cfgs], steps, max_seconds))


# --------------------------------------------------------------------------------------------------
# From step times to screened objectives and decisions (pure: testable with synthetic rates)


def objective_of_step(cfg: Config, objective: str) -> Callable[[float], float]:
    """The objective as a function of the trial's seconds per step (per-chip TFLOPS or global images/s;
    time_to_accuracy is ordered by images/s)."""
    from rayvit.models import vit_complexity

    batch, workers = cfg.train.batch_size, cfg.parallel.num_workers
    if objective == "tflops_per_chip":
        flops = vit_complexity(cfg.model).train_flops_per_image
        return lambda s: flops * batch / s / 1e12
    return lambda s: batch * workers / s


def projected_offset(cfg: Config, seconds_per_step: float, profile) -> float:
    """Seconds the trial's step adds to the single-device step: the projection's communication at the
    trial's worker count (and the shared host's slowdown), from the measured single-device rate."""
    from rayvit.projection.performance import compute_from_measured, project

    single = cfg.replace({"parallel.num_workers": 1})
    compute = compute_from_measured(single, single.train.batch_size / seconds_per_step, profile, "screen")
    # peak=1: MFU is not wanted here, and on CPUs the peak would be timed.
    return project(cfg, cfg.parallel.num_workers, profile, compute, peak=1.0).step_s - seconds_per_step


def screen(baseline: Screened, candidates: list[Screened], objective: str, *, device: str = "cpu",
           native_bf16: Optional[bool] = None, profile=None, seconds: float = 0.0) -> ScreenReport:
    """Screened objectives, ratios to the baseline and the first decisions, from measured step times.

    ``profile``: the hardware profile the projection carries single-device steps to the trials' worker
    count with (None: no projection, the single-device step is the trial's).
    """
    for s in [baseline] + candidates:
        _estimate(s, objective, profile)
    prunes = objective != "time_to_accuracy"
    report = ScreenReport(baseline, candidates, device, native_bf16, seconds, objective, prunes,
                          getattr(profile, "name", None))
    if baseline.objective is None:
        # Nothing to compare with: every candidate is trained, in plan order.
        for c in candidates:
            c.reason = f"not screened: the baseline's screen failed ({baseline.error})"
        return report
    base_blocks = _blocks(baseline)
    for c in candidates:
        if c.objective is None:
            c.reason = f"not screened ({c.error or 'no step timed'}): trained anyway"
            continue
        ratio = stats.paired_ratio(_blocks(c), base_blocks, _value(c, objective), _value(baseline, objective))
        c.ratio = ratio.widened(NOISE_FLOOR) if ratio is not None else None
        if c.ratio is not None:
            _decide(c, device, native_bf16, prunes)
    return report


def _decide(c: Screened, device: str, native_bf16: Optional[bool], prunes: bool) -> None:
    """Train ``c`` or not, from its screened ratio to the baseline (prunes: throughput objectives)."""
    c.note = slow_note(c, device, native_bf16)
    why = stop_reason(c.ratio, 1.0) if prunes else None
    if why is None:
        c.reason = f"screened {c.ratio.text('.2f', 'x')} the baseline"
        return
    c.decision = "screened out"
    if c.ratio.verdict(1.0) == stats.BELOW:
        # Below the baseline beyond the screen's noise: say how far, and why where the screen can tell.
        why = f"{c.ratio.median:.2f}x the baseline on this {device}" + (f": {c.note}" if c.note else "")
    c.reason = why


def slow_note(c: Screened, device: str, native_bf16: Optional[bool]) -> str:
    """Why a setting is slow, where that is known: bf16 on a CPU without bf16 instructions."""
    p = c.cfg.precision
    if device == "cpu" and p.mode != "fp32" and p.dtype == "bf16" and native_bf16 is False:
        return "no native bf16 (no avx512_bf16 or amx_bf16: bf16 is emulated)"
    if device == "cpu" and p.mode != "fp32" and p.dtype == "fp16":
        return "no fast fp16 kernels on CPUs"
    return ""


def _blocks(s: Screened) -> list[list[stats.Block]]:
    return [stats.cut(steady(r)) for r in s.step_times if r]


def steady(times: Sequence[float], limit: float = 1.5) -> list[float]:
    """A round's steps without those over ``limit`` x its median: on a shared machine a step another
    process preempted says nothing about the setting (a few steps cannot average such a stall away)."""
    if len(times) < 3:
        return list(times)
    cut = _median(times) * limit
    return [t for t in times if t <= cut]


def _value(s: Screened, objective: str) -> Callable[[float], float]:
    f, offset = objective_of_step(s.cfg, objective), s.step_s_offset
    return lambda seconds: f(seconds + offset)


def _estimate(s: Screened, objective: str, profile) -> None:
    blocks = _blocks(s)
    s.step_s_offset = 0.0
    if not blocks:
        return
    if profile is not None:
        median_step = stats.seconds_per_step([b for r in blocks for b in r])
        try:
            s.step_s_offset = max(0.0, projected_offset(s.cfg, median_step, profile))
        except Exception:  # noqa: BLE001 - the projection refines; without it the single-device step stands
            s.step_s_offset = 0.0
    s.objective = stats.estimate(blocks, _value(s, objective))
    s.step_s = stats.seconds_per_step([b for r in blocks for b in r]) + s.step_s_offset


def from_measurement(labels: list[str], settings: list[dict[str, Any]], cfgs: list[Config],
                     measured: Mapping[str, Any]) -> list[Screened]:
    """:class:`Screened` entries (baseline first) from :func:`time_steps`' answer."""
    return [Screened(label, dict(setting), cfg, step_times=[list(r) for r in times], seconds=secs, error=error)
            for label, setting, cfg, times, secs, error in zip(
                labels, settings, cfgs, measured["times"], measured["seconds"], measured["errors"])]


def profile_for(device: str, use_gpu: bool, memory_bytes: Optional[int] = None):
    """The hardware profile of the screen's device, for the projection (CPU: the local CPU profile); its
    memory tells the variants of a chip apart (A100 40 or 80 GB), as in the sweep. A GPU without a profile
    of its own gets a generic one, and its warning says so."""
    from rayvit.projection.profiles import cpu_profile, profile_for_accelerator

    if not use_gpu or device == "cpu":
        return cpu_profile()
    return profile_for_accelerator(device, memory_bytes)


def where_projected(report: ScreenReport, plan: SearchPlan) -> str:
    """`` (79 GiB: projected to 8 GPUs with the a100-80gb profile)`` for a GPU screen; empty on CPUs."""
    if report.device == "cpu" or report.profile is None:
        return ""
    memory = f"{report.memory_bytes / 2**30:.0f} GiB: " if report.memory_bytes else ""
    return f" ({memory}projected to {plan.base.parallel.num_workers} GPUs with the {report.profile} profile)"


# --------------------------------------------------------------------------------------------------
# During the trials: what is left to train


def stop_reason(screened: stats.Estimate, reference: float, reference_label: Optional[str] = None) -> Optional[str]:
    """None if a setting screened at ``screened`` x the baseline may still beat the reference; else why not.

    The stop rule, the same before the trials (``reference`` 1.0: the baseline, which counts as the first
    feasible setting) and during them (``reference_label``'s measured ratio to the baseline, the best
    feasible trial so far): a setting whose screened ratio is not above the reference's is not trained.
    Trials run best screened first, so once one setting stops every later one does too.
    """
    text = screened.text(".2f", "x")
    if reference_label is None:
        if screened.hi <= reference:
            return f"screened {text} the baseline: cannot beat it even at the top of the screen's interval"
        return f"screened {text} the baseline: not above it" if screened.median <= reference else None
    measured = f"{reference_label}'s measured {reference:.2f}x"
    if screened.hi <= reference:
        return f"screened {text} the baseline: cannot beat {measured} even at the top of the screen's interval"
    if screened.median <= reference:
        return f"screened {text} the baseline: {measured} already " + (
            "exceeds it" if screened.median < reference else "equals it")
    return None


def saved_estimate(skipped: list[Screened], baseline: Screened, baseline_seconds: float, steps: int,
                   devices_per_trial: int) -> tuple[float, float]:
    """(trial seconds, device-hours) the skipped settings would have cost: each a run of ``steps`` at its
    screened step, plus the fixed cost the baseline's run had beyond its own steps."""
    fixed = max(0.0, baseline_seconds - steps * (baseline.step_s or 0.0))
    seconds = sum(fixed + steps * (c.step_s or baseline.step_s or 0.0) for c in skipped)
    return seconds, seconds * devices_per_trial / 3600


def screen_plan_lines(cfg: Config, s, candidates: int) -> list[str]:
    """What the screen will do, in words (the dry run prints it)."""
    kind = (f"one GPU{' (' + cfg.parallel.accelerator_type + ')' if cfg.parallel.accelerator_type else ''}"
            if cfg.parallel.use_gpu else f"{cfg.parallel.cpus_per_worker} CPU(s)")
    return [
        f"screen: the baseline and {candidates} setting(s), one at a time in one Ray task on {kind} (one "
        f"trial worker's resources), synthetic data, {WARMUP_STEPS['gpu' if cfg.parallel.use_gpu else 'cpu']} warm-up + up to {s.screen_steps} timed "
        f"steps per setting and round (at most {s.screen_seconds:g} s timed), {ROUNDS} interleaved rounds "
        f"(settings below {DECIDED_BELOW:g}x the baseline after round 1 are decided)",
        f"  screened objective: the single-device step projected to {cfg.parallel.num_workers} workers "
        f"(rayvit.projection), 95% interval from blocks of timed steps, at least +-{NOISE_FLOOR:.0%}",
        "  trials run best screened first; a setting whose screened objective is not above the baseline's "
        "is not trained, and the search stops once a feasible trial's measured objective exceeds every "
        "remaining setting's screened objective",
    ]
