"""Single-process training benchmark: ``rayvit bench [--config F] [key=value ...] [--compare ...]``.

Synthetic data generated once on the device, warm-up steps excluded, every step timed with device
synchronisation. ``--compare key=v1,v2`` builds one training session per value and runs them in
alternating rounds in this one process, so drift of a shared, noisy machine hits every variant alike;
each variant is reported as a ratio to the first. Several ``--compare`` flags give several groups.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass, field

import torch

from rayvit.config import Config, ConfigError, load_config
from rayvit.worker import hardware, metrics
from rayvit.worker.loop import Session

EXAMPLES = """examples:
  rayvit bench model.name=vit_s16 model.image_size=224 train.batch_size=8
  rayvit bench model.name=vit_s16 model.image_size=224 train.batch_size=8 \\
      --compare optim.impl=loop,foreach --compare precision.mode=fp32,amp
  rayvit bench --config experiments/configs/cpu_default.yaml --compare model.layout=batch_first,batch_second
"""


@dataclass
class Variant:
    label: str
    session: Session
    times: list[float] = field(default_factory=list)
    model_state_bytes: int = 0          # read before the session is closed (closing releases the model)

    @property
    def images_per_sec(self) -> float:
        # The median step: robust to the odd step a shared machine slows down.
        return metrics.images_per_sec(self.session.cfg.train.batch_size, 1, statistics.median(self.times))


def parse_compare(spec: str) -> tuple[str, list[str]]:
    key, sep, values = spec.partition("=")
    options = [v.strip() for v in values.split(",") if v.strip()]
    if not sep or len(options) < 2:
        raise ConfigError(f"--compare {spec!r} must look like section.key=value1,value2[,...]")
    return key.strip(), options


def run_group(cfg: Config, compare: tuple[str, list[str]] | None, rounds: int, steps_per_round: int,
              warmup: int) -> list[Variant]:
    """Build every variant, warm each up, then time them in alternating rounds."""
    if compare is None:
        variants_cfg = [("as configured", cfg)]
    else:
        key, values = compare
        variants_cfg = [(f"{key}={v}", cfg.replace([f"{key}={v}"])) for v in values]
    variants = []
    for label, vcfg in variants_cfg:
        session = Session(vcfg)
        print(f"  built {label}: {sum(p.numel() for p in session.model.parameters()):,} params "
              f"(local), {session.complexity.train_flops_per_image / 1e9:.2f} GFLOP/image to train",
              file=sys.stderr)
        variants.append(Variant(label, session))
    try:
        for v in variants:
            for _ in range(warmup):
                v.session.clear_grads()
                v.session.train_step()
        for r in range(rounds):
            for v in variants:
                for _ in range(steps_per_round):
                    v.session.clear_grads()
                    v.session.train_step()
                    v.times.append(v.session.history[-1]["step_time_s"])
            print(f"  round {r + 1}/{rounds}: " + ", ".join(
                f"{v.label} {v.images_per_sec:.1f} img/s" for v in variants), file=sys.stderr)
        for v in variants:
            v.model_state_bytes = v.session.model_state_bytes()
    finally:
        for v in reversed(variants):
            v.session.close()
    return variants


def report(variants: list[Variant]) -> list[dict]:
    base = variants[0].images_per_sec
    rows = []
    for v in variants:
        s = v.session
        ips = v.images_per_sec
        rate = s.rate_figures(ips)
        rows.append({
            "variant": v.label, "images_per_sec": ips, "ratio": ips / base,
            **metrics.step_time_percentiles(v.times),
            "tflops": rate["tflops_per_chip"], "mfu": rate["mfu"], "peak_source": rate["peak_source"],
            "model_state_mb": v.model_state_bytes / 2 ** 20,
            "peak_memory_mb": hardware.peak_memory_bytes(s.device) / 2 ** 20,
        })
    return rows


def format_rows(rows: list[dict]) -> str:
    header = (f"{'variant':<34} {'img/s':>9} {'ratio':>6} {'p50 s':>8} {'p90 s':>8} {'TFLOPS':>8} "
              f"{'MFU':>6} {'state MB':>9} {'peak MB':>9}")
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(f"{r['variant']:<34} {r['images_per_sec']:>9.2f} {r['ratio']:>6.3f} "
                     f"{r['step_time_p50_s']:>8.4f} {r['step_time_p90_s']:>8.4f} {r['tflops']:>8.4f} "
                     f"{r['mfu']:>6.3f} {r['model_state_mb']:>9.1f} {r['peak_memory_mb']:>9.1f}")
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
    try:
        # The benchmark measures the step itself: synthetic data, never a dataset's decode cost.
        cfg = load_config(args.config, ["data.name=synthetic", *args.overrides])
        groups = [parse_compare(c) for c in args.compare] or [None]
        for group in groups:
            if group is not None:
                for value in group[1]:
                    cfg.replace([f"{group[0]}={value}"])       # validate every variant before any runs
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
