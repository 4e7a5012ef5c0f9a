"""Single-process training benchmark: ``rayvit bench [--config F] [key=value ...] [--compare ...]``.

Synthetic data generated once on the device, warm-up steps excluded, every step timed with device
synchronisation. ``--compare key=v1,v2`` times one training session per value, in alternating rounds in
this one process, so drift of a shared, noisy machine hits every variant alike; each variant is reported
as a ratio to the first, taken within each round (paired), with its 95% interval and whether it is beyond
noise (:func:`compare` is the same as a library call). Only one variant exists at a time: each round builds it, warms it up, times it
and closes it before the next is built, so each variant's peak memory is its own (a session restarts the
peak when it starts) and no variant's model shares the device with another's. Several ``--compare``
flags give several groups.

``--compare model.compile=false,true`` times kernel fusion: the steps that compile are among each round's
warm-up steps, never timed; how much longer they took than a timed step is reported separately (``compile
s``: the first round's; every round's is in the JSON). Each round compiles from empty caches
(``model.compile_cold``, :mod:`rayvit.worker.compiling`), so the rounds' compile times are alike.
"""

from __future__ import annotations

import sys
from typing import Optional

from rayvit.errors import CompareFailed
from rayvit.config import as_config
from rayvit.config_schema import Config
from rayvit.errors import ConfigError
from rayvit.process_state import keeps_process_state
from rayvit.results import Comparison, RunResult
from rayvit.stats import Estimate
from rayvit.worker.rounds import measure_rounds



def parse_compare(spec: str) -> tuple[str, list[str]]:
    key, sep, values = spec.partition("=")
    options = [v.strip() for v in values.split(",") if v.strip()]
    if not sep or len(options) < 2:
        raise ConfigError(f"--compare {spec!r} must look like section.key=value1,value2[,...]")
    return key.strip(), options



def check_bench(cfg: Config, groups: list[tuple[str, list[str]] | None], warmup: int) -> None:
    """Raise :class:`ConfigError` before anything runs when a variant of ``groups`` (``parse_compare``'s
    (key, values), or None for ``cfg`` as it is) is not a valid config, or compiles without a warm-up step to
    keep compiling out of the timing."""
    for group in groups:
        if group is not None:
            for value in group[1]:
                variant = cfg.replace([f"{group[0]}={value}"])   # validate every variant before any runs
                if variant.model.compile and warmup < 1:
                    raise ConfigError(f"{group[0]}={value} compiles in its first step: it needs --warmup >= 1 "
                                      "to keep compiling out of the timing")
    if cfg.model.compile and warmup < 1:
        raise ConfigError("model.compile=true compiles in its first step: it needs --warmup >= 1 to keep "
                          "compiling out of the timing")

@keeps_process_state
def compare_configs(cfgs: list[Config | dict], rounds: int, *, on_step=None, on_round=None) -> list[RunResult]:
    """Train every config once per round, interleaved and rotated (A B, B A, ...), in this process on one
    device; each config's result over its rounds (medians with 95% intervals; ``rounds`` entries keep each
    round's figures). Only one config's model exists at a time, so each has its own peak memory.
    ``on_step(session, index, round)``, ``on_round(index, round, slot, result dict, error)``: see
    :func:`rayvit.worker.rounds.measure_rounds`. Raises :class:`CompareFailed` when a config fails."""
    cfgs = [as_config(c) for c in cfgs]
    outcomes = measure_rounds(cfgs, rounds, on_step=on_step, on_round=on_round)
    for cfg, outcome in zip(cfgs, outcomes):
        if outcome["error"] is not None:
            raise CompareFailed(f"{cfg.flatten()} failed:\n{outcome['error']}")
    return [RunResult.of_rounds([RunResult.from_dict(r) for r in o["rounds"]], [tuple(p) for p in o["places"]])
            for o in outcomes]


def compare(a: Config | dict, b: Config | dict, *, rounds: int = 5,
            key: str = "images_per_sec_per_chip") -> Comparison:
    """An A/B of two configs in this process: trained in ``rounds`` interleaved rounds, ``b``'s ``key`` over
    ``a``'s as a paired ratio with its interval and verdict. ``rayvit bench --compare`` is its command line;
    :func:`rayvit.trainer.compare` runs the same on a Ray Train worker group."""
    first, second = compare_configs([a, b], rounds)
    return Comparison(first, second, key)


def bench_config(cfg: Config, steps: int, warmup: int) -> Config:
    """``cfg`` as the benchmark runs it: synthetic data made once on the device, ``warmup`` untimed steps,
    then ``steps`` timed ones, no evaluation."""
    return cfg.replace({"data.name": "synthetic", "train.steps": warmup + steps, "train.warmup_steps": warmup,
                        "train.eval_every": 0})


