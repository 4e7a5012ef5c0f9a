"""Single-process training benchmark: ``rayvit bench [--config F] [key=value ...] [--compare ...]``.

Synthetic data generated once on the device, warm-up steps excluded, every step timed with device
synchronisation. ``--compare key=v1,v2`` times one training session per value, in alternating rounds in
this one process, so drift of a shared, noisy machine hits every variant alike; each variant is reported
as a ratio to the first. Only one variant exists at a time: each round builds it, warms it up, times it
and closes it before the next is built, so each variant's peak memory is its own (a session restarts the
peak when it starts) and no variant's model shares the device with another's. Several ``--compare``
flags give several groups.

``--compare model.compile=false,true`` times kernel fusion: the steps that compile are among each round's
warm-up steps, never timed; how much longer they took than a timed step is reported separately (``compile
s``: the first round's; every round's is in the JSON). Each round compiles from empty caches
(``model.compile_cold``, :mod:`rayvit.worker.compiling`), so the rounds' compile times are alike.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
from dataclasses import dataclass, field

import torch

from rayvit.config import Config, ConfigError, load_config
from rayvit.worker import hardware, metrics
from rayvit.worker.loop import Session, compile_overhead_s

EXAMPLES = """examples:
  rayvit bench model.name=vit_s16 model.image_size=224 train.batch_size=8
  rayvit bench model.name=vit_s16 model.image_size=224 train.batch_size=8 \\
      --compare optim.impl=loop,foreach --compare precision.mode=fp32,amp
  rayvit bench --config experiments/configs/cpu_default.yaml --compare model.layout=batch_first,batch_second
  rayvit bench model.name=vit_s16 model.image_size=224 train.batch_size=8 --compare model.compile=false,true
