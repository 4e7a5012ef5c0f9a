"""How sure a figure is: medians over rounds and their 95% intervals, for one point and for ratios.

A point is measured in *rounds* (a sweep runs each strategy once per round, interleaved with the others
on the same workers); each round's timed steps are cut into *blocks* of consecutive steps. A figure is
the median over rounds of the round's value, and its interval is a percentile bootstrap that resamples
both levels: rounds with replacement, then blocks within each drawn round with replacement (a
hierarchical bootstrap: rounds differ by the moment and, across runs, the placement; blocks by the
noise within a round). Blocks, not single steps, because neighbouring steps share their noise (a
burst of another process's work spans several). With one round the interval comes from the blocks
alone and says nothing about run-to-run spread: sweeps default to 3 rounds.

A ratio of two points measured in the same rounds on the same workers (``speedup_vs_ddp``, the ladder's
``relative_throughput``) is *paired*: the ratio is taken within each round, adjacent in time, and the
bootstrap draws the same rounds for both sides. A ratio of points from different runs (scaling
efficiency across worker counts) resamples each side on its own.

The resampling is seeded, so the same measurements always give the same interval.

**Beyond noise**, one rule for every comparison rayvit makes (a sweep's ``speedup_vs_ddp`` and the
ladder's verdicts, a search's screen against its baseline, a trial against the baseline): two figures
differ when the 95% interval of their *ratio* leaves 1.0 out (:meth:`Estimate.verdict`). The ratio is
paired when both were measured in the same rounds, else each side is resampled alone
(:func:`compare`); a measurement that knows it sees less than its interval says (the screen's few steps
in one process) widens it first (:meth:`Estimate.widened`), it does not change the rule.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from statistics import median
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

CONFIDENCE = 0.95
RESAMPLES = 2000
BLOCK_STEPS = 5          # timed steps per block (a round with fewer has one block per step)
SEED = 20221208

# Figures that get ``<key>_lo`` / ``<key>_hi`` beside them: every throughput figure of a point, each a
# function of the round's timed step times (see :func:`figure_functions`), and data_wait_fraction, of its
# step and wait times (:func:`data_wait_estimate`).
INTERVAL_KEYS = ("images_per_sec_per_chip", "images_per_sec", "tflops_per_chip", "mfu", "step_time_mean_s",
                 "data_wait_fraction")
# Of those, the figures of the step time alone, which two runs' results compare as ratios (:func:`compare`).
RATIO_KEYS = INTERVAL_KEYS[:5]

# A block: (timed steps, their seconds).
Block = tuple[int, float]

# What :meth:`Estimate.verdict` says of a figure against its reference.
ABOVE, BELOW, WITHIN_NOISE = "above", "below", "within noise"


@dataclass(frozen=True)
class Estimate:
    """A median over rounds with its interval (``lo`` <= ``median`` <= ``hi``) and the rounds behind it."""

    median: float
    lo: float
    hi: float
    rounds: int

    def contains(self, value: float) -> bool:
        return self.lo <= value <= self.hi

    def verdict(self, reference: float = 1.0) -> str:
        """``above``, ``below`` or ``within noise`` of ``reference``: the beyond-noise rule (a ratio
        against 1.0 differs only when its interval leaves 1.0 out; an interval touching it is noise)."""
        if self.contains(reference):
            return WITHIN_NOISE
        return ABOVE if self.lo > reference else BELOW

    def widened(self, floor: float) -> "Estimate":
        """This estimate with its interval at least ``floor`` x its median either side: for a measurement
        that sees less than its own spread shows (a few steps in one process)."""
        return Estimate(self.median, min(self.lo, self.median * (1 - floor)),
                        max(self.hi, self.median * (1 + floor)), self.rounds)

    def figures(self, key: str) -> dict[str, float]:
        return {key: self.median, f"{key}_lo": self.lo, f"{key}_hi": self.hi}

    def text(self, spec: str = ".2f", suffix: str = "") -> str:
        """``0.67x (0.61-0.72)`` for ``spec=".2f", suffix="x"``."""
        from rayvit.formats import interval

        return interval(self.median, self.lo, self.hi, spec, suffix)


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile with linear interpolation between order statistics (numpy's default)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def step_time_percentiles(step_times: Sequence[float]) -> dict[str, float]:
    return {"step_time_p50_s": quantile(step_times, 0.5), "step_time_p90_s": quantile(step_times, 0.9)}


def cut(step_times: Sequence[float], size: int = BLOCK_STEPS) -> list[Block]:
    """Consecutive timed steps as blocks of ``size`` (a short tail joins the last block)."""
    times = [float(t) for t in step_times if t is not None and math.isfinite(t) and t > 0]
    if not times:
        return []
    if len(times) < 2 * size:
        size = max(1, len(times) // 2) if len(times) >= 2 else 1
    count = len(times) // size
    blocks = [(size, sum(times[i * size:(i + 1) * size])) for i in range(count)]
    tail = times[count * size:]
    if tail:
        steps, seconds = blocks[-1]
        blocks[-1] = (steps + len(tail), seconds + sum(tail))
    return blocks


def seconds_per_step(blocks: Sequence[Block]) -> float:
    steps = sum(b[0] for b in blocks)
    return sum(b[1] for b in blocks) / steps if steps else math.nan


def _draw(rng: random.Random, items: Sequence[Any]) -> list[Any]:
    return [items[rng.randrange(len(items))] for _ in items]


def _percentiles(values: list[float]) -> tuple[float, float]:
    values = [v for v in values if math.isfinite(v)]
    tail = (1 - CONFIDENCE) / 2
    return quantile(values, tail), quantile(values, 1 - tail)


def _estimate(point: float, replicates: list[float], rounds: int) -> Estimate:
    lo, hi = _percentiles(replicates)
    # A percentile interval can miss a median that sits on a discrete edge; it always covers it here.
    return Estimate(point, min(lo, point), max(hi, point), rounds)


def estimate(rounds: Sequence[Sequence[Block]], value: Callable[[float], float],
             resamples: int = RESAMPLES, seed: int = SEED) -> Optional[Estimate]:
    """The median over rounds of ``value(seconds per step of the round)``, with its interval."""
    rounds = [r for r in rounds if r]
    if not rounds:
        return None
    point = median(value(seconds_per_step(r)) for r in rounds)
    rng = random.Random(seed)
    replicates = [median(value(seconds_per_step(_draw(rng, r))) for r in _draw(rng, rounds))
                  for _ in range(resamples)]
    return _estimate(point, replicates, len(rounds))


def paired_ratio(a: Sequence[Sequence[Block]], b: Sequence[Sequence[Block]],
                 value_a: Callable[[float], float], value_b: Callable[[float], float],
                 resamples: int = RESAMPLES, seed: int = SEED) -> Optional[Estimate]:
    """Median over rounds of ``value_a(round of a) / value_b(the same round of b)``, with its interval.

    ``a`` and ``b`` are rounds of blocks (:func:`rounds_blocks`); rounds are paired by position (round i
    of ``a`` ran beside round i of ``b``); a round either side lacks is left out. Two runs' results are
    compared with :func:`compare`.
    """
    for side in (a, b):
        if hasattr(side, "metrics") and hasattr(side, "rounds"):
            raise TypeError("paired_ratio takes rounds of blocks of step times; to compare two runs' "
                            "results use rayvit.stats.compare(a, b, key)")
    pairs = [(ra, rb) for ra, rb in zip(a, b) if ra and rb]
    if not pairs:
        return None

    def ratio(ra: Sequence[Block], rb: Sequence[Block]) -> float:
        return value_a(seconds_per_step(ra)) / value_b(seconds_per_step(rb))

    point = median(ratio(ra, rb) for ra, rb in pairs)
    rng = random.Random(seed)
    replicates = [median(ratio(_draw(rng, ra), _draw(rng, rb)) for ra, rb in _draw(rng, pairs))
                  for _ in range(resamples)]
    return _estimate(point, replicates, len(pairs))


def unpaired_ratio(a: Sequence[Sequence[Block]], b: Sequence[Sequence[Block]],
                   value_a: Callable[[float], float], value_b: Callable[[float], float],
                   resamples: int = RESAMPLES, seed: int = SEED) -> Optional[Estimate]:
    """``median(value_a over a's rounds) / median(value_b over b's rounds)``, each side resampled alone."""
    a, b = [r for r in a if r], [r for r in b if r]
    if not a or not b:
        return None

    def med(rounds: Sequence[Sequence[Block]], value: Callable[[float], float], rng=None) -> float:
        if rng is not None:
            rounds = [_draw(rng, r) for r in _draw(rng, rounds)]
        return median(value(seconds_per_step(r)) for r in rounds)

    point = med(a, value_a) / med(b, value_b)
    rng = random.Random(seed)
    replicates = [med(a, value_a, rng) / med(b, value_b, rng) for _ in range(resamples)]
    return _estimate(point, replicates, min(len(a), len(b)))


# --------------------------------------------------------------------------------------------------
# Figures of a run from its step times


def figure_functions(batch_per_chip: int, world_size: int, train_flops_per_image: float,
                     peak_tflops: Optional[float]) -> dict[str, Callable[[float], float]]:
    """Each interval figure as a function of seconds per step (the slowest rank's)."""
    def per_chip(s: float) -> float:
        return batch_per_chip / s

    functions: dict[str, Callable[[float], float]] = {
        "images_per_sec_per_chip": per_chip,
        "images_per_sec": lambda s: per_chip(s) * world_size,
        "tflops_per_chip": lambda s: train_flops_per_image * per_chip(s) / 1e12,
        "step_time_mean_s": lambda s: s,
    }
    if peak_tflops:
        functions["mfu"] = lambda s: train_flops_per_image * per_chip(s) / 1e12 / peak_tflops
    return functions


def functions_of(metrics: Mapping[str, Any], conditions: Mapping[str, Any]) -> dict[str, Callable[[float], float]]:
    return figure_functions(int(conditions["batch_per_chip"]), int(conditions["world_size"]),
                            float(metrics["train_flops_per_image"]), metrics.get("peak_tflops"))


def rounds_blocks(rounds: Iterable[Mapping[str, Any]], size: int = BLOCK_STEPS) -> list[list[Block]]:
    """The blocks of each recorded round (``{"step_times": [...], ...}``), in round order."""
    return [cut(r.get("step_times") or [], size) for r in rounds]


def intervals(rounds: Sequence[Mapping[str, Any]], metrics: Mapping[str, Any],
              conditions: Mapping[str, Any]) -> dict[str, float]:
    """``<key>``, ``<key>_lo``, ``<key>_hi`` for every :data:`INTERVAL_KEYS` figure, and ``rounds``."""
    blocks = rounds_blocks(rounds)
    functions = functions_of(metrics, conditions)
    out: dict[str, float] = {}
    for key in INTERVAL_KEYS:
        if key not in functions:          # MFU without a peak to divide by
            continue
        est = estimate(blocks, functions[key])
        if est is not None:
            out.update(est.figures(key))
            out["rounds"] = float(est.rounds)
    wait = data_wait_estimate(rounds)
    if wait is not None:
        out.update(wait.figures("data_wait_fraction"))
    return out


# --------------------------------------------------------------------------------------------------
# The share of step time spent waiting for data


def wait_blocks(step_times: Sequence[float], wait_times: Sequence[float], size: int = BLOCK_STEPS
                ) -> list[tuple[int, float, float]]:
    """(steps, their seconds, their seconds waiting for data) in the blocks :func:`cut` makes."""
    pairs = [(float(s), float(w)) for s, w in zip(step_times, wait_times)
             if s is not None and w is not None and math.isfinite(s) and s > 0 and math.isfinite(w)]
    blocks = cut([s for s, _ in pairs], size)
    out, start = [], 0
    for steps, seconds in blocks:
        out.append((steps, seconds, sum(w for _, w in pairs[start:start + steps])))
        start += steps
    return out


def data_wait_estimate(rounds: Sequence[Mapping[str, Any]], resamples: int = RESAMPLES,
                       seed: int = SEED) -> Optional[Estimate]:
    """``data_wait_fraction``: the median over rounds of (seconds waiting / seconds stepping), resampled
    as :func:`estimate` resamples (rounds, then blocks within them); None without wait times."""
    blocks = [wait_blocks(r.get("step_times") or [], r.get("data_wait_times") or []) for r in rounds]
    blocks = [b for b in blocks if b]
    if not blocks:
        return None

    def fraction(r: Sequence[tuple[int, float, float]]) -> float:
        return sum(b[2] for b in r) / sum(b[1] for b in r)

    point = median(fraction(r) for r in blocks)
    rng = random.Random(seed)
    replicates = [median(fraction(_draw(rng, r)) for r in _draw(rng, blocks)) for _ in range(resamples)]
    return _estimate(point, replicates, len(blocks))


# --------------------------------------------------------------------------------------------------
# Two runs' results


def compare(a: Any, b: Any, key: str = "images_per_sec_per_chip", *,
            paired: Optional[bool] = None) -> Optional[Estimate]:
    """``a``'s ``key`` over ``b``'s, with its 95% interval, from two runs' results (``RunResult``: of a
    :func:`~rayvit.trainer.fit_group`, a :func:`~rayvit.trainer.fit` or a sweep's points).

    ``paired`` (default: whether both were measured in the same rounds, as a group's results are): the
    ratio is taken within each round and the rounds are resampled together (:func:`paired_ratio`); else
    each side is resampled alone (:func:`unpaired_ratio`). ``key``: a figure of the step time (one of
    :data:`RATIO_KEYS`). None when either side has no timed steps.
    """
    if key not in RATIO_KEYS:
        raise ValueError(f"key={key!r} is not a figure of the step time; choose one of {', '.join(RATIO_KEYS)}")
    if paired is None:
        paired = bool(a.rounds) and [r.get("round") for r in a.rounds] == [r.get("round") for r in b.rounds]
    blocks = [rounds_blocks(r.rounds or [{"step_times": r.step_times}]) for r in (a, b)]
    try:
        fa, fb = functions_of(a.metrics, a.conditions)[key], functions_of(b.metrics, b.conditions)[key]
    except KeyError:
        raise ValueError(f"{key} is not known for both runs (mfu needs a peak to divide by)") from None
    return (paired_ratio if paired else unpaired_ratio)(*blocks, fa, fb)