def run_group(cfg: Config, compare_spec: tuple[str, list[str]] | None, rounds: int) -> list[tuple[str, RunResult]]:
    """Time every variant in alternating rounds, one variant on the device at a time: (label, result)."""
    if compare_spec is None:
        labels, cfgs = ["as configured"], [cfg]
    else:
        key, values = compare_spec
        labels, cfgs = [f"{key}={v}" for v in values], [cfg.replace([f"{key}={v}"]) for v in values]
    rates: dict[int, dict[int, float]] = {}          # round -> index -> images/s

    def announce(session, index: int, r: int) -> None:
        if r == 0 and session.step == 1:
            print(f"  {labels[index]}: {sum(p.numel() for p in session.model.parameters()):,} params (local), "
                  f"{session.complexity.train_flops_per_image / 1e9:.2f} GFLOP/image to train", file=sys.stderr)

    def round_done(index: int, r: int, slot: int, result: Optional[dict], error: Optional[str]) -> None:
        rates.setdefault(r, {})[index] = result["metrics"]["images_per_sec_per_chip"] if result else float("nan")
        if len(rates[r]) == len(cfgs):
            print(f"  round {r + 1}/{rounds}: " + ", ".join(
                f"{labels[i]} {rates[r][i]:.1f} img/s" for i in range(len(cfgs))), file=sys.stderr)

    results = compare_configs(cfgs, rounds, on_step=announce, on_round=round_done)
    return list(zip(labels, results))


def report(variants: list[tuple[str, RunResult]]) -> list[dict]:
    """One row per variant; ``ratio`` (with ``ratio_lo``/``ratio_hi`` and ``verdict``) is its images/s
    over the first variant's, paired round by round."""
    first = variants[0][1]
    rows = []
    for label, result in variants:
        m = result.metrics
        comparison = Comparison(first, result)
        # The first variant is the reference: exactly 1 (a ratio of its rounds with themselves resampled
        # apart would show an interval that means nothing).
        ratio = comparison.ratio if result is not first else Estimate(1.0, 1.0, 1.0, len(result.rounds))
        compile_times = [r["compile_time_s"] for r in result.rounds if r.get("compile_time_s") is not None]
        rows.append({
            "variant": label, "images_per_sec": m["images_per_sec_per_chip"],
            "ratio": ratio.median if ratio else None, "ratio_lo": ratio.lo if ratio else None,
            "ratio_hi": ratio.hi if ratio else None,
            "verdict": comparison.verdict if result is not first else "reference",
            "step_time_p50_s": m["step_time_p50_s"], "step_time_p90_s": m["step_time_p90_s"],
            "tflops": m["tflops_per_chip"], "mfu": m["mfu"], "peak_source": result.conditions["peak_source"],
            "model_state_mb": m["model_state_bytes_per_rank"] / 2 ** 20,
            "peak_memory_mb": m["peak_memory_bytes_per_rank"] / 2 ** 20,
            # The first round's compile (cold), and every round's; None when not compiled.
            "compile_s": compile_times[0] if compile_times else None,
            "compile_s_by_round": compile_times,
            "rounds": [r["images_per_sec_per_chip"] for r in result.rounds],
        })
    return rows


def format_rows(rows: list[dict]) -> str:
    header = (f"{'variant':<34} {'img/s':>9} {'ratio':>6} {'95% CI':>13} {'p50 s':>8} {'p90 s':>8} "
              f"{'TFLOPS':>8} {'MFU':>6} {'state MB':>9} {'peak MB':>9} {'compile s':>9}")
    lines = [header, "-" * len(header)]
    for r in rows:
        ci = "-" if r["ratio_lo"] is None else f"{r['ratio_lo']:.3f}-{r['ratio_hi']:.3f}"
        lines.append(f"{r['variant']:<34} {r['images_per_sec']:>9.2f} {r['ratio']:>6.3f} {ci:>13} "
                     f"{r['step_time_p50_s']:>8.4f} {r['step_time_p90_s']:>8.4f} {r['tflops']:>8.4f} "
                     f"{r['mfu']:>6.3f} {r['model_state_mb']:>9.1f} {r['peak_memory_mb']:>9.1f} "
                     f"{'-' if r['compile_s'] is None else format(r['compile_s'], '.1f'):>9}")
    for r in rows[1:]:
        what = "within noise of" if r["verdict"] == "within noise" else f"{r['verdict']}, beyond noise, than"
        lines.append(f"paired over rounds: {r['variant']} images/s {what} {rows[0]['variant']}'s")
    for r in rows:
        if r["compile_s"] is not None:
            later = r["compile_s_by_round"][1:]
            lines.append(f"{r['variant']}: compiling took {r['compile_s']:.1f} s in the first round"
                         + (f" ({min(later):.1f}-{max(later):.1f} s in later rounds)" if later else "")
                         + ", in warm-up steps outside the timing")
    return "\n".join(lines)