"""


@dataclass
class Variant:
    label: str
    cfg: Config
    times: list[float] = field(default_factory=list)
    # Read from each round's session before it closes (closing releases the model).
    model_state_bytes: int = 0
    peak_memory_bytes: int = 0          # the largest of its rounds' peaks
    rate: dict = field(default_factory=dict)
    # model.compile: per round, the warm-up steps' time beyond the round's median timed step.
    compile_times: list[float] = field(default_factory=list)

    @property
    def images_per_sec(self) -> float:
        # The median step: robust to the odd step a shared machine slows down.
        return metrics.images_per_sec(self.cfg.train.batch_size, 1, statistics.median(self.times))


def parse_compare(spec: str) -> tuple[str, list[str]]:
    key, sep, values = spec.partition("=")
    options = [v.strip() for v in values.split(",") if v.strip()]
    if not sep or len(options) < 2:
        raise ConfigError(f"--compare {spec!r} must look like section.key=value1,value2[,...]")
    return key.strip(), options


def run_group(cfg: Config, compare: tuple[str, list[str]] | None, rounds: int, steps_per_round: int,
              warmup: int) -> list[Variant]:
    """Time every variant in alternating rounds, one variant on the device at a time."""
    if compare is None:
        variants = [Variant("as configured", cfg)]
    else:
        key, values = compare
        variants = [Variant(f"{key}={v}", cfg.replace([f"{key}={v}"])) for v in values]
    for r in range(rounds):
        for v in variants:
            measure_round(v, steps_per_round, warmup, announce=r == 0)
        print(f"  round {r + 1}/{rounds}: " + ", ".join(
            f"{v.label} {v.images_per_sec:.1f} img/s" for v in variants), file=sys.stderr)
    return variants


def measure_round(v: Variant, steps: int, warmup: int, announce: bool = False) -> None:
    """One round of ``v``: a fresh session (its own memory peak), ``warmup`` untimed steps, ``steps`` timed
    ones; the session is closed, and its memory released, before the next variant is built."""
    session = Session(v.cfg)
    try:
        if announce:
            print(f"  {v.label}: {sum(p.numel() for p in session.model.parameters()):,} params (local), "
                  f"{session.complexity.train_flops_per_image / 1e9:.2f} GFLOP/image to train", file=sys.stderr)
        for _ in range(warmup):
            session.clear_grads()
            session.train_step()
        for _ in range(steps):
            session.clear_grads()
            session.train_step()
            v.times.append(session.history[-1]["step_time_s"])
        if v.cfg.model.compile:
            times = [h["step_time_s"] for h in session.history]
            v.compile_times.append(compile_overhead_s(times[:warmup], times[warmup:]))
        v.model_state_bytes = session.model_state_bytes()
        v.peak_memory_bytes = max(v.peak_memory_bytes, hardware.peak_memory_bytes(session.device))
        v.rate = session.rate_figures(v.images_per_sec)
    finally:
        session.close()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def report(variants: list[Variant]) -> list[dict]:
    base = variants[0].images_per_sec
    rows = []
    for v in variants:
        ips, rate = v.images_per_sec, v.rate
        rows.append({
            "variant": v.label, "images_per_sec": ips, "ratio": ips / base,
            **metrics.step_time_percentiles(v.times),
            "tflops": rate["tflops_per_chip"], "mfu": rate["mfu"], "peak_source": rate["peak_source"],
            "model_state_mb": v.model_state_bytes / 2 ** 20,
            "peak_memory_mb": v.peak_memory_bytes / 2 ** 20,
            # The first round's compile (cold), and every round's; None when not compiled.
            "compile_s": v.compile_times[0] if v.compile_times else None,
            "compile_s_by_round": list(v.compile_times),
        })
    return rows


def format_rows(rows: list[dict]) -> str:
    header = (f"{'variant':<34} {'img/s':>9} {'ratio':>6} {'p50 s':>8} {'p90 s':>8} {'TFLOPS':>8} "
              f"{'MFU':>6} {'state MB':>9} {'peak MB':>9} {'compile s':>9}")
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(f"{r['variant']:<34} {r['images_per_sec']:>9.2f} {r['ratio']:>6.3f} "
                     f"{r['step_time_p50_s']:>8.4f} {r['step_time_p90_s']:>8.4f} {r['tflops']:>8.4f} "
                     f"{r['mfu']:>6.3f} {r['model_state_mb']:>9.1f} {r['peak_memory_mb']:>9.1f} "
                     f"{'-' if r['compile_s'] is None else format(r['compile_s'], '.1f'):>9}")
    for r in rows:
        if r["compile_s"] is not None:
            later = r["compile_s_by_round"][1:]
            lines.append(f"{r['variant']}: compiling took {r['compile_s']:.1f} s in the first round"
                         + (f" ({min(later):.1f}-{max(later):.1f} s in later rounds)" if later else "")
                         + ", in warm-up steps outside the timing")
    return "\n".join(lines)


def main(argv: list[str] | None = None, prog: str = "rayvit bench") -> int:
    parser = argparse.ArgumentParser(
        prog=prog, description=__doc__, epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides")
    parser.add_argument("--config", help="YAML config file (defaults: a tiny ViT on CPU)")
    parser.add_argument("--compare", action="append", default=[], metavar="KEY=V1,V2",
                        help="variants to time side by side; repeat for several groups")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds (default 5)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant per round (default 3)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per variant first (default 2)")
    parser.add_argument("--json", help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    if args.warmup < 0 or args.steps < 1 or args.rounds < 1:
        print("error: --warmup must be >= 0, --steps and --rounds >= 1", file=sys.stderr)
        return 2
    try:
        # The benchmark measures the step itself: synthetic data, never a dataset's decode cost.
        cfg = load_config(args.config, ["data.name=synthetic", *args.overrides])
        groups = [parse_compare(c) for c in args.compare] or [None]
        for group in groups:
            if group is not None:
                for value in group[1]:
                    variant = cfg.replace([f"{group[0]}={value}"])   # validate every variant before any runs
                    if variant.model.compile and args.warmup < 1:
                        raise ConfigError(f"{group[0]}={value} compiles in its first step: it needs --warmup >= 1 "
                                          "to keep compiling out of the timing")
        if cfg.model.compile and args.warmup < 1:
            raise ConfigError("model.compile=true compiles in its first step: it needs --warmup >= 1 to keep "
                              "compiling out of the timing")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    m, t = cfg.model, cfg.train
    print(f"rayvit bench: {m.name} {m.image_size}px batch {t.batch_size}, {cfg.precision.mode}/"
          f"{cfg.precision.dtype}, {cfg.optim.name}-{cfg.optim.impl}, {cfg.parallel.cpus_per_worker} "
          f"thread(s), torch {torch.__version__}; {args.rounds} rounds x {args.steps} steps after "
          f"{args.warmup} warm-up", file=sys.stderr)
    results = []
    for group in groups:
        variants = run_group(cfg, group, args.rounds, args.steps, args.warmup)
        rows = report(variants)
        print(format_rows(rows))
        print()
        results.append({"compare": group[0] if group else None, "rows": rows})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": cfg.to_dict(), "groups": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
